"""A checkpoint's permutation spec — given, recorded in its metadata, or inferred from its
names and shapes (config.json for a Hugging Face model folder) — the statistic points it
has, and whether clients are alike enough to be fused together."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fusekit.core import metadata as meta
from fusekit.core.checkpoint import Checkpoint
from fusekit.core.errors import IncompatibleModelsError
from fusekit.core.spec import (
    GraphSpec,
    PermutationSpec,
    infer_spec,
    load_spec_file,
    spec_from_json,
)
from fusekit.core.stats import input_point, statistic_points
from fusekit.core.transformer import TransformerSpec, calibration_points, infer_transformer

SpecLike = str | os.PathLike[str] | Mapping[str, Any] | PermutationSpec | GraphSpec


def tensor_shapes(checkpoint: Checkpoint) -> dict[str, tuple[int, ...]]:
    return {name: info.shape for name, info in checkpoint.tensors.items()}


def fused_spec(checkpoint: Checkpoint) -> PermutationSpec | GraphSpec | TransformerSpec:
    """A fused (or client) model's spec for calibration: the one in its metadata, else
    inferred (from config.json for a Hugging Face model folder)."""
    shapes = tensor_shapes(checkpoint)
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
        return {p.point: p.size for p in calibration_points(spec, tensor_shapes(checkpoint))}
    return statistic_points(spec)


def input_points(checkpoint: Checkpoint, spec) -> dict[str, int]:
    """The input moments a statistics file of this model may hold, with their dimension d:
    the first layer's (``fusekit stats --input-moments``), where a hidden layer follows."""
    if isinstance(spec, TransformerSpec) or len(spec.layers) < 2:
        return {}
    first = spec.layers[0]
    return {input_point(first.name): math.prod(checkpoint.tensors[first.weight].shape[1:])}


def client_specs(checkpoints: Sequence[Checkpoint], spec: SpecLike | None
                 ) -> list[PermutationSpec]:
    """:func:`client_spec` of every client; one inferred from names and shapes alone (no
    spec, no config.json) serves every client with the same names and shapes (ten
    ResNet-50s: one inference of about 3 ms instead of ten)."""
    inferred: dict[tuple[tuple[str, tuple[int, ...]], ...], PermutationSpec] = {}
    specs = []
    for checkpoint in checkpoints:
        if spec is not None or checkpoint.config is not None:
            specs.append(client_spec(checkpoint, spec))
            continue
        key = tuple(tensor_shapes(checkpoint).items())
        if key not in inferred:
            inferred[key] = client_spec(checkpoint, None)
        specs.append(inferred[key])
    return specs


def client_spec(checkpoint: Checkpoint, spec: SpecLike | None) -> PermutationSpec:
    """The permutation spec of one client: given, or inferred (from config.json for a
    Hugging Face model folder, from names and shapes otherwise)."""
    shapes = tensor_shapes(checkpoint)
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
