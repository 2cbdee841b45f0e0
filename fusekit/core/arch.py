"""Architecture descriptions (the ``fusekit.arch`` checkpoint metadata), without torch.

An architecture is a JSON object::

    {"type": "mlp", "in_features": 64, "hidden": [100], "out_features": 10,
     "batchnorm": false, "pan": null}
    {"type": "convnet", "in_channels": 1, "image_size": [8, 8], "channels": [32, 64],
     "kernel_size": 3, "pool": true, "hidden": [], "out_features": 10, "pan": null}

``pan`` is null or ``{"mode": "multiplicative"|"additive", "amplitude": A, "period": T}``
(position-aware neurons, PANs paper Eq. 4-5). An optional ``fed2`` entry describes a Fed²
grouped structure (:mod:`fusekit.core.fed2`).

torchvision's families, built with exactly torchvision's tensor names and shapes::

    {"type": "resnet", "name": "resnet18", "block": "basic", "layers": [2, 2, 2, 2],
     "stem": "imagenet", "in_channels": 3, "out_features": 10, "widths": null}
    {"type": "vgg", "name": "vgg11_bn", "config": [64, "M", 128, "M", ...],
     "batchnorm": true, "hidden": [4096, 4096], "in_channels": 3, "out_features": 10}

``block`` is ``basic`` (BasicBlock) or ``bottleneck`` (Bottleneck, torchvision's v1.5 with
the stride on the 3x3 conv); ``stem`` is ``imagenet`` (7x7/2 conv and 3x3/2 max pool) or
``cifar`` (one 3x3 conv, stages of 16/32/64 channels: He et al.'s ResNet-20/56, with 1x1
conv + BatchNorm shortcuts). ``widths`` lists the width of every permutation group in the
order of :class:`fusekit.core.spec.GraphSpec` (null: the standard widths), so a fused
ResNet whose groups grew or shrank is rebuilt as it is. VGG widths are the numbers in
``config`` (``"M"``: 2x2 max pool) and ``hidden``; torchvision's 7x7 adaptive average pool
sits before the classifier.

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
from fusekit.core.settings import settings_object

ARCH_TYPES = ("mlp", "convnet", "resnet", "vgg")
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
_RESNET_KEYS = {"type", "name", "block", "layers", "stem", "in_channels", "out_features",
                "widths"}
_VGG_KEYS = {"type", "name", "config", "batchnorm", "hidden", "in_channels", "out_features"}
_KEYS = {"mlp": _MLP_KEYS, "convnet": _CONVNET_KEYS, "resnet": _RESNET_KEYS, "vgg": _VGG_KEYS}

#: torchvision's ResNets and He et al.'s CIFAR ResNets: block, blocks per stage, stem.
RESNETS = {
    "resnet18": ("basic", (2, 2, 2, 2), "imagenet"),
    "resnet34": ("basic", (3, 4, 6, 3), "imagenet"),
    "resnet50": ("bottleneck", (3, 4, 6, 3), "imagenet"),
    "resnet20": ("basic", (3, 3, 3), "cifar"),
    "resnet56": ("basic", (9, 9, 9), "cifar"),
}
_VGG_CONFIGS = {
    "vgg11": (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"),
    "vgg16": (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M",
              512, 512, 512, "M"),
}
VGGS = (*_VGG_CONFIGS, *(f"{name}_bn" for name in _VGG_CONFIGS))
_STEM_WIDTH = {"imagenet": 64, "cifar": 16}
_EXPANSION = {"basic": 1, "bottleneck": 4}


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
    allowed = _KEYS[kind]
    unknown = sorted(set(arch) - allowed)
    if unknown:
        raise SpecError(f"arch ({kind}): unknown key(s) {unknown}; allowed {sorted(allowed)}")
    if kind == "resnet":
        return _validate_resnet(arch)
    if kind == "vgg":
        return _validate_vgg(arch)
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
    if settings_object(pan, "arch.pan", ("mode", "amplitude", "period")) is None:
        return None
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
    flatten). ResNet: every permutation group (see :func:`resnet_groups`). VGG: the conv
    widths of ``config`` then ``hidden``.
    """
    arch = validate_arch(arch)
    if arch["type"] == "mlp":
        return list(arch["hidden"])
    if arch["type"] == "resnet":
        return [width for _, width in resnet_groups(arch)]
    if arch["type"] == "vgg":
        return [c for c in arch["config"] if c != "M"] + list(arch["hidden"])
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
    elif out["type"] == "resnet":
        out["widths"] = widths
    elif out["type"] == "vgg":
        convs = iter(widths)
        out["config"] = [c if c == "M" else next(convs) for c in out["config"]]
        out["hidden"] = list(convs)
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
    if arch["type"] in ("resnet", "vgg"):
        standard = hidden_widths(arch) == hidden_widths(_standard(arch))
        return (f"{arch['name'] or arch['type']} {arch['in_channels']}-{arch['out_features']}"
                + ("" if standard else " (widths changed)"))
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


def named_arch(name: str, out_features: int, *, in_channels: int = 3) -> dict[str, Any]:
    """A torchvision architecture by name (``resnet18/34/50``, ``resnet20/56`` for CIFAR,
    ``vgg11``, ``vgg16`` and their ``_bn`` forms) at its standard widths.

    Raises:
        SpecError: an unknown name.
    """
    if name in RESNETS:
        block, layers, stem = RESNETS[name]
        return validate_arch({"type": "resnet", "name": name, "block": block,
                              "layers": list(layers), "stem": stem, "in_channels": in_channels,
                              "out_features": out_features, "widths": None})
    if name in VGGS:
        base = name.removesuffix("_bn")
        return validate_arch({"type": "vgg", "name": name, "config": list(_VGG_CONFIGS[base]),
                              "batchnorm": name.endswith("_bn"), "hidden": [4096, 4096],
                              "in_channels": in_channels, "out_features": out_features})
    raise SpecError(f"arch: unknown architecture {name!r}; known: "
                    f"{', '.join([*RESNETS, *VGGS])}")


def resnet_blocks(arch: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The blocks of a ResNet description, in order, with the group each conv writes.

    Returns:
        One dict per block: ``name`` (``layerN.M``), ``stride``, ``reads`` (the residual
        stream it reads), ``inner`` (the groups of every conv but the last), ``writes``
        (the stream it writes) and ``downsample`` (True when it has a 1x1 conv + BatchNorm
        shortcut: torchvision's rule, stride != 1 or a change of width at standard widths).
        Groups are indices into :func:`resnet_groups`.
    """
    stream, blocks, index = 0, [], 1
    widths = _STEM_WIDTH[arch["stem"]]
    expansion = _EXPANSION[arch["block"]]
    n_inner = 1 if arch["block"] == "basic" else 2
    for stage, count in enumerate(arch["layers"]):
        planes = _STEM_WIDTH[arch["stem"]] * 2**stage
        for j in range(count):
            stride = 2 if stage and not j else 1
            downsample = stride != 1 or widths != planes * expansion
            inner = list(range(index, index + n_inner))
            index += n_inner
            writes = stream
            if downsample:
                writes, index = index, index + 1
            blocks.append({"name": f"layer{stage + 1}.{j}", "stride": stride, "reads": stream,
                           "inner": inner, "writes": writes, "downsample": downsample,
                           "planes": planes, "expansion": expansion})
            stream, widths = writes, planes * expansion
    return blocks


def resnet_groups(arch: Mapping[str, Any]) -> list[tuple[str, int]]:
    """(name, width) of every permutation group of a ResNet, in GraphSpec order: ``conv1``
    (the first stream), then per block its inner convs ``layerN.M.convK`` and, when it has a
    shortcut, the stream it opens (``layerN.M``). Widths come from ``arch["widths"]`` or
    are the standard ones."""
    groups = [("conv1", _STEM_WIDTH[arch["stem"]])]
    for block in resnet_blocks(arch):
        groups += [(f"{block['name']}.conv{k + 1}", block["planes"])
                   for k in range(len(block["inner"]))]
        if block["downsample"]:
            groups.append((block["name"], block["planes"] * block["expansion"]))
    if arch.get("widths") is not None:
        groups = [(name, width) for (name, _), width in zip(groups, arch["widths"], strict=True)]
    return groups


def infer_arch(shapes: Mapping[str, Sequence[int]]) -> dict[str, Any] | None:
    """The torchvision architecture a state_dict's names and shapes describe, or None.

    Recognises ResNets (``conv1``, ``layerN.M.convK``, ``fc``; Bottleneck when
    ``layer1.0.conv3`` exists, the CIFAR stem when ``conv1`` is 3x3) and VGGs
    (``features.N`` convs, ``classifier.{0,3,...}`` linears; every torchvision
    configuration ends with a max pool, so one is assumed after the last conv). The
    description carries the widths found, so it rebuilds the checkpoint's module.
    """
    shapes = {name: tuple(shape) for name, shape in shapes.items()}
    if "conv1.weight" in shapes and "fc.weight" in shapes and "layer1.0.conv1.weight" in shapes:
        return _infer_resnet_arch(shapes)
    if any(name.startswith("features.") for name in shapes) and "classifier.0.weight" in shapes:
        return _infer_vgg_arch(shapes)
    return None


def _infer_resnet_arch(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any] | None:
    from fusekit.core.spec import infer_spec

    stages: dict[int, int] = {}
    for name in shapes:
        match = re.match(r"^layer(\d+)\.(\d+)\.conv1\.weight$", name)
        if match:
            stage, block = int(match.group(1)), int(match.group(2))
            stages[stage] = max(stages.get(stage, 0), block + 1)
    if sorted(stages) != list(range(1, len(stages) + 1)):
        return None
    stem = "imagenet" if shapes["conv1.weight"][2:] == (7, 7) else "cifar"
    arch = {"type": "resnet", "name": None,
            "block": "bottleneck" if "layer1.0.conv3.weight" in shapes else "basic",
            "layers": [stages[i] for i in sorted(stages)], "stem": stem,
            "in_channels": shapes["conv1.weight"][1], "out_features": shapes["fc.weight"][0],
            "widths": None}
    try:
        spec = infer_spec(shapes)
        standard = validate_arch(arch)
    except SpecError:
        return None
    if list(spec.group_names) != [name for name, _ in resnet_groups(standard)]:
        return None  # shortcuts where torchvision has none, or the reverse
    known = [name for name, (block, layers, s) in RESNETS.items()
             if (block, list(layers), s) == (arch["block"], arch["layers"], stem)]
    arch["name"] = known[0] if known else None
    if spec.hidden_widths != hidden_widths(standard):
        arch["widths"] = spec.hidden_widths
    return validate_arch(arch)


def _infer_vgg_arch(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any] | None:
    convs = sorted(int(m.group(1)) for name in shapes
                   if (m := re.match(r"^features\.(\d+)\.weight$", name))
                   and len(shapes[name]) == 4)
    linears = sorted(int(m.group(1)) for name in shapes
                     if (m := re.match(r"^classifier\.(\d+)\.weight$", name)))
    if not convs or linears != list(range(0, 3 * len(linears), 3)):
        return None
    batchnorm = f"features.{convs[0] + 1}.running_mean" in shapes
    config: list[Any] = []
    position = 0
    for index in convs:
        config += ["M"] * (index - position) + [shapes[f"features.{index}.weight"][0]]
        position = index + (3 if batchnorm else 2)
    config.append("M")
    if shapes["classifier.0.weight"][1] != config[-2] * 49:
        return None
    arch = {"type": "vgg", "name": None, "config": config, "batchnorm": batchnorm,
            "hidden": [shapes[f"classifier.{i}.weight"][0] for i in linears[:-1]],
            "in_channels": shapes[f"features.{convs[0]}.weight"][1],
            "out_features": shapes[f"classifier.{linears[-1]}.weight"][0]}
    for name in VGGS:
        standard = named_arch(name, arch["out_features"], in_channels=arch["in_channels"])
        if [c == "M" for c in standard["config"]] == [c == "M" for c in config] \
                and standard["batchnorm"] == batchnorm and len(standard["hidden"]) == len(
                    arch["hidden"]):
            arch["name"] = name
    try:
        return validate_arch(arch)
    except SpecError:
        return None


def _standard(arch: Mapping[str, Any]) -> dict[str, Any]:
    """The same architecture at its standard widths (only meaningful for named ones)."""
    if arch.get("name") in (*RESNETS, *VGGS):
        return named_arch(arch["name"], arch["out_features"], in_channels=arch["in_channels"])
    return dict(arch)


def _validate_resnet(arch: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "resnet", "name": _optional_name(arch.get("name"))}
    if arch.get("block") not in _EXPANSION:
        raise SpecError(
            f"arch.block: expected 'basic' or 'bottleneck', found {arch.get('block')!r}")
    out["block"] = arch["block"]
    out["layers"] = _width_list(arch.get("layers"), "layers", allow_empty=False)
    if arch.get("stem") not in _STEM_WIDTH:
        raise SpecError(f"arch.stem: expected 'imagenet' or 'cifar', found {arch.get('stem')!r}")
    out["stem"] = arch["stem"]
    out["in_channels"] = _positive_int(arch, "in_channels")
    out["out_features"] = _positive_int(arch, "out_features")
    out["widths"] = None
    widths = arch.get("widths")
    if widths is not None:
        widths = _width_list(widths, "widths")
        expected = len(resnet_groups(out))
        if len(widths) != expected:
            raise SpecError(f"arch.widths: expected {expected} group widths for this ResNet, "
                            f"found {len(widths)}")
        out["widths"] = widths
    return out


def _validate_vgg(arch: Mapping[str, Any]) -> dict[str, Any]:
    config = arch.get("config")
    if (not isinstance(config, Sequence) or isinstance(config, str) or not config
            or not all(c == "M" or (_is_int(c) and c > 0) for c in config)
            or all(c == "M" for c in config)):
        raise SpecError(f"arch.config: expected a list of conv widths and \"M\" (max pool) "
                        f"with at least one width, found {config!r}")
    return {"type": "vgg", "name": _optional_name(arch.get("name")),
            "config": [c if c == "M" else int(c) for c in config],
            "batchnorm": _boolean(arch.get("batchnorm", False), "batchnorm"),
            "hidden": _width_list(arch.get("hidden", []), "hidden"),
            "in_channels": _positive_int(arch, "in_channels"),
            "out_features": _positive_int(arch, "out_features")}


def _optional_name(value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise SpecError(f"arch.name: expected a string or null, found {value!r}")
    return value
