"""The forward passes of an alignment round (ALGORITHMS.md §12.4): a client's cross
statistics of the reference (the fused model sent back) and its own model on its own data,
and the whole round run locally for simulations, demos and benchmarks.

Only aggregates leave :func:`cross_statistics`: per hidden layer, the count, the two
models' per-channel means and variances and the covariance matrix of their channels.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence

import numpy as np
import torch

from fusekit import api
from fusekit.core import metadata as meta
from fusekit.core.checkpoint import Checkpoint, load_checkpoint
from fusekit.core.cross_stats import CrossMoments, CrossStatistics
from fusekit.core.errors import DataError, ParameterError
from fusekit.core.stats import DEFAULT_MIN_SAMPLES, preactivation_point
from fusekit.methods.base import FusionResult
from fusekit.toolkit.calibration import DEFAULT_BATCH_SIZE, calibrate_locally
from fusekit.toolkit.nn.fused import load_fused, preactivation_modules

log = logging.getLogger(__name__)


class _CrossAccumulator:
    """Count, means, M2s and co-moment of paired (samples, R) and (samples, O) streams
    (Chan et al.'s pairwise update, exact in float64)."""

    def __init__(self) -> None:
        self.count = 0
        self.sums: list[np.ndarray] = []  # mean_r, mean_o, m2_r, m2_o, comoment

    def add(self, reference: torch.Tensor, own: torch.Tensor) -> None:
        x, y = _samples(reference), _samples(own)
        n = x.shape[0]
        mx, my = x.mean(0), y.mean(0)
        dx, dy = x - mx, y - my
        batch = [mx, my, (dx * dx).sum(0), (dy * dy).sum(0), dx.T @ dy]
        batch = [b.cpu().numpy() for b in batch]
        if not self.sums:
            self.count, self.sums = n, batch
            return
        total = self.count + n
        mean_r, mean_o, m2_r, m2_o, co = self.sums
        delta_r, delta_o = batch[0] - mean_r, batch[1] - mean_o
        factor = self.count * n / total
        self.sums = [mean_r + delta_r * n / total, mean_o + delta_o * n / total,
                     m2_r + batch[2] + delta_r ** 2 * factor,
                     m2_o + batch[3] + delta_o ** 2 * factor,
                     co + batch[4] + np.outer(delta_r, delta_o) * factor]
        self.count = total

    def moments(self) -> CrossMoments:
        mean_r, mean_o, m2_r, m2_o, co = self.sums
        n = float(self.count)
        return CrossMoments(np.array([n]), mean_r, m2_r / n, mean_o, m2_o / n, co / n)


def _samples(value: torch.Tensor) -> torch.Tensor:
    """(samples, C) float64: every spatial position of a conv channel is a sample."""
    if value.dim() == 4:
        value = value.transpose(0, 1).reshape(value.shape[1], -1).T
    return value.detach().double()


def cross_statistics(
    reference: Checkpoint | str | os.PathLike[str],
    own: Checkpoint | str | os.PathLike[str],
    inputs: np.ndarray,
    *,
    batch_size: int = DEFAULT_BATCH_SIZE,
    device: str = "cpu",
    min_samples: int = DEFAULT_MIN_SAMPLES,
) -> CrossStatistics:
    """One client's cross statistics of ``reference`` and its ``own`` model on ``inputs``.

    Both models run as they are (eval mode) on the same batches; at every hidden layer's
    pre-activation the joint moments of the reference's and the own model's channels are
    accumulated.

    Args:
        reference: the model the server sent (the fused model, calibrated or not).
        own: the client's own model (the one it sent for fusion).
        inputs: (N, ...) inputs both models accept.
        batch_size: inputs per forward pass.
        device: where the models run.
        min_samples: refuse to compute statistics over fewer inputs.

    Returns:
        :class:`CrossStatistics` naming both models by their content hashes.

    Raises:
        DataError: inputs that do not fit the models, or fewer than ``min_samples``.
        ParameterError: a batch size < 1, or models of different depths.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ParameterError(f"batch_size: expected an integer >= 1, found {batch_size!r}")
    models = [m if isinstance(m, Checkpoint) else load_checkpoint(m) for m in (reference, own)]
    inputs = np.asarray(inputs)
    if inputs.ndim < 2 or len(inputs) < max(min_samples, 1):
        raise DataError(f"cross statistics: expected inputs of shape (N, ...) with N >= "
                        f"{max(min_samples, 1)} (--min-samples), found {inputs.shape}")
    specs = [api.fused_spec(m) for m in models]
    if [layer.name for layer in specs[0].layers] != [layer.name for layer in specs[1].layers]:
        raise ParameterError(
            f"{models[1].label}: its layers are not those of the reference "
            f"{models[0].label}; cross statistics pair the same layers of the two models")
    networks = [load_fused(m, device) for m in models]
    modules = [preactivation_modules(n, s)[:-1] for n, s in zip(networks, specs, strict=True)]
    accumulators = {preactivation_point(layer.name): _CrossAccumulator()
                    for layer in specs[0].layers[:-1]}
    outputs: list[dict[str, torch.Tensor]] = [{}, {}]
    hooks = [module.register_forward_hook(_recorder(outputs[side], point))
             for side in (0, 1)
             for module, point in zip(modules[side], accumulators, strict=True)]
    try:
        with torch.no_grad():
            for start in range(0, len(inputs), batch_size):
                batch = torch.from_numpy(np.ascontiguousarray(
                    inputs[start:start + batch_size], dtype=np.float32)).to(device)
                for network in networks:
                    network(batch)
                for point, accumulator in accumulators.items():
                    accumulator.add(outputs[0].pop(point), outputs[1].pop(point))
    except RuntimeError as exc:
        raise DataError(f"cross statistics: inputs of shape {tuple(inputs.shape)} do not fit "
                        f"{models[1].label} ({str(exc).splitlines()[0]})") from None
    finally:
        for hook in hooks:
            hook.remove()
    return CrossStatistics(reference=models[0].content_hash, model=models[1].content_hash,
                           num_samples=len(inputs), mode="eval",
                           points={p: a.moments() for p, a in accumulators.items()},
                           label=f"cross statistics of {models[0].label} and {models[1].label}")


def _recorder(outputs: dict[str, torch.Tensor], point: str):
    def record(_module, _args, output):
        outputs[point] = output

    return record


def align_locally(
    fused: Checkpoint | str | os.PathLike[str],
    clients: Sequence[Checkpoint],
    client_inputs: Sequence[np.ndarray],
    *,
    alignment_rounds: int = 1,
    rounds: str = "layerwise",
    min_samples: int = DEFAULT_MIN_SAMPLES,
    batch_size: int = DEFAULT_BATCH_SIZE,
    device: str = "cpu",
) -> FusionResult:
    """Calibrate, then run ``alignment_rounds`` alignment rounds, each followed by
    calibration, with every client's data at hand (simulations, demos, benchmarks).

    Each alignment round: every client computes :func:`cross_statistics` of the current
    (calibrated) fused model and its own model on its own inputs; :func:`fusekit.align`
    re-matches and re-fuses; :func:`calibrate_locally` calibrates the result.

    Args:
        fused: the one-shot fused model.
        clients: the clients' own models, in the order of ``client_inputs``.
        client_inputs: per client, its inputs.
        alignment_rounds: alignment rounds (>= 1), each against the previous result.
        rounds, min_samples, batch_size, device: see :func:`calibrate_locally`.

    Returns:
        The calibrated, aligned model; ``report["alignment"]`` per round, the mean matched
        correlation.
    """
    if isinstance(alignment_rounds, bool) or not isinstance(alignment_rounds, int) or not (
            1 <= alignment_rounds <= 100):
        raise ParameterError(f"alignment_rounds: expected an integer in [1, 100], found "
                             f"{alignment_rounds!r}")

    def calibrated(model: Checkpoint) -> Checkpoint:
        result = calibrate_locally(model, client_inputs, clients=clients, rounds=rounds,
                                   min_samples=min_samples, batch_size=batch_size,
                                   device=device)
        return Checkpoint.from_state_dict(result.state_dict, result.metadata,
                                          source=f"{model.label} (calibrated)")

    current = calibrated(fused if isinstance(fused, Checkpoint) else load_checkpoint(fused))
    history = []
    for _ in range(alignment_rounds):
        cross = [cross_statistics(current, own, x, batch_size=batch_size, device=device,
                                  min_samples=min_samples)
                 for own, x in zip(clients, client_inputs, strict=True)]
        aligned = api.align(current, clients, cross, min_samples=min_samples)
        history.append(aligned.report["alignment"])
        current = calibrated(Checkpoint.from_state_dict(aligned.state_dict, aligned.metadata,
                                                        source="aligned"))
    result = FusionResult(state_dict=current.state_dict(),
                          method=current.metadata.get(meta.METHOD, "unknown"), params={},
                          widths=api.fused_spec(current).hidden_widths,
                          report={"alignment": history}, metadata=dict(current.metadata))
    result.metadata[meta.ALIGNMENT] = json.dumps(
        {"rounds": alignment_rounds,
         "mean_correlation": [h["mean_correlation"] for h in history]})
    return result
