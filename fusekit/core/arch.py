"""Architecture descriptions (the ``fusekit.arch`` checkpoint metadata), without torch.

An architecture is a JSON object::

    {"type": "mlp", "in_features": 64, "hidden": [100], "out_features": 10,
     "batchnorm": false, "pan": null}
    {"type": "convnet", "in_channels": 1, "image_size": [8, 8], "channels": [32, 64],
     "kernel_size": 3, "pool": true, "hidden": [], "out_features": 10, "pan": null}

``pan`` is null or ``{"mode": "multiplicative"|"additive", "amplitude": A, "period": T}``
(position-aware neurons, PANs paper Eq. 4-5). An optional ``fed2`` entry describes a Fed²
grouped structure (:mod:`fusekit.core.fed2`).

Fusion methods import this module to read and rewrite hidden widths; it must stay free of
torch so the fusion path does not pay torch's import time.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from fusekit.core.errors import SpecError
from fusekit.core.fed2 import validate_fed2

ARCH_TYPES = ("mlp", "convnet")
PAN_MODES = ("multiplicative", "additive")
DEFAULT_PAN = {"mode": "multiplicative", "amplitude": 0.1, "period": 1.0}

_MLP_KEYS = {"type", "in_features", "hidden", "out_features", "batchnorm", "pan", "fed2"}
_CONVNET_KEYS = {
    "type",
    "in_channels",
    "image_size",
    "channels",
    "kernel_size",
    "pool",
    "hidden",
    "out_features",
    "pan",
    "fed2",
}


def validate_arch(arch: Mapping[str, Any]) -> dict[str, Any]:
    """Check an architecture description and return a normalised copy (defaults filled).

    Args:
        arch: the parsed ``fusekit.arch`` JSON object.

    Returns:
        A new dict with every key of its type present (``batchnorm`` False, ``pan`` None,
        ``hidden`` [] for a convnet, ``kernel_size`` 3 and ``pool`` True when absent).

    Raises:
        SpecError: unknown type or key, a missing key, or a value of the wrong type/range.
    """
    if not isinstance(arch, Mapping):
        raise SpecError(f"arch: expected a JSON object, found {type(arch).__name__}")
    kind = arch.get("type")
    if kind not in ARCH_TYPES:
        raise SpecError(f"arch.type: expected one of {list(ARCH_TYPES)}, found {kind!r}")
    allowed = _MLP_KEYS if kind == "mlp" else _CONVNET_KEYS
    unknown = sorted(set(arch) - allowed)
    if unknown:
        raise SpecError(f"arch ({kind}): unknown key(s) {unknown}; allowed {sorted(allowed)}")
    out: dict[str, Any] = {"type": kind}
    if kind == "mlp":
        out["in_features"] = _positive_int(arch, "in_features")
        out["hidden"] = _width_list(arch.get("hidden", []), "hidden")
        out["out_features"] = _positive_int(arch, "out_features")
        out["batchnorm"] = _boolean(arch.get("batchnorm", False), "batchnorm")
    else:
        out["in_channels"] = _positive_int(arch, "in_channels")
        size = arch.get("image_size")
        if (
            not isinstance(size, Sequence)
            or len(size) != 2
            or not all(_is_int(v) and v > 0 for v in size)
        ):
            raise SpecError(f"arch.image_size: expected [height, width] > 0, found {size!r}")
        out["image_size"] = [int(size[0]), int(size[1])]
        out["channels"] = _width_list(arch.get("channels"), "channels", allow_empty=False)
        kernel = arch.get("kernel_size", 3)
        if not _is_int(kernel) or kernel < 1 or kernel % 2 == 0:
            raise SpecError(f"arch.kernel_size: expected an odd integer >= 1, found {kernel!r}")
        out["kernel_size"] = int(kernel)
        out["pool"] = _boolean(arch.get("pool", True), "pool")
        out["hidden"] = _width_list(arch.get("hidden", []), "hidden")
        out["out_features"] = _positive_int(arch, "out_features")
        height, width = convnet_feature_size(out)
        if height < 1 or width < 1:
            raise SpecError(
                f"arch: {len(out['channels'])} pooled conv blocks shrink the "
                f"{out['image_size']} image to nothing; use fewer channels blocks or pool=false"
            )
    out["pan"] = validate_pan(arch.get("pan"))
    if arch.get("fed2") is not None:  # Fed² structure (fusekit.core.fed2); absent otherwise
        widths = out["hidden"] if kind == "mlp" else out["channels"] + out["hidden"]
        out["fed2"] = validate_fed2(arch["fed2"], num_classes=out["out_features"], widths=widths)
    return out


def validate_pan(pan: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Check PAN settings (PANs paper Eq. 4-5); None means no PANs.

    Multiplicative encodings must stay positive (amplitude < 1) so that they commute with
    the ReLU they follow in fusekit's layer order.

    Raises:
        SpecError: unknown mode, negative amplitude or period, or a multiplicative
            amplitude >= 1.
    """
    if pan is None:
        return None
    if not isinstance(pan, Mapping):
        raise SpecError(f"arch.pan: expected null or an object, found {type(pan).__name__}")
    unknown = sorted(set(pan) - {"mode", "amplitude", "period"})
    if unknown:
        raise SpecError(f"arch.pan: unknown key(s) {unknown}; allowed mode, amplitude, period")
    mode = pan.get("mode", DEFAULT_PAN["mode"])
    if mode not in PAN_MODES:
        raise SpecError(f"arch.pan.mode: expected one of {list(PAN_MODES)}, found {mode!r}")
    amplitude = _real(pan.get("amplitude", DEFAULT_PAN["amplitude"]), "pan.amplitude")
    period = _real(pan.get("period", DEFAULT_PAN["period"]), "pan.period")
    if amplitude < 0 or period < 0:
        raise SpecError(
            f"arch.pan: amplitude and period must be >= 0, found {amplitude} and {period}"
        )
    if mode == "multiplicative" and amplitude >= 1:
        raise SpecError(
            f"arch.pan.amplitude: multiplicative encodings need amplitude < 1 (positive "
            f"factors), found {amplitude}"
        )
    return {"mode": mode, "amplitude": amplitude, "period": period}


def pan_encoding(width: int, pan: Mapping[str, Any]) -> np.ndarray:
    """The PAN encoding of a layer of ``width`` neurons, float32 of shape (width,).

    additive: e_j = A sin(2 pi T j / J); multiplicative: e_j = 1 + A sin(2 pi T j / J),
    j = 0..J-1 (PANs paper Eq. 4-5).
    """
    pan = validate_pan(pan)
    assert pan is not None
    j = np.arange(width, dtype=np.float64)
    wave = pan["amplitude"] * np.sin(2.0 * math.pi * pan["period"] * j / width)
    return (wave + (1.0 if pan["mode"] == "multiplicative" else 0.0)).astype(np.float32)


def hidden_widths(arch: Mapping[str, Any]) -> list[int]:
    """Widths of every permutable hidden layer, in layer order.

    MLP: ``hidden``. ConvNet: ``channels`` then ``hidden`` (the linear layers after the
    flatten).
    """
    arch = validate_arch(arch)
    if arch["type"] == "mlp":
        return list(arch["hidden"])
    return list(arch["channels"]) + list(arch["hidden"])


def with_hidden_widths(arch: Mapping[str, Any], widths: Sequence[int]) -> dict[str, Any]:
    """A copy of ``arch`` whose hidden layers have ``widths`` (as ordered by
    :func:`hidden_widths`); used by fusion methods whose output layers grow or shrink.

    Raises:
        SpecError: ``widths`` has a different number of layers than ``arch``, or a width < 1.
    """
    arch = validate_arch(arch)
    current = hidden_widths(arch)
    widths = _width_list(list(widths), "widths")
    if len(widths) != len(current):
        raise SpecError(
            f"widths: expected {len(current)} hidden widths for this {arch['type']}, "
            f"found {len(widths)} ({widths})"
        )
    out = copy.deepcopy(arch)
    if out["type"] == "mlp":
        out["hidden"] = widths
    else:
        n_conv = len(out["channels"])
        out["channels"] = widths[:n_conv]
        out["hidden"] = widths[n_conv:]
    return out


def convnet_feature_size(arch: Mapping[str, Any]) -> tuple[int, int]:
    """Spatial size (H, W) of the feature map at the flatten of a convnet."""
    height, width = arch["image_size"]
    if arch.get("pool", True):
        for _ in arch["channels"]:
            height, width = height // 2, width // 2
    return height, width


def mlp_arch(
    in_features: int,
    hidden: Sequence[int],
    out_features: int,
    *,
    batchnorm: bool = False,
    pan: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A validated MLP description."""
    return validate_arch(
        {
            "type": "mlp",
            "in_features": in_features,
            "hidden": list(hidden),
            "out_features": out_features,
            "batchnorm": batchnorm,
            "pan": pan,
        }
    )


def convnet_arch(
    input_shape: Sequence[int],
    channels: Sequence[int],
    out_features: int,
    *,
    hidden: Sequence[int] = (),
    kernel_size: int = 3,
    pool: bool = True,
    pan: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A validated ConvNet description; ``input_shape`` is (C, H, W)."""
    if len(input_shape) != 3:
        raise SpecError(
            f"convnet: expected image inputs of shape (C, H, W), found shape {tuple(input_shape)}"
        )
    return validate_arch(
        {
            "type": "convnet",
            "in_channels": input_shape[0],
            "image_size": list(input_shape[1:]),
            "channels": list(channels),
            "kernel_size": kernel_size,
            "pool": pool,
            "hidden": list(hidden),
            "out_features": out_features,
            "pan": pan,
        }
    )


_ARCH_STRING = re.compile(r"^(mlp|conv|convnet)(?::([0-9,]*))?(?:/([0-9,]*))?$")


def parse_arch_string(
    text: str,
    *,
    input_shape: Sequence[int],
    num_classes: int,
    batchnorm: bool = False,
    pan: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Build an architecture from the CLI's short form.

    ``mlp:100`` or ``mlp:200,100`` (hidden widths; ``mlp:`` for none), ``conv:32,64``
    (conv channels) with an optional ``/128`` for linear hidden layers after the flatten.

    Raises:
        SpecError: the text does not match the grammar, or the model does not fit the data.
    """
    match = _ARCH_STRING.match(text.strip().replace(" ", ""))
    if not match:
        raise SpecError(
            f"--arch: expected 'mlp:W1,W2,...' or 'conv:C1,C2' (optionally '/W1,...' for "
            f"linear layers), found {text!r}"
        )
    kind, first, second = match.groups()
    widths = [int(v) for v in (first or "").split(",") if v]
    extra = [int(v) for v in (second or "").split(",") if v]
    if kind == "mlp":
        if second is not None:
            raise SpecError(f"--arch: '/...' is only for conv architectures, found {text!r}")
        return mlp_arch(
            int(np.prod(input_shape)), widths, num_classes, batchnorm=batchnorm, pan=pan
        )
    if len(input_shape) != 3:
        raise SpecError(
            f"--arch {text}: a ConvNet needs image data of shape (C, H, W); this data set has "
            f"samples of shape {tuple(input_shape)}"
        )
    return convnet_arch(input_shape, widths, num_classes, hidden=extra, pan=pan)


def describe_arch(arch: Mapping[str, Any]) -> str:
    """Short human-readable form, e.g. ``mlp 64-100-10`` or ``convnet 1x8x8-c32-c64-10``."""
    arch = validate_arch(arch)
    pan = f" +PAN({arch['pan']['mode'][:4]})" if arch["pan"] else ""
    if arch.get("fed2"):
        pan += f" +Fed2(G={arch['fed2']['groups']}, d={arch['fed2']['depth']})"
    if arch["type"] == "mlp":
        dims = [arch["in_features"], *arch["hidden"], arch["out_features"]]
        return "mlp " + "-".join(map(str, dims)) + pan
    h, w = arch["image_size"]
    parts = [
        f"{arch['in_channels']}x{h}x{w}",
        *(f"c{c}" for c in arch["channels"]),
        *map(str, arch["hidden"]),
        str(arch["out_features"]),
    ]
    return "convnet " + "-".join(parts) + pan


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _positive_int(arch: Mapping[str, Any], key: str) -> int:
    value = arch.get(key)
    if not _is_int(value) or value < 1:
        raise SpecError(f"arch.{key}: expected a positive integer, found {value!r}")
    return int(value)


def _width_list(value: Any, key: str, *, allow_empty: bool = True) -> list[int]:
    if (
        not isinstance(value, Sequence)
        or isinstance(value, str)
        or not all(_is_int(v) and v > 0 for v in value)
        or (not allow_empty and len(value) == 0)
    ):
        need = "a non-empty list" if not allow_empty else "a list"
        raise SpecError(f"arch.{key}: expected {need} of positive integers, found {value!r}")
    return [int(v) for v in value]


def _boolean(value: Any, key: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise SpecError(f"arch.{key}: expected true or false, found {value!r}")
    return bool(value)


def _real(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise SpecError(f"arch.{key}: expected a number, found {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise SpecError(f"arch.{key}: expected a finite number, found {value}")
    return value
