"""The ClientApp side: pack a trained torch model into a train reply, and rebuild the global
model the server sends (whose widths a PFNM/NAFI round changed)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from torch import nn

from fusekit.core import metadata as meta
from fusekit.core.checkpoint import Checkpoint
from fusekit.core.errors import ParameterError
from fusekit.toolkit.nn.fused import load_fused

from .records import (
    ARCH,
    ARCH_RECORD,
    CLASS_COUNTS,
    NUM_EXAMPLES,
    arrays_to_state_dict,
    model_metadata,
)


def train_reply(
    model: nn.Module,
    num_examples: int,
    class_counts: Sequence[int] | None = None,
    *,
    metrics: Mapping[str, Any] | None = None,
    arrays_key: str = "arrays",
    metrics_key: str = "metrics",
) -> RecordDict:
    """The content of a train reply that :class:`FusekitStrategy` can fuse.

    Args:
        model: the trained model; its state_dict is sent with its tensor names. A fusekit
            module (``fusekit.toolkit.nn.build_model``) also sends its architecture.
        num_examples: how many examples it was trained on (weights the client).
        class_counts: examples per class, summing to ``num_examples`` (for class-aware
            fusion such as ``avg --class-weighted``).
        metrics: further client metrics (numbers or lists of numbers), e.g. ``train-loss``.
        arrays_key, metrics_key: the record names (FedAvg's defaults).

    Raises:
        ParameterError: a count is not a non-negative integer, or the class counts do not
            add up to ``num_examples``.
    """
    if int(num_examples) != num_examples or num_examples <= 0:
        raise ParameterError(f"num_examples: expected a positive integer, found {num_examples!r}")
    record = MetricRecord({**(metrics or {}), NUM_EXAMPLES: int(num_examples)})
    if class_counts is not None:
        counts = [int(c) for c in class_counts]
        if counts != list(class_counts) or min(counts, default=-1) < 0 or (
                sum(counts) != num_examples):
            raise ParameterError(
                f"class_counts: expected non-negative integers adding up to num_examples="
                f"{num_examples}, found {list(class_counts)}"
            )
        record[CLASS_COUNTS] = counts
    state = {name: tensor.detach().cpu() for name, tensor in model.state_dict().items()}
    content = RecordDict({arrays_key: ArrayRecord(state), metrics_key: record})
    arch = getattr(model, "arch", None)
    if isinstance(arch, Mapping):
        content[ARCH_RECORD] = ConfigRecord({ARCH: json.dumps(dict(arch))})
    return content


def global_model(content: RecordDict, arch: Mapping[str, Any] | None = None, *,
                 arrays_key: str = "arrays", config_key: str = "config") -> nn.Module:
    """The global model a train or evaluate message carries, as a torch module in eval mode.

    Its architecture is the one the server sent (``fusekit-arch``, ``fusekit-spec`` or
    ``fusekit-ams`` in the ConfigRecord: the fused model) or else ``arch``; without either
    the model is read as a ReLU MLP from its tensors, as ``fusekit.load_fused`` does.

    Raises:
        CheckpointError: the arrays do not match the architecture.
    """
    metadata = model_metadata(content.config_records.get(config_key, ConfigRecord()))
    if not metadata and arch is not None:
        metadata = {meta.ARCH: json.dumps(dict(arch))}
    checkpoint = Checkpoint.from_state_dict(
        arrays_to_state_dict(content.array_records[arrays_key]), metadata, source="global model")
    return load_fused(checkpoint, "cpu")
