"""How fusekit's models travel in Flower records, on both sides of a federation.

A ClientApp's train reply holds one ``ArrayRecord`` (the model's state_dict, tensor names
kept), one ``MetricRecord`` with ``num-examples`` (and, optionally, ``class-counts``: one
count per class), for fusekit models a ``ConfigRecord`` with the architecture
(``fusekit-arch``, the ``fusekit.arch`` JSON) and, optionally, the node's statistics of its
own model (the ``statistics`` ArrayRecord and ``fusekit-stats`` ConfigRecord of a
statistics reply, below): REPAIR's targets. After a fusion the server sends, in the train
and evaluate ``ConfigRecord``, what ``fusekit.load_fused`` rebuilds the global model from:
``fusekit-arch``, ``fusekit-spec`` and ``fusekit-ams`` where the fused model has them, and
``fusekit-widths`` (the fused hidden widths, which PFNM/NAFI change).

Calibration (``FusekitStrategy(calibrate=True)``) sends a ``query.statistics`` message
with the model to calibrate, the same ConfigRecord plus ``fusekit-norm-targets`` and
``fusekit-stats-mode``; the node replies with an ArrayRecord ``statistics`` holding per
channel count, mean and variance of every point (a statistics file's tensors, float64) and
a ConfigRecord ``fusekit-stats`` with the file's description (model hash, number of inputs,
mode): nothing else, no input or label. Alignment and refit rounds
(``FusekitStrategy(alignment_rounds=...)``) send the same query with
``fusekit-stats-kind`` ``cross`` (and the node answers with its cross statistics of the
model and its own: ArrayRecord ``cross-statistics``, ConfigRecord ``fusekit-cross-stats``)
or ``refit`` with ``fusekit-refit-layer`` (refit statistics of that layer:
``refit-statistics``, ``fusekit-refit-stats``): the tensors and description of the files
``fusekit stats --against`` writes. A node keeps the model it trained in its
``Context.state`` (``fusekit-own-model``, ``fusekit-own-arch``) to answer them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import NamedTuple

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, MessageType, RecordDict

from fusekit.core import metadata as meta
from fusekit.core.checkpoint import Checkpoint
from fusekit.core.cross_stats import (
    CrossStatistics,
    RefitStatistics,
    cross_statistics_description,
    cross_statistics_tensors,
    parse_cross_statistics,
    parse_refit_statistics,
    refit_statistics_description,
    refit_statistics_tensors,
)
from fusekit.core.errors import CheckpointError, StatisticsError
from fusekit.core.stats import (
    Statistics,
    parse_statistics,
    statistics_description,
    statistics_tensors,
)

NUM_EXAMPLES = "num-examples"  # Flower's FedAvg weights replies by this key
CLASS_COUNTS = "class-counts"
ARCH = "fusekit-arch"
SPEC = "fusekit-spec"
AMS = "fusekit-ams"
WIDTHS = "fusekit-widths"
PREPROCESS = "fusekit-preprocess"
ARCH_RECORD = "fusekit"  # the reply's ConfigRecord carrying REPLY_KEYS
#: What a node says of the model it sends (architecture, input normalisation), and the
#: ConfigRecord keys it travels under.
REPLY_KEYS = {meta.ARCH: ARCH, meta.PREPROCESS: PREPROCESS}
#: The fused model's metadata that rebuilds it, and the ConfigRecord keys it travels under.
MODEL_KEYS = {meta.ARCH: ARCH, meta.SPEC: SPEC, meta.AMS: AMS, meta.PREPROCESS: PREPROCESS}
#: The query action of calibration: a ClientApp answers it in ``@app.query("statistics")``.
STATISTICS = "statistics"
STATISTICS_QUERY = f"{MessageType.QUERY}.{STATISTICS}"
NORM_TARGETS = "fusekit-norm-targets"
STATS_MODE = "fusekit-stats-mode"
STATS_ARRAYS = "statistics"
STATS_RECORD = "fusekit-stats"
#: What a statistics query asks for: calibration's per-channel statistics of the model,
#: an alignment round's cross statistics of it and the node's own model, or a refit
#: round's moments of one layer (``STATS_LAYER``).
STATS_KIND = "fusekit-stats-kind"
KINDS = ("channels", "cross", "refit")
STATS_LAYER = "fusekit-refit-layer"
CROSS_ARRAYS, CROSS_RECORD = "cross-statistics", "fusekit-cross-stats"
REFIT_ARRAYS, REFIT_RECORD = "refit-statistics", "fusekit-refit-stats"
#: Where a ClientApp keeps the model it trained, in its ``Context.state``.
OWN_MODEL, OWN_ARCH = "fusekit-own-model", "fusekit-own-arch"


def arrays_to_state_dict(arrays: ArrayRecord) -> dict[str, np.ndarray]:
    """An ArrayRecord as a name -> numpy array mapping, in the record's order."""
    return {name: array.numpy() for name, array in arrays.items()}


def state_dict_to_arrays(state_dict: Mapping[str, np.ndarray]) -> ArrayRecord:
    """A name -> numpy array mapping as an ArrayRecord (names, order and shapes kept: a 0-d
    tensor such as BatchNorm's ``num_batches_tracked`` stays 0-d)."""
    return ArrayRecord({name: Array(np.require(value, requirements="C"))
                        for name, value in state_dict.items()})


def reply_checkpoint(content: RecordDict, source: str,
                     weighted_by_key: str = NUM_EXAMPLES) -> Checkpoint:
    """A client's train reply as a fusekit checkpoint, checked as ``fusekit fuse`` checks a
    file: tensor dtypes, finite values, sample and class counts, architecture.

    The model is the reply's one ArrayRecord other than ``statistics`` (the node's
    statistics of it, :func:`reply_targets`).

    Raises:
        CheckpointError: the reply lacks its ArrayRecord, MetricRecord or sample count, or
            holds values fusekit cannot fuse (the message names ``source``).
    """
    arrays = _only({name: record for name, record in content.array_records.items()
                    if name != STATS_ARRAYS}, "model ArrayRecord", source)
    metrics = _only(content.metric_records, "MetricRecord", source)
    if weighted_by_key not in metrics:
        raise CheckpointError(
            f"{source}: the reply's MetricRecord has no {weighted_by_key!r}; expected the "
            f"number of training examples (it has {sorted(metrics)})"
        )
    metadata = {meta.NUM_SAMPLES: str(metrics[weighted_by_key])}
    if CLASS_COUNTS in metrics:
        metadata[meta.CLASS_COUNTS] = json.dumps(metrics[CLASS_COUNTS])
    for config in content.config_records.values():
        metadata.update(reply_metadata(config))
    checkpoint = Checkpoint.from_state_dict(arrays_to_state_dict(arrays), metadata,
                                            source=source)
    # Parse everything now: a bad reply must be left out before the fusion starts.
    _ = checkpoint.num_samples, checkpoint.class_counts, checkpoint.arch, checkpoint.preprocess
    checkpoint.state_dict()
    return checkpoint


def model_config(fused_metadata: Mapping[str, str], widths: list[int]) -> ConfigRecord:
    """What clients need to rebuild the global model: its hidden widths (none for AMS) and
    the metadata ``fusekit.load_fused`` reads (architecture, spec, AMS description)."""
    config = ConfigRecord({key: fused_metadata[name] for name, key in MODEL_KEYS.items()
                           if name in fused_metadata})
    if widths:
        config[WIDTHS] = [int(w) for w in widths]
    return config


def model_metadata(config: ConfigRecord) -> dict[str, str]:
    """The fusekit metadata a :func:`model_config` record carries."""
    return {name: str(config[key]) for name, key in MODEL_KEYS.items() if key in config}


class StatisticsQuery(NamedTuple):
    """What a statistics query asks a node: run ``model`` in ``mode``, for ``kind``
    statistics (of ``layer``, for a refit round)."""

    model: Checkpoint
    mode: str
    kind: str = "channels"
    layer: str | None = None


def statistics_query(state_dict: Mapping[str, np.ndarray], metadata: Mapping[str, str],
                     widths: list[int], mode: str, kind: str = "channels",
                     layer: str | None = None) -> RecordDict:
    """The content of a statistics query: the model to run (``arrays``) and what rebuilds
    it, its BatchNorms' targets, the mode and what to compute (``config``)."""
    config = model_config(metadata, widths)
    if meta.NORM_TARGETS in metadata:
        config[NORM_TARGETS] = metadata[meta.NORM_TARGETS]
    config[STATS_MODE] = mode
    config[STATS_KIND] = kind
    if layer is not None:
        config[STATS_LAYER] = layer
    return RecordDict({"arrays": state_dict_to_arrays(state_dict), "config": config})


def query_checkpoint(content: RecordDict) -> StatisticsQuery:
    """The model a statistics query carries, the mode to run it in and what to compute.

    Raises:
        CheckpointError: the content is not a statistics query.
    """
    config = content.config_records.get("config", ConfigRecord())
    kind = str(config.get(STATS_KIND, "channels"))
    if ("arrays" not in content.array_records or STATS_MODE not in config
            or kind not in KINDS or (kind == "refit") != (STATS_LAYER in config)):
        raise CheckpointError(
            f"statistics query: expected an ArrayRecord 'arrays' and a ConfigRecord 'config' "
            f"with {STATS_MODE!r}, {STATS_KIND!r} one of {list(KINDS)} and, for refit, "
            f"{STATS_LAYER!r} (FusekitStrategy's calibration), found records "
            f"{sorted(content)}")
    metadata = model_metadata(config)
    if NORM_TARGETS in config:
        metadata[meta.NORM_TARGETS] = str(config[NORM_TARGETS])
    checkpoint = Checkpoint.from_state_dict(arrays_to_state_dict(content["arrays"]), metadata,
                                            source="model to calibrate")
    layer = str(config[STATS_LAYER]) if STATS_LAYER in config else None
    return StatisticsQuery(checkpoint, str(config[STATS_MODE]), kind, layer)


class _Reply(NamedTuple):
    """How one kind of statistics travels in a reply: its ArrayRecord's and ConfigRecord's
    names, the metadata key of its description, and the functions of its file format."""

    arrays: str
    record: str
    key: str
    tensors: Callable
    description: Callable
    parse: Callable


#: Per kind of query, its reply's records (those of the files ``fusekit stats`` writes).
REPLIES = {
    "channels": _Reply(STATS_ARRAYS, STATS_RECORD, meta.STATS, statistics_tensors,
                       statistics_description, parse_statistics),
    "cross": _Reply(CROSS_ARRAYS, CROSS_RECORD, meta.CROSS_STATS, cross_statistics_tensors,
                    cross_statistics_description, parse_cross_statistics),
    "refit": _Reply(REFIT_ARRAYS, REFIT_RECORD, meta.REFIT_STATS, refit_statistics_tensors,
                    refit_statistics_description, parse_refit_statistics),
}


def statistics_content(stats: Statistics | CrossStatistics | RefitStatistics,
                       kind: str = "channels") -> RecordDict:
    """A statistics reply (``kind`` as the query's): the aggregates and their description,
    nothing else."""
    form = REPLIES[kind]
    return RecordDict({form.arrays: state_dict_to_arrays(form.tensors(stats)),
                       form.record: ConfigRecord({form.key: form.description(stats)})})


def reply_statistics(content: RecordDict, source: str, kind: str = "channels"
                     ) -> Statistics | CrossStatistics | RefitStatistics:
    """A node's statistics reply (``kind`` as the query's), parsed and checked for form
    only (not yet against the models: see :func:`fusekit.core.stats.check_statistics`
    and :mod:`fusekit.core.cross_stats`).

    Raises:
        StatisticsError: the reply lacks its records or they are malformed (the message
            names ``source``).
    """
    form = REPLIES[kind]
    arrays = content.array_records.get(form.arrays)
    description = content.config_records.get(form.record, ConfigRecord()).get(form.key)
    if arrays is None or not isinstance(description, str):
        raise StatisticsError(
            f"{source}: expected an ArrayRecord {form.arrays!r} and a ConfigRecord "
            f"{form.record!r} with {form.key!r} (fusekit.flower.statistics_reply), found "
            f"records {sorted(content)}")
    try:
        return form.parse(description, arrays_to_state_dict(arrays), source)
    except (TypeError, ValueError) as exc:  # arrays that are not numbers
        raise StatisticsError(f"{source}: statistics that are not float arrays ({exc})"
                              ) from None


def reply_metadata(config: ConfigRecord) -> dict[str, str]:
    """The fusekit metadata a node's ConfigRecord says of its model (:data:`REPLY_KEYS`)."""
    return {name: str(config[key]) for name, key in REPLY_KEYS.items() if key in config}


def reply_config(metadata: Mapping[str, str]) -> ConfigRecord:
    """A node's model's fusekit metadata (architecture, input normalisation) as the
    ConfigRecord its reply carries."""
    return ConfigRecord({key: metadata[name] for name, key in REPLY_KEYS.items()
                         if name in metadata})


def keep_model(state: RecordDict, arrays: ArrayRecord, metadata: Mapping[str, str]) -> None:
    """Keep a node's trained model (its ArrayRecord, its ``fusekit.arch`` and
    ``fusekit.preprocess``) in its ``Context.state``, for the alignment and refit queries
    of the same run."""
    state[OWN_MODEL] = arrays
    state[OWN_ARCH] = reply_config(metadata)


def kept_model(state: RecordDict) -> Checkpoint | None:
    """The model :func:`keep_model` kept, or None."""
    if OWN_MODEL not in state.array_records:
        return None
    metadata = reply_metadata(state.config_records.get(OWN_ARCH, ConfigRecord()))
    return Checkpoint.from_state_dict(arrays_to_state_dict(state[OWN_MODEL]), metadata,
                                      source="this node's trained model")


def reply_targets(content: RecordDict, source: str) -> Statistics | None:
    """The node's statistics of its own model a train reply carries (REPAIR's targets),
    parsed, or None when it carries none.

    Raises:
        StatisticsError: they are malformed (the message names ``source``).
    """
    if STATS_ARRAYS not in content.array_records:
        return None
    return reply_statistics(content, source)


def _only(records: Mapping, kind: str, source: str):
    if len(records) != 1:
        raise CheckpointError(
            f"{source}: expected one {kind} in the reply, found {len(records)}"
        )
    return next(iter(records.values()))
