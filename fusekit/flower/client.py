"""The ClientApp side: pack a trained torch model into a train reply (with, for
calibration's REPAIR, the node's statistics of that model), rebuild the global model the
server sends (whose widths a PFNM/NAFI round changed), and answer calibration's statistics
query."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from torch import nn

from fusekit.core import metadata as meta
from fusekit.core.checkpoint import Checkpoint
from fusekit.core.errors import ParameterError
from fusekit.core.stats import DEFAULT_MIN_SAMPLES
from fusekit.toolkit.calibration import client_statistics
from fusekit.toolkit.nn.fused import load_fused

from .records import (
    ARCH,
    ARCH_RECORD,
    CLASS_COUNTS,
    NUM_EXAMPLES,
    arrays_to_state_dict,
    model_metadata,
    query_checkpoint,
    statistics_content,
)


def train_reply(
    model: nn.Module,
    num_examples: int,
    class_counts: Sequence[int] | None = None,
    *,
    metrics: Mapping[str, Any] | None = None,
    arrays_key: str = "arrays",
    metrics_key: str = "metrics",
    statistics_inputs: Any = None,
    min_samples: int = DEFAULT_MIN_SAMPLES,
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
        statistics_inputs: (N, ...) this node's inputs (the training inputs): the reply
            also carries the per-channel count, mean and variance of every hidden
            pre-activation and BatchNorm input of ``model`` on them (records
            ``statistics`` and ``fusekit-stats``, as :func:`statistics_reply`), REPAIR's
            targets for :class:`FusekitStrategy`'s calibration of layers without BatchNorm.
            No input, label or per-sample value.
        min_samples: refuse to compute those statistics over fewer inputs.

    Raises:
        ParameterError: a count is not a non-negative integer, or the class counts do not
            add up to ``num_examples``.
        DataError: ``statistics_inputs`` that do not fit the model, or fewer than
            ``min_samples``.
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
    if statistics_inputs is not None:
        metadata = {meta.ARCH: json.dumps(dict(arch))} if isinstance(arch, Mapping) else {}
        own = Checkpoint.from_state_dict({name: t.numpy() for name, t in state.items()},
                                         metadata, source="trained model")
        stats = client_statistics(own, _numpy(statistics_inputs), min_samples=min_samples)
        content.update(statistics_content(stats))
    return content


def _numpy(inputs: Any) -> np.ndarray:
    """A numpy array or torch tensor of inputs as a numpy array."""
    if hasattr(inputs, "detach"):  # a torch tensor
        inputs = inputs.detach().cpu().numpy()
    return np.asarray(inputs)


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


def statistics_reply(content: RecordDict, inputs: Any, *, batch_size: int = 1024,
                     min_samples: int = DEFAULT_MIN_SAMPLES, device: str = "cpu"
                     ) -> RecordDict:
    """The reply to :class:`FusekitStrategy`'s statistics query (``@app.query("statistics")``):
    per-channel count, mean and variance of every hidden pre-activation and BatchNorm
    input of the model the query carries, run on this node's ``inputs``
    (:func:`fusekit.toolkit.calibration.client_statistics`). Only those aggregates leave
    the node: no input, label or per-sample value.

    Args:
        content: the query message's content.
        inputs: (N, ...) this node's inputs (numpy array or torch tensor), those the model
            accepts (the training inputs: calibration matches the data the clients saw).
        batch_size: inputs per forward pass (in one-pass calibration also the BatchNorm
            batch).
        min_samples: refuse to answer over fewer inputs (the moments of a few samples
            reveal them); the strategy refuses such replies too.
        device: where the model runs.

    Raises:
        CheckpointError: the content is not a statistics query.
        DataError: inputs that do not fit the model, or fewer than ``min_samples``.
    """
    checkpoint, mode = query_checkpoint(content)
    stats = client_statistics(checkpoint, _numpy(inputs), mode=mode,
                              batch_size=batch_size, device=device, min_samples=min_samples)
    return statistics_content(stats)
