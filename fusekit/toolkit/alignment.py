"""The forward passes of an alignment round (ALGORITHMS.md §12): a client's cross
statistics of the reference (the fused model sent back) and its own model on its own data,
and its refit statistics of one layer. The rounds that ask for them run locally in
:mod:`fusekit.toolkit.local`.

Only aggregates leave :func:`cross_statistics`: per hidden layer, the count, the two
models' per-channel means and variances and the covariance matrix of their channels.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Sequence

import numpy as np
import torch

from fusekit.core.checkpoint import Checkpoint, load_checkpoint
from fusekit.core.cross_stats import (
    CrossMoments,
    CrossStatistics,
    RefitStatistics,
    combine_cross,
)
from fusekit.core.errors import DataError, ParameterError
from fusekit.core.model_spec import fused_spec
from fusekit.core.stats import DEFAULT_MIN_SAMPLES, preactivation_point
from fusekit.toolkit.calibration import (
    DEFAULT_BATCH_SIZE,
    channel_samples,
    checked_inputs,
)
from fusekit.toolkit.nn.fused import load_fused, preactivation_modules

log = logging.getLogger(__name__)


class _CrossAccumulator:
    """Joint moments of paired (samples, R) and (samples, O) streams, merged batch by batch
    with :func:`fusekit.core.cross_stats.combine_cross` (exact in float64)."""

    def __init__(self) -> None:
        self.total: CrossMoments | None = None

    def add(self, reference: torch.Tensor, own: torch.Tensor) -> None:
        x, y = channel_samples(reference), channel_samples(own)
        dx, dy = x - x.mean(0), y - y.mean(0)
        n = x.shape[0]
        batch = CrossMoments(np.array([float(n)]),
                             *(t.cpu().numpy() for t in (x.mean(0), (dx * dx).mean(0),
                                                          y.mean(0), (dy * dy).mean(0),
                                                          dx.T @ dy / n)))
        self.total = batch if self.total is None else combine_cross([self.total, batch])

    def moments(self) -> CrossMoments:
        return self.total


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
    models, specs, inputs = _paired(reference, own, inputs, batch_size, min_samples)
    networks = [load_fused(m, device) for m in models]
    modules = [preactivation_modules(n, s)[:-1] for n, s in zip(networks, specs, strict=True)]
    accumulators = {preactivation_point(layer.name): _CrossAccumulator()
                    for layer in specs[0].layers[:-1]}
    outputs: list[dict[str, torch.Tensor]] = [{}, {}]
    hooks = [module.register_forward_hook(_recorder(outputs[side], point))
             for side in (0, 1)
             for module, point in zip(modules[side], accumulators, strict=True)]
    with _running(inputs, models[1].label, hooks):
        for batch in _batches(inputs, batch_size, device):
            for network in networks:
                network(batch)
            for point, accumulator in accumulators.items():
                accumulator.add(outputs[0].pop(point), outputs[1].pop(point))
    return CrossStatistics(reference=models[0].content_hash, model=models[1].content_hash,
                           num_samples=len(inputs), mode="eval",
                           points={p: a.moments() for p, a in accumulators.items()},
                           label=f"cross statistics of {models[0].label} and {models[1].label}")


def _paired(reference, own, inputs, batch_size: int, min_samples: int):
    """The two models (checkpoints), their specs and the inputs, checked."""
    inputs = checked_inputs(inputs, batch_size, min_samples)
    models = [m if isinstance(m, Checkpoint) else load_checkpoint(m) for m in (reference, own)]
    specs = [fused_spec(m) for m in models]
    if [layer.name for layer in specs[0].layers] != [layer.name for layer in specs[1].layers]:
        raise ParameterError(
            f"{models[1].label}: its layers are not those of the fused model "
            f"{models[0].label}; the statistics pair the same layers of the two models")
    return models, specs, inputs


def _batches(inputs: np.ndarray, batch_size: int, device: str):
    """Mini-batches of ``inputs`` as float32 tensors."""
    for start in range(0, len(inputs), batch_size):
        yield torch.from_numpy(np.ascontiguousarray(inputs[start:start + batch_size],
                                                    dtype=np.float32)).to(device)


@contextlib.contextmanager
def _running(inputs: np.ndarray, label: str, hooks: Sequence):
    """No gradients; a shape error of the models becomes one DataError line; the hooks are
    removed at the end."""
    try:
        with torch.no_grad():
            yield
    except RuntimeError as exc:
        raise DataError(f"statistics: inputs of shape {tuple(inputs.shape)} do not fit "
                        f"{label} ({str(exc).splitlines()[0]})") from None
    finally:
        for hook in hooks:
            hook.remove()


def _recorder(outputs: dict[str, torch.Tensor], point: str):
    def record(_module, _args, output):
        outputs[point] = output

    return record


def refit_statistics(
    fused: Checkpoint | str | os.PathLike[str],
    own: Checkpoint | str | os.PathLike[str],
    inputs: np.ndarray,
    layer: str,
    *,
    batch_size: int = DEFAULT_BATCH_SIZE,
    device: str = "cpu",
    min_samples: int = DEFAULT_MIN_SAMPLES,
) -> RefitStatistics:
    """One client's moments for refitting ``layer`` of ``fused``: E[u uᵀ] and E[y uᵀ] over
    every input position, u the fused model's input to the layer (a conv's patch) with a
    trailing 1, y the ``own`` model's pre-activation of that layer.

    Raises:
        DataError: inputs that do not fit the models, or fewer than ``min_samples``.
        ParameterError: a layer the fused model does not have, or models whose layers differ.
    """
    models, specs, inputs = _paired(fused, own, inputs, batch_size, min_samples)
    names = [spec_layer.name for spec_layer in specs[0].layers]
    if layer not in names:
        raise ParameterError(f"layer: expected one of {names[:6]}..., found {layer!r}")
    index = names.index(layer)
    networks = [load_fused(m, device) for m in models]
    module = networks[0].get_submodule(layer)
    seen: dict[str, torch.Tensor] = {}
    hooks = [module.register_forward_pre_hook(
                 lambda _m, args: seen.__setitem__("u", _rows(module, args[0]))),
             preactivation_modules(networks[1], specs[1])[index].register_forward_hook(
                 lambda _m, _a, out: seen.__setitem__("y", channel_samples(out)))]
    gram, cross, count = 0.0, 0.0, 0
    with _running(inputs, models[1].label, hooks):
        for batch in _batches(inputs, batch_size, device):
            for network in networks:
                network(batch)
            u, y = seen.pop("u"), seen.pop("y")
            gram, cross = gram + (u.T @ u).cpu().numpy(), cross + (y.T @ u).cpu().numpy()
            count += u.shape[0]
    return RefitStatistics(reference=models[0].content_hash, model=models[1].content_hash,
                           layer=layer, num_samples=len(inputs), count=count,
                           gram=gram / count, cross=cross / count,
                           label=f"refit statistics of {models[1].label} at {layer}")


def _rows(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """(rows, d+1) float64: a Linear's inputs, or a Conv2d's patches (C_in·kh·kw values, in
    the order of its weight), each with a trailing 1."""
    if isinstance(module, torch.nn.Conv2d):
        cols = torch.nn.functional.unfold(x, module.kernel_size, dilation=module.dilation,
                                          padding=module.padding, stride=module.stride)
        x = cols.transpose(1, 2).reshape(-1, cols.shape[1])
    x = x.reshape(x.shape[0], -1).double()
    return torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype, device=x.device)], 1)
