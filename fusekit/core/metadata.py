"""Every safetensors metadata key fusekit reads or writes, and the parsers of their values.

Client checkpoints carry ``fusekit.num_samples``, ``fusekit.class_counts``,
``fusekit.arch`` and ``fusekit.preprocess`` (what the model expects of its inputs); fused files add provenance (method, parameters, input hashes, version),
the fused permutation spec and, for AMS, the description of the packed models.

Every JSON value is parsed through :func:`load_json`, which bounds its size and nesting
first; spec files are read through :func:`read_json_file`, which also refuses FIFOs and
devices.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fusekit.core.errors import CheckpointError, FusekitError

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
#: Per client and permutation group, the fused neuron of each client neuron (calibration).
ASSIGNMENTS = "fusekit.assignments"
#: Per BatchNorm of a fused model whose BatchNorms were folded: the affine (|gamma|, beta)
#: of the client neurons matched into each fused neuron, restored by calibration.
NORM_TARGETS = "fusekit.norm_targets"
#: A statistics file's description: format, model content hash, samples, mode.
STATS = "fusekit.stats"
STATS_FORMAT = "fusekit.stats/1"
#: What calibration did to a calibrated model: clients, samples, mode, layers.
CALIBRATION = "fusekit.calibration"
#: A cross statistics file's description (alignment round): format, the reference's and
#: the own model's content hashes, samples, mode.
CROSS_STATS = "fusekit.cross_stats"
CROSS_STATS_FORMAT = "fusekit.cross_stats/1"
#: A refit statistics file's description (one refit round): format, the fused model's and
#: the own model's content hashes, the layer, samples.
REFIT_STATS = "fusekit.refit_stats"
REFIT_STATS_FORMAT = "fusekit.refit_stats/1"
#: The layers refit rounds have refit, and the ridge.
REFIT = "fusekit.refit"
#: What an alignment round did: the reference it matched to, clients, matched correlations.
ALIGNMENT = "fusekit.alignment"
#: What a model expects of its inputs: ``{"mean": [...], "std": [...]}``, the model sees
#: ``(x - mean) / std``; absent: the inputs as they are.
PREPROCESS = "fusekit.preprocess"


# Bounds on every JSON value fusekit parses (metadata values, spec files): far above what
# any real description needs (an AMS artefact of hundreds of models is well under 1 MiB),
# far below what would exhaust memory or Python's recursion limit.
MAX_JSON_CHARS = 16 * 1024 * 1024
MAX_JSON_DEPTH = 64
# fusekit.num_samples and each class count: at most 15 decimal digits, so every count and
# every sum of a few thousand counts is an exact float64.
MAX_COUNT_DIGITS = 15
MAX_CLASSES = 1_000_000


def json_depth(text: str) -> int:
    """Deepest nesting of ``[``/``{`` in ``text``, brackets inside JSON strings ignored."""
    # Drop escaped characters, then every other '"'-separated piece is inside a string.
    outside = "".join(re.sub(r"\\.", "", text, flags=re.DOTALL).split('"')[::2])
    brackets = re.sub(r"[^\[\]{}]", "", outside)
    if not brackets:
        return 0
    opens = np.isin(np.frombuffer(brackets.encode(), np.uint8), (ord("["), ord("{")))
    return int(np.cumsum(np.where(opens, 1, -1)).max())


def load_json(text: str, what: str, error: type[FusekitError] = CheckpointError,
              **hooks: Any) -> Any:
    """``json.loads`` with the size and nesting of ``text`` bounded first.

    Args:
        text: the JSON text.
        what: how messages name it (``"a.safetensors: metadata fusekit.arch"``).
        error: the FusekitError subclass to raise.
        **hooks: passed to ``json.loads`` (``parse_float``, ``parse_constant``).

    Raises:
        error: text longer than MAX_JSON_CHARS, nested deeper than MAX_JSON_DEPTH, or not JSON.
    """
    if len(text) > MAX_JSON_CHARS:
        raise error(f"{what}: expected at most {MAX_JSON_CHARS} characters of JSON, found "
                    f"{len(text)}")
    depth = json_depth(text)
    if depth > MAX_JSON_DEPTH:
        raise error(f"{what}: expected JSON nested at most {MAX_JSON_DEPTH} levels deep, "
                    f"found {depth}")
    try:
        return json.loads(text, **hooks)
    except (json.JSONDecodeError, ValueError) as exc:  # ValueError: an int of > 4300 digits
        raise error(f"{what}: not JSON: found {text[:80]!r} ({exc})") from None


def read_json_file(path: Path, what: str, error: type[FusekitError]) -> Any:
    """A JSON file, read only if it is a regular file and no larger than MAX_JSON_CHARS.

    Raises:
        error: the path is missing or not a regular file (a FIFO or device would block or
            never end), too large, not UTF-8, or not bounded JSON.
    """
    info = check_regular_file(path, what, error)
    if info.st_size > MAX_JSON_CHARS:
        raise error(f"{path}: expected a {what} of at most {MAX_JSON_CHARS} bytes, found "
                    f"{info.st_size}")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(MAX_JSON_CHARS + 1)
    except UnicodeDecodeError as exc:
        raise error(f"{path}: expected a UTF-8 {what} ({exc})") from None
    except OSError as exc:
        raise error(f"{path}: cannot read the {what} ({exc.strerror})") from None
    return load_json(text, f"{path}: {what}", error)


def check_regular_file(path: Path, what: str, error: type[FusekitError]) -> os.stat_result:
    """Refuse a path that is missing or not a regular file (reading a FIFO or a device
    would block or never end), saying what it is instead.

    Raises:
        error: naming the path, what was expected and what was found.
    """
    try:
        info = path.stat()
    except FileNotFoundError:
        raise error(f"{path}: {what} does not exist") from None
    except OSError as exc:
        found = ("a symlink loop (too many levels of symbolic links)"
                 if exc.errno == errno.ELOOP else f"unreadable ({exc.strerror})")
        raise error(f"{path}: cannot read the {what}: found {found}") from None
    if not stat.S_ISREG(info.st_mode):
        raise error(f"{path}: cannot read the {what}: expected a regular file, found "
                    f"{describe_file_type(info.st_mode)}")
    return info


def describe_file_type(mode: int) -> str:
    """What a non-regular file is, in words, for messages."""
    kinds = [(stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISSOCK, "a socket")]
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def parse_num_samples(raw: str, label: str) -> int:
    """``fusekit.num_samples``: a positive integer written as 1 to 15 ASCII decimal digits
    (no sign, spaces, separators or exponent)."""
    if not re.fullmatch(rf"[0-9]{{1,{MAX_COUNT_DIGITS}}}", raw) or int(raw) == 0:
        raise CheckpointError(
            f"{label}: metadata {NUM_SAMPLES} must be a positive integer of 1 to "
            f"{MAX_COUNT_DIGITS} ASCII digits, found {raw[:40]!r}"
        )
    return int(raw)


def parse_class_counts(raw: str, label: str) -> np.ndarray:
    """``fusekit.class_counts``: a JSON list of non-negative integer counts, one per class
    (each below 10**15), at least one of them positive. Returned as float64 (exact)."""
    what = f"{label}: metadata {CLASS_COUNTS}"
    counts = load_json(raw, what, parse_float=_not_an_integer, parse_constant=_not_an_integer)
    if (not isinstance(counts, list) or not 0 < len(counts) <= MAX_CLASSES
            or not all(_is_count(n) for n in counts) or not any(counts)):
        raise CheckpointError(
            f"{what} must be a JSON list of 1 to {MAX_CLASSES} non-negative integer counts "
            f"below 10**{MAX_COUNT_DIGITS}, at least one positive, found {raw[:80]!r}"
        )
    return np.asarray(counts, dtype=np.float64)


def _not_an_integer(text: str) -> str:
    # json.loads hook for floats and NaN/Infinity: keep them as strings, which are refused.
    return text


def _is_count(value: Any) -> bool:
    return type(value) is int and 0 <= value < 10**MAX_COUNT_DIGITS


def parse_json_object(raw: str, key: str, label: str) -> dict[str, Any]:
    """A metadata value that must hold a JSON object (``fusekit.arch``, ``fusekit.spec``)."""
    value = load_json(raw, f"{label}: metadata {key}")
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
    description = load_json(raw, f"{label}: metadata {AMS}")
    if (not isinstance(description, dict) or description.get("format") != AMS_FORMAT
            or not isinstance(description.get("models"), list) or not description["models"]):
        raise CheckpointError(
            f"{label}: metadata {AMS} must be an object with \"format\": "
            f"\"{AMS_FORMAT}\" and a non-empty \"models\" list, found {raw[:120]!r}"
        )
    return description


MAX_NORMALIZATION_VALUES = 1_000_000


@dataclass(frozen=True)
class Normalization:
    """What a model expects of its inputs: it sees ``(x - mean) / std``.

    ``mean`` and ``std`` hold one value (every input element), one per channel (axis 1
    of an input (N, C, ...)) or one per feature (every element of a sample, flattened).
    """

    mean: tuple[float, ...]
    std: tuple[float, ...]

    def __post_init__(self) -> None:
        if not 0 < len(self.mean) == len(self.std) <= MAX_NORMALIZATION_VALUES:
            raise ValueError(f"expected mean and std of the same length, 1 to "
                             f"{MAX_NORMALIZATION_VALUES}; found {len(self.mean)} and "
                             f"{len(self.std)}")
        if not (all(math.isfinite(m) for m in self.mean)
                and all(math.isfinite(s) and s > 0 for s in self.std)):
            raise ValueError("expected finite means and finite positive standard deviations")

    def to_json(self) -> str:
        return json.dumps({"mean": list(self.mean), "std": list(self.std)})

    def describe(self) -> str:
        """For messages: ``mean [0.1307], std [0.3081]`` (long lists shortened)."""
        def short(values: tuple[float, ...]) -> str:
            shown = ", ".join(f"{v:.6g}" for v in values[:4])
            return f"[{shown}{', ...' if len(values) > 4 else ''}]"
        return f"mean {short(self.mean)}, std {short(self.std)} ({len(self.mean)} value(s))"


def parse_preprocess(raw: str, label: str) -> Normalization:
    """``fusekit.preprocess``: a JSON object ``{"mean": [...], "std": [...]}`` of finite
    numbers, equal lengths, every std > 0.

    Raises:
        CheckpointError: naming the file, what was expected and what was found.
    """
    what = f"{label}: metadata {PREPROCESS}"
    value = load_json(raw, what)
    try:
        if not isinstance(value, dict) or set(value) != {"mean", "std"}:
            raise ValueError("expected an object with exactly the keys \"mean\" and \"std\"")
        return normalization(value["mean"], value["std"])
    except ValueError as exc:
        raise CheckpointError(f"{what}: {exc}; found {raw[:120]!r}") from None


def normalization(mean: Sequence[Any], std: Sequence[Any]) -> Normalization:
    """A :class:`Normalization` from two lists of numbers.

    Raises:
        ValueError: not lists of real numbers, lengths differ, non-finite values or a
            std <= 0.
    """
    if not (isinstance(mean, list | tuple) and isinstance(std, list | tuple)):
        raise ValueError("expected \"mean\" and \"std\" to be lists of numbers")
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in (*mean, *std)):
        raise ValueError("expected \"mean\" and \"std\" to hold numbers only")
    return Normalization(tuple(float(v) for v in mean), tuple(float(v) for v in std))


def read_preprocess(metadata: Mapping[str, str], label: str) -> Normalization | None:
    """The model's recorded input normalisation, or None (inputs as they are)."""
    raw = metadata.get(PREPROCESS)
    return None if raw is None else parse_preprocess(raw, label)
