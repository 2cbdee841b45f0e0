"""How fusekit's models travel in Flower records, on both sides of a federation.

A ClientApp's train reply holds one ``ArrayRecord`` (the model's state_dict, tensor names
kept), one ``MetricRecord`` with ``num-examples`` (and, optionally, ``class-counts``: one
count per class) and, for fusekit models, a ``ConfigRecord`` with the architecture
(``fusekit-arch``, the ``fusekit.arch`` JSON). After a fusion the server sends
``fusekit-arch`` and ``fusekit-widths`` (the fused hidden widths) in the train and evaluate
``ConfigRecord``, so clients can rebuild the global model whose widths PFNM/NAFI changed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from fusekit.core import metadata as meta
from fusekit.core.checkpoint import Checkpoint
from fusekit.core.errors import CheckpointError

NUM_EXAMPLES = "num-examples"  # Flower's FedAvg weights replies by this key
CLASS_COUNTS = "class-counts"
ARCH = "fusekit-arch"
WIDTHS = "fusekit-widths"
ARCH_RECORD = "fusekit"  # the reply's ConfigRecord carrying ARCH


def arrays_to_state_dict(arrays: ArrayRecord) -> dict[str, np.ndarray]:
    """An ArrayRecord as a name -> numpy array mapping, in the record's order."""
    return {name: array.numpy() for name, array in arrays.items()}


def state_dict_to_arrays(state_dict: Mapping[str, np.ndarray]) -> ArrayRecord:
    """A name -> numpy array mapping as an ArrayRecord (names and order kept)."""
    return ArrayRecord({name: Array(np.ascontiguousarray(value))
                        for name, value in state_dict.items()})


def reply_checkpoint(content: RecordDict, source: str,
                     weighted_by_key: str = NUM_EXAMPLES) -> Checkpoint:
    """A client's train reply as a fusekit checkpoint, checked as ``fusekit fuse`` checks a
    file: tensor dtypes, finite values, sample and class counts, architecture.

    Raises:
        CheckpointError: the reply lacks its ArrayRecord, MetricRecord or sample count, or
            holds values fusekit cannot fuse (the message names ``source``).
    """
    arrays = _only(content.array_records, "ArrayRecord", source)
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
        if ARCH in config:
            metadata[meta.ARCH] = str(config[ARCH])
    checkpoint = Checkpoint.from_state_dict(arrays_to_state_dict(arrays), metadata,
                                            source=source)
    # Parse everything now: a bad reply must be left out before the fusion starts.
    _ = checkpoint.num_samples, checkpoint.class_counts, checkpoint.arch
    checkpoint.state_dict()
    return checkpoint


def architecture_config(fused_metadata: Mapping[str, str], widths: list[int]) -> ConfigRecord:
    """What clients need to rebuild the global model: its hidden widths and, when known,
    its ``fusekit.arch`` JSON."""
    config = ConfigRecord({WIDTHS: [int(w) for w in widths]})
    if meta.ARCH in fused_metadata:
        config[ARCH] = fused_metadata[meta.ARCH]
    return config


def _only(records: Mapping, kind: str, source: str):
    if len(records) != 1:
        raise CheckpointError(
            f"{source}: expected one {kind} in the reply, found {len(records)}"
        )
    return next(iter(records.values()))
