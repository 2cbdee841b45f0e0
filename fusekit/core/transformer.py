"""Permutation groups of transformers (BERT, ViT, GPT-2), from config.json and tensor names.

A transformer has no layer chain for :mod:`fusekit.core.spec` to follow: attention mixes
positions, LayerNorms scale the residual stream, and several tensors hold several groups
at once. Its structure is therefore described by groups of *slots*: a slot is a span of
one axis of one tensor, cut into ``size`` units of ``block`` consecutive entries starting
at ``offset``; permuting a group re-orders the units of every slot of that group alike.
Group kinds (ALGORITHMS.md §13):

- ``stream``: the residual stream: the embeddings' feature axes, every attention output
  projection's and MLP output's rows and bias, every LayerNorm weight and bias, the final
  LayerNorm, the columns of every layer reading the stream (q, k, v, MLP input, pooler,
  classifier, an untied LM head; a tied LM head is the token embedding itself).
- ``mlp``: the hidden units of one block's MLP (input rows and bias, output columns).
- ``heads``: one block's attention heads as units (``block`` = head dimension): the q, k and
  v rows of a head and the output projection's columns of that head move together.
- ``qk`` / ``v``: within head h of a block, the query and key dimensions (one permutation
  for both, so every q·k product is kept) and, separately, the value dimensions (with the
  output projection's columns). No permutation changes softmax(QKᵀ): it is a sum over
  head dimensions, taken whole.

Groups are listed in the order they are applied: a block's ``heads`` before its ``qk``/
``v`` groups, whose offsets name head positions after the head permutation.

Any other transformer is described by a ``fusekit.spec/3`` file, the same data as JSON::

    {"format": "fusekit.spec/3", "family": "my-model",
     "groups": [{"name": "stream", "kind": "stream", "size": 16,
                 "slots": [{"tensor": "emb.weight", "axis": 1},
                           {"tensor": "blocks.0.attn.qkv.weight", "axis": 0,
                            "block": 4, "offset": 0, "role": "q"}]}]}

``block`` (default 1), ``offset`` (default 0) and ``role`` (``q``/``k``/``v``/``o`` in a
``heads`` group, for matching heads by their circuits; default "") are optional.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from fusekit.core.errors import SpecError

TRANSFORMER_FORMAT = "fusekit.spec/3"
KINDS = ("stream", "mlp", "heads", "qk", "v", "other")
ROLES = ("", "q", "k", "v", "o")
#: The config key that holds each family's MLP width (GPT-2: None means 4 x n_embd).
MLP_WIDTH_KEYS = {"bert": "intermediate_size", "vit": "intermediate_size", "gpt2": "n_inner"}


@dataclass(frozen=True)
class Slot:
    """Units ``0..size-1`` of a group are entries ``offset + u*block .. +block`` of axis
    ``axis`` of tensor ``tensor``."""

    tensor: str
    axis: int
    block: int = 1
    offset: int = 0
    role: str = ""

    def index(self, perm: np.ndarray, length: int) -> np.ndarray:
        """Indices along the axis (``length`` entries) that put unit ``perm[u]`` at u."""
        index = np.arange(length)
        span = (self.offset + perm[:, None] * self.block + np.arange(self.block)).ravel()
        index[self.offset:self.offset + span.size] = span
        return index


@dataclass(frozen=True)
class Group:
    name: str
    kind: str
    size: int
    slots: tuple[Slot, ...]


@dataclass(frozen=True)
class TransformerSpec:
    """The permutation groups of one transformer (see module docstring)."""

    family: str
    groups: tuple[Group, ...]
    other: tuple[str, ...] = field(default=())

    @property
    def group_names(self) -> tuple[str, ...]:
        return tuple(g.name for g in self.groups)

    @property
    def hidden_widths(self) -> list[int]:
        """The widths a fusion may change or that describe the model: stream, then each
        block's MLP width."""
        return [g.size for g in self.groups if g.kind in ("stream", "mlp")]

    def of_kind(self, *kinds: str) -> list[int]:
        return [i for i, g in enumerate(self.groups) if g.kind in kinds]

    def structure(self) -> list[tuple[Any, ...]]:
        """What must agree between clients to be fused (everything but MLP widths)."""
        return [("family", self.family)] + [
            (g.name, g.kind, None if g.kind == "mlp" else g.size,
             tuple((s.tensor, s.axis, s.role) for s in g.slots)) for g in self.groups]

    def with_group_sizes(self, sizes: Mapping[str, int]) -> TransformerSpec:
        """The same model with other sizes for the named groups (e.g. fused MLP widths)."""
        return replace(self, groups=tuple(
            replace(g, size=int(sizes.get(g.name, g.size))) for g in self.groups))

    def to_json(self) -> dict[str, Any]:
        return {"format": TRANSFORMER_FORMAT, "family": self.family, "groups": [
            {"name": g.name, "kind": g.kind, "size": g.size,
             "slots": [{"tensor": s.tensor, "axis": s.axis, "block": s.block,
                        "offset": s.offset, "role": s.role} for s in g.slots]}
            for g in self.groups], "other": list(self.other)}

    def describe(self) -> list[dict[str, Any]]:
        """One JSON-able row per group, for ``fusekit inspect``."""
        return [{"name": g.name, "kind": g.kind, "size": g.size, "slots": len(g.slots)}
                for g in self.groups]


# ---- inference from a Hugging Face config and tensor names ----------------------------

Shapes = Mapping[str, tuple[int, ...]]


class _Builder:
    """Collects slots per group while a family's tensors are walked."""

    def __init__(self, shapes: Shapes, label: str):
        self.shapes, self.label = shapes, label
        self.groups: dict[str, tuple[str, int, list[Slot]]] = {}

    def group(self, name: str, kind: str, size: int) -> str:
        self.groups.setdefault(name, (kind, size, []))
        return name

    def add(self, group: str, tensor: str, axis: int, **slot: Any) -> None:
        if tensor not in self.shapes:
            raise SpecError(f"{self.label}: tensor {tensor!r} not found; expected it in a "
                            f"{self.groups[group][0]} group of this model")
        self.groups[group][2].append(Slot(tensor, axis, **slot))

    def linear(self, module: str, reads: str | None, writes: str | None, *,
               transposed: bool = False, **rows: Any) -> None:
        """A Linear (weight (out, in)) or GPT-2 Conv1D (weight (in, out)) module: its
        inputs are units of ``reads``, its outputs (weight rows and bias) of ``writes``."""
        out_axis, in_axis = (1, 0) if transposed else (0, 1)
        if reads is not None:
            self.add(reads, f"{module}.weight", in_axis)
        if writes is not None:
            self.add(writes, f"{module}.weight", out_axis, **rows)
            if f"{module}.bias" in self.shapes:
                self.add(writes, f"{module}.bias", 0, **rows)

    def norm(self, module: str, group: str) -> None:
        for part in ("weight", "bias"):
            if f"{module}.{part}" in self.shapes:
                self.add(group, f"{module}.{part}", 0)

    def build(self, family: str) -> TransformerSpec:
        groups = tuple(Group(name, kind, size, tuple(slots))
                       for name, (kind, size, slots) in self.groups.items())
        used = {s.tensor for g in groups for s in g.slots}
        other = sorted(set(self.shapes) - used)
        unknown = [name for name in other if not name.endswith(_UNPERMUTED)]
        if unknown:  # they may hold a permuted axis: averaging them as they are is wrong
            raise SpecError(
                f"{self.label}: tensor(s) {unknown[:3]} are in no permutation group fusekit "
                f"infers for {family} (a head it does not know, such as a question-answering "
                "head); describe the model with a fusekit.spec/3 file (--spec)")
        spec = TransformerSpec(family, groups, tuple(other))
        check_slots(spec, self.shapes, self.label)
        return spec


#: Tensors outside every group that the families hold: output biases (classes) and GPT-2's
#: causal-mask buffers (positions), the same in every client.
_UNPERMUTED = ("classifier.bias", "score.bias", "lm_head.bias", ".attn.bias",
               ".attn.masked_bias", "cls.predictions.bias", "cls.predictions.decoder.bias")


def infer_transformer(config: Mapping[str, Any], shapes: Shapes, *,
                      label: str = "model") -> TransformerSpec:
    """The groups of a BERT (encoder), ViT or GPT-2 model from its config.json and shapes.

    Raises:
        SpecError: another ``model_type``, a config without the widths it needs, or
            tensors missing or of unexpected shapes; the message suggests a spec/3 file.
    """
    family = config.get("model_type")
    if family not in _FAMILIES:
        raise SpecError(f"{label}: config.json has model_type {family!r}; fusekit infers the "
                        f"permutation groups of {', '.join(sorted(_FAMILIES))}; describe other "
                        "transformers with a fusekit.spec/3 file (--spec)")
    return _FAMILIES[family](config, _Builder(shapes, label), label)


def _config_int(config: Mapping[str, Any], key: str, label: str,
                default: int | None = None) -> int:
    value = config.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpecError(f"{label}: config.json {key!r}: expected a positive integer, "
                        f"found {value!r}")
    return value


def _prefix(shapes: Shapes, pattern: str, label: str, family: str) -> str:
    """The base model's name prefix (``bert.``, ``transformer.``, or none)."""
    found = sorted({m.group(1) for name in shapes if (m := re.fullmatch(pattern, name))},
                   key=len)
    if not found:
        raise SpecError(f"{label}: no tensor matches {pattern!r}; expected a {family} "
                        "checkpoint as Hugging Face transformers saves it")
    return found[0]


def _heads(b: _Builder, block: str, hidden: int, n_heads: int, stream: str,
           qkv: Sequence[tuple[str, int]], out: str, transposed: bool) -> None:
    """One block's attention: a ``heads`` group, then per head a ``qk`` and a ``v`` group.

    ``qkv``: (module, offset of its rows) for q, k and v (one fused module for GPT-2)."""
    if hidden % n_heads:
        raise SpecError(f"{b.label}: hidden size {hidden} is not a multiple of the "
                        f"{n_heads} attention heads")
    dim = hidden // n_heads
    heads = b.group(f"{block}.heads", "heads", n_heads)
    for role, (module, offset) in zip("qkv", qkv, strict=True):
        if role == "q" or module != qkv[0][0]:  # a fused qkv module reads the stream once
            b.linear(module, stream, None, transposed=transposed)
        b.linear(module, None, heads, transposed=transposed, block=dim, offset=offset,
                 role=role)
    o_axis = 0 if transposed else 1
    b.add(heads, f"{out}.weight", o_axis, block=dim, role="o")
    b.linear(out, None, stream, transposed=transposed)
    for h in range(n_heads):
        qk = b.group(f"{block}.head{h}.qk", "qk", dim)
        v = b.group(f"{block}.head{h}.v", "v", dim)
        for role, (module, offset) in zip("qkv", qkv, strict=True):
            b.linear(module, None, v if role == "v" else qk, transposed=transposed,
                     offset=offset + h * dim, role=role)
        b.add(v, f"{out}.weight", o_axis, offset=h * dim, role="o")


def _bert(config: Mapping[str, Any], b: _Builder, label: str) -> TransformerSpec:
    p = _prefix(b.shapes, r"(.*)embeddings\.word_embeddings\.weight", label, "bert")
    hidden = _config_int(config, "hidden_size", label)
    stream = b.group("stream", "stream", hidden)
    for name in ("word_embeddings", "position_embeddings", "token_type_embeddings"):
        if f"{p}embeddings.{name}.weight" in b.shapes:
            b.add(stream, f"{p}embeddings.{name}.weight", 1)
    b.norm(f"{p}embeddings.LayerNorm", stream)
    _encoder_blocks(config, b, label, p, stream, "self",
                    ("attention.output.LayerNorm", "output.LayerNorm"))
    if f"{p}pooler.dense.weight" in b.shapes:
        pooled = b.group("pooler", "other", hidden)
        b.linear(f"{p}pooler.dense", stream, pooled)
        _heads_of(b, pooled, ("classifier",))
    else:
        _heads_of(b, stream, ("classifier",))
    if f"{_MLM}.transform.dense.weight" in b.shapes:
        _masked_lm_head(b, stream, hidden)
    return b.build("bert")


_MLM = "cls.predictions"


def _masked_lm_head(b: _Builder, stream: str, hidden: int) -> None:
    """BERT's masked-LM head: a dense layer and a LayerNorm, then the decoder to the
    vocabulary. Tied to the token embeddings (no ``decoder.weight`` saved), the decoder
    reads the transform's output in the stream's basis, so the transform writes the
    stream; untied, the transform writes a group of its own that the decoder reads."""
    tied = f"{_MLM}.decoder.weight" not in b.shapes
    out = stream if tied else b.group("mlm_transform", "other", hidden)
    b.linear(f"{_MLM}.transform.dense", stream, out)
    b.norm(f"{_MLM}.transform.LayerNorm", out)
    if not tied:
        b.add(out, f"{_MLM}.decoder.weight", 1)


def _encoder_blocks(config: Mapping[str, Any], b: _Builder, label: str, p: str, stream: str,
                    attention: str, norms: Sequence[str]) -> None:
    """BERT's and ViT's encoder layers (``{p}encoder.layer.N``): attention with q, k, v
    under ``attention.<attention>``, an MLP, and two LayerNorms on the stream."""
    mlp_width = _config_int(config, "intermediate_size", label)
    for i in range(_config_int(config, "num_hidden_layers", label)):
        layer = f"{p}encoder.layer.{i}"
        _heads(b, layer, _config_int(config, "hidden_size", label),
               _config_int(config, "num_attention_heads", label), stream,
               [(f"{layer}.attention.{attention}.{m}", 0) for m in ("query", "key", "value")],
               f"{layer}.attention.output.dense", False)
        for norm in norms:
            b.norm(f"{layer}.{norm}", stream)
        mlp = b.group(f"{layer}.mlp", "mlp", mlp_width)
        b.linear(f"{layer}.intermediate.dense", stream, mlp)
        b.linear(f"{layer}.output.dense", mlp, stream)


def _vit(config: Mapping[str, Any], b: _Builder, label: str) -> TransformerSpec:
    p = _prefix(b.shapes, r"(.*)embeddings\.patch_embeddings\.projection\.weight", label,
                "vit")
    hidden = _config_int(config, "hidden_size", label)
    stream = b.group("stream", "stream", hidden)
    b.linear(f"{p}embeddings.patch_embeddings.projection", None, stream)
    for name in ("cls_token", "position_embeddings", "mask_token"):
        if f"{p}embeddings.{name}" in b.shapes:
            b.add(stream, f"{p}embeddings.{name}", 2)
    _encoder_blocks(config, b, label, p, stream, "attention",
                    ("layernorm_before", "layernorm_after"))
    b.norm(f"{p}layernorm", stream)
    if f"{p}pooler.dense.weight" in b.shapes:
        b.linear(f"{p}pooler.dense", stream, b.group("pooler", "other", hidden))
    _heads_of(b, stream, ("classifier",))
    return b.build("vit")


def _gpt2(config: Mapping[str, Any], b: _Builder, label: str) -> TransformerSpec:
    p = _prefix(b.shapes, r"(.*)wte\.weight", label, "gpt2")
    hidden = _config_int(config, "n_embd", label)
    stream = b.group("stream", "stream", hidden)
    b.add(stream, f"{p}wte.weight", 1)
    b.add(stream, f"{p}wpe.weight", 1)
    mlp_width = _config_int(config, "n_inner", label, default=4 * hidden)
    for i in range(_config_int(config, "n_layer", label)):
        layer = f"{p}h.{i}"
        b.norm(f"{layer}.ln_1", stream)
        qkv = f"{layer}.attn.c_attn"
        _heads(b, layer, hidden, _config_int(config, "n_head", label), stream,
               [(qkv, 0), (qkv, hidden), (qkv, 2 * hidden)], f"{layer}.attn.c_proj", True)
        b.norm(f"{layer}.ln_2", stream)
        mlp = b.group(f"{layer}.mlp", "mlp", mlp_width)
        b.linear(f"{layer}.mlp.c_fc", stream, mlp, transposed=True)
        b.linear(f"{layer}.mlp.c_proj", mlp, stream, transposed=True)
    b.norm(f"{p}ln_f", stream)
    _heads_of(b, stream, ("lm_head", "score"))
    return b.build("gpt2")


def _heads_of(b: _Builder, group: str, modules: Sequence[str]) -> None:
    """Output heads reading ``group`` (classifier, an untied LM head, a score layer)."""
    for module in modules:
        if f"{module}.weight" in b.shapes:
            b.linear(module, group, None)


_FAMILIES = {"bert": _bert, "vit": _vit, "gpt2": _gpt2}


# ---- checks, JSON, applying permutations ----------------------------------------------

def check_slots(spec: TransformerSpec, shapes: Shapes, label: str) -> None:
    """Every slot lies inside its tensor, and no axis span is claimed by two groups."""
    claimed: dict[tuple[str, int], list[tuple[int, int, str]]] = {}
    for group in spec.groups:
        for slot in group.slots:
            shape = shapes.get(slot.tensor)
            if shape is None:
                raise SpecError(f"{label}: group {group.name!r} names tensor "
                                f"{slot.tensor!r}, which the checkpoint does not have")
            if not 0 <= slot.axis < len(shape):
                raise SpecError(f"{label}: group {group.name!r}: tensor {slot.tensor!r} has "
                                f"{len(shape)} axes; expected axis {slot.axis} to exist")
            end = slot.offset + group.size * slot.block
            if slot.offset < 0 or slot.block < 1 or end > shape[slot.axis]:
                raise SpecError(
                    f"{label}: group {group.name!r} ({group.size} units of {slot.block}) "
                    f"needs entries {slot.offset}..{end - 1} of axis {slot.axis} of tensor "
                    f"{slot.tensor!r}, whose shape is {shape}")
            claimed.setdefault((slot.tensor, slot.axis), []).append(
                (slot.offset, end, group.name))
    for (tensor, axis), spans in claimed.items():
        _check_nesting(sorted(spans), tensor, axis, label)


def _check_nesting(spans: list[tuple[int, int, str]], tensor: str, axis: int,
                   label: str) -> None:
    """Spans of one axis are disjoint or nested (a head's dims inside the heads' span)."""
    for i, (a0, a1, ga) in enumerate(spans):
        for b0, b1, gb in spans[i + 1:]:
            if b0 >= a1:
                break
            if not (a0 <= b0 and b1 <= a1) and not (b0 <= a0 and a1 <= b1):
                raise SpecError(
                    f"{label}: groups {ga!r} and {gb!r} overlap on axis {axis} of tensor "
                    f"{tensor!r} ({a0}..{a1 - 1} and {b0}..{b1 - 1}); expected disjoint or "
                    "nested spans")


def transformer_from_json(data: Mapping[str, Any], shapes: Shapes, *,
                          label: str = "spec") -> TransformerSpec:
    """A :class:`TransformerSpec` from its ``fusekit.spec/3`` JSON, checked against shapes."""
    groups = data.get("groups")
    if not isinstance(groups, list) or not groups:
        raise SpecError(f"{label}: \"groups\": expected a non-empty list of groups")
    out = []
    for i, entry in enumerate(groups):
        where = f"{label}: groups[{i}]"
        if not isinstance(entry, Mapping) or not isinstance(entry.get("name"), str) \
                or entry.get("kind") not in KINDS or not isinstance(entry.get("slots"), list):
            raise SpecError(f"{where}: expected an object with \"name\", \"kind\" (one of "
                            f"{', '.join(KINDS)}), \"size\" and a \"slots\" list")
        size = entry.get("size")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise SpecError(f"{where}.size: expected a positive integer, found {size!r}")
        out.append(Group(entry["name"], entry["kind"], size,
                         tuple(_slot(s, f"{where}.slots[{j}]")
                               for j, s in enumerate(entry["slots"]))))
    used = {s.tensor for g in out for s in g.slots}
    spec = TransformerSpec(str(data.get("family", "custom")), tuple(out),
                           tuple(sorted(set(shapes) - used)))
    check_slots(spec, shapes, label)
    return spec


def _slot(entry: Any, where: str) -> Slot:
    if not isinstance(entry, Mapping) or not isinstance(entry.get("tensor"), str):
        raise SpecError(f"{where}: expected an object with a \"tensor\" name")
    values = {}
    for key, default in (("axis", None), ("block", 1), ("offset", 0)):
        value = entry.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise SpecError(f"{where}.{key}: expected a non-negative integer, found {value!r}")
        values[key] = value
    role = entry.get("role", "")
    if role not in ROLES:
        raise SpecError(f"{where}.role: expected one of {ROLES}, found {role!r}")
    return Slot(entry["tensor"], values["axis"], values["block"], values["offset"], role)


def permute_group(state_dict: dict[str, np.ndarray], group: Group,
                  perm: np.ndarray, owned: set[str] | None = None) -> None:
    """Re-order the units of ``group`` in place of the dict's arrays: new unit u is old
    unit ``perm[u]`` in every slot. Arrays are replaced, never modified, except those
    named in ``owned`` (arrays this permutation put in the dict, which it adds there):
    their slot's span alone is re-ordered in place, not the whole tensor copied (a head's
    64 rows of a 768 x 768 projection)."""
    perm = np.asarray(perm)
    for slot in group.slots:
        array = state_dict[slot.tensor]
        if owned is not None and slot.tensor in owned:
            span = slot_span(array, slot, perm.size)  # a view: written through
            span[...] = span[(perm[:, None] * slot.block + np.arange(slot.block)).ravel()]
            continue
        state_dict[slot.tensor] = np.take(array, slot.index(perm, array.shape[slot.axis]),
                                          axis=slot.axis)
        if owned is not None:
            owned.add(slot.tensor)


def permute_transformer(state_dict: Mapping[str, np.ndarray], spec: TransformerSpec,
                        perms: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Apply one permutation per named group, in the spec's group order; returns a new
    dict (inputs untouched). Function-preserving by construction (module docstring)."""
    out = dict(state_dict)
    for group in spec.groups:
        if group.name in perms:
            permute_group(out, group, perms[group.name])
    return out


def unit_rows(array: np.ndarray, slot: Slot, size: int, dtype: type = np.float64
              ) -> np.ndarray:
    """The slot's units as rows: (size, block * everything else), in ``dtype`` (the slot's
    span alone is converted, in one copy)."""
    return np.ascontiguousarray(slot_span(array, slot, size), dtype=dtype).reshape(size, -1)


def slot_span(array: np.ndarray, slot: Slot, size: int) -> np.ndarray:
    """A view of the slot's entries with its axis first: (size * block, everything else)."""
    return np.moveaxis(array, slot.axis, 0)[slot.offset:slot.offset + size * slot.block]


#: Per family, the config keys of its stream width, MLP width (GPT-2's default: 4 x the
#: stream) and number of blocks.
_SIZE_KEYS = {"bert": ("hidden_size", "intermediate_size", "num_hidden_layers"),
              "vit": ("hidden_size", "intermediate_size", "num_hidden_layers"),
              "gpt2": ("n_embd", "n_inner", "n_layer")}


def check_config_matches_spec(config: Mapping[str, Any], spec: Mapping[str, Any],
                              label: str = "config") -> None:
    """A config.json against a ``fusekit.spec/3`` of a known family, before any weights:
    its ``model_type``, stream and MLP widths, and number of blocks (one MLP group each).

    Raises:
        SpecError: one line naming what disagrees, with both values.
    """
    family = spec.get("family")
    if family not in _SIZE_KEYS:
        return  # a custom family: the config can only be checked against weights
    if config.get("model_type") != family:
        raise SpecError(f"{label}: model_type {config.get('model_type')!r}; the spec given "
                        f"describes a {family!r} model")
    stream_key, mlp_key, blocks_key = _SIZE_KEYS[family]
    stream = _config_int(config, stream_key, label)
    expected = {"stream": stream,
                "mlp": _config_int(config, mlp_key, label, default=4 * stream)}
    groups = [g for g in spec.get("groups", []) if isinstance(g, Mapping)]
    for group in groups:
        kind, size = group.get("kind"), group.get("size")
        if kind in expected and size != expected[kind]:
            key = stream_key if kind == "stream" else mlp_key
            raise SpecError(f"{label}: {key!r} is {expected[kind]}; the spec's {kind} group "
                            f"{group.get('name')!r} has size {size!r}")
    mlps = sum(1 for g in groups if g.get("kind") == "mlp")
    if mlps != _config_int(config, blocks_key, label):
        raise SpecError(f"{label}: {blocks_key!r} is {config.get(blocks_key)}; the spec "
                        f"given has {mlps} MLP group(s), one per block")


def config_with_widths(config: Mapping[str, Any], spec: TransformerSpec) -> dict[str, Any]:
    """config.json for a fused model: the MLP width key set when the width changed."""
    out = dict(config)
    widths = {g.size for g in spec.groups if g.kind == "mlp"}
    key = MLP_WIDTH_KEYS.get(spec.family)
    if len(widths) > 1:
        raise SpecError(f"{spec.family}: the blocks' MLP widths differ ({sorted(widths)}); "
                        "config.json holds one width for every block")
    if key is not None and widths:
        width = widths.pop()
        if config.get(key) is not None or width != 4 * config.get("n_embd", 0):
            out[key] = width
    return out


# ---- where calibration acts ------------------------------------------------------------

#: Statistics point kinds of a transformer: an MLP's hidden pre-activations (the output of
#: its input layer, before the activation) and a LayerNorm's output channels. Both count
#: tokens, not inputs (ALGORITHMS.md §13, "Calibration").
MLP_HIDDEN = "mlp_hidden"
LAYERNORM = "layernorm"


@dataclass(frozen=True)
class CalibrationPoint:
    """A place calibration rescales and shifts: the channels written by ``weight`` (rows
    along ``weight.axis``) and ``bias``, which are the units of group ``group``."""

    kind: str  # MLP_HIDDEN or LAYERNORM
    module: str  # the module's name in the checkpoint (an MLP's input layer, a LayerNorm)
    group: str
    size: int
    weight: Slot
    bias: str

    @property
    def point(self) -> str:
        """Its name in a statistics file: ``<kind>:<module>``."""
        return f"{self.kind}:{self.module}"


def calibration_points(spec: TransformerSpec, shapes: Shapes) -> list[CalibrationPoint]:
    """Every MLP's hidden units (its input layer: the MLP group's slot with a bias) and
    every LayerNorm on the residual stream (a 1-D weight and bias in the stream group)."""
    out = []
    for group in spec.groups:
        if group.kind not in ("mlp", "stream"):
            continue
        tensors = {slot.tensor: slot for slot in group.slots}
        for slot in group.slots:
            module, _, part = slot.tensor.rpartition(".")
            bias = f"{module}.bias"
            if part != "weight" or bias not in tensors:
                continue
            if group.kind == "mlp":
                out.append(CalibrationPoint(MLP_HIDDEN, module, group.name, group.size, slot,
                                            bias))
            elif len(shapes[slot.tensor]) == 1 and len(shapes[bias]) == 1:
                out.append(CalibrationPoint(LAYERNORM, module, group.name, group.size, slot,
                                            bias))
    return out
