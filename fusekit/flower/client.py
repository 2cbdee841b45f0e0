"""The ClientApp side: pack a trained torch model into a train reply (with, for
calibration's REPAIR, the node's statistics of that model), rebuild the global model the
server sends (whose widths a PFNM/NAFI round changed), and answer the statistics queries
of calibration, alignment and refit rounds."""

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
from fusekit.toolkit.alignment import cross_statistics, refit_statistics
from fusekit.toolkit.calibration import client_statistics
from fusekit.toolkit.nn.fused import load_fused
from fusekit.toolkit.nn.preprocess import model_normalization

from .records import (
    ARCH_RECORD,
    CLASS_COUNTS,
    NUM_EXAMPLES,
    arrays_to_state_dict,
    keep_model,
    model_metadata,
    query_checkpoint,
    reply_config,
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
    input_moments: bool = False,
    min_samples: int = DEFAULT_MIN_SAMPLES,
    keep_in: RecordDict | None = None,
) -> RecordDict:
    """The content of a train reply that :class:`FusekitStrategy` can fuse.

    Args:
        model: the trained model; its state_dict is sent with its tensor names. A fusekit
            module (``fusekit.toolkit.nn.build_model``) also sends its architecture.
        num_examples: how many examples it was trained on (weights the client).
        class_counts: examples per class, summing to ``num_examples`` (for class-aware
            fusion such as ``avg --class-weighted``).
        metrics: further client metrics (numbers or lists of numbers), e.g. ``train-loss``.
        arrays_key: the ArrayRecord's name (FedAvg's default).
        metrics_key: the MetricRecord's name (FedAvg's default).
        statistics_inputs: (N, ...) this node's inputs (the training inputs): the reply
            also carries the per-channel count, mean and variance of every hidden
            pre-activation and BatchNorm input of ``model`` on them (records
            ``statistics`` and ``fusekit-stats``, as :func:`statistics_reply`), REPAIR's
            targets for :class:`FusekitStrategy`'s calibration of layers without BatchNorm.
            No input, label or per-sample value.
        input_moments: with ``statistics_inputs``, also the first layer's input moments
            (count, mean, d x d covariance of its input vectors;
            ``client_statistics(..., input_moments=True)``): layer-by-layer calibration
            then calibrates the first layer without a query round. They say more about
            the data than per-channel moments (ALGORITHMS §12): opt-in.
        min_samples: refuse to compute those statistics over fewer inputs.
        keep_in: the node's ``context.state``: the model sent is kept there, so that
            :func:`statistics_reply` can answer alignment and refit queries
            (``FusekitStrategy(alignment_rounds=...)``) against it.

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
    metadata = _own_metadata(model)
    if metadata:
        content[ARCH_RECORD] = reply_config(metadata)
    if statistics_inputs is not None:
        stats = client_statistics(_checkpoint(model), _numpy(statistics_inputs),
                                  min_samples=min_samples, input_moments=input_moments)
        content.update(statistics_content(stats))
    if keep_in is not None:
        keep_model(keep_in, content[arrays_key], metadata)
    return content


def _own_metadata(model: nn.Module) -> dict[str, str]:
    """What a module says of itself: a fusekit module's architecture (``fusekit.arch``),
    the input normalisation it applies (``fusekit.preprocess``); none for other modules."""
    arch = getattr(model, "arch", None)
    metadata = {meta.ARCH: json.dumps(dict(arch))} if isinstance(arch, Mapping) else {}
    normalization = model_normalization(model)
    if normalization is not None:
        metadata[meta.PREPROCESS] = normalization.to_json()
    return metadata


def _checkpoint(model: nn.Module | Checkpoint) -> Checkpoint:
    """A torch model as the checkpoint its train reply sends (the same content hash)."""
    if isinstance(model, Checkpoint):
        return model
    return Checkpoint.from_state_dict(
        {name: t.detach().cpu().numpy() for name, t in model.state_dict().items()},
        _own_metadata(model), source="this node's trained model")


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
    the model is read as a ReLU MLP from its tensors, as ``fusekit.load_fused`` does. It
    normalises its inputs as the fused model's clients did (``fusekit-preprocess``).

    Raises:
        CheckpointError: the arrays do not match the architecture.
    """
    metadata = model_metadata(content.config_records.get(config_key, ConfigRecord()))
    if not metadata and arch is not None:
        metadata = {meta.ARCH: json.dumps(dict(arch))}
    checkpoint = Checkpoint.from_state_dict(
        arrays_to_state_dict(content.array_records[arrays_key]), metadata, source="global model")
    return load_fused(checkpoint, "cpu")


def statistics_reply(content: RecordDict, inputs: Any, *,
                     own_model: nn.Module | Checkpoint | None = None, batch_size: int = 1024,
                     min_samples: int = DEFAULT_MIN_SAMPLES, device: str = "cpu"
                     ) -> RecordDict:
    """The reply to :class:`FusekitStrategy`'s statistics query (``@app.query("statistics")``),
    computed on this node's ``inputs`` with the library's functions, as ``fusekit stats``
    computes them:

    - calibration: per-channel count, mean and variance of every hidden pre-activation and
      BatchNorm input of the model the query carries
      (:func:`fusekit.toolkit.calibration.client_statistics`);
    - an alignment round: the cross statistics of that model and ``own_model`` (per hidden
      layer, both models' channel moments and their covariance matrix;
      :func:`fusekit.toolkit.alignment.cross_statistics`);
    - a refit round: for the layer the query names, E[u uᵀ] of the model's input to it and
      E[y uᵀ] with ``own_model``'s pre-activation y
      (:func:`fusekit.toolkit.alignment.refit_statistics`).

    Only those aggregates leave the node: no input, label or per-sample value.

    Args:
        content: the query message's content.
        inputs: (N, ...) this node's inputs (numpy array or torch tensor), those the model
            accepts (the training inputs: calibration matches the data the clients saw).
        own_model: the model this node trained and sent in the round (a torch module, or
            ``kept_model(context.state)`` after ``train_reply(..., keep_in=context.state)``);
            needed for alignment and refit queries only.
        batch_size: inputs per forward pass (in one-pass calibration also the BatchNorm
            batch).
        min_samples: refuse to answer over fewer inputs (the moments of a few samples
            reveal them); the strategy refuses such replies too.
        device: where the model runs.

    Raises:
        CheckpointError: the content is not a statistics query.
        ParameterError: an alignment or refit query without ``own_model``.
        DataError: inputs that do not fit the model, or fewer than ``min_samples``.
    """
    query = query_checkpoint(content)
    inputs = _numpy(inputs)
    if query.kind == "channels":
        return statistics_content(client_statistics(
            query.model, inputs, mode=query.mode, batch_size=batch_size, device=device,
            min_samples=min_samples))
    if own_model is None:
        raise ParameterError(f"own_model: the query asks for {query.kind} statistics against "
                             "this node's trained model; pass own_model= (e.g. "
                             "kept_model(context.state))")
    own = _checkpoint(own_model)
    options = {"batch_size": batch_size, "device": device, "min_samples": min_samples}
    if query.kind == "cross":
        return statistics_content(cross_statistics(query.model, own, inputs, **options),
                                  "cross")
    return statistics_content(refit_statistics(query.model, own, inputs, query.layer,
                                               **options), "refit")
