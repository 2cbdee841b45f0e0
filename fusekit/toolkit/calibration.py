"""The forward passes of calibration (ALGORITHMS.md §12): a client's statistics of a model
(a network, or a Hugging Face transformer: §13) on its own data. The rounds that ask for
them run locally in :mod:`fusekit.toolkit.local`.

Only per-channel count, mean and variance leave :func:`client_statistics` (and, when asked
for, the first layer's input moments: a d x d covariance); the inputs never do.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fusekit.core.checkpoint import Checkpoint, load_checkpoint
from fusekit.core.errors import CheckpointError, DataError, ParameterError
from fusekit.core.model_spec import fused_spec
from fusekit.core.stats import (
    DEFAULT_MIN_SAMPLES,
    MODES,
    InputMoments,
    Moments,
    Statistics,
    bn_input_point,
    combine,
    combine_inputs,
    input_point,
    preactivation_point,
)
from fusekit.core.transformer import calibration_points
from fusekit.methods.calibration import read_norm_targets
from fusekit.toolkit.nn.fused import load_fused, preactivation_modules
from fusekit.toolkit.nn.hf import load_pretrained, model_from_tensors, modules_by_saved_name

log = logging.getLogger(__name__)

#: How a fused model is calibrated locally: one round per calibrated layer (exact), or
#: one pass with every BatchNorm normalised by the batch's statistics (approximate).
ROUNDS = ("layerwise", "one-pass")
DEFAULT_BATCH_SIZE = 1024


def channel_samples(value: torch.Tensor) -> torch.Tensor:
    """(samples, C) float64: every spatial position of a conv channel is a sample."""
    if value.dim() == 4:  # (N, C, H, W)
        value = value.transpose(0, 1).reshape(value.shape[1], -1).T
    return value.detach().double()


class ChannelAccumulator:
    """Per-channel moments of a stream of (samples, C) batches, merged batch by batch with
    :func:`fusekit.core.stats.combine`."""

    def __init__(self) -> None:
        self.total: Moments | None = None

    def add(self, value: torch.Tensor) -> None:
        x = channel_samples(value)
        mean = x.mean(0)
        var = ((x - mean) ** 2).mean(0)
        batch = Moments(np.full(x.shape[1], float(x.shape[0])), mean.cpu().numpy(),
                        var.cpu().numpy())
        self.total = batch if self.total is None else combine([self.total, batch])

    def moments(self) -> Moments:
        return self.total


#: Input vectors per chunk when a conv's patches are unfolded (bounds the float64 copy).
_PATCH_CHUNK = 1 << 22


class _InputAccumulator:
    """Count, mean and covariance of the vectors a first layer multiplies: a Linear's
    inputs, a Conv2d's zero-padded patches at every output position (torch's ``unfold``
    order, that of ``weight.reshape(out, -1)``)."""

    def __init__(self, module: nn.Module, label: str) -> None:
        if isinstance(module, nn.Conv2d) and (
                module.groups != 1 or module.padding_mode != "zeros"
                or isinstance(module.padding, str)):
            raise ParameterError(
                f"input_moments: {label} is a Conv2d with groups={module.groups}, padding "
                f"{module.padding!r} ({module.padding_mode}); input moments cover Linear layers "
                "and Conv2d layers with groups=1 and numeric zero padding")
        if not isinstance(module, (nn.Linear, nn.Conv2d)):
            raise ParameterError(f"input_moments: {label} is a {type(module).__name__}; "
                                 "input moments cover a first Linear or Conv2d layer")
        self.module = module
        self.total: InputMoments | None = None

    def add(self, value: torch.Tensor) -> None:
        value = value.detach()
        if isinstance(self.module, nn.Linear):
            self._merge(value.reshape(-1, value.shape[-1]).double())
            return
        m = self.module
        per_image = value[0].numel() * m.kernel_size[0] * m.kernel_size[1]  # patch entries,
        for chunk in value.split(max(1, _PATCH_CHUNK // per_image)):  # at most (stride 1)
            patches = F.unfold(chunk, m.kernel_size, dilation=m.dilation, padding=m.padding,
                               stride=m.stride)  # (n, d, positions)
            self._merge(patches.transpose(1, 2).reshape(-1, patches.shape[1]).double())

    def _merge(self, x: torch.Tensor) -> None:
        mean = x.mean(0)
        centred = x - mean
        cov = (centred.T @ centred) / x.shape[0]
        batch = InputMoments(float(x.shape[0]), mean.cpu().numpy(), cov.cpu().numpy())
        self.total = batch if self.total is None else combine_inputs([self.total, batch])

    def moments(self) -> InputMoments:
        cov = self.total.cov
        return InputMoments(self.total.count, self.total.mean, (cov + cov.T) / 2)


def checked_inputs(inputs, batch_size: int, min_samples: int) -> np.ndarray:
    """``inputs`` as an array of at least ``min_samples`` samples, and ``batch_size``
    checked: what every statistics pass over a client's data requires.

    Raises:
        ParameterError: a batch size < 1.
        DataError: inputs that are not (N, ...) with N >= ``min_samples``.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ParameterError(f"batch_size: expected an integer >= 1, found {batch_size!r}")
    inputs = np.asarray(inputs)
    if inputs.ndim < 2 or len(inputs) < max(min_samples, 1):
        raise DataError(f"statistics: expected inputs of shape (N, ...) with N >= "
                        f"{max(min_samples, 1)} (min_samples), found {inputs.shape}")
    return inputs


def client_statistics(
    model: Checkpoint | str | os.PathLike[str],
    inputs: np.ndarray,
    *,
    mode: str = "eval",
    batch_size: int = DEFAULT_BATCH_SIZE,
    device: str = "cpu",
    min_samples: int = DEFAULT_MIN_SAMPLES,
    input_moments: bool = False,
) -> Statistics:
    """One client's statistics of ``model`` on its own ``inputs``.

    Args:
        model: the model (a fused model, or the client's own for REPAIR's targets).
        inputs: (N, ...) inputs the model accepts.
        mode: ``eval`` runs the model as it is (exact for the layers whose inputs are
            already calibrated); ``batch`` normalises every BatchNorm with the batch's
            statistics and the affine calibration will give it (one-pass calibration).
        batch_size: inputs per forward pass (in ``batch`` mode also the BatchNorm batch).
        device: where the model runs.
        min_samples: refuse to compute statistics over fewer inputs (they would come close
            to revealing them; :func:`fusekit.calibrate` refuses them too).
        input_moments: also record the first layer's input moments (count, mean (d,),
            covariance (d, d) of its input vectors; ``input:<layer>``), from which
            :func:`fusekit.calibrate` derives the fused first layer's statistics without a
            round. Opt-in: d x d second moments say more about the data than per-channel
            moments.

    Returns:
        :class:`Statistics` naming the model by its content hash.

    Raises:
        DataError: inputs that do not fit the model, fewer than ``min_samples``, or (with
            ``input_moments``) no more input vectors than their dimension.
        ParameterError: an unknown mode or a batch size < 1; ``input_moments`` for a model
            whose first layer is its output layer, or not a Linear or plain Conv2d.
    """
    if mode not in MODES:
        raise ParameterError(f"mode: expected one of {list(MODES)}, found {mode!r}")
    inputs = checked_inputs(inputs, batch_size, min_samples)
    checkpoint = model if isinstance(model, Checkpoint) else load_checkpoint(model)
    if checkpoint.config is not None:  # a Hugging Face transformer: no BatchNorm
        if input_moments:
            raise ParameterError(f"input_moments: {checkpoint.label} is a transformer; input "
                                 "moments cover a first Linear or Conv2d layer")
        if mode == "batch":
            raise ParameterError(f"mode: {checkpoint.label} is a transformer, which has no "
                                 "BatchNorm to normalise with batch statistics; use eval")
        return transformer_statistics(checkpoint, inputs, mode=mode, batch_size=batch_size,
                                      device=device)
    spec = fused_spec(checkpoint)
    network = load_fused(checkpoint, device)
    if mode == "batch":
        _batch_mode(network, checkpoint, spec)
    accumulators: dict[str, ChannelAccumulator] = {}
    hooks = []
    for layer, module in zip(spec.layers[:-1], preactivation_modules(network, spec)[:-1],
                             strict=True):
        hooks.append(_hook(module, accumulators, preactivation_point(layer.name), "output"))
        if layer.norm is not None:
            norm = network.get_submodule(layer.norm.prefix)
            hooks.append(_hook(norm, accumulators, bn_input_point(layer.norm.prefix), "input"))
    first_layer = _first_layer_inputs(network, spec, hooks) if input_moments else {}

    def run(batch: np.ndarray) -> None:
        network(torch.from_numpy(np.ascontiguousarray(batch, dtype=np.float32)).to(device))

    stats = recorded_statistics(run, inputs, batch_size, hooks, accumulators, checkpoint, mode)
    stats.inputs = {point: _enough(point, a.moments()) for point, a in first_layer.items()}
    return stats


def _first_layer_inputs(network: nn.Module, spec, hooks: list) -> dict[str, _InputAccumulator]:
    """Hook the first layer's input (ALGORITHMS §12: derived without a round)."""
    first = spec.layers[0]
    if len(spec.layers) < 2:
        raise ParameterError(f"input_moments: the first layer ({first.name}) is the output "
                             "layer; there is no hidden layer to calibrate")
    module = network.get_submodule(first.weight.rpartition(".")[0])
    accumulator = _InputAccumulator(module, f"the first layer ({first.name})")
    hooks.append(module.register_forward_pre_hook(lambda _m, args: accumulator.add(args[0])))
    return {input_point(first.name): accumulator}


def _enough(point: str, moments: InputMoments) -> InputMoments:
    """Refuse input moments over no more vectors than their dimension."""
    if moments.count <= moments.mean.size:
        raise DataError(
            f"statistics: {point}: {moments.count:g} input vectors of dimension "
            f"{moments.mean.size}; input moments need more vectors than dimensions (fewer lie "
            "in a subspace their covariance reveals)")
    return moments


def recorded_statistics(run: Callable[[np.ndarray], object], inputs: np.ndarray,
                        batch_size: int, hooks: Sequence,
                        accumulators: dict[str, ChannelAccumulator], checkpoint: Checkpoint,
                        mode: str) -> Statistics:
    """Run ``run`` over ``inputs`` in batches without gradients while ``hooks`` fill
    ``accumulators`` (the hooks are removed after), and return what they recorded.

    Raises:
        DataError: the model refuses the inputs.
    """
    try:
        with torch.no_grad():
            for start in range(0, len(inputs), batch_size):
                run(inputs[start:start + batch_size])
    except DataError:
        raise
    except (RuntimeError, IndexError, ValueError) as exc:  # IndexError: a token id too large
        raise DataError(f"statistics: inputs of shape {tuple(inputs.shape)} do not fit "
                        f"{checkpoint.label} ({str(exc).splitlines()[0]})") from None
    finally:
        for hook in hooks:
            hook.remove()
    return Statistics(model=checkpoint.content_hash, num_samples=len(inputs), mode=mode,
                      points={p: a.moments() for p, a in accumulators.items()},
                      label=f"statistics of {checkpoint.label}")


def _hook(module: nn.Module, accumulators: dict[str, ChannelAccumulator], point: str, side: str):
    accumulator = accumulators.setdefault(point, ChannelAccumulator())

    def record(_module, args, output):
        accumulator.add(args[0] if side == "input" else output)

    return module.register_forward_hook(record)


def _batch_mode(network: nn.Module, checkpoint: Checkpoint, spec) -> None:
    """BatchNorms normalise with batch statistics and the affine calibration restores."""
    targets = read_norm_targets(checkpoint, spec) or {}
    for layer in spec.layers[:-1]:
        if layer.norm is None:
            continue
        norm = network.get_submodule(layer.norm.prefix)
        norm.train()
        if layer.norm.prefix in targets and norm.affine:
            mean, std = targets[layer.norm.prefix]
            with torch.no_grad():
                norm.weight.copy_(torch.from_numpy(std))
                norm.bias.copy_(torch.from_numpy(mean))


# -- a transformer's statistics (ALGORITHMS.md §13, "Calibration") --------------------------
# Per channel count, mean and variance of every MLP's hidden pre-activation and every
# LayerNorm's output, over every token that is not padding: a token model's inputs
# (``input_ids``) run with an attention mask that is 0 where a token equals the config's
# ``pad_token_id`` (when it has one), those positions left out; every other position of
# every input counts once (a ViT: every patch and the class token).

def transformer_statistics(checkpoint: Checkpoint, inputs: np.ndarray, *, mode: str,
                           batch_size: int, device: str) -> Statistics:
    """Statistics of a transformer (a model folder, or tensors with their config) on
    ``inputs``: (N, ...) pixel values, or (N, L) token ids, as the model's main input.
    Points appear in the order the forward pass reaches them (the layer-by-layer order).

    Raises:
        DataError: inputs the model does not take (token ids that are not integers in the
            vocabulary, shapes it refuses).
    """
    spec = fused_spec(checkpoint)
    shapes = {name: info.shape for name, info in checkpoint.tensors.items()}
    points = calibration_points(spec, shapes)
    model = _module(checkpoint, device)
    modules = modules_by_saved_name(model)
    accumulators: dict[str, ChannelAccumulator] = {}  # filled in forward order
    mask: list[torch.Tensor | None] = [None]

    def hook(point: str):
        def record(_module, _args, output):
            tokens = output.reshape(-1, output.shape[-1]) if mask[0] is None else (
                output[mask[0]])
            accumulators.setdefault(point, ChannelAccumulator()).add(tokens)
        return record

    hooks = [modules[p.module].register_forward_hook(hook(p.point)) for p in points]

    def run(batch: np.ndarray) -> None:
        feed, mask[0] = _feed(model, batch, device)
        model(**feed)

    return recorded_statistics(run, inputs, batch_size, hooks, accumulators, checkpoint, mode)


def _module(checkpoint: Checkpoint, device: str):
    if checkpoint.path is not None and checkpoint.path.is_dir():
        return load_pretrained(checkpoint.path, device)
    if checkpoint.config is None:
        raise CheckpointError(f"{checkpoint.label}: a transformer's tensors without their "
                              "config.json cannot be run")
    return model_from_tensors(checkpoint.config, checkpoint.state_dict(), checkpoint.label,
                              device)


def _feed(model, batch: np.ndarray, device: str
          ) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """The model's keyword inputs for one batch, and the mask of the tokens counted."""
    name = model.main_input_name
    if name != "input_ids":
        values = torch.from_numpy(np.ascontiguousarray(batch, dtype=np.float32))
        return {name: values.to(device)}, None
    if batch.dtype.kind == "f" and not np.array_equal(batch, np.round(batch)):
        raise DataError("statistics: a token model's inputs must be integer token ids; "
                        f"found {batch.dtype} values that are not integers")
    ids = torch.from_numpy(np.ascontiguousarray(batch, dtype=np.int64)).to(device)
    pad = getattr(model.config, "pad_token_id", None)
    if pad is None:
        return {name: ids}, None
    mask = ids != pad
    return {name: ids, "attention_mask": mask.long()}, mask
