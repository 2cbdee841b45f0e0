"""Permutation specs: which tensor axes move together when a hidden neuron is permuted.

fusekit handles sequential networks of Linear and Conv2d layers, each optionally followed
by a BatchNorm, with a flatten between the last conv and the first linear layer. The spec
is inferred from a state_dict's names and shapes (see :func:`infer_spec`); anything the
inference cannot read is described by a JSON spec file (see :func:`load_spec_file`):

    {"format": "fusekit.spec/1",
     "layers": [
        {"name": "features.0", "weight": "features.0.weight", "bias": "features.0.bias",
         "norm": "features.1", "eps": 1e-5},
        {"name": "head", "weight": "head.weight", "bias": "head.bias"}],
     "other": ["pan.encoding"]}

Kinds, widths, kernel sizes and the flatten block size are read from the tensor shapes;
"norm" names the BatchNorm module prefix (its weight, bias, running_mean, running_var and
num_batches_tracked tensors). Layers are listed input to output.

For hidden layer l, a permutation of its J_l neurons moves: rows of W_l and b_l, entries
of the BatchNorm tensors, and input axis 1 of W_{l+1} in blocks of ``input_block``
columns (H·W spatial positions per channel after a flatten, 1 otherwise).

Residual networks are not sequential: a residual stream is ONE permutation group shared by
every layer that writes to it (the stem, each block's last conv and BatchNorm, each
downsample shortcut) and every layer that reads from it (the next blocks' first convs and
shortcuts, the classifier). A :class:`GraphSpec` wires layers through such groups: layer i
reads group ``reads[i]`` and writes group ``writes[i]``. It is inferred for torchvision's
ResNets (BasicBlock and Bottleneck, ``conv1``/``bn1``/``layerN.M.convK``/``bnK``/
``downsample.0|1``/``fc``, CIFAR stems included) and described for anything else by a
``fusekit.spec/2`` file, which lists the groups and, per layer, the group it reads
(``null``: the network input) and the group it writes (``null``: the network output)::

    {"format": "fusekit.spec/2",
     "groups": ["stem", "block.conv1"],
     "layers": [
        {"name": "stem", "weight": "stem.weight", "norm": "stem_bn",
         "reads": null, "writes": "stem"},
        {"name": "block.conv1", "weight": "block.conv1.weight", "reads": "stem",
         "writes": "block.conv1"},
        {"name": "block.conv2", "weight": "block.conv2.weight", "reads": "block.conv1",
         "writes": "stem"},
        {"name": "head", "weight": "head.weight", "bias": "head.bias", "reads": "stem",
         "writes": null}]}

Layers are listed in the order data flows; every group must be written before it is read.
``fusekit.spec/1`` files keep working unchanged. Transformers (attention heads, LayerNorms,
tied embeddings) are described by groups of tensor slots instead: ``fusekit.spec/3``, see
:mod:`fusekit.core.transformer`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from itertools import permutations
from pathlib import Path
from typing import Any

import numpy as np

from fusekit.core.errors import SpecError
from fusekit.core.metadata import read_json_file
from fusekit.core.transformer import (
    TRANSFORMER_FORMAT,
    TransformerSpec,
    transformer_from_json,
)

SPEC_FORMAT = "fusekit.spec/1"
GRAPH_FORMAT = "fusekit.spec/2"
BATCHNORM_EPS = 1e-5
_NORM_PARTS = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")


@dataclass(frozen=True)
class BatchNorm:
    """A BatchNorm1d/2d module following a layer, by its tensor names."""

    prefix: str
    weight: str | None
    bias: str | None
    running_mean: str
    running_var: str
    num_batches_tracked: str | None
    eps: float = BATCHNORM_EPS

    @property
    def tensors(self) -> list[str]:
        names = (self.weight, self.bias, self.running_mean, self.running_var)
        return [n for n in names if n is not None]


@dataclass(frozen=True)
class Layer:
    """A Linear or Conv2d layer, in the order data flows through the network."""

    name: str
    kind: str  # "linear" or "conv2d"
    weight: str
    bias: str | None
    in_features: int  # input channels for conv2d, input columns / input_block for linear
    out_features: int
    kernel_size: tuple[int, int] = (1, 1)
    input_block: int = 1  # columns of W per unit of the layer below (H*W after a flatten)
    norm: BatchNorm | None = None

    @property
    def tensors(self) -> list[str]:
        own = [self.weight] + ([self.bias] if self.bias else [])
        return own + (self.norm.tensors if self.norm else [])


@dataclass(frozen=True)
class AxisRef:
    """Axis ``axis`` of tensor ``tensor`` moves in blocks of ``block`` entries."""

    tensor: str
    axis: int
    block: int = 1


@dataclass(frozen=True)
class PermutationSpec:
    """The layers of a sequential network and the tensors outside them."""

    layers: tuple[Layer, ...]
    other: tuple[str, ...] = field(default=())

    @property
    def hidden_widths(self) -> list[int]:
        return [layer.out_features for layer in self.layers[:-1]]

    @property
    def group_names(self) -> tuple[str, ...]:
        """Name of each permutation group: the hidden layer it belongs to."""
        return tuple(layer.name for layer in self.layers[:-1])

    @property
    def reads(self) -> tuple[int | None, ...]:
        """Group each layer reads (None: the network input); see :class:`GraphSpec`."""
        return (None, *range(len(self.layers) - 1))

    @property
    def writes(self) -> tuple[int | None, ...]:
        """Group each layer writes (None: the network output)."""
        return (*range(len(self.layers) - 1), None)

    @property
    def in_features(self) -> int:
        return self.layers[0].in_features

    @property
    def out_features(self) -> int:
        return self.layers[-1].out_features

    def group(self, hidden: int) -> list[AxisRef]:
        """The tensor axes that move together when hidden layer ``hidden`` is permuted."""
        layer, following = self.layers[hidden], self.layers[hidden + 1]
        axes = [AxisRef(name, 0) for name in layer.tensors]
        axes.append(AxisRef(following.weight, 1, following.input_block))
        return axes

    def structure(self) -> list[tuple[Any, ...]]:
        """What must agree between clients for them to be fused (everything but widths)."""
        rows = [
            (layer.name, layer.kind, layer.kernel_size, layer.norm is not None,
             layer.bias is not None)
            for layer in self.layers
        ]
        return [*rows, ("in", self.in_features), ("out", self.out_features)]

    def with_hidden_widths(self, widths: Sequence[int]) -> PermutationSpec:
        """The same network with other hidden widths (a fused model's spec)."""
        if len(widths) != len(self.layers) - 1:
            raise SpecError(
                f"expected {len(self.layers) - 1} hidden widths, got {len(widths)}"
            )
        layers = list(self.layers)
        for i, width in enumerate(widths):
            layers[i] = replace(layers[i], out_features=int(width))
            layers[i + 1] = replace(layers[i + 1], in_features=int(width))
        return replace(self, layers=tuple(layers))

    def to_json(self) -> dict[str, Any]:
        return {"format": SPEC_FORMAT, "layers": [_layer_json(layer) for layer in self.layers],
                "other": list(self.other)}

    def describe(self) -> list[dict[str, Any]]:
        """One JSON-able row per layer, for ``fusekit inspect``."""
        return _describe_layers(self.layers)


@dataclass(frozen=True)
class GraphSpec:
    """Layers wired through permutation groups (residual networks; see module docstring).

    Layer i reads group ``reads[i]`` (None: the network input) and writes group
    ``writes[i]`` (None: the network output). Permuting group g moves axis 0 of every
    tensor of the layers writing g (weight, bias, BatchNorm) and axis 1 of the weights of
    the layers reading g (in blocks of their ``input_block`` columns).
    """

    layers: tuple[Layer, ...]
    reads: tuple[int | None, ...]
    writes: tuple[int | None, ...]
    group_names: tuple[str, ...]
    other: tuple[str, ...] = field(default=())

    @property
    def hidden_widths(self) -> list[int]:
        """Width of every group, in group order."""
        widths = [0] * len(self.group_names)
        for layer, group in zip(self.layers, self.writes, strict=True):
            if group is not None:
                widths[group] = layer.out_features
        return widths

    @property
    def in_features(self) -> int:
        return next(layer.in_features for layer, g in zip(self.layers, self.reads, strict=True)
                    if g is None)

    @property
    def out_features(self) -> int:
        return next(layer.out_features for layer, g in zip(self.layers, self.writes, strict=True)
                    if g is None)

    def writers(self, group: int) -> list[int]:
        """Indices of the layers whose outputs are the neurons of ``group``."""
        return [i for i, g in enumerate(self.writes) if g == group]

    def readers(self, group: int) -> list[int]:
        """Indices of the layers whose inputs are the neurons of ``group``."""
        return [i for i, g in enumerate(self.reads) if g == group]

    def group(self, hidden: int) -> list[AxisRef]:
        """The tensor axes that move together when group ``hidden`` is permuted."""
        axes = [AxisRef(name, 0) for i in self.writers(hidden) for name in self.layers[i].tensors]
        axes += [AxisRef(self.layers[i].weight, 1, self.layers[i].input_block)
                 for i in self.readers(hidden)]
        return axes

    def structure(self) -> list[tuple[Any, ...]]:
        """What must agree between clients for them to be fused (everything but widths)."""
        def name(group: int | None) -> str | None:
            return None if group is None else self.group_names[group]

        rows = [
            (layer.name, layer.kind, layer.kernel_size, layer.norm is not None,
             layer.bias is not None, name(r), name(w))
            for layer, r, w in zip(self.layers, self.reads, self.writes, strict=True)
        ]
        return [*rows, ("in", self.in_features), ("out", self.out_features)]

    def with_hidden_widths(self, widths: Sequence[int]) -> GraphSpec:
        """The same network with other group widths (a fused model's spec)."""
        if len(widths) != len(self.group_names):
            raise SpecError(
                f"expected {len(self.group_names)} group widths, got {len(widths)}"
            )
        layers = []
        for layer, r, w in zip(self.layers, self.reads, self.writes, strict=True):
            if r is not None:
                layer = replace(layer, in_features=int(widths[r]))
            if w is not None:
                layer = replace(layer, out_features=int(widths[w]))
            layers.append(layer)
        return replace(self, layers=tuple(layers))

    def to_json(self) -> dict[str, Any]:
        layers = []
        for layer, r, w in zip(self.layers, self.reads, self.writes, strict=True):
            entry = _layer_json(layer)
            entry["reads"] = None if r is None else self.group_names[r]
            entry["writes"] = None if w is None else self.group_names[w]
            layers.append(entry)
        return {"format": GRAPH_FORMAT, "groups": list(self.group_names), "layers": layers,
                "other": list(self.other)}

    def describe(self) -> list[dict[str, Any]]:
        """One JSON-able row per layer, for ``fusekit inspect``."""
        return [{**row, "reads": entry["reads"], "writes": entry["writes"]}
                for row, entry in zip(_describe_layers(self.layers), self.to_json()["layers"],
                                      strict=True)]


Spec = PermutationSpec | GraphSpec | TransformerSpec


def _layer_json(layer: Layer) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": layer.name, "weight": layer.weight, "bias": layer.bias}
    if layer.norm is not None:
        entry["norm"] = layer.norm.prefix
        entry["eps"] = layer.norm.eps
    return entry


def _describe_layers(layers: Sequence[Layer]) -> list[dict[str, Any]]:
    return [
        {**{k: v for k, v in asdict(layer).items() if k != "norm"},
         "norm": layer.norm.prefix if layer.norm else None}
        for layer in layers
    ]


Shapes = Mapping[str, tuple[int, ...]]


def shapes_of(state_dict: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Tensor shapes from a state_dict of arrays, or from a mapping that already holds shapes."""
    out = {}
    for name, value in state_dict.items():
        shape = getattr(value, "shape", value)
        out[name] = tuple(int(d) for d in shape)
    return out


def infer_spec(state_dict: Mapping[str, Any], *, label: str = "state_dict") -> Spec:
    """Infer the permutation spec of a sequential MLP or CNN from names and shapes.

    Modules are found from the ``<prefix>.<part>`` names (``weight`` of 2 dims: Linear,
    4 dims: Conv2d; ``running_mean``/``running_var``: BatchNorm). Layer order is the natural
    order of the prefixes (``net.2`` before ``net.10``); when that does not chain (output
    width of each layer = input width of the next), top-level module groups are reordered
    to the one order that does (``features.*`` before ``classifier.*``).

    Networks with torchvision's ResNet names (``layerN.M.convK``) get a :class:`GraphSpec`
    instead: see :func:`_infer_resnet`.

    Raises:
        SpecError: no layer found, an unsupported layer (e.g. Conv1d), or no order in which
            the shapes chain; the message suggests a JSON spec file.
    """
    shapes = shapes_of(state_dict)
    modules: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, shape in shapes.items():
        prefix, _, part = name.rpartition(".")
        modules.setdefault(prefix, {})[part] = shape
    norms = [p for p, parts in modules.items() if "running_mean" in parts]
    weights = [p for p, parts in modules.items() if "weight" in parts and p not in norms]
    for prefix in weights:
        ndim = len(modules[prefix]["weight"])
        if ndim not in (2, 4):
            raise SpecError(
                f"{label}: tensor {prefix}.weight has {ndim} dims; fusekit infers Linear (2) and "
                "Conv2d (4) layers only; describe other models with a JSON spec file (--spec)"
            )
    if not weights:
        raise SpecError(
            f"{label}: found no Linear or Conv2d weight tensors (names '<module>.weight')"
        )
    if any(_RESNET_PART.match(prefix) for prefix in modules):
        return _infer_resnet(modules, shapes, label)
    order = _chained_order(sorted(weights + norms, key=_natural_key), modules, label)
    return _build_spec(order, modules, shapes, label)


_RESNET_PART = re.compile(r"^(layer\d+\.\d+)\.(conv\d+|bn\d+|downsample\.[01])$")


def _infer_resnet(modules, shapes: Shapes, label: str) -> GraphSpec:
    """The groups of a torchvision-style ResNet (BasicBlock or Bottleneck, any stem).

    ``conv1``/``bn1`` open the first residual stream; in block ``layerN.M`` each conv but the
    last opens a group of its own (``layerN.M.convK``) that the next conv reads; the last
    conv writes the stream, or, when the block has a ``downsample`` shortcut, a new stream
    (named after the block) that the shortcut writes too, reading the old stream. ``fc``
    reads the last stream.
    """
    blocks = sorted({m.group(1) for p in modules if (m := _RESNET_PART.match(p))},
                    key=_natural_key)
    groups: list[str] = []

    def open_group(name: str) -> int:
        groups.append(name)
        return len(groups) - 1

    def norm(prefix: str) -> str | None:
        return prefix if prefix in modules and "running_mean" in modules[prefix] else None

    for needed in ("conv1", "fc"):
        if needed not in modules or "weight" not in modules[needed]:
            raise SpecError(f"{label}: tensor {needed}.weight not found; fusekit infers "
                            "torchvision-style ResNets (conv1, layerN.M.*, fc); describe other "
                            "residual networks with a fusekit.spec/2 file (--spec)")
    stream = open_group("conv1")
    entries = [("conv1", norm("bn1"), None, stream)]
    for block in blocks:
        convs = sorted((p for p in modules if re.fullmatch(rf"{re.escape(block)}\.conv\d+", p)),
                       key=_natural_key)
        if not convs:
            raise SpecError(f"{label}: block {block} has no conv layers ({block}.conv1.weight)")
        below = stream
        for conv in convs[:-1]:
            group = open_group(conv)
            entries.append((conv, norm(conv.replace(".conv", ".bn")), below, group))
            below = group
        last_norm = norm(convs[-1].replace(".conv", ".bn"))
        shortcut = f"{block}.downsample.0"
        if shortcut in modules:
            out = open_group(block)
            entries.append((convs[-1], last_norm, below, out))
            entries.append((shortcut, norm(f"{block}.downsample.1"), stream, out))
            stream = out
        else:
            entries.append((convs[-1], last_norm, below, stream))
    entries.append(("fc", None, stream, None))
    return _build_graph(entries, groups, modules, shapes, label)


def _build_graph(entries, group_names: Sequence[str], modules, shapes: Shapes, label: str,
                 eps: Mapping[str, float] | None = None,
                 names: Mapping[str, Mapping[str, str]] | None = None) -> GraphSpec:
    """A GraphSpec from (layer prefix, norm prefix or None, reads, writes) entries."""
    widths: dict[int, tuple[str, int]] = {}
    for prefix, _, _, writes in entries:
        out = modules[prefix]["weight"][0]
        if writes is not None and widths.setdefault(writes, (prefix, out))[1] != out:
            first, width = widths[writes]
            raise SpecError(
                f"{label}: group {group_names[writes]!r}: layer {prefix} writes {out} channels "
                f"but {first} writes {width}; every layer of a group must have its width"
            )
    unwritten = [name for g, name in enumerate(group_names) if g not in widths]
    if unwritten:
        raise SpecError(f"{label}: group(s) {unwritten} are written by no layer")
    layers: list[Layer] = []
    used: set[str] = set()
    written: set[int] = set()
    for prefix, norm_prefix, reads, writes in entries:
        if reads is not None and reads not in written:
            raise SpecError(f"{label}: layer {prefix} reads group {group_names[reads]!r} before "
                            "any layer writes it; list layers in the order data flows")
        parts = modules[prefix]
        own = {part: f"{prefix}.{part}" for part in parts} | dict((names or {}).get(prefix, {}))
        units = None if reads is None else widths[reads][1]
        layer = _graph_layer(prefix, parts["weight"], own, units, label)
        if norm_prefix is not None:
            layer = replace(layer, norm=_norm(norm_prefix, modules[norm_prefix],
                                              (eps or {}).get(norm_prefix, BATCHNORM_EPS)))
            used.add(layer.norm.num_batches_tracked or "")
        _check_layer_tensors(layer, shapes, label)
        layers.append(layer)
        used.update(layer.tensors)
        if writes is not None:
            written.add(writes)
    reads = tuple(e[2] for e in entries)
    writes = tuple(e[3] for e in entries)
    inputs = {layer.in_features for layer, r in zip(layers, reads, strict=True) if r is None}
    if len(inputs) != 1 or None not in writes:
        raise SpecError(f"{label}: expected layers reading the network input (all of the same "
                        f"width) and a layer writing its output; found input widths "
                        f"{sorted(inputs)} and {writes.count(None)} output layer(s)")
    return GraphSpec(tuple(layers), reads, writes, tuple(group_names),
                     tuple(sorted(set(shapes) - used)))


def _graph_layer(prefix: str, shape: tuple[int, ...], names, units: int | None,
                 label: str) -> Layer:
    weight, bias = names["weight"], names.get("bias")
    if len(shape) not in (2, 4):
        raise SpecError(f"{label}: tensor {weight} has {len(shape)} dims; expected a Linear (2) "
                        "or Conv2d (4) weight")
    units = shape[1] if units is None else units
    if len(shape) == 4:
        if shape[1] != units:
            raise SpecError(f"{label}: tensor {weight} has {shape[1]} input channels; the group "
                            f"it reads has {units}")
        return Layer(prefix, "conv2d", weight, bias, units, shape[0], (shape[2], shape[3]))
    if shape[1] % units:
        raise SpecError(f"{label}: tensor {weight} has {shape[1]} input columns; expected a "
                        f"multiple of the {units} units of the group it reads")
    return Layer(prefix, "linear", weight, bias, units, shape[0], input_block=shape[1] // units)


def _natural_key(prefix: str) -> list[Any]:
    return [(0, int(tok), "") if tok.isdigit() else (1, 0, tok)
            for tok in re.split(r"(\d+)", prefix) if tok]


def _chained_order(prefixes: list[str], modules, label: str) -> list[str]:
    groups: dict[str, list[str]] = {}
    for prefix in prefixes:
        groups.setdefault(prefix.split(".")[0], []).append(prefix)
    if len(groups) <= 6:  # a handful of top-level modules: try each order of them
        for order in permutations(groups):
            candidate = [p for g in order for p in groups[g]]
            if _chains(candidate, modules):
                return candidate
    elif _chains(prefixes, modules):
        return prefixes
    widths = [f"{p}:{tuple(modules[p].get('weight', modules[p].get('running_mean')))}"
              for p in prefixes]
    raise SpecError(
        f"{label}: cannot order the layers so that each layer's output width feeds the next "
        f"(found {', '.join(widths)}); describe the model with a JSON spec file (--spec)"
    )


def _chains(prefixes: list[str], modules) -> bool:
    width, after_conv = None, False  # what flows out of the previous module
    for prefix in prefixes:
        parts = modules[prefix]
        if "running_mean" in parts:
            if width is None or parts["running_mean"][0] != width:
                return False
            continue
        shape = parts["weight"]
        flatten = after_conv and len(shape) == 2 and shape[1] % width == 0
        if width is not None and shape[1] != width and not flatten:
            return False
        if len(shape) == 4 and width is not None and not after_conv:
            return False  # a conv never follows a linear layer in a sequential CNN
        width, after_conv = shape[0], len(shape) == 4
    return "running_mean" not in modules[prefixes[0]]


def _build_spec(order: list[str], modules, shapes: Shapes, label: str,
                eps: Mapping[str, float] | None = None,
                names: Mapping[str, Mapping[str, str]] | None = None) -> PermutationSpec:
    layers: list[Layer] = []
    used: set[str] = set()
    for prefix in order:
        parts = modules[prefix]
        if "running_mean" in parts:
            norm = _norm(prefix, parts, (eps or {}).get(prefix, BATCHNORM_EPS))
            layers[-1] = replace(layers[-1], norm=norm)
            used.update([*norm.tensors, norm.num_batches_tracked or ""])
            continue
        own = {part: f"{prefix}.{part}" for part in parts} | dict((names or {}).get(prefix, {}))
        layers.append(_layer(prefix, parts, own, layers[-1] if layers else None, label))
        used.update(layers[-1].tensors)
    other = tuple(sorted(set(shapes) - used))
    spec = PermutationSpec(layers=tuple(layers), other=other)
    _check_shapes(spec, shapes, label)
    return spec


def _norm(prefix: str, parts, eps: float) -> BatchNorm:
    def name(part: str) -> str | None:
        return f"{prefix}.{part}" if part in parts else None

    return BatchNorm(prefix, name("weight"), name("bias"), f"{prefix}.running_mean",
                     f"{prefix}.running_var", name("num_batches_tracked"), eps)


def _layer(prefix: str, parts, names, below: Layer | None, label: str) -> Layer:
    shape = parts["weight"]
    weight, bias = names["weight"], names.get("bias") if "bias" in parts else None
    if len(shape) == 4:
        return Layer(prefix, "conv2d", weight, bias, shape[1], shape[0], (shape[2], shape[3]))
    block = 1
    if below is not None and below.kind == "conv2d":
        if shape[1] % below.out_features:
            raise SpecError(
                f"{label}: tensor {weight} has {shape[1]} input columns; expected a "
                f"multiple of the {below.out_features} channels of {below.name} (flatten)"
            )
        block = shape[1] // below.out_features
    return Layer(prefix, "linear", weight, bias, shape[1] // block, shape[0], input_block=block)


def _check_layer_tensors(layer: Layer, shapes: Shapes, label: str) -> None:
    expected = {layer.bias: (layer.out_features,)}
    if layer.norm is not None:
        expected.update({n: (layer.out_features,) for n in layer.norm.tensors})
    for name, shape in expected.items():
        if name is not None and shapes[name] != shape:
            raise SpecError(
                f"{label}: tensor {name!r} has shape {shapes[name]}; expected {shape} "
                f"to match the {layer.out_features} outputs of {layer.name}"
            )


def _check_shapes(spec: PermutationSpec, shapes: Shapes, label: str) -> None:
    for i, layer in enumerate(spec.layers):
        _check_layer_tensors(layer, shapes, label)
        if i and layer.in_features != spec.layers[i - 1].out_features:
            raise SpecError(
                f"{label}: layer {layer.name} takes {layer.in_features} inputs but "
                f"{spec.layers[i - 1].name} gives {spec.layers[i - 1].out_features}"
            )
    if len(spec.layers) < 1:
        raise SpecError(f"{label}: the model has no layers")


def spec_from_json(data: Mapping[str, Any], state_dict: Mapping[str, Any], *,
                   label: str = "spec") -> Spec:
    """Build a spec from its JSON form (see module docstring), checked against the shapes:
    a :class:`PermutationSpec` from ``fusekit.spec/1``, a :class:`GraphSpec` from
    ``fusekit.spec/2``, a :class:`~fusekit.core.transformer.TransformerSpec` from
    ``fusekit.spec/3``."""
    check_spec_format(data, label)
    if data["format"] == TRANSFORMER_FORMAT:
        return transformer_from_json(data, shapes_of(state_dict), label=label)
    shapes = shapes_of(state_dict)
    modules: dict[str, dict[str, tuple[int, ...]]] = {}
    entries: list[tuple[str, str | None, Any, Any]] = []
    eps: dict[str, float] = {}
    names: dict[str, dict[str, str]] = {}
    for i, entry in enumerate(data["layers"]):
        prefix = entry.get("name", entry["weight"].rpartition(".")[0])
        parts = {"weight": entry["weight"], "bias": entry.get("bias")}
        names[prefix] = {k: v for k, v in parts.items() if v is not None}
        modules[prefix] = {}
        for part, tensor in parts.items():
            if tensor is None:
                continue
            if tensor not in shapes:
                raise SpecError(f"{label}: layers[{i}] names tensor {tensor!r}, "
                                "which the checkpoint does not have")
            modules[prefix][part] = shapes[tensor]
        norm = entry.get("norm")
        if norm:
            modules[norm] = {p: shapes[f"{norm}.{p}"] for p in _NORM_PARTS
                             if f"{norm}.{p}" in shapes}
            if "running_mean" not in modules[norm]:
                raise SpecError(f"{label}: layers[{i}] norm {norm!r}: tensor "
                                f"{norm}.running_mean not found")
            eps[norm] = float(entry.get("eps", BATCHNORM_EPS))
        entries.append((prefix, norm or None, entry.get("reads"), entry.get("writes")))
    if data["format"] == SPEC_FORMAT:
        order = [p for prefix, norm, _, _ in entries for p in (prefix, norm) if p]
        return _build_spec(order, modules, shapes, label, eps, names)
    groups = data["groups"]
    index = {name: g for g, name in enumerate(groups)}
    wired = [(prefix, norm, index.get(reads), index.get(writes))
             for prefix, norm, reads, writes in entries]
    return _build_graph(wired, groups, modules, shapes, label, eps, names)


def check_spec_format(data: Any, label: str = "spec") -> None:
    """What can be checked of a spec's JSON form without a checkpoint (a service checks a
    job's spec so, before any client uploads): the format, each layer entry, and a graph's
    groups and wiring.

    Raises:
        SpecError: naming the entry, what was expected and what was found.
    """
    if not isinstance(data, Mapping):
        raise SpecError(f"{label}: expected a JSON object, found {type(data).__name__}")
    if data.get("format") == TRANSFORMER_FORMAT:
        return
    if data.get("format") not in (SPEC_FORMAT, GRAPH_FORMAT) \
            or not isinstance(data.get("layers"), list):
        raise SpecError(
            f"{label}: expected a JSON object with \"format\": \"{SPEC_FORMAT}\", "
            f"\"{GRAPH_FORMAT}\" (with a \"layers\" list) or \"{TRANSFORMER_FORMAT}\", "
            f"found keys {sorted(data)}"
        )
    for i, entry in enumerate(data["layers"]):
        _check_entry(entry, f"{label}: layers[{i}]")
    if data["format"] == GRAPH_FORMAT:
        _check_wiring(data, label)


def _check_wiring(data: Mapping[str, Any], label: str) -> None:
    groups = data.get("groups")
    if not isinstance(groups, list) or not all(isinstance(g, str) for g in groups) \
            or len(set(groups)) != len(groups):
        raise SpecError(f"{label}: \"groups\": expected a list of distinct group names, "
                        f"found {groups!r}")
    for i, entry in enumerate(data["layers"]):
        for key in ("reads", "writes"):
            value = entry.get(key)
            if value is not None and value not in groups:
                raise SpecError(f"{label}: layers[{i}].{key}: expected null or one of the "
                                f"groups {groups}, found {value!r}")


def _check_entry(entry: Any, where: str) -> None:
    if not isinstance(entry, Mapping) or "weight" not in entry:
        raise SpecError(f"{where}: expected an object with a \"weight\" tensor name")
    for key in ("name", "weight", "bias", "norm", "reads", "writes"):
        value = entry.get(key)
        if value is not None and not isinstance(value, str):
            raise SpecError(f"{where}.{key}: expected a tensor or module name (a string), "
                            f"found {value!r}")
    eps = entry.get("eps", BATCHNORM_EPS)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
        raise SpecError(f"{where}.eps: expected a number in (0, 1), found {eps!r}")


def load_spec_file(path: str | os.PathLike[str], state_dict: Mapping[str, Any]) -> Spec:
    """Read a JSON spec file and check it against a state_dict's shapes."""
    path = Path(path)
    data = read_json_file(path, "spec file", SpecError)
    if not isinstance(data, dict):
        raise SpecError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return spec_from_json(data, state_dict, label=str(path))


def permute(state_dict: Mapping[str, np.ndarray], spec: Spec,
            perms: Sequence[np.ndarray | None]) -> dict[str, np.ndarray]:
    """Apply one permutation per group (hidden layer); ``perms[g][new] = old`` neuron index.

    Permuting hidden neurons this way never changes the network's function (without PANs).
    Returns a new dict; the input arrays are not modified.
    """
    out = dict(state_dict)
    for hidden, perm in enumerate(perms):
        if perm is None:
            continue
        perm = np.asarray(perm)
        for ref in spec.group(hidden):
            array = np.asarray(out[ref.tensor])
            index = (perm[:, None] * ref.block + np.arange(ref.block)).ravel()
            out[ref.tensor] = np.take(array, index, axis=ref.axis)
    return out
