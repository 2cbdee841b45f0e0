"""The round protocol run with every client's data at hand (simulations, demos, benchmarks):
the rounds of :func:`fusekit.protocol.plan` (or :func:`~fusekit.protocol.calibration_rounds`),
each taking part client's reply computed here by the forward passes of
:mod:`fusekit.toolkit.calibration` and :mod:`fusekit.toolkit.alignment`, each step
:func:`fusekit.protocol.advance`, as the service and the Flower strategy run them over the
network (ALGORITHMS.md §12).
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Sequence

import numpy as np

from fusekit import protocol
from fusekit.calibration import calibrate
from fusekit.core import metadata as meta
from fusekit.core.checkpoint import Checkpoint, load_checkpoint
from fusekit.core.cross_stats import DEFAULT_RIDGE
from fusekit.core.errors import ParameterError
from fusekit.core.model_spec import fused_spec
from fusekit.core.stats import DEFAULT_MIN_SAMPLES
from fusekit.methods.base import FusionResult
from fusekit.methods.calibration import calibration_layers
from fusekit.toolkit.alignment import cross_statistics, refit_statistics
from fusekit.toolkit.calibration import DEFAULT_BATCH_SIZE, client_statistics


def run_locally(state: protocol.State, client_inputs: Sequence[np.ndarray], *,
                batch_size: int = DEFAULT_BATCH_SIZE, device: str = "cpu") -> protocol.State:
    """Every round of ``state``, each taking part client's reply computed on its inputs
    (``client_inputs[key]``: the clients are keyed by their index)."""
    options = {"batch_size": batch_size, "device": device, "min_samples": state.min_samples}
    while not state.done:
        round_, model = state.round, state.model

        def reply(key: int, round_=round_, model=model):
            if round_.calibrates:
                return client_statistics(model, client_inputs[key], mode=round_.mode, **options)
            own = state.clients[key]
            if round_.kind == protocol.CROSS:
                return cross_statistics(model, own, client_inputs[key], **options)
            return refit_statistics(model, own, client_inputs[key], round_.layer, **options)

        state = protocol.advance(state, {key: reply(key) for key in state.participants}
                                 if round_.asks else {})
    return state


def calibrate_locally(
    fused: Checkpoint | str | os.PathLike[str],
    client_inputs: Sequence[np.ndarray],
    *,
    clients: Sequence[Checkpoint] | None = None,
    rounds: str = "layerwise",
    layers: Collection[str] | None = None,
    min_samples: int = DEFAULT_MIN_SAMPLES,
    batch_size: int = DEFAULT_BATCH_SIZE,
    device: str = "cpu",
    input_moments: bool = False,
    paired: bool = True,
) -> FusionResult:
    """Run the calibration protocol with every client's data at hand (simulations, demos,
    benchmarks): the rounds of :func:`fusekit.protocol.calibration_rounds`; each round, each
    client computes statistics of the current model on its own inputs and
    :func:`fusekit.calibrate` pools them (:func:`run_locally`).

    Args:
        fused: the fused model.
        client_inputs: per client, its inputs.
        clients: the clients' own models, in the order of ``client_inputs``: their
            statistics become REPAIR's targets for layers without BatchNorm (a
            transformer needs them: every MLP and LayerNorm is calibrated towards them).
        rounds: ``layerwise`` (one round per calibrated layer, input to output; each
            layer's statistics are taken with the layers below already calibrated: exact;
            a transformer's points in the order its forward pass reaches them, which its
            clients' statistics record) or ``one-pass`` (one round in ``batch`` mode, for a
            transformer in ``eval`` mode: approximate, see §12).
        layers: calibrate only these layers (by name: a transformer's MLP input layers
            and LayerNorms by module), in their order; default all.
        min_samples: see :func:`fusekit.calibrate`.
        batch_size: see :func:`~fusekit.toolkit.calibration.client_statistics`.
        device: see :func:`~fusekit.toolkit.calibration.client_statistics`.
        input_moments: the clients send their first layer's input moments with their own
            models' statistics (needs ``clients``): layer by layer, the first layer is
            calibrated from them without a round (exact). One pass is unchanged.
        paired: REPAIR reads each fused neuron on the data of the clients matched into
            it, each client's statistics of the fused model paired with those of its own
            model (:func:`fusekit.calibrate`'s ``paired``; not for transformers); False:
            on the union of their data, as where statistics come from some clients only.

    Returns:
        The calibrated model; ``report["calibration"]["rounds"]`` counts the rounds that
        asked the clients for statistics.
    """
    if rounds not in protocol.CALIBRATIONS:
        raise ParameterError(f"rounds: expected one of {list(protocol.CALIBRATIONS)}, found "
                             f"{rounds!r}")
    if input_moments and not clients:
        raise ParameterError("input_moments: needs clients (the moments travel with the "
                             "statistics of their own models)")
    current = fused if isinstance(fused, Checkpoint) else load_checkpoint(fused)
    spec = fused_spec(current)
    transformer = current.config is not None
    if not (clients if transformer else calibration_layers(spec, repair=bool(clients))):
        # nothing to calibrate (a transformer without targets is refused): no pass runs
        return _with_rounds(calibrate(current, [], layers=[]), 0)
    options = {"batch_size": batch_size, "device": device, "min_samples": min_samples}
    targets = {key: client_statistics(own, x, input_moments=input_moments, **options)
               for key, (own, x) in enumerate(zip(clients, client_inputs, strict=True))
               } if clients else {}
    plan = protocol.calibration_rounds(
        spec, rounds, repair=bool(targets), derive_first=input_moments, layers=layers,
        order=[point.partition(":")[2] for point in targets[0].points] if transformer else None)
    if not plan:  # none of the layers asked for: no pass runs
        return _with_rounds(calibrate(current, [], targets=list(targets.values()), layers=[]), 0)
    participants = dict(enumerate(clients)) if clients else dict.fromkeys(
        range(len(client_inputs)))
    state = run_locally(protocol.start(current, plan, participants, targets=targets,
                                       min_samples=min_samples, paired=paired),
                        client_inputs, batch_size=batch_size, device=device)
    result = state.result
    if rounds == "layerwise":
        result.report["calibration"]["layers"] = "all" if layers is None else [
            round_.layers[0] for round_ in plan]
    return _with_rounds(result, sum(round_.asks for round_ in plan))


def _with_rounds(result: FusionResult, rounds: int) -> FusionResult:
    """Record the number of rounds in the report and the ``fusekit.calibration`` metadata."""
    result.report["calibration"]["rounds"] = rounds
    result.metadata[meta.CALIBRATION] = json.dumps(result.report["calibration"])
    return result


def align_locally(
    fused: Checkpoint | str | os.PathLike[str],
    clients: Sequence[Checkpoint],
    client_inputs: Sequence[np.ndarray],
    *,
    alignment_rounds: int = 1,
    refit: bool = True,
    ridge: float = DEFAULT_RIDGE,
    rounds: str = "layerwise",
    min_samples: int = DEFAULT_MIN_SAMPLES,
    batch_size: int = DEFAULT_BATCH_SIZE,
    device: str = "cpu",
) -> FusionResult:
    """Calibrate, run ``alignment_rounds`` alignment rounds, then refit every layer (or
    calibrate), with every client's data at hand (simulations, demos, benchmarks): the
    rounds of :func:`fusekit.protocol.plan`, each client's reply computed here
    (:func:`run_locally`), each step :func:`fusekit.protocol.advance`, as the service and
    the Flower strategy run them over the network.

    Calibration takes REPAIR's targets from the clients' own models (paired, as
    :func:`calibrate_locally`); each alignment round, every client computes
    :func:`~fusekit.toolkit.alignment.cross_statistics` of the current (calibrated) fused
    model and its own model on its own inputs and :func:`fusekit.align` re-matches and
    re-fuses; between rounds the result is calibrated; after the last it is refit layer by
    layer (each client's :func:`~fusekit.toolkit.alignment.refit_statistics`,
    :func:`fusekit.refit`), or calibrated without ``refit``.

    Args:
        fused: the one-shot fused model.
        clients: the clients' own models, in the order of ``client_inputs``.
        client_inputs: per client, its inputs.
        alignment_rounds: alignment rounds (>= 1), each against the previous result.
        refit: end with refit rounds (one per layer) instead of calibration.
        ridge: the refit's relative ridge (:func:`fusekit.refit`).
        rounds: see :func:`calibrate_locally`.
        min_samples: see :func:`calibrate_locally`.
        batch_size: see :func:`calibrate_locally`.
        device: see :func:`calibrate_locally`.

    Returns:
        The aligned model, refit or calibrated; ``report["alignment"]`` per round, the mean
        matched correlation.
    """
    if isinstance(alignment_rounds, bool) or not isinstance(alignment_rounds, int) or not (
            1 <= alignment_rounds <= 100):
        raise ParameterError(f"alignment_rounds: expected an integer in [1, 100], found "
                             f"{alignment_rounds!r}")
    fused = fused if isinstance(fused, Checkpoint) else load_checkpoint(fused)
    options = {"batch_size": batch_size, "device": device, "min_samples": min_samples}
    targets = {k: client_statistics(c, x, **options)
               for k, (c, x) in enumerate(zip(clients, client_inputs, strict=True))}
    plan = protocol.plan(fused_spec(fused), calibration=rounds, repair=True,
                         alignment_rounds=alignment_rounds, refit=refit)
    state = run_locally(protocol.start(fused, plan, dict(enumerate(clients)), targets=targets,
                                       min_samples=min_samples, ridge=ridge),
                        client_inputs, batch_size=batch_size, device=device)
    history = [done["alignment"] for done in state.history if done["kind"] == protocol.CROSS]
    current = state.model
    result = FusionResult(state_dict=current.state_dict(),
                          method=current.metadata.get(meta.METHOD, "unknown"), params={},
                          widths=fused_spec(current).hidden_widths,
                          report={"alignment": history}, metadata=dict(current.metadata))
    result.metadata[meta.ALIGNMENT] = json.dumps(
        {"rounds": alignment_rounds, "refit": refit,
         "mean_correlation": [h["mean_correlation"] for h in history]})
    return result


def refit_locally(aligned: Checkpoint, clients: Sequence[Checkpoint],
                  client_inputs: Sequence[np.ndarray], *, ridge: float = DEFAULT_RIDGE,
                  min_samples: int = DEFAULT_MIN_SAMPLES, batch_size: int = DEFAULT_BATCH_SIZE,
                  device: str = "cpu") -> FusionResult:
    """Refit rounds with every client's data at hand: every layer of ``aligned``, input to
    output, one round each (each round's statistics see the layers below already refit)."""
    plan = [protocol.Round(protocol.REFIT, layer=layer.name)
            for layer in fused_spec(aligned).layers]
    state = protocol.start(aligned, plan, dict(enumerate(clients)), min_samples=min_samples,
                           ridge=ridge)
    return run_locally(state, client_inputs, batch_size=batch_size, device=device).result
