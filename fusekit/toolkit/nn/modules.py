"""torch modules built from an architecture description (see :mod:`fusekit.core.arch`).

Every model holds ONE ``nn.Sequential`` named ``net`` so its tensor names are
``net.<i>.weight`` etc. and their natural order is the layer order:

    MLP:     [Linear, (BatchNorm1d), ReLU, (PAN)]* + Linear
    ConvNet: [Conv2d(padding=k//2), BatchNorm2d, ReLU, (PAN), (MaxPool2d(2))]*
             + Flatten + [Linear, ReLU, (PAN)]* + Linear

PAN encodings are buffers ``net.<i>.encoding``, never parameters. Fed² models (``"fed2"`` in
the architecture, :mod:`fusekit.core.fed2`) use the same layers with the decoupled ones
masked to their groups (:class:`GroupMaskedLinear`, :class:`GroupMaskedConv2d`); the masks
are derived from the architecture and are not stored. The PANs paper applies the encoding
before the activation (Eq. 2-3); fusekit applies it after the ReLU. For
multiplicative encodings (all factors > 0) the two are the same function; for additive
ones fusekit's order adds a fixed per-neuron offset to the layer output instead of to the
pre-activation, which breaks permutation symmetry in the same way.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from fusekit.core.arch import convnet_feature_size, hidden_widths, pan_encoding, validate_arch
from fusekit.core.checkpoint import Checkpoint, is_integer_buffer, load_checkpoint
from fusekit.core.errors import CheckpointError, SpecError
from fusekit.core.fed2 import layer_masks
from fusekit.toolkit.nn.preprocess import attach_normalization
from fusekit.toolkit.nn.zoo import VGG, ResNet


class PositionEncoding(nn.Module):
    """Position-aware neurons (PANs paper Eq. 4-5): a fixed per-neuron encoding added to or
    multiplied with a layer's outputs.

    Args:
        width: number of neurons (or channels) J.
        pan: ``{"mode", "amplitude", "period"}`` as validated by ``validate_pan``.
        channels_first_image: True for conv feature maps (encoding shape (J, 1, 1)),
            False for linear layers (shape (J,)).
    """

    def __init__(self, width: int, pan: Mapping[str, Any], *, channels_first_image: bool):
        super().__init__()
        self.mode = pan["mode"]
        values = torch.from_numpy(pan_encoding(width, pan))
        if channels_first_image:
            values = values.reshape(width, 1, 1)
        self.register_buffer("encoding", values)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "additive":
            return x + self.encoding
        return x * self.encoding

    def extra_repr(self) -> str:
        return f"mode={self.mode}, width={self.encoding.shape[0]}"


class FusekitMLP(nn.Module):
    """Multi-layer perceptron; inputs of any shape (N, ...) are flattened to (N, D)."""

    def __init__(self, arch: Mapping[str, Any]):
        super().__init__()
        self.arch = validate_arch(arch)
        layers: list[nn.Module] = []
        width_in = self.arch["in_features"]
        for width in self.arch["hidden"]:
            layers.append(nn.Linear(width_in, width))
            if self.arch["batchnorm"]:
                layers.append(nn.BatchNorm1d(width))
            layers.append(nn.ReLU())
            if self.arch["pan"]:
                layers.append(PositionEncoding(width, self.arch["pan"], channels_first_image=False))
            width_in = width
        layers.append(nn.Linear(width_in, self.arch["out_features"]))
        self.net = nn.Sequential(*layers)
        _decouple(self.net, self.arch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.flatten(1))


class FusekitConvNet(nn.Module):
    """Small ConvNet of conv-BatchNorm-ReLU blocks and a linear head; inputs (N, C, H, W)
    or flattened (N, C*H*W)."""

    def __init__(self, arch: Mapping[str, Any]):
        super().__init__()
        self.arch = validate_arch(arch)
        a = self.arch
        layers: list[nn.Module] = []
        channels_in = a["in_channels"]
        for channels in a["channels"]:
            layers += [
                nn.Conv2d(channels_in, channels, a["kernel_size"], padding=a["kernel_size"] // 2),
                nn.BatchNorm2d(channels),
                nn.ReLU(),
            ]
            if a["pan"]:
                layers.append(PositionEncoding(channels, a["pan"], channels_first_image=True))
            if a["pool"]:
                layers.append(nn.MaxPool2d(2))
            channels_in = channels
        height, width = convnet_feature_size(a)
        layers.append(nn.Flatten())
        width_in = channels_in * height * width
        for width_out in a["hidden"]:
            layers += [nn.Linear(width_in, width_out), nn.ReLU()]
            if a["pan"]:
                layers.append(PositionEncoding(width_out, a["pan"], channels_first_image=False))
            width_in = width_out
        layers.append(nn.Linear(width_in, a["out_features"]))
        self.net = nn.Sequential(*layers)
        _decouple(self.net, a, spatial=height * width)
        self._input_shape = (a["in_channels"], *a["image_size"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.reshape(x.shape[0], *self._input_shape))


class _GroupMasked:
    """A Linear or Conv2d layer whose weight only connects within Fed² groups.

    The forward pass uses ``weight * mask``, so entries outside the groups get no gradient
    and stay zero (they are zeroed at construction). Tensor names and shapes are the plain
    layer's; the mask is a non-persistent buffer derived from the architecture.
    """

    weight: nn.Parameter
    mask: torch.Tensor

    def set_mask(self, mask: np.ndarray) -> None:
        keep = torch.from_numpy(mask).to(self.weight.dtype)
        keep = keep.reshape(*keep.shape, *([1] * (self.weight.ndim - 2)))
        self.register_buffer("mask", keep, persistent=False)  # type: ignore[attr-defined]
        with torch.no_grad():
            # Initialise as a layer of the group's fan-in, as a group convolution would be
            # (PyTorch's default init draws from U(+-1/sqrt(fan_in))).
            fan_ratio = mask.shape[1] / np.maximum(mask.sum(axis=1), 1)
            scale = torch.from_numpy(np.sqrt(fan_ratio)).to(self.weight.dtype)
            self.weight.mul_(keep * scale.reshape(-1, *([1] * (self.weight.ndim - 1))))


class GroupMaskedLinear(_GroupMasked, nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight * self.mask, self.bias)


class GroupMaskedConv2d(_GroupMasked, nn.Conv2d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._conv_forward(x, self.weight * self.mask, self.bias)


def _decouple(net: nn.Sequential, arch: Mapping[str, Any], *, spatial: int = 1) -> None:
    """Mask the decoupled layers of a Fed² model in place (no-op without ``fed2``)."""
    if not arch.get("fed2"):
        return
    masks = layer_masks(arch["fed2"], hidden_widths(arch), arch["out_features"])
    positions = [i for i, m in enumerate(net) if isinstance(m, (nn.Linear, nn.Conv2d))]
    for position, mask in zip(positions, masks, strict=True):
        if mask is None:
            continue
        layer = net[position]
        if isinstance(layer, nn.Linear):
            if layer.in_features != mask.shape[1]:  # conv -> linear flatten: H*W per channel
                mask = np.repeat(mask, spatial, axis=1)
            masked: _GroupMasked = nn.utils.skip_init(
                GroupMaskedLinear, layer.in_features, layer.out_features)
        else:
            masked = nn.utils.skip_init(GroupMaskedConv2d, layer.in_channels,
                                        layer.out_channels, layer.kernel_size,
                                        padding=layer.padding)
        masked.load_state_dict(layer.state_dict())  # keep the seeded initial weights
        masked.set_mask(mask)
        net[position] = masked


def build_model(arch: Mapping[str, Any], *, seed: int | None = None) -> nn.Module:
    """Build the torch module an architecture describes (float32, on the CPU).

    Args:
        arch: architecture description (``fusekit.arch`` metadata).
        seed: when given, the initial weights are drawn from this seed without touching
            torch's global random state; otherwise from the global state.

    Raises:
        SpecError: the description is invalid.
    """
    classes = {"mlp": FusekitMLP, "convnet": FusekitConvNet, "resnet": ResNet, "vgg": VGG}
    cls = classes[validate_arch(arch)["type"]]
    if seed is None:
        return cls(arch)
    with torch.random.fork_rng(devices=[]):  # the models are built on the CPU
        torch.default_generator.manual_seed(seed)  # torch.manual_seed would reseed CUDA too
        return cls(arch)


def state_dict_to_torch(state_dict: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """numpy/torch arrays -> torch tensors (float32 weights, int64 counters), copied so that
    read-only numpy buffers are never shared with torch."""
    out = {}
    for name, value in state_dict.items():
        tensor = torch.as_tensor(np.array(value, copy=True))
        out[name] = tensor.long() if is_integer_buffer(name) else tensor.float()
    return out


def load_state_into(model: nn.Module, state_dict: Mapping[str, Any], label: str) -> nn.Module:
    """Load ``state_dict`` into ``model`` strictly, with a message naming ``label``.

    Raises:
        CheckpointError: missing/unexpected tensors or shape mismatches.
    """
    tensors = state_dict_to_torch(state_dict)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"{label}: tensors do not match its fusekit.arch; missing {missing[:6]}, "
            f"unexpected {unexpected[:6]}"
        )
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(
                f"{label}: tensor {name!r} has shape {tuple(tensor.shape)}; its fusekit.arch "
                f"expects {tuple(expected[name].shape)}"
            )
    model.load_state_dict(tensors)
    return model


def load_model(
    checkpoint_or_path: Checkpoint | str | os.PathLike[str],
    device: str | torch.device = "cpu",
) -> nn.Module:
    """Build the module of a plain client or fused checkpoint and load its weights.

    Args:
        checkpoint_or_path: a :class:`~fusekit.core.checkpoint.Checkpoint` or a path to one.
        device: where to put the model; it is returned in eval mode.

    Returns:
        The torch module (``FusekitMLP`` or ``FusekitConvNet``), normalising its inputs
        as the checkpoint's ``fusekit.preprocess`` records.

    Raises:
        CheckpointError: no ``fusekit.arch`` metadata, an invalid one, or tensors that do
            not match it.
    """
    ckpt = (
        checkpoint_or_path
        if isinstance(checkpoint_or_path, Checkpoint)
        else load_checkpoint(checkpoint_or_path)
    )
    if ckpt.arch is None:
        raise CheckpointError(
            f"{ckpt.label}: no fusekit.arch metadata; fusekit needs it to rebuild the model "
            "(checkpoints written by `fusekit simulate` and `fusekit fuse` carry it)"
        )
    try:
        model = build_model(ckpt.arch)
    except SpecError as exc:
        raise CheckpointError(f"{ckpt.label}: invalid fusekit.arch ({exc})") from None
    load_state_into(model, ckpt.state_dict(), ckpt.label)
    attach_normalization(model, ckpt.preprocess, ckpt.label)
    return model.to(device).eval()


def pan_buffer_names(model_or_state: nn.Module | Mapping[str, Any]) -> list[str]:
    """Names of the PAN encoding buffers of a model or state_dict (empty when no PANs)."""
    names = (
        model_or_state.state_dict().keys()
        if isinstance(model_or_state, nn.Module)
        else model_or_state.keys()
    )
    return [n for n in names if n.endswith(".encoding")]
