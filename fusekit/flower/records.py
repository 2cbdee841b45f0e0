"""How fusekit's models travel in Flower records, on both sides of a federation.

A ClientApp's train reply holds one ``ArrayRecord`` (the model's state_dict, tensor names
kept), one ``MetricRecord`` with ``num-examples`` (and, optionally, ``class-counts``: one
count per class) and, for fusekit models, a ``ConfigRecord`` with the architecture
(``fusekit-arch``, the ``fusekit.arch`` JSON). After a fusion the server sends, in the train
and evaluate ``ConfigRecord``, what ``fusekit.load_fused`` rebuilds the global model from:
``fusekit-arch``, ``fusekit-spec`` and ``fusekit-ams`` where the fused model has them, and
``fusekit-widths`` (the fused hidden widths, which PFNM/NAFI change).
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
SPEC = "fusekit-spec"
AMS = "fusekit-ams"
WIDTHS = "fusekit-widths"
ARCH_RECORD = "fusekit"  # the reply's ConfigRecord carrying ARCH
#: The fused model's metadata that rebuilds it, and the ConfigRecord keys it travels under.
MODEL_KEYS = {meta.ARCH: ARCH, meta.SPEC: SPEC, meta.AMS: AMS}


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


def _only(records: Mapping, kind: str, source: str):
    if len(records) != 1:
        raise CheckpointError(
            f"{source}: expected one {kind} in the reply, found {len(records)}"
        )
    return next(iter(records.values()))
