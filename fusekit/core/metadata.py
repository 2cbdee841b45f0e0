"""Every safetensors metadata key fusekit reads or writes, and the parsers of their values.

Client checkpoints carry ``fusekit.num_samples``, ``fusekit.class_counts`` and
``fusekit.arch``; fused files add provenance (method, parameters, input hashes, version),
the fused permutation spec and, for AMS, the description of the packed models.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from fusekit.core.errors import CheckpointError

NUM_SAMPLES = "fusekit.num_samples"
CLASS_COUNTS = "fusekit.class_counts"
ARCH = "fusekit.arch"
METHOD = "fusekit.method"
PARAMS = "fusekit.params"
INPUTS = "fusekit.inputs"
VERSION = "fusekit.version"
SPEC = "fusekit.spec"
SIMULATION = "fusekit.simulation"
AMS = "fusekit.ams"
AMS_FORMAT = "fusekit.ams/1"


def parse_num_samples(raw: str, label: str) -> int:
    """``fusekit.num_samples``: a positive integer."""
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value <= 0:
        raise CheckpointError(
            f"{label}: metadata {NUM_SAMPLES} must be a positive integer, found {raw!r}"
        )
    return value


def parse_class_counts(raw: str, label: str) -> np.ndarray:
    """``fusekit.class_counts``: a JSON list of non-negative counts, one per class."""
    try:
        counts = np.asarray(json.loads(raw), dtype=np.float64)
    except (json.JSONDecodeError, TypeError, ValueError):
        counts = np.array([-1.0])
    if counts.ndim != 1 or counts.size == 0 or (counts < 0).any():
        raise CheckpointError(
            f"{label}: metadata {CLASS_COUNTS} must be a JSON list of non-negative "
            f"counts, found {raw!r}"
        )
    return counts


def parse_json_object(raw: str, key: str, label: str) -> dict[str, Any]:
    """A metadata value that must hold a JSON object (``fusekit.arch``, ``fusekit.spec``)."""
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise CheckpointError(
            f"{label}: metadata {key} must be JSON, found {raw[:80]!r} ({exc})"
        ) from None
    if not isinstance(value, dict):
        raise CheckpointError(
            f"{label}: metadata {key} must be a JSON object, found {type(value).__name__}"
        )
    return value


def read_ams(metadata: Mapping[str, str], label: str) -> dict[str, Any]:
    """Parse and check the ``fusekit.ams`` description of an AMS artefact (format, models).

    Raises:
        CheckpointError: the key is missing, not JSON, of another format, or lacks models.
    """
    raw = metadata.get(AMS)
    if raw is None:
        raise CheckpointError(f"{label}: no {AMS} metadata; not an AMS artefact")
    try:
        description = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{label}: metadata {AMS} is not JSON ({exc})") from None
    if (not isinstance(description, dict) or description.get("format") != AMS_FORMAT
            or not isinstance(description.get("models"), list) or not description["models"]):
        raise CheckpointError(
            f"{label}: metadata {AMS} must be an object with \"format\": "
            f"\"{AMS_FORMAT}\" and a non-empty \"models\" list, found {raw[:120]!r}"
        )
    return description
