"""``fusekit.fuse``: the one call behind the CLI, the Python API and every other front door."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from fusekit.core import metadata as meta
from fusekit.core import neurons
from fusekit.core.checkpoint import Checkpoint, load_checkpoint
from fusekit.core.errors import (
    CheckpointError,
    IncompatibleModelsError,
    ParameterError,
    StatisticsError,
)
from fusekit.core.cross_stats import (
    DEFAULT_RIDGE,
    CrossStatistics,
    RefitStatistics,
    check_cross_statistics,
    check_refit_statistics,
    load_cross_statistics,
    load_refit_statistics,
)
from fusekit.core.metadata import load_json
from fusekit.core.spec import (
    GraphSpec,
    PermutationSpec,
    infer_spec,
    load_spec_file,
    spec_from_json,
)
from fusekit.core.stats import (
    DEFAULT_MIN_SAMPLES,
    Statistics,
    calibrated_point,
    check_statistics,
    input_point,
    load_statistics,
    pool,
    statistic_points,
)
from fusekit.core.transformer import (
    CalibrationPoint,
    TransformerSpec,
    calibration_points,
    infer_transformer,
)
from fusekit.methods import METHODS, alignment, calibration, get_method, transformer_calibration
from fusekit.methods.base import FusionMethod, FusionResult, provenance, sample_weights
from fusekit.methods.params import ParamSpec, method_params, validate

log = logging.getLogger(__name__)

CheckpointLike = str | os.PathLike[str] | Checkpoint
SpecLike = str | os.PathLike[str] | Mapping[str, Any] | PermutationSpec | GraphSpec


def fuse(
    inputs: Sequence[CheckpointLike],
    method: str = "avg",
    *,
    spec: SpecLike | None = None,
    **params: Any,
) -> FusionResult:
    """Fuse client checkpoints into one model, in one shot and without data.

    Args:
        inputs: safetensors paths or :class:`Checkpoint` objects, one per client. Their
            order does not matter: clients are put in a canonical order (widest first,
            then by a hash of their contents, see :func:`canonical_order`) so a fusion is
            reproducible on any machine.
        method: a name from ``fusekit.METHODS`` (avg, pfnm, nafi, ot, ams, ...).
        spec: a JSON spec file, its parsed dict, or a PermutationSpec, for models whose
            permutation structure cannot be inferred from names and shapes.
        **params: the method's parameters (docs/PARAMETERS.md, ``fusekit fuse --help``),
            checked against the method's declaration: strict types (an int parameter
            refuses 3.5 and "3"; a float one accepts 3), choices and bounds.

    Returns:
        FusionResult with the fused state_dict, widths, report and provenance metadata.

    Raises:
        CheckpointError: an input is missing, corrupt or holds unusable tensors.
        IncompatibleModelsError: the inputs do not describe the same kind of network.
        UnknownMethodError, ParameterError: bad method name or parameters.
    """
    if isinstance(inputs, (str, os.PathLike, Checkpoint)):
        raise ParameterError(
            f"inputs: expected a list of checkpoints, found one {type(inputs).__name__} "
            f"({inputs!r:.80}); pass [path] to fuse a single file"
        )
    if not inputs:
        raise ParameterError("inputs: expected at least one checkpoint, got none")
    fusion, declared = validate_params(method, params)
    checkpoints = [c if isinstance(c, Checkpoint) else load_checkpoint(c) for c in inputs]
    if len(inputs) == 1:  # once the input is known to be a checkpoint
        log.warning("fusing a single checkpoint with %s: there is nothing to combine; the "
                    "result is that client's model", fusion.name)
    specs = [client_spec(c, spec) for c in checkpoints]
    if fusion.requires_same_architecture:
        check_compatible(checkpoints, specs)
    transformers = [c for c, s in zip(checkpoints, specs, strict=True)
                    if isinstance(s, TransformerSpec)]
    if transformers and not fusion.handles_transformers:
        fusing = [name for name, cls in sorted(METHODS.items()) if cls.handles_transformers]
        raise IncompatibleModelsError(
            f"{transformers[0].label}: a transformer; method {method!r} does not fuse "
            f"transformers; use one of {', '.join(fusing)}"
        )
    if not fusion.handles_groups and any(isinstance(s, GraphSpec) for s in specs):
        fusing = [name for name, cls in sorted(METHODS.items()) if cls.handles_groups]
        raise IncompatibleModelsError(
            f"{checkpoints[0].label}: a residual network (permutation groups shared by several "
            f"layers); method {method!r} fuses sequential networks only; use one of "
            f"{', '.join(fusing)}"
        )
    order = canonical_order(checkpoints, specs)
    checkpoints = [checkpoints[i] for i in order]
    specs = [specs[i] for i in order]
    per_client = [p.name for p in declared if p.per_client]
    params = _in_canonical_order(params, per_client, order)
    with _content_hashes_meanwhile(checkpoints):
        start = time.perf_counter()
        with _peak_memory() as peak:
            result = fusion.fuse(checkpoints, specs, **params)
        elapsed = time.perf_counter() - start
    result.report.setdefault("time_s", elapsed)
    result.report.setdefault("peak_memory_mb", peak["mb"])
    result.report.setdefault("clients", [c.label for c in checkpoints])
    provenance(result, checkpoints)
    _calibration_metadata(result, fusion, checkpoints, specs)
    for checkpoint in checkpoints:  # the result holds its own arrays: the inputs' can go
        checkpoint.release()
    return result


def _calibration_metadata(result: FusionResult, fusion: FusionMethod,
                          checkpoints: Sequence[Checkpoint], specs: Sequence[PermutationSpec]
                          ) -> None:
    """What calibration needs from the fusion (ALGORITHMS §12): the fused neuron of every
    client neuron and, where the method folded BatchNorms, the matched clients' affine."""
    if result.assignments is None:
        return
    result.metadata[meta.ASSIGNMENTS] = calibration.assignments_json(result.assignments)
    if fusion.folds_batchnorm and not isinstance(specs[0], TransformerSpec) and any(
            layer.norm for layer in specs[0].layers):
        targets = calibration.norm_targets(checkpoints, specs, result.spec, result.assignments,
                                           sample_weights(checkpoints))
        result.metadata[meta.NORM_TARGETS] = json.dumps(targets, separators=(",", ":"))


StatisticsLike = str | os.PathLike[str] | Statistics


def calibrate(
    fused: CheckpointLike,
    statistics: Sequence[StatisticsLike] = (),
    *,
    targets: Sequence[StatisticsLike] = (),
    layers: Sequence[str] | None = None,
    min_samples: int = DEFAULT_MIN_SAMPLES,
    paired: bool = False,
) -> FusionResult:
    """Calibrate a fused model with statistics its clients computed on their own data.

    Args:
        fused: the fused checkpoint (path or :class:`Checkpoint`).
        statistics: each client's statistics of ``fused`` (``fusekit stats FUSED ...``, or
            :func:`fusekit.toolkit.calibration.client_statistics`), pooled exactly. None:
            the first layer alone, derived from the input moments the ``targets`` carry
            (no round), or nothing when ``layers`` is empty.
        targets: clients' statistics of their own models (the fusion's inputs): REPAIR's
            targets for layers without BatchNorm (which are left as they are without);
            with every client's input moments (``client_statistics(...,
            input_moments=True)``, ``fusekit stats --input-moments``), the first layer's
            statistics without a round (ALGORITHMS §12).
        layers: calibrate only these layers (layer-by-layer rounds); default all (without
            ``statistics``: the first layer).
        min_samples: refuse statistics over fewer inputs.
        paired: ``statistics[k]`` and ``targets[k]`` were computed on the same client's
            data: REPAIR then reads each fused neuron's moments on the data of the clients
            matched into it, where its targets were measured, instead of pooling them over
            every client's, and restores the first layer's spread around its own mean
            (ALGORITHMS §12; the default where the rounds run locally).

    Returns:
        A FusionResult holding the calibrated model (same tensors, names and widths) and
        the fused model's metadata plus ``fusekit.calibration``; ``report["calibration"]``.

    Raises:
        StatisticsError: a statistics file that is malformed, of another model, of a
            model that is not one of the fusion's inputs, or over too few samples; input
            moments from some clients only, or of another dimension than the first
            layer's; without statistics of ``fused``, a layer that needs a round, or no
            input moments; ``paired`` statistics over another number of inputs than their
            client's targets.
        ParameterError: ``paired`` without as many targets as statistics, or for a
            transformer.
        CheckpointError: the fused file is unreadable or its calibration metadata malformed.
    """
    checkpoint = fused if isinstance(fused, Checkpoint) else load_checkpoint(fused)
    spec = fused_spec(checkpoint)
    transformer = isinstance(spec, TransformerSpec)
    where = calibration_points(spec, _shapes(checkpoint)) if transformer else None
    points = model_points(checkpoint, spec)
    stats = [_statistics(s, checkpoint.content_hash, points, min_samples) for s in statistics]
    if paired and (transformer or not targets or (stats and len(targets) != len(stats))):
        raise ParameterError(
            f"paired: expected as many targets as statistics of a network's fused model "
            f"(one pair per client), found {len(stats)} statistics and {len(targets)} targets"
            + (f" for a transformer ({checkpoint.label})" if transformer else ""))
    if transformer:
        nothing_to_calibrate = layers is not None and not layers
        pooled = {} if nothing_to_calibrate and not stats else pool(stats)
        state_dict = _calibrated_transformer(checkpoint, spec, where, pooled, targets, layers,
                                             min_samples)
        used = stats
    else:
        state_dict, layers, used = _calibrated_network(checkpoint, spec, stats, targets, layers,
                                                       min_samples, paired)
    report = {"clients": len(used), "samples": sum(s.num_samples for s in used),
              "mode": stats[0].mode if stats else ("derived" if used else None),
              "repair": bool(targets), "paired": paired,
              "layers": list(layers) if layers is not None else "all"}
    metadata = dict(checkpoint.metadata)
    metadata[meta.CALIBRATION] = json.dumps(report)
    inputs = [p for p in [checkpoint.path, *statistics, *targets] if isinstance(p, (str, Path))]
    return FusionResult(state_dict=state_dict, method=metadata.get(meta.METHOD, "unknown"),
                        params={}, widths=spec.hidden_widths, report={"calibration": report},
                        metadata=metadata, inputs=[Path(p).absolute() for p in inputs],
                        spec=spec, config=checkpoint.config)


def _calibrated_network(checkpoint: Checkpoint, spec, stats: Sequence[Statistics],
                        targets: Sequence[StatisticsLike], layers: Sequence[str] | None,
                        min_samples: int, paired: bool = False
                        ) -> tuple[dict[str, Any], list[str] | None, list[Statistics]]:
    """BatchNorms restored and REPAIR (ALGORITHMS §12); without statistics of the fused
    model, the first layer alone, from the input moments the targets carry.

    Returns:
        The calibrated tensors, the layers calibrated (None: all) and the statistics used.
    """
    own, chosen = (_target_assignments(checkpoint, spec, targets, min_samples) if targets
                   else ([], []))
    repair = calibration.neuron_targets(spec, own, chosen) if own else None
    calibration.changed_layers(spec, layers, repair=bool(own), label=checkpoint.label)
    used = list(stats)
    if not stats:  # the first layer alone, each client's statistics derived
        stats = _derived_first_layer(checkpoint, spec, own)
        used = own if stats else []
        layers = _derivable_layers(spec, layers, stats[0].points if stats else {},
                                   checkpoint.label)
    pooled = pool(stats) if stats else {}
    if paired and stats:
        pooled.update(calibration.matched_moments(spec, _same_data(stats, own), own, chosen,
                                                  pooled))
        repair = calibration.first_layer_mean_kept(spec, repair, pooled) if repair else None
    state_dict = calibration.calibrated_state_dict(
        checkpoint.state_dict(), spec, pooled,
        norm_targets=calibration.read_norm_targets(checkpoint, spec), targets=repair,
        layers=layers)
    return state_dict, layers, used


def _derived_first_layer(checkpoint: Checkpoint, spec, own: Sequence[Statistics]
                         ) -> list[Statistics]:
    """Per client, the fused first layer's statistics from its input moments (ALGORITHMS
    §12: exact; pooled, those of the union); empty when no client sent any."""
    if not any(s.inputs for s in own) or len(spec.layers) < 2:
        return []
    first = spec.layers[0]
    ((point, fan_in),) = input_points(checkpoint, spec).items()
    for s in own:
        moments = s.inputs.get(point)
        if moments is None:
            raise StatisticsError(
                f"{s.label}: no input moments of the first layer ({point!r}); the first layer "
                "is derived from every client's input moments, or calibrated in a round")
        if moments.mean.shape != (fan_in,):
            raise StatisticsError(
                f"{s.label}: point {point!r}: input moments of dimension "
                f"{moments.mean.shape[0]}; layer {first.name!r} multiplies vectors of {fan_in}")
    weight = checkpoint.tensor(first.weight)
    bias = checkpoint.tensor(first.bias) if first.bias else None
    return [Statistics(checkpoint.content_hash, s.num_samples, "eval", {
        calibrated_point(first): calibration.derived_moments(weight, bias, s.inputs[point])},
        label=f"{s.label} (derived)") for s in own]


def _derivable_layers(spec, layers: Sequence[str] | None, pooled: Mapping[str, Any],
                      label: str) -> list[str]:
    """Without a round: the layers whose statistics were derived (default), refusing any
    other, and at least one unless ``layers`` is empty."""
    available = [layer.name for layer in spec.layers[:-1] if calibrated_point(layer) in pooled]
    if layers is None and not available:
        raise StatisticsError(
            f"{label}: calibration needs each client's statistics of this model, or, for the "
            "first layer alone, --targets carrying input moments (fusekit stats "
            "--input-moments); found neither")
    chosen = available if layers is None else list(layers)
    needing = [name for name in chosen if name not in available]
    if needing:
        raise StatisticsError(
            f"layers: {needing[0]!r} needs statistics of the fused model (a round); without "
            f"them only {available or 'no layer'} can be calibrated, from input moments")
    return chosen


def fused_spec(checkpoint: Checkpoint) -> PermutationSpec | GraphSpec | TransformerSpec:
    """A fused (or client) model's spec for calibration: the one in its metadata, else
    inferred (from config.json for a Hugging Face model folder)."""
    shapes = _shapes(checkpoint)
    raw = checkpoint.metadata.get(meta.SPEC)
    if raw is not None:
        return spec_from_json(meta.parse_json_object(raw, meta.SPEC, checkpoint.label),
                              shapes, label=checkpoint.label)
    if checkpoint.config is not None:
        return infer_transformer(checkpoint.config, shapes, label=checkpoint.label)
    return infer_spec(shapes, label=checkpoint.label)


def model_points(checkpoint: Checkpoint, spec) -> dict[str, int]:
    """Every point a statistics file of this model holds, with its width: its hidden
    layers' pre-activations and BatchNorm inputs; a transformer's MLP hidden units and
    LayerNorms."""
    if isinstance(spec, TransformerSpec):
        return {p.point: p.size for p in calibration_points(spec, _shapes(checkpoint))}
    return statistic_points(spec)


def input_points(checkpoint: Checkpoint, spec) -> dict[str, int]:
    """The input moments a statistics file of this model may hold, with their dimension d:
    the first layer's (``fusekit stats --input-moments``), where a hidden layer follows."""
    if isinstance(spec, TransformerSpec) or len(spec.layers) < 2:
        return {}
    first = spec.layers[0]
    return {input_point(first.name): math.prod(checkpoint.tensors[first.weight].shape[1:])}


def _shapes(checkpoint: Checkpoint) -> dict[str, tuple[int, ...]]:
    return {name: info.shape for name, info in checkpoint.tensors.items()}


def _calibrated_transformer(checkpoint: Checkpoint, spec: TransformerSpec,
                            where: Sequence[CalibrationPoint], pooled: Mapping[str, Any],
                            targets: Sequence[StatisticsLike], layers: Sequence[str] | None,
                            min_samples: int) -> dict[str, Any]:
    """REPAIR of every MLP's hidden units and every LayerNorm (ALGORITHMS §13), towards the
    clients' statistics of their own models."""
    if not targets:
        raise ParameterError(
            f"targets: {checkpoint.label} is a transformer, which has no BatchNorm to "
            "restore: give each client's statistics of its own model (--targets)")
    modules = [p.module for p in where]
    unknown = sorted(set(layers or ()) - set(modules))
    if unknown:
        raise ParameterError(f"layers: {unknown[:3]} are not calibration points of "
                             f"{checkpoint.label}; expected some of {modules[:4]}...")
    stats, chosen = _target_assignments(checkpoint, spec, targets, min_samples)
    goals = transformer_calibration.point_targets(spec, where, stats, chosen)
    return transformer_calibration.calibrated_transformer(
        checkpoint.state_dict(), where, pooled, goals, modules=layers)


def _statistics(source: StatisticsLike, model: str, points: Mapping[str, int],
                min_samples: int) -> Statistics:
    return _screened(source, Statistics, check_statistics, load_statistics, model=model,
                     points=points, min_samples=min_samples)


def _screened(source, in_memory: type, check: Callable[..., None], load: Callable[..., Any],
              **checks: Any) -> Any:
    """``source``, statistics of any kind, checked: in memory (an ``in_memory``) by
    ``check``, a file by ``load``, both with ``checks``."""
    if isinstance(source, in_memory):
        check(source, **checks)
        return source
    return load(source, **checks)


def _one_per_client(clients: Sequence[Checkpoint], sources: Sequence[Any],
                    read: Callable[[Any], Any], kind: str, stage: str) -> list[Any]:
    """The statistics ``read`` gives for ``sources`` (each checked, naming one of
    ``clients`` as its model), in the clients' order: exactly one per client.

    Raises:
        StatisticsError: two for one client, or none for one.
    """
    index = {c.content_hash: i for i, c in enumerate(clients)}
    out: list[Any] = [None] * len(clients)
    for source in sources:
        stats = read(source)
        if out[index[stats.model]] is not None:
            raise StatisticsError(f"{stats.label}: a second {kind} file for client "
                                  f"{clients[index[stats.model]].label}")
        out[index[stats.model]] = stats
    missing = [c.label for c, s in zip(clients, out, strict=True) if s is None]
    if missing:
        raise StatisticsError(f"{stage}: no {kind} for client(s) {', '.join(missing[:3])}; "
                              "every client must send one")
    return out


def _same_data(stats: Sequence[Statistics], own: Sequence[Statistics]) -> list[Statistics]:
    """Paired statistics, checked as far as they can be: each pair over as many inputs.

    Raises:
        StatisticsError: a pair over different numbers of inputs (not one client's data).
    """
    for fused_side, own_side in zip(stats, own, strict=True):
        if fused_side.num_samples != own_side.num_samples:
            raise StatisticsError(
                f"{fused_side.label}: paired with {own_side.label}, but computed over "
                f"{fused_side.num_samples} inputs against {own_side.num_samples}; paired "
                "statistics are one client's, on the same data, in the same order")
    return list(stats)


def _target_assignments(checkpoint: Checkpoint, spec, targets: Sequence[StatisticsLike],
                        min_samples: int) -> tuple[list[Statistics], list[Any]]:
    """The clients' statistics of their own models, each with its assignments: the
    fusion's for that client (each file names its model, which must be one of the fusion's
    inputs), or the identity for statistics of the calibrated model itself."""
    assignments = calibration.read_assignments(checkpoint, spec)
    inputs = load_json(checkpoint.metadata.get(meta.INPUTS, "[]"),
                       f"{checkpoint.label}: metadata {meta.INPUTS}")
    stats = [_statistics(s, None, None, min_samples) for s in targets]
    if assignments is None and all(s.model == checkpoint.content_hash for s in stats):
        identity = [np.arange(width) for width in spec.hidden_widths]
        return stats, [identity] * len(stats)
    if assignments is None or not isinstance(inputs, list) or len(inputs) != len(assignments):
        raise CheckpointError(
            f"{checkpoint.label}: REPAIR targets need the fusion's {meta.ASSIGNMENTS} and "
            f"{meta.INPUTS} metadata (a fusion by a method that matches neurons); found none")
    chosen = []
    for s in stats:
        if s.model not in inputs:
            raise StatisticsError(
                f"{s.label}: computed for model {s.model[:16]}..., which is not one of the "
                f"fusion's inputs; targets are the clients' statistics of their own models")
        chosen.append(assignments[inputs.index(s.model)])
    return stats, chosen


CrossStatisticsLike = str | os.PathLike[str] | CrossStatistics


def align(
    reference: CheckpointLike,
    clients: Sequence[CheckpointLike],
    cross_statistics: Sequence[CrossStatisticsLike],
    *,
    min_samples: int = DEFAULT_MIN_SAMPLES,
) -> FusionResult:
    """Re-match every client to a reference by activations and re-fuse (an alignment
    round, ALGORITHMS.md §12).

    Args:
        reference: the fused model the clients ran (best calibrated first: its
            activations are then those of a working network).
        clients: the clients' own models (the fusion's inputs).
        cross_statistics: one per client, its cross statistics of ``reference`` and its own
            model on its own data (``fusekit stats REFERENCE --against OWN_MODEL``, or
            :func:`fusekit.toolkit.alignment.cross_statistics`).
        min_samples: refuse statistics over fewer inputs.

    Returns:
        The re-fused model at the reference's widths, BatchNorms folded (calibrate it
        next), with the fusion's assignments and norm targets; ``report["alignment"]``:
        per client and group the mean correlation of the matched channels.

    Raises:
        StatisticsError: cross statistics that are malformed, against another reference,
            of a model that is none of the clients, two for one client or none for one.
        IncompatibleModelsError: clients whose layers are not the reference's, or a
            transformer.
    """
    reference = reference if isinstance(reference, Checkpoint) else load_checkpoint(reference)
    reference_spec = fused_spec(reference)
    if isinstance(reference_spec, TransformerSpec):
        raise IncompatibleModelsError(
            f"{reference.label}: a transformer; alignment rounds re-match the ReLU units of "
            "MLPs, CNNs and ResNets and do not cover transformers' heads and streams")
    checkpoints = [c if isinstance(c, Checkpoint) else load_checkpoint(c) for c in clients]
    specs = [client_spec(c, None) for c in checkpoints]
    order = canonical_order(checkpoints, specs)
    checkpoints, specs = [checkpoints[i] for i in order], [specs[i] for i in order]
    for checkpoint, spec in zip(checkpoints, specs, strict=True):
        if [layer.name for layer in spec.layers] != [layer.name for layer in
                                                     reference_spec.layers]:
            raise IncompatibleModelsError(
                f"{checkpoint.label}: its layers are not those of the reference "
                f"{reference.label}")
    cross = _cross_statistics_by_client(reference, reference_spec, checkpoints, specs,
                                        cross_statistics, min_samples)
    weights = sample_weights(checkpoints)
    state_dict, assignments, report = alignment.realign(
        checkpoints, specs, reference_spec, cross, weights)
    report["reference"] = reference.content_hash
    method = reference.metadata.get(meta.METHOD, "unknown")
    result = FusionResult(state_dict=state_dict, method=method, params={},
                          widths=reference_spec.hidden_widths, report={"alignment": report},
                          metadata={key: reference.metadata[key] for key in (meta.SPEC, meta.ARCH)
                                    if key in reference.metadata},
                          assignments=assignments, spec=reference_spec)
    provenance(result, checkpoints)
    result.metadata[meta.PARAMS] = reference.metadata.get(meta.PARAMS, "{}")
    result.metadata[meta.ALIGNMENT] = json.dumps({"reference": reference.content_hash,
                                                  "mean_correlation": report["mean_correlation"]})
    result.metadata[meta.ASSIGNMENTS] = calibration.assignments_json(assignments)
    if any(layer.norm for layer in reference_spec.layers):
        targets = calibration.norm_targets(checkpoints, specs, reference_spec, assignments,
                                           weights)
        result.metadata[meta.NORM_TARGETS] = json.dumps(targets, separators=(",", ":"))
    return result


def _cross_statistics_by_client(reference: Checkpoint, reference_spec: Any,
                                checkpoints: Sequence[Checkpoint], specs: Sequence[Any],
                                sources: Sequence[CrossStatisticsLike],
                                min_samples: int) -> list[CrossStatistics]:
    """Each client's cross statistics (clients' order), checked against the reference and
    that client."""
    checks = {"reference": reference.content_hash, "min_samples": min_samples,
              "models": {c.content_hash: alignment.cross_points(s)
                         for c, s in zip(checkpoints, specs, strict=True)},
              "widths": alignment.cross_points(reference_spec)}
    return _one_per_client(
        checkpoints, sources, lambda source: _screened(
            source, CrossStatistics, check_cross_statistics, load_cross_statistics, **checks),
        "cross statistics", "alignment")


RefitStatisticsLike = str | os.PathLike[str] | RefitStatistics


def refit(
    fused: CheckpointLike,
    clients: Sequence[CheckpointLike],
    refit_statistics: Sequence[RefitStatisticsLike],
    *,
    ridge: float = DEFAULT_RIDGE,
    min_samples: int = DEFAULT_MIN_SAMPLES,
) -> FusionResult:
    """Refit one layer of a fused model to the matched clients' pre-activations, by least
    squares from the clients' moments (a refit round, ALGORITHMS.md §12).

    Args:
        fused: the fused model the clients ran (after an alignment round: its
            ``fusekit.assignments`` say which client neuron each fused neuron fits).
        clients: the clients' own models (the fusion's inputs; some of them: a fused
            neuron that none of them was matched into keeps its weights).
        refit_statistics: one per client, all for the same layer (``fusekit stats FUSED
            --against OWN_MODEL --layer NAME``, or
            :func:`fusekit.toolkit.alignment.refit_statistics`).
        ridge: relative ridge towards the layer's current weights (> 0).
        min_samples: refuse statistics over fewer inputs.

    Returns:
        The fused model with that layer refit (BatchNorms folded: the layer now emits the
        clients' pre-activations itself); ``report["refit"]``.

    Raises:
        StatisticsError: statistics that are malformed, of another fused model, of a model
            that is none of the clients, of different layers, two or none for a client.
        CheckpointError: a fused model without ``fusekit.assignments``.
        ParameterError: a ridge that is not > 0.
    """
    if isinstance(ridge, bool) or not isinstance(ridge, (int, float)) or not ridge > 0:
        raise ParameterError(f"ridge: expected a number > 0, found {ridge!r}")
    fused = fused if isinstance(fused, Checkpoint) else load_checkpoint(fused)
    spec = fused_spec(fused)
    assignments = calibration.read_assignments(fused, spec)
    hashes = load_json(fused.metadata.get(meta.INPUTS, "[]"), f"{fused.label}: metadata "
                       f"{meta.INPUTS}")
    if assignments is None or not isinstance(hashes, list) or len(hashes) != len(assignments):
        raise CheckpointError(f"{fused.label}: a refit needs the fusion's {meta.ASSIGNMENTS} "
                              f"and {meta.INPUTS} metadata (run fusekit align first)")
    checkpoints = {c.content_hash: c for c in (
        c if isinstance(c, Checkpoint) else load_checkpoint(c) for c in clients)}
    if not checkpoints or not set(checkpoints) <= set(hashes):
        raise IncompatibleModelsError(f"clients: expected some of the {len(hashes)} models "
                                      f"{fused.label} was fused from, found others")
    ordered = [checkpoints[h] for h in hashes if h in checkpoints]
    specs = [client_spec(c, None) for c in ordered]
    stats = _refit_statistics_by_client(fused, spec, ordered, specs, refit_statistics,
                                        min_samples)
    index = [layer.name for layer in spec.layers].index(stats[0].layer)
    layers = neurons.client_layers(fused, spec)
    group = spec.writes[index]
    rows = [np.arange(spec.layers[index].out_features) if group is None else a[group]
            for h, a in zip(hashes, assignments, strict=True) if h in checkpoints]
    weights = sample_weights(ordered)
    layers[index] = alignment.refit_layer(layers[index], [s.gram for s in stats],
                                          [s.cross for s in stats], rows, weights, ridge)
    state_dict = neurons.to_state_dict(ordered, spec, layers)
    state_dict.update({name: fused.tensor(name) for name in spec.other})
    done = load_json(fused.metadata.get(meta.REFIT, "{}"), f"{fused.label}: metadata "
                     f"{meta.REFIT}")
    record = {"layers": [*(done.get("layers", []) if isinstance(done, dict) else []),
                         stats[0].layer], "ridge": ridge}
    metadata = {**fused.metadata, meta.REFIT: json.dumps(record)}
    return FusionResult(state_dict=state_dict, method=fused.metadata.get(meta.METHOD, "unknown"),
                        params={}, widths=spec.hidden_widths, report={"refit": record},
                        metadata=metadata, assignments=assignments, spec=spec)


def _refit_statistics_by_client(fused: Checkpoint, spec: Any, clients: Sequence[Checkpoint],
                                specs: Sequence[Any], sources: Sequence[RefitStatisticsLike],
                                min_samples: int) -> list[RefitStatistics]:
    """Each client's refit statistics (clients' order), checked, all of one layer."""
    models = {c.content_hash: {layer.name: layer.out_features for layer in s.layers}
              for c, s in zip(clients, specs, strict=True)}
    checks = {"reference": fused.content_hash, "models": models,
              "inputs": alignment.layer_inputs(spec), "min_samples": min_samples}
    layers: list[str] = []

    def read(source: RefitStatisticsLike) -> RefitStatistics:
        stats = _screened(source, RefitStatistics, check_refit_statistics,
                          load_refit_statistics, **checks)
        if layers and stats.layer != layers[0]:
            raise StatisticsError(f"{stats.label}: layer {stats.layer!r}; the other files "
                                  "are for another layer (one refit round refits one layer)")
        layers.append(stats.layer)
        return stats

    return _one_per_client(clients, sources, read, "refit statistics", "refit")


@contextlib.contextmanager
def _content_hashes_meanwhile(checkpoints: Sequence[Checkpoint]) -> Iterator[None]:
    """Compute the inputs' content hashes, which the provenance records, on one more
    thread while the block (the fusion) runs: sha256 and file reads release the GIL, and
    so do the engine's kernels. If the block fails, its error is raised and hashes not
    begun are dropped; otherwise the first hashing error, in canonical order, is."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fusekit-hash")
    futures = [pool.submit(lambda c=c: c.content_hash) for c in checkpoints]
    try:
        yield
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
    for future in futures:
        future.result()


@contextlib.contextmanager
def _peak_memory():
    """Peak resident memory of the process during the block, in MB, or None off Linux.

    Linux keeps the high-water mark (VmHWM) and lets a process reset it through
    /proc/self/clear_refs: two small file operations, against the 25 % that tracing every
    allocation (tracemalloc) adds to a fusion. It is the whole process's resident peak
    (the interpreter and what was loaded before included), the C++ engine's buffers too.
    """
    out: dict[str, float | None] = {"mb": None}
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
    except OSError:
        yield out
        return
    yield out
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                out["mb"] = round(int(line.split()[1]) / 1024, 1)


def validate_params(method: str, params: Mapping[str, Any]
                    ) -> tuple[FusionMethod, list[ParamSpec]]:
    """The method and its declared parameters, once ``params`` passed that declaration:
    what :func:`fuse` checks before reading any checkpoint (front doors call it to refuse a
    request early).

    Raises:
        UnknownMethodError, ParameterError: bad method name or parameters.
    """
    fusion = get_method(method)
    declared = method_params(fusion)
    validate(fusion.name, declared, dict(params))
    return fusion, declared


def fusion_summary(result: FusionResult, output: str, time_s: float) -> dict[str, Any]:
    """The report of one fusion: what ``fusekit fuse --json`` prints and the service serves."""
    return {
        "output": output,
        "method": result.method,
        "params": result.params,
        "widths": result.widths,
        "time_s": time_s,
        "report": result.report,
    }


def _in_canonical_order(params: dict[str, Any], names: Sequence[str],
                        order: Sequence[int]) -> dict[str, Any]:
    """Per-client values come in the order of the inputs; methods see clients reordered."""
    out = dict(params)
    for name in names:
        value = out.get(name)
        if isinstance(value, Sequence) and not isinstance(value, str) and len(value) == len(order):
            out[name] = type(value)(value[i] for i in order) if isinstance(value, tuple) else [
                value[i] for i in order]
    return out


def client_spec(checkpoint: Checkpoint, spec: SpecLike | None) -> PermutationSpec:
    """The permutation spec of one client: given, or inferred (from config.json for a
    Hugging Face model folder, from names and shapes otherwise)."""
    shapes = _shapes(checkpoint)
    if spec is None and checkpoint.config is not None:
        return infer_transformer(checkpoint.config, shapes, label=checkpoint.label)
    if spec is None:
        return infer_spec(shapes, label=checkpoint.label)
    if isinstance(spec, (PermutationSpec, GraphSpec, TransformerSpec)):
        return spec_from_json(spec.to_json(), shapes, label=checkpoint.label)
    if isinstance(spec, Mapping):
        return spec_from_json(spec, shapes, label=checkpoint.label)
    return load_spec_file(Path(spec), shapes)


def check_compatible(checkpoints: Sequence[Checkpoint], specs: Sequence[PermutationSpec]) -> None:
    """Every client must have the same tensors and the same layer structure."""
    first, first_spec = checkpoints[0], specs[0]
    for other, spec in zip(checkpoints[1:], specs[1:], strict=True):
        if isinstance(first_spec, TransformerSpec) or isinstance(spec, TransformerSpec):
            _check_same_transformer(first, first_spec, other, spec)
        else:
            _check_same_layers(first, first_spec, other, spec)
        missing = sorted(set(first.tensors) - set(other.tensors))
        extra = sorted(set(other.tensors) - set(first.tensors))
        if missing or extra:
            name, where, lacks = (missing[0], first, other) if missing else (extra[0], other, first)
            raise IncompatibleModelsError(
                f"tensor {name!r} is in {where.label} but missing from {lacks.label}; "
                "expected every client to have the same tensors"
            )


def _check_same_layers(first: Checkpoint, first_spec: Any, other: Checkpoint,
                       spec: Any) -> None:
    if len(first_spec.layers) != len(spec.layers):
        raise IncompatibleModelsError(
            f"architectures cannot be fused: {first.label} has {len(first_spec.layers)} "
            f"layers, {other.label} has {len(spec.layers)}"
        )
    for mine, theirs in zip(first_spec.structure(), spec.structure(), strict=True):
        if mine != theirs:
            raise IncompatibleModelsError(
                f"architectures cannot be fused: {first.label} has {_describe(mine)} "
                f"where {other.label} has {_describe(theirs)}"
            )


def _check_same_transformer(first: Checkpoint, first_spec: Any, other: Checkpoint,
                            spec: Any) -> None:
    """Same family, same groups with the same sizes (MLP widths aside), same slots."""
    if not (isinstance(first_spec, TransformerSpec) and isinstance(spec, TransformerSpec)):
        mixed = first if isinstance(first_spec, TransformerSpec) else other
        raise IncompatibleModelsError(f"architectures cannot be fused: {mixed.label} is a "
                                      "transformer and the other client is not")
    mine, theirs = first_spec.structure(), spec.structure()
    for a, b in zip(mine, theirs, strict=False):
        if a != b:
            raise IncompatibleModelsError(
                f"architectures cannot be fused: {first.label} has {_group_text(a)} where "
                f"{other.label} has {_group_text(b)}")
    if len(mine) != len(theirs):
        raise IncompatibleModelsError(
            f"architectures cannot be fused: {first.label} has {len(mine) - 1} permutation "
            f"groups, {other.label} has {len(theirs) - 1} (a different depth or head count)")


def _group_text(row: tuple[Any, ...]) -> str:
    if row[0] == "family":
        return f"model type {row[1]!r}"
    name, kind, size = row[:3]
    return f"group {name} ({kind}{f', {size} units' if size is not None else ''})"


def _describe(row: tuple[Any, ...]) -> str:
    if row[0] in ("in", "out"):
        return f"{row[1]} {'inputs' if row[0] == 'in' else 'outputs'}"
    name, kind, kernel, norm, bias = row
    extras = [f"kernel {kernel[0]}x{kernel[1]}" if kind == "conv2d" else "",
              "BatchNorm" if norm else "", "bias" if bias else "no bias"]
    return f"layer {name} ({kind}{''.join(', ' + e for e in extras if e)})"


def canonical_order(checkpoints: Sequence[Checkpoint],
                    specs: Sequence[PermutationSpec]) -> list[int]:
    """Indices of the clients in canonical order, a function of their contents alone
    (independent of input order): widest first, then by sample hash, then, among clients
    whose widths and sample hash are equal, by content hash. Only those clients are
    hashed in full here; the others' content hashes are left for the provenance."""
    keys = [(tuple(-w for w in spec.hidden_widths), checkpoint.sample_hash)
            for checkpoint, spec in zip(checkpoints, specs, strict=True)]
    shared = {key for key, n in Counter(keys).items() if n > 1}
    return sorted(range(len(checkpoints)), key=lambda i: (
        *keys[i], checkpoints[i].content_hash if keys[i] in shared else ""))


def describe_checkpoint(checkpoint: Checkpoint) -> dict[str, Any]:
    """What ``fusekit inspect`` shows: layers, widths, permutation groups, metadata, problems."""
    info: dict[str, Any] = {
        "path": checkpoint.label,
        "tensors": len(checkpoint.tensors),
        "parameters": sum(_numel(t.shape) for t in checkpoint.tensors.values()),
        "metadata": checkpoint.metadata,
        "problems": [],
    }
    try:
        if meta.AMS in checkpoint.metadata:
            return _describe_ams(checkpoint, info)
        spec = client_spec(checkpoint, None)
    except ValueError as exc:
        info["problems"].append(str(exc))
        return info
    if isinstance(spec, TransformerSpec):
        info["family"] = spec.family
        info["groups"] = spec.describe()
        members = [group.slots for group in spec.groups]
    else:
        info["layers"] = spec.describe()
        members = [spec.group(i) for i in range(len(spec.hidden_widths))]
    info["hidden_widths"] = spec.hidden_widths
    info["group_names"] = list(spec.group_names)
    info["permutation_groups"] = [[_axis_text(a) for a in group] for group in members]
    info["other_tensors"] = list(spec.other)
    info["limits"] = _permutation_limits(checkpoint, spec)
    try:
        checkpoint.check_values()
    except ValueError as exc:
        info["problems"].append(str(exc))
    info["metadata"] = {k: _maybe_json(v) for k, v in checkpoint.metadata.items()}
    return info


def _axis_text(ref: Any) -> str:
    """``tensor[axis A, block B, from O]``: one member of a permutation group."""
    extras = [f", block {ref.block}" if ref.block > 1 else "",
              f", from {ref.offset}" if getattr(ref, "offset", 0) else ""]
    return f"{ref.tensor}[axis {ref.axis}{''.join(extras)}]"


def _describe_ams(checkpoint: Checkpoint, info: dict[str, Any]) -> dict[str, Any]:
    """An AMS artefact: its selection rule and each sub-model's layers, from its metadata."""
    from fusekit.methods.ams import read_ams_metadata

    description = read_ams_metadata(checkpoint.metadata, checkpoint.label)
    shapes = {name: t.shape for name, t in checkpoint.tensors.items()}
    models = []
    for entry in description["models"]:
        prefix = entry["prefix"]
        own = {n[len(prefix):]: s for n, s in shapes.items() if n.startswith(prefix)}
        spec = spec_from_json(entry["spec"], own, label=f"{checkpoint.label} [{prefix}*]")
        models.append({"prefix": prefix, "layers": spec.describe(),
                       "hidden_widths": spec.hidden_widths})
    info.update(ams={"mode": description["mode"], "k": description["k"], "models": models},
                hidden_widths=[m["hidden_widths"] for m in models],
                metadata={k: _maybe_json(v) for k, v in checkpoint.metadata.items()})
    return info


def _permutation_limits(checkpoint: Checkpoint, spec: PermutationSpec) -> list[str]:
    """Why permutation-based methods would refuse this checkpoint (other methods may not)."""
    from fusekit.core.neurons import refuse_position_aware
    from fusekit.methods import METHODS

    permuting = sorted(name for name, cls in METHODS.items() if cls.permutes_neurons)
    try:
        refuse_position_aware([checkpoint], [spec], "/".join(permuting))
    except IncompatibleModelsError as exc:
        return [str(exc)]
    return []


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _maybe_json(value: str) -> Any:
    try:
        return load_json(value, "metadata")
    except CheckpointError:
        return value
