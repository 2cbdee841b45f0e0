"""Checkpoints: safetensors files with fusekit's metadata conventions.

Loading is lazy (``safe_open``): headers are validated at once, tensors are read on demand.
Writing is atomic: a temporary file in the target directory, fsync, then a rename, so a
failed or interrupted fusion never leaves a partial output and inputs are never touched.

Metadata (string -> string; parsers and bounds in fusekit.core.metadata):
    fusekit.num_samples   number of training samples of the client: 1 to 15 ASCII digits
    fusekit.class_counts  JSON list of per-class sample counts (non-negative integers)
    fusekit.arch          JSON architecture description (see fusekit.core.arch)
    fusekit.preprocess    JSON {"mean": [...], "std": [...]}: the model sees (x - mean) / std
Fused outputs add fusekit.method, fusekit.params (JSON), fusekit.inputs (JSON list of
content hashes) and fusekit.version.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import math
import mmap
import os
import shutil
import signal
import struct
import tempfile
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import safetensors
import safetensors.numpy

from fusekit.core import metadata as meta
from fusekit.core.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    IncompatibleModelsError,
    NonFiniteOutputError,
    OutputError,
    ParameterError,
)

# A safetensors header is a few KB per hundred tensors; anything near this is an attack or
# a corrupt length field, and reading it would allocate that much memory.
MAX_HEADER_BYTES = 100 * 1024 * 1024

# First bytes of the formats most often handed in for safetensors: torch.save's zip archive
# and pickles of protocol 2+ (torch's legacy format). A safetensors file may start with
# these bytes too (a header of 128 + 256 k bytes); its JSON header, at byte 8, opens with "{".
PICKLE_MAGIC, ZIP_MAGIC = b"\x80", b"PK\x03\x04"

# Integer tensors that are counters, not weights (BatchNorm's step counter).
INTEGER_BUFFER_SUFFIXES = ("num_batches_tracked",)
# Variances, which must not be negative (BatchNorm's running statistics).
VARIANCE_SUFFIXES = ("running_var",)

# How each safetensors dtype is stored on disk (little-endian). numpy has no bfloat16 or
# float8: those are read as their raw bits and widened to float32 exactly (see widen).
STORAGE_DTYPES = {
    "F16": "<f2", "F32": "<f4", "F64": "<f8", "BF16": "<u2", "F8_E4M3": "u1", "F8_E5M2": "u1",
    "I8": "i1", "I16": "<i2", "I32": "<i4", "I64": "<i8",
    "U8": "u1", "U16": "<u2", "U32": "<u4", "U64": "<u8", "BOOL": "?",
}
FLOAT_DTYPES = ("F16", "F32", "F64", "BF16", "F8_E4M3", "F8_E5M2")
# Values at each end of a tensor that Checkpoint.sample_hash covers: enough to tell
# clients apart in practice, few enough to read in microseconds.
SAMPLE_VALUES = 32
# Bytes a content hash reads at a time (one reused buffer, whatever the tensors' sizes).
HASH_PIECE_BYTES = 8 << 20
#: Threads hashing the inputs during a fusion: sha256 costs more per byte than a streamed
#: average (on 2 cores, one thread made avg wait for it), and two keep pace with it.
HASH_THREADS = 2
#: Pieces of at least this many bytes that :meth:`Checkpoint.pieces` may map are viewed in
#: the file's mapped pages instead of copied into a buffer; below it the mapping's system
#: calls cost more than the copy.
MAP_MIN_BYTES = 256 << 10
# Stored types that tensor() widens to float32.
WIDENED_DTYPES = ("BF16", "F8_E4M3", "F8_E5M2")
# A Hugging Face model folder: its config, its weights, or the index of its shards.
HF_CONFIG = "config.json"
HF_WEIGHTS = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"
#: An image model's processor settings beside its config (image_mean, image_std, ...).
HF_PROCESSOR = "preprocessor_config.json"
# Integer buffers older transformers saved with the weights (BERT's position_ids): indices
# the model rebuilds, read past in a model folder rather than refused as non-weights.
DERIVED_BUFFERS = ("position_ids",)
# Elements checked at a time for NaN/Inf, so a check never allocates a tensor-sized mask.
_CHUNK = 1 << 22
# Memory Checkpoint.check_values works in by default (a service checks each upload so), and
# what one value costs it at most: 8 raw bytes (F64), 4 of a float32 widening and its
# intermediates (F8_E5M2: 2 + 2 + 4), 2 of NaN/Inf masks; 16 leaves room.
VALUE_CHECK_BYTES = 64 << 20
VALUE_CHECK_BYTES_PER_VALUE = 16
# Bytes written at a time, so a signal during a large write is handled promptly.
_WRITE_CHUNK = 64 << 20


def is_integer_buffer(name: str) -> bool:
    return name.endswith(INTEGER_BUFFER_SUFFIXES)


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]


@dataclass
class Checkpoint:
    """One client's model: a validated safetensors file read lazily.

    Use :func:`load_checkpoint` to open one; ``Checkpoint.from_state_dict`` wraps arrays
    already in memory (tests, simulations) with the same interface.
    """

    path: Path | None
    metadata: dict[str, str]
    tensors: dict[str, TensorInfo]
    _arrays: dict[str, np.ndarray] = field(default_factory=dict, repr=False)
    source: str | None = None
    #: Absolute byte range of each tensor in the file.
    _offsets: dict[str, tuple[int, int]] = field(default_factory=dict, repr=False)
    #: A Hugging Face model folder's config.json (``path`` is then the folder).
    config: dict[str, Any] | None = None
    #: The file holding each tensor, where it is not ``path`` (a folder's shards).
    _files: dict[str, Path] = field(default_factory=dict, repr=False)

    @classmethod
    def from_state_dict(
        cls,
        state_dict: Mapping[str, Any],
        metadata: Mapping[str, str] | None = None,
        *,
        source: str | None = None,
        config: Mapping[str, Any] | None = None,
    ) -> Checkpoint:
        """Wrap arrays in memory; ``source`` names them in messages (e.g. ``node 7``);
        ``config``: a Hugging Face model's config.json, when they are one's tensors."""
        arrays = {k: _as_numpy(v) for k, v in state_dict.items()}
        ckpt = cls(
            path=None,
            metadata=dict(metadata or {}),
            tensors={k: TensorInfo(_dtype_name(a.dtype), a.shape) for k, a in arrays.items()},
            _arrays=arrays,
            source=source,
            config=None if config is None else dict(config),
        )
        ckpt._validate_header()
        return ckpt

    @property
    def label(self) -> str:
        """How messages name this checkpoint: its path, its source, or '<in-memory checkpoint>'."""
        if self.path is not None:
            return str(self.path)
        return self.source or "<in-memory checkpoint>"

    def __len__(self) -> int:
        return len(self.tensors)

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def tensor(self, name: str) -> np.ndarray:
        """Tensor ``name`` as a read-only numpy array, checked to be finite."""
        if name not in self.tensors:
            raise CheckpointError(
                f"{self.label}: tensor {name!r} not found; it has {sorted(self.tensors)}"
            )
        array = self._arrays.get(name)
        if array is None:  # read from the file once, so checked once
            array = self._arrays[name] = self._checked(name, self._read(name))
        elif self.path is None:  # the caller's array, which may have changed since
            self._checked(name, array)
        view = array.view()  # read-only for the caller, without freezing an array it passed in
        view.flags.writeable = False
        return view

    def _checked(self, name: str, array: np.ndarray) -> np.ndarray:
        """``array`` if its values are usable weights, else a CheckpointError naming it."""
        self._check_pieces(name, [array])
        return array

    def _check_pieces(self, name: str, pieces: Iterable[np.ndarray]) -> None:
        """Check tensor ``name``'s values, given as consecutive pieces: finite, and not
        negative for a variance; a CheckpointError names it and counts the culprits."""
        bad = negative = 0
        smallest = math.inf
        variance = name.endswith(VARIANCE_SUFFIXES)
        for piece in pieces:
            bad += count_non_finite(piece)
            below = int(np.count_nonzero(piece < 0)) if variance else 0
            if below:
                negative, smallest = negative + below, min(smallest, float(piece.min()))
        if bad:
            raise CheckpointError(
                f"{self.label}: tensor {name!r} has {bad} non-finite value(s) (NaN or Inf); "
                "expected finite weights"
            )
        if negative:
            raise CheckpointError(
                f"{self.label}: tensor {name!r} has {negative} negative value(s) (smallest "
                f"{smallest:g}); expected variances >= 0"
            )

    def check_values(self, budget: int = VALUE_CHECK_BYTES) -> None:
        """Check every tensor's values as :meth:`tensor` does, keeping none: a tensor in the
        file is read in pieces, so the check needs at most about ``budget`` bytes of memory
        (its raw values, their float32 widening and masks) whatever the tensor's size."""
        step = max(1, budget // VALUE_CHECK_BYTES_PER_VALUE)
        with contextlib.ExitStack() as stack:
            handles: dict[Path | None, io.FileIO] = {}
            for name in self.tensors:
                if self.path is None or name in self._arrays:  # in memory: checked whole
                    self.tensor(name)
                    continue
                handle = self._handle(name, handles, stack)
                count = math.prod(self.tensors[name].shape)
                self._check_pieces(name, (
                    self._read_span(handle, name, first, min(count, first + step))
                    for first in range(0, count, step)))

    def value_dtype(self, name: str) -> np.dtype:
        """The dtype :meth:`tensor` returns for ``name`` (BF16/F8 widened to float32)."""
        dtype = self.tensors[name].dtype
        return np.dtype(np.float32 if dtype in WIDENED_DTYPES else STORAGE_DTYPES[dtype])

    def pieces(self, name: str, step: int, buffer: np.ndarray, *, mapped: bool = False
               ) -> Iterator[np.ndarray]:
        """Tensor ``name``'s flat values, ``step`` at a time, **unchecked**, for passes that
        read each tensor once and check what they compute from it (a non-finite value
        makes a weighted sum non-finite; :meth:`tensor` then names the culprit).

        Values in the file are read straight into ``buffer`` (raw bytes, at least ``step``
        values of the storage dtype), reused by every piece: a piece is valid until the
        next one is asked for, and no memory is allocated or faulted in per tensor. With
        ``mapped``, a piece of at least ``MAP_MIN_BYTES`` is instead a read-only view of
        the file's pages mapped for it alone (no copy; unmapped when its last view goes),
        and ``buffer`` needs only ``min(step values, MAP_MIN_BYTES)``. A held or in-memory
        tensor is sliced as it is.
        """
        count = math.prod(self.tensors[name].shape)
        held = self._arrays.get(name)
        if held is not None:
            flat = held.reshape(-1)
            for first in range(0, count, step):
                yield flat[first:first + step]
            return
        start, storage, _ = self._location(name)
        raw = buffer.view(np.uint8)
        with self._open(name) as handle:
            for first in range(0, count, step):
                size, offset = min(step, count - first), start + first * storage.itemsize
                if mapped and size * storage.itemsize >= MAP_MIN_BYTES:
                    # held by no local here, so the pages are unmapped once the caller
                    # drops the piece
                    yield widen(self._mapped(handle, name, offset, size, storage),
                                self.tensors[name].dtype)
                    continue
                piece = raw[:size * storage.itemsize].view(storage)
                self._read_into(handle, name, offset, piece)
                yield widen(piece, self.tensors[name].dtype)

    def _mapped(self, handle: io.FileIO, name: str, offset: int, count: int,
                storage: np.dtype) -> np.ndarray:
        """``count`` values of ``storage`` at ``offset`` of the open file ``handle``, viewed
        in its pages mapped read-only for them (the mapping starts at the page boundary
        below ``offset``). A file shorter than that is refused before it is mapped: a
        mapped page past its end would stop the process (SIGBUS) instead."""
        end = offset + count * storage.itemsize
        base = offset - offset % mmap.ALLOCATIONGRANULARITY
        try:
            if os.fstat(handle.fileno()).st_size < end:
                raise CheckpointError(f"{self.label}: tensor {name!r} is truncated")
            window = mmap.mmap(handle.fileno(), end - base, prot=mmap.PROT_READ, offset=base)
        except OSError as exc:
            raise CheckpointError(
                f"{self.label}: cannot read tensor {name!r} ({exc.strerror or exc})"
            ) from None
        return np.frombuffer(window, dtype=storage, count=count, offset=offset - base)

    def release(self, *names: str) -> None:
        """Forget tensors read from the file (all when no name is given) so that their
        memory can be freed; they are read again on demand. In-memory checkpoints keep
        their arrays."""
        if self.path is None:
            return
        for name in names or list(self._arrays):
            self._arrays.pop(name, None)

    def state_dict(self) -> dict[str, np.ndarray]:
        return {name: self.tensor(name) for name in self.tensors}

    @cached_property
    def num_samples(self) -> int | None:
        raw = self.metadata.get(meta.NUM_SAMPLES)
        return None if raw is None else meta.parse_num_samples(raw, self.label)

    @cached_property
    def class_counts(self) -> np.ndarray | None:
        raw = self.metadata.get(meta.CLASS_COUNTS)
        return None if raw is None else meta.parse_class_counts(raw, self.label)

    @cached_property
    def arch(self) -> dict[str, Any] | None:
        raw = self.metadata.get(meta.ARCH)
        return None if raw is None else meta.parse_json_object(raw, meta.ARCH, self.label)

    @cached_property
    def preprocess(self) -> meta.Normalization | None:
        """What the model expects of its inputs (``fusekit.preprocess``); None: raw inputs."""
        return meta.read_preprocess(self.metadata, self.label)

    @cached_property
    def content_hash(self) -> str:
        """sha256 over sorted tensor names, dtypes, shapes and bytes (not the file's bytes:
        safetensors orders metadata differently in each process). Streams the file: it
        keeps no tensor it did not already hold, and never changes which ones it holds, so
        it may run on another thread while a fusion reads and releases tensors."""
        digest = hashlib.sha256()
        step = HASH_PIECE_BYTES // 8
        buffer = np.empty(HASH_PIECE_BYTES, dtype=np.uint8)
        for name in sorted(self.tensors):
            if self.path is None:  # the caller's arrays
                _hash_values(digest, name, self.tensor(name))
                continue
            # a held tensor as held; any other read and checked piece by piece, not kept
            digest.update(self.hash_header(name))
            pieces = self.pieces(name, step, buffer)
            if name not in self._arrays:
                pieces = self._checked_pieces(name, pieces)
            for piece in pieces:
                digest.update(np.ascontiguousarray(piece).view(np.uint8))
        return digest.hexdigest()

    def hash_header(self, name: str) -> bytes:
        """What :attr:`content_hash` of a checkpoint read from files feeds before tensor
        ``name``'s values (then each of :meth:`pieces`' bytes, tensors in sorted order)."""
        shape = self.tensors[name].shape or (1,)  # as _hash_values sees a 0-d tensor
        return f"{name}|{self.value_dtype(name).str}|{shape}|".encode()

    def adopt_content_hash(self, digest: Any) -> None:
        """Take ``digest`` (a sha256 fed as :meth:`hash_header` says, with every tensor's
        values, checked by the pass that read them) as :attr:`content_hash`, so that the
        files are not read a second time to hash them."""
        self.__dict__["content_hash"] = digest.hexdigest()  # what cached_property stores

    def _checked_pieces(self, name: str, pieces: Iterable[np.ndarray]) -> Iterator[np.ndarray]:
        """``pieces`` passed on, each checked as :meth:`_check_pieces` checks a tensor."""
        for piece in pieces:
            self._check_pieces(name, [piece])
            yield piece

    @cached_property
    def sample_hash(self) -> str:
        """sha256 as :attr:`content_hash`, but over only the first and last
        ``SAMPLE_VALUES`` values of each tensor (all of a smaller one): a content key that
        reads a few hundred bytes per tensor, for ordering clients. Different contents may
        share it; :attr:`content_hash` tells them apart. Values are not checked here: they
        are when the tensor is read."""
        digest = hashlib.sha256()
        with contextlib.ExitStack() as stack:
            handles: dict[Path | None, io.FileIO] = {}
            for name in sorted(self.tensors):
                count = math.prod(self.tensors[name].shape)
                spans = ([(0, count)] if count <= 2 * SAMPLE_VALUES
                         else [(0, SAMPLE_VALUES), (count - SAMPLE_VALUES, count)])
                array = self._arrays.get(name)
                if array is not None:
                    values = np.concatenate([array.flat[a:b] for a, b in spans])
                else:
                    handle = self._handle(name, handles, stack)
                    values = np.concatenate([self._read_span(handle, name, a, b)
                                             for a, b in spans])
                _hash_values(digest, name, values, self.tensors[name].shape)
        return digest.hexdigest()

    def _read(self, name: str) -> np.ndarray:
        """Read one tensor straight from its bytes in the file: one allocation of exactly
        the tensor's size (no intermediate copy), BF16/F8 widened to float32."""
        info = self.tensors[name]
        start, storage, count = self._location(name)
        try:
            raw = np.empty(count, dtype=storage)
        except MemoryError:
            raise CheckpointError(
                f"{self.label}: not enough memory to read tensor {name!r} "
                f"({count * storage.itemsize} bytes)"
            ) from None
        with self._open(name) as handle:
            self._read_into(handle, name, start, raw)
        return widen(raw, info.dtype).reshape(info.shape)

    def _read_span(self, handle: io.FileIO, name: str, first: int, stop: int) -> np.ndarray:
        """Flat values ``first`` to ``stop`` of one tensor, from the open file ``handle``,
        BF16/F8 widened to float32."""
        start, storage, _ = self._location(name)
        raw = np.empty(stop - first, dtype=storage)
        self._read_into(handle, name, start + first * storage.itemsize, raw)
        return widen(raw, self.tensors[name].dtype)

    def _read_into(self, handle: io.FileIO, name: str, offset: int, out: np.ndarray) -> None:
        """Fill ``out`` with the bytes at ``offset`` of the unbuffered file ``handle`` (a
        seek, then reads straight into the array: no intermediate buffer)."""
        view = memoryview(out.reshape(-1).view(np.uint8))
        done = 0
        try:
            handle.seek(offset)
            while done < len(view):  # one read returns at most about 2 GB on Linux
                n = handle.readinto(view[done:])
                if not n:
                    raise CheckpointError(f"{self.label}: tensor {name!r} is truncated")
                done += n
        except OSError as exc:
            raise CheckpointError(
                f"{self.label}: cannot read tensor {name!r} ({exc.strerror or exc})"
            ) from None

    def _handle(self, name: str, handles: dict[Path | None, io.FileIO],
                stack: contextlib.ExitStack) -> io.FileIO:
        """The open file holding tensor ``name`` during a pass over the tensors: one open
        file per file (a model folder's shards), closed with ``stack``."""
        file = self._files.get(name, self.path)
        if file not in handles:
            handles[file] = stack.enter_context(self._open(name))
        return handles[file]

    def _open(self, name: str) -> io.FileIO:
        """The file, unbuffered, to read tensor ``name`` (named if it cannot be opened)."""
        try:
            return open(self._files.get(name, self.path), "rb", buffering=0)
        except OSError as exc:
            raise CheckpointError(
                f"{self.label}: cannot read tensor {name!r} ({exc.strerror or exc})"
            ) from None

    def _location(self, name: str) -> tuple[int, np.dtype, int]:
        """Where tensor ``name``'s bytes start in the file, their storage dtype and count,
        checked against its byte range."""
        if self.path is None or name not in self._offsets:
            raise CheckpointError(f"{self.label}: tensor {name!r} was never loaded")
        info = self.tensors[name]
        start, end = self._offsets[name]
        storage = np.dtype(STORAGE_DTYPES[info.dtype])
        count = math.prod(info.shape)
        if end - start != count * storage.itemsize:
            raise CheckpointError(
                f"{self.label}: tensor {name!r} ({info.dtype}, shape {info.shape}) needs "
                f"{count * storage.itemsize} bytes; found {end - start}"
            )
        return start, storage, count

    def _validate_header(self) -> None:
        for name, info in self.tensors.items():
            if not (info.dtype in FLOAT_DTYPES
                    or (is_integer_buffer(name) and info.dtype in STORAGE_DTYPES)):
                raise CheckpointError(
                    f"{self.label}: tensor {name!r} has dtype {info.dtype}; expected a "
                    f"floating-point weight ({', '.join(FLOAT_DTYPES)}; only counters like "
                    "num_batches_tracked may be integers)"
                )
            if 0 in info.shape:
                raise CheckpointError(
                    f"{self.label}: tensor {name!r} has shape {info.shape}; expected no "
                    "zero-size dimension (a layer of width 0 or an input of dimension 0)"
                )
            if is_integer_buffer(name) and math.prod(info.shape) != 1:
                raise CheckpointError(
                    f"{self.label}: tensor {name!r} has shape {info.shape}; expected a "
                    "scalar counter (one element)"
                )


def _hash_values(digest: Any, name: str, values: np.ndarray,
                 shape: tuple[int, ...] | None = None) -> None:
    """Feed one tensor to a content digest: name, dtype, shape (``values``' own unless
    given) and the values' bytes."""
    values = np.ascontiguousarray(values)  # free when it already is
    digest.update(name.encode())
    digest.update(f"|{values.dtype.str}|{values.shape if shape is None else shape}|".encode())
    digest.update(values.reshape(-1).view(np.uint8))  # the bytes, without a copy


def widen(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Raw BF16/F8 bits as float32 (exact); any other dtype unchanged."""
    if dtype == "BF16":  # the upper half of a float32
        return (raw.astype(np.uint32) << 16).view(np.float32)
    if dtype == "F8_E5M2":  # the upper half of a float16
        return (raw.astype(np.uint16) << 8).view(np.float16).astype(np.float32)
    if dtype == "F8_E4M3":
        return _E4M3FN[raw]
    return raw


def _e4m3fn_values() -> np.ndarray:
    """The 256 float8 E4M3FN values: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no
    infinities, S.1111.111 is NaN (the OCP FP8 format torch and safetensors use)."""
    bits = np.arange(256)
    exponent, mantissa = (bits >> 3) & 0xF, (bits & 7) / 8.0
    magnitude = np.where(exponent == 0, mantissa * 2.0**-6,
                         (1 + mantissa) * 2.0 ** (exponent - 7.0))
    values = np.where(bits >> 7, -magnitude, magnitude)
    values[(bits & 0x7F) == 0x7F] = np.nan
    return values.astype(np.float32)


_E4M3FN = _e4m3fn_values()


def count_non_finite(array: np.ndarray) -> int:
    """How many entries of a floating-point array are NaN or Inf (0 for other dtypes),
    checked in chunks so no tensor-sized mask is allocated."""
    if array.dtype.kind != "f":
        return 0
    flat = array.reshape(-1)
    return sum(int(np.count_nonzero(~np.isfinite(flat[i:i + _CHUNK])))
               for i in range(0, flat.size, _CHUNK))


def _dtype_name(dtype: np.dtype) -> str:
    kind = {"f": "F", "i": "I", "u": "U", "b": "BOOL"}.get(dtype.kind, dtype.kind)
    return kind if kind == "BOOL" else f"{kind}{dtype.itemsize * 8}"


def _as_numpy(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor
        value = value.detach().cpu()
        if str(value.dtype) == "torch.bfloat16":
            value = value.float()
        value = value.numpy()
    return np.asarray(value)


def common_preprocess(checkpoints: Sequence[Checkpoint]) -> meta.Normalization | None:
    """The input normalisation every checkpoint records (None: all take raw inputs).

    Raises:
        IncompatibleModelsError: two checkpoints expect different inputs (naming both).
    """
    first = checkpoints[0].preprocess if checkpoints else None
    for other in checkpoints[1:]:
        if other.preprocess != first:
            def said(c: Checkpoint) -> str:
                return c.preprocess.describe() if c.preprocess else "none (raw inputs)"
            raise IncompatibleModelsError(
                f"{other.label}: metadata {meta.PREPROCESS} is {said(other)}; "
                f"{checkpoints[0].label} has {said(checkpoints[0])}; expected clients that "
                "take the same inputs")
    return first


def with_preprocess(checkpoint: Checkpoint, normalization: meta.Normalization | None
                    ) -> Checkpoint:
    """``checkpoint`` expecting ``normalization`` (what a user says of a model that records
    none): a copy whose metadata records it; the file is not touched. None, or the
    normalisation it records already, returns ``checkpoint``.

    Raises:
        ParameterError: the checkpoint records a different normalisation, or is a Hugging
            Face model folder.
    """
    if normalization is None or checkpoint.preprocess == normalization:
        return checkpoint
    if checkpoint.config is not None:
        raise ParameterError(f"{checkpoint.label}: a Hugging Face model folder takes its "
                             "inputs as its tokenizer or processor gives them; expected no "
                             "--normalize")
    if checkpoint.preprocess is not None:
        raise ParameterError(
            f"{checkpoint.label}: records {meta.PREPROCESS} {checkpoint.preprocess.describe()}; "
            f"--normalize gives {normalization.describe()}; expected no --normalize for a "
            "model that records its preprocessing")
    metadata = {**checkpoint.metadata, meta.PREPROCESS: normalization.to_json()}
    return dataclasses.replace(checkpoint, metadata=metadata)


def load_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Open and validate a safetensors checkpoint without reading its tensors; a folder
    with a ``config.json`` is a Hugging Face model folder (:func:`load_model_folder`).

    Raises:
        CheckpointNotFoundError: the path does not exist or is not a regular file (a
            directory, FIFO, device, socket or symlink loop).
        CheckpointError: the file is truncated, corrupt, has an absurd header, holds
            unsupported dtypes, zero-size or malformed tensors, or malformed fusekit metadata.
    """
    path = Path(path)
    if path.is_dir():
        if (path / HF_CONFIG).exists():
            return load_model_folder(path)
        raise CheckpointNotFoundError(
            f"{path}: a folder without {HF_CONFIG}; expected a .safetensors file or a "
            f"Hugging Face model folder ({HF_CONFIG} beside model.safetensors)")
    return _validate(_read_header(path))


def _read_header(path: Path) -> Checkpoint:
    """A safetensors file's tensors (dtypes, shapes, byte ranges) and metadata, as read:
    the file checked, its tensors and metadata not yet (:func:`_validate`)."""
    meta.check_regular_file(path, "checkpoint file", CheckpointNotFoundError)
    header_len = _check_header_length(path)
    with safetensors_errors(path):
        with safetensors.safe_open(path, framework="numpy") as f:
            metadata = dict(f.metadata() or {})
            tensors = {}
            for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                sl = f.get_slice(name)
                tensors[name] = TensorInfo(sl.get_dtype(), tuple(sl.get_shape()))
        offsets = _data_offsets(path, header_len)
    return Checkpoint(path=path, metadata=metadata, tensors=tensors, _offsets=offsets)


def image_processor(checkpoint: Checkpoint) -> dict[str, Any] | None:
    """A Hugging Face model folder's ``preprocessor_config.json`` (how its processor
    rescales and normalises pixels), or None: not a folder, or no such file.

    Raises:
        CheckpointError: the file is not a bounded JSON object.
    """
    if checkpoint.config is None or checkpoint.path is None or not checkpoint.path.is_dir():
        return None
    path = checkpoint.path / HF_PROCESSOR
    if not path.exists():
        return None
    settings = meta.read_json_file(path, "image processor config", CheckpointError)
    if not isinstance(settings, dict):
        raise CheckpointError(f"{path}: expected a JSON object, found "
                              f"{type(settings).__name__}")
    return settings


def load_model_folder(path: Path) -> Checkpoint:
    """A Hugging Face model folder as one checkpoint: ``config.json`` beside
    ``model.safetensors``, or beside shards listed by ``model.safetensors.index.json``
    (integer ``position_ids`` buffers left out: transformers rebuilds them).

    Raises:
        CheckpointError: config.json is not a JSON object, neither weights file is there,
            the index is malformed or names a tensor its shard lacks, or two shards hold
            the same tensor; and whatever :func:`load_checkpoint` raises for a file.
    """
    config = meta.read_json_file(path / HF_CONFIG, "model config", CheckpointError)
    if not isinstance(config, dict):
        raise CheckpointError(f"{path / HF_CONFIG}: expected a JSON object, found "
                              f"{type(config).__name__}")
    if (path / HF_WEIGHTS).exists():
        shards = [_read_header(path / HF_WEIGHTS)]
    elif (path / HF_INDEX).exists():
        shards = [_read_header(path / name) for name in _shard_names(path / HF_INDEX)]
    else:
        raise CheckpointError(f"{path}: a model folder (it has {HF_CONFIG}) without weights: "
                              f"expected {HF_WEIGHTS} or {HF_INDEX} with its shards")
    folder = Checkpoint(path=path, metadata=dict(shards[0].metadata), tensors={},
                        config=config)
    for shard in shards:
        for name, info in shard.tensors.items():
            if name.endswith(DERIVED_BUFFERS):  # 0, 1, 2, ...: rebuilt by transformers
                continue
            if name in folder.tensors:
                raise CheckpointError(f"{shard.path}: tensor {name!r} is also in "
                                      f"{folder._files[name]}; expected it in one shard")
            folder.tensors[name] = info
            folder._offsets[name] = shard._offsets[name]
            folder._files[name] = shard.path
    return _validate(folder)


def _shard_names(index: Path) -> list[str]:
    """The shard files an index names (each once, in order), checked to stay in its folder."""
    data = meta.read_json_file(index, "weights index", CheckpointError)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map or not all(
            isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index}: expected a JSON object with a \"weight_map\" of "
                              "tensor names to shard file names")
    names = list(dict.fromkeys(weight_map.values()))
    for name in names:
        if Path(name).name != name:
            raise CheckpointError(f"{index}: shard {name!r}: expected a file name in the "
                                  "model folder")
    return names


def save_model_folder(path: str | os.PathLike[str], tensors: Mapping[str, Any],
                      metadata: Mapping[str, str], config: Mapping[str, Any], *,
                      force: bool = False,
                      inputs: Sequence[str | os.PathLike[str]] = ()) -> Path:
    """Write a Hugging Face model folder (``config.json``, ``model.safetensors``) beside
    the target, then rename it into place: a failed write leaves no partial folder.

    Raises:
        OutputError: the parent folder is missing; the folder exists and not ``force``;
            it is or holds an input (even with ``force``).
    """
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    check_output_folder(path, force=force, inputs=inputs)
    staging = Path(tempfile.mkdtemp(dir=parent, prefix=f".{path.name}.", suffix=".tmp"))
    try:
        os.chmod(staging, 0o777 & ~_umask())
        write_model_files(staging, tensors, metadata, config)
        swap_in_folder(staging, path, force=force)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return path


def write_model_files(folder: Path, tensors: Mapping[str, Any], metadata: Mapping[str, str],
                      config: Mapping[str, Any]) -> None:
    """``model.safetensors`` (with ``format: pt``, which transformers expects) and
    ``config.json`` into an existing folder."""
    save_checkpoint(folder / HF_WEIGHTS, tensors, {**metadata, "format": "pt"}, force=True)
    write_atomic(folder / HF_CONFIG, (json.dumps(config, indent=2, sort_keys=True)
                                      + "\n").encode())


def check_output_folder(path: Path, *, force: bool,
                        inputs: Sequence[str | os.PathLike[str]] = ()) -> None:
    """Refuse an output folder whose parent is missing, which exists (without ``force``),
    is not a folder, or is or holds one of ``inputs`` (whatever ``force`` says).

    Raises:
        OutputError: naming the folder and what is wrong.
    """
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise OutputError(f"{path}: output directory {parent} does not exist")
    if path.exists() and not path.is_dir():
        raise OutputError(f"{path}: exists and is not a folder")
    for source in inputs:
        if path.exists() and Path(source).resolve().is_relative_to(path.resolve()):
            raise OutputError(f"{path}: the output folder holds the input {source}; expected "
                              "another folder (inputs are never replaced, even with force=True)"
                              ).naming("force")
    if path.exists() and not force:
        raise OutputError(f"{path}: output folder exists; pass force=True to replace it"
                          ).naming("force")


def swap_in_folder(staging: Path, path: Path, *, force: bool) -> None:
    """Rename a fully written folder into place (replacing ``path`` with ``force``)."""
    if not path.exists():
        try:
            os.rename(staging, path)
        except OSError as exc:
            raise OutputError(f"{path}: cannot write the output folder ({exc.strerror})") from None
        return
    if not force:
        raise OutputError(f"{path}: output folder exists; pass force=True to replace it"
                          ).naming("force")
    old = staging.with_name(staging.name + ".old")
    os.rename(path, old)
    os.rename(staging, path)
    shutil.rmtree(old, ignore_errors=True)


def _validate(ckpt: Checkpoint) -> Checkpoint:
    """What every opened checkpoint passes: weight dtypes and shapes, then fusekit's
    metadata (now, not halfway through a fusion)."""
    ckpt._validate_header()
    for prop in ("num_samples", "class_counts", "arch", "preprocess"):
        getattr(ckpt, prop)
    return ckpt


@contextlib.contextmanager
def safetensors_errors(path: Path) -> Iterator[None]:
    """Turn what safetensors raises into CheckpointError naming ``path``, including its
    Rust panics (pyo3's PanicException derives from BaseException, not Exception)."""
    try:
        yield
    except MemoryError:
        raise CheckpointError(f"{path}: not enough memory to map the checkpoint") from None
    except (safetensors.SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: not a valid safetensors file ({exc})") from None
    except BaseException as exc:
        if not _is_panic(exc):
            raise
        raise CheckpointError(
            f"{path}: safetensors failed on this file ({exc}); it may not fit in memory"
        ) from None


def _is_panic(exc: BaseException) -> bool:
    """pyo3's PanicException (a Rust panic inside safetensors) derives from BaseException
    only, and its class is not importable: recognise it by name."""
    return type(exc).__name__ == "PanicException"


def _data_offsets(path: Path, header_len: int) -> dict[str, tuple[int, int]]:
    """Where each tensor's bytes are in the file (safetensors, already validated, has
    checked the header; its Python API does not expose the offsets)."""
    with open(path, "rb") as f:
        f.seek(8)
        header = json.loads(f.read(header_len))
    base = 8 + header_len
    return {name: (base + entry["data_offsets"][0], base + entry["data_offsets"][1])
            for name, entry in header.items() if name != "__metadata__"}


def _check_header_length(path: Path) -> int:
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(9)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read the checkpoint ({exc.strerror})") from None
    if is_pickle_or_torch_zip(prefix):
        # The command opens the file itself (torch.load reads a path ending in .safetensors
        # as safetensors) and never writes over it.
        converted = path.with_suffix(".safetensors")
        if converted == path:
            converted = path.with_suffix(".converted.safetensors")
        raise CheckpointError(
            f"{path}: a torch.save (zip) or pickle file, not safetensors; fusekit never "
            f"unpickles. Convert a state_dict with: python -c \"import torch, safetensors.torch "
            f"as st; st.save_file(torch.load(open({str(path)!r}, 'rb'), weights_only=True), "
            f"{str(converted)!r})\"")
    return header_length(prefix, str(path), size)


def is_pickle_or_torch_zip(head: bytes) -> bool:
    """Whether a file's first 9 bytes are those of a pickle (protocol 2+) or a zip archive
    (torch.save's default), not of a safetensors file."""
    return head.startswith((PICKLE_MAGIC, ZIP_MAGIC)) and head[8:9] != b"{"


def header_length(prefix: bytes, label: str, size: int | None = None) -> int:
    """The JSON header's length from a file's first 8 bytes, checked against the cap and,
    when known, against the file's ``size``."""
    if len(prefix) < 8:
        raise CheckpointError(
            f"{label}: not a valid safetensors file (expected an 8-byte header length, found "
            f"a file of {len(prefix) if size is None else size} bytes)"
        )
    (length,) = struct.unpack("<Q", prefix[:8])
    if length > MAX_HEADER_BYTES:
        raise CheckpointError(
            f"{label}: safetensors header claims {length} bytes; expected at most "
            f"{MAX_HEADER_BYTES} (corrupt or malicious file)"
        )
    if size is not None and length > size - 8:
        raise CheckpointError(
            f"{label}: truncated safetensors file (header claims {length} bytes, only "
            f"{size - 8} follow)"
        )
    return length


def check_header(head: bytes, label: str) -> int:
    """Validate a safetensors header from the file's first bytes alone, before its tensors
    arrive (a streamed upload): length, JSON, dtypes, shapes, contiguous offsets and
    fusekit's metadata, as :func:`load_checkpoint` checks them. ``head`` holds at least
    the 8-byte length and the JSON header.

    Returns:
        The size in bytes the whole file must have.
    """
    length = header_length(head, label)
    if len(head) < 8 + length:
        raise CheckpointError(
            f"{label}: truncated safetensors file (header claims {length} bytes, only "
            f"{len(head) - 8} follow)"
        )
    try:
        text = head[8:8 + length].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{label}: not a valid safetensors file (header: {exc})") from None
    header = meta.load_json(text, f"{label}: safetensors header")
    if not isinstance(header, dict):
        raise CheckpointError(f"{label}: safetensors header must be a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
            isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{label}: safetensors metadata must map strings to strings")
    tensors, end = {}, 0
    for name, entry in sorted(header.items(), key=lambda item: _offsets(item, label)):
        begin, stop = _offsets((name, entry), label)
        dtype, shape = entry.get("dtype"), entry.get("shape")
        if dtype not in STORAGE_DTYPES or not isinstance(shape, list) or not all(
                isinstance(d, int) and d >= 0 for d in shape):
            raise CheckpointError(
                f"{label}: tensor {name!r} has dtype {dtype!r} and shape {shape!r}; expected a "
                f"safetensors dtype ({', '.join(STORAGE_DTYPES)}) and non-negative dimensions")
        expected = np.dtype(STORAGE_DTYPES[dtype]).itemsize * math.prod(shape)
        if begin != end or stop - begin != expected:
            raise CheckpointError(
                f"{label}: tensor {name!r} has data_offsets [{begin}, {stop}]; expected "
                f"[{end}, {end + expected}] (contiguous, {expected} bytes)")
        tensors[name], end = TensorInfo(dtype, tuple(shape)), stop
    _validate(Checkpoint(path=Path(label), metadata=metadata, tensors=tensors))
    return 8 + length + end


def _offsets(item: tuple[str, Any], label: str) -> tuple[int, int]:
    name, entry = item
    offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
    if not (isinstance(offsets, list) and len(offsets) == 2
            and all(isinstance(o, int) and o >= 0 for o in offsets) and offsets[0] <= offsets[1]):
        raise CheckpointError(
            f"{label}: tensor {name!r} has data_offsets {offsets!r}; expected [begin, end]")
    return offsets[0], offsets[1]


def save_checkpoint(
    path: str | os.PathLike[str],
    tensors: Mapping[str, Any],
    metadata: Mapping[str, str] | None = None,
    *,
    force: bool = False,
    inputs: Sequence[str | os.PathLike[str]] = (),
) -> Path:
    """Write ``tensors`` to ``path`` atomically (temporary file, fsync, rename).

    Refuses to replace an existing file unless ``force``, to replace any of ``inputs``
    whatever ``force`` says, and to write NaN or Inf; never leaves a partial file.

    Raises:
        OutputError: see :func:`check_output_path`; or the write failed.
        NonFiniteOutputError: a floating-point tensor holds NaN or Inf.
    """
    path = Path(path)
    check_output_path(path, force=force, inputs=inputs)
    # np.require keeps 0-d tensors 0-d (np.ascontiguousarray would make them 1-d).
    arrays = {k: np.require(_as_numpy(v), requirements="C") for k, v in tensors.items()}
    for name, array in arrays.items():
        bad = count_non_finite(array)
        if bad:
            raise NonFiniteOutputError(
                f"{path}: output tensor {name!r} has {bad} non-finite value(s) (NaN or Inf); "
                "expected finite weights, so nothing was written (check the inputs' "
                "magnitudes and metadata)"
            )
    return write_atomic(path, safetensors_parts(arrays, metadata or {}), force=force)


def safetensors_parts(arrays: Mapping[str, np.ndarray], metadata: Mapping[str, str]
                      ) -> list[Any]:
    """The safetensors file of C-contiguous ``arrays`` as the buffers to write in order:
    the header, then each array's own memory (no serialised copy of the model). Tensors
    are laid out as safetensors lays them out, wider types first, then by name, so every
    tensor stays aligned after the 8-byte-aligned header."""
    for key, value in metadata.items():
        if not (isinstance(key, str) and isinstance(value, str)):
            raise TypeError(f"metadata {key!r}: expected str -> str, found {value!r}")
    order = sorted(arrays, key=lambda name: (-arrays[name].dtype.itemsize, name))
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset, data = 0, []
    for name in order:
        array = arrays[name].astype(arrays[name].dtype.newbyteorder("<"), copy=False)
        header[name] = {"dtype": _dtype_name(array.dtype), "shape": list(array.shape),
                        "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
        data.append(array.reshape(-1).view(np.uint8))
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # padding the format allows, for aligned tensors
    return [struct.pack("<Q", len(text)) + text, *data]


def check_output_path(path: Path, *, force: bool,
                      inputs: Sequence[str | os.PathLike[str]] = ()) -> None:
    """Fail before any work if ``path`` cannot or must not be written.

    Raises:
        OutputError: the folder is missing or not writable; the path is a directory or
            another non-regular file; it is (any spelling or link of) one of ``inputs``
            (refused even with ``force``); or it exists and ``force`` is false.
    """
    directory = path.parent
    if not directory.is_dir():
        raise OutputError(f"{path}: output directory {directory} does not exist")
    if path.is_dir():
        raise OutputError(f"{path}: is a directory; expected a file name for the output")
    check_not_an_input(path, inputs)
    if not os.access(directory, os.W_OK | os.X_OK):
        raise OutputError(f"{path}: output directory {directory} is not writable")
    if path.exists() and not path.is_file():
        raise OutputError(
            f"{path}: expected a regular file or a new name for the output, found "
            f"{meta.describe_file_type(path.stat().st_mode)}"
        )
    if path.exists() and not force:
        raise OutputError(f"{path}: output file exists; pass force=True to replace it"
                          ).naming("force")


def check_not_an_input(path: Path, inputs: Sequence[str | os.PathLike[str]]) -> None:
    """Refuse an output that is one of the inputs, by any spelling, symlink or hard link.

    Raises:
        OutputError: naming the output and the input it would replace.
    """
    if not path.exists():  # every input exists, so a new name is none of them
        return
    for source in inputs:
        if _same_file(path, source):
            raise OutputError(
                f"{path}: the output is the input {source}; expected another path "
                "(inputs are never replaced, even with force=True)"
            ).naming("force")


def _same_file(a: Path, b: str | os.PathLike[str]) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # b is missing or unreadable: not the file at a
        return False


def write_atomic(path: str | os.PathLike[str], payload: bytes | Sequence[Any], *,
                 force: bool = True) -> Path:
    """Write ``payload`` (bytes, or buffers written one after the other) to ``path``
    through a temporary file in the same folder, fsync and
    rename: readers see the old file or the new one, never a partial one. The temporary
    file is removed on any failure, Ctrl-C or SIGTERM.

    Raises:
        OutputError: ``path`` exists and not ``force``, or the write failed (named by
            ``path``, never by the temporary file).
    """
    path = Path(path)
    directory = path.parent
    with _sigterm_unwinds():
        try:
            fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.", suffix=".tmp")
        except OSError as exc:
            raise OutputError(
                f"{path}: cannot create the output in {directory} ({exc.strerror})"
            ) from None
        try:
            _write_file(fd, payload)
            if force:
                os.replace(tmp, path)
            else:
                os.link(tmp, path)  # atomic, and fails instead of clobbering a file made meanwhile
                os.unlink(tmp)
        except FileExistsError:
            os.unlink(tmp)
            raise OutputError(f"{path}: output file exists; pass force=True to replace it"
                              ).naming("force") from None
        except OSError as exc:
            _remove(tmp)
            raise OutputError(
                f"{path}: cannot write the output ({exc.strerror or exc})"
            ) from None
        except BaseException:
            _remove(tmp)
            raise
    _fsync_directory(directory)
    return path


def _write_file(fd: int, payload: bytes | Sequence[Any]) -> None:
    parts = [payload] if isinstance(payload, bytes | bytearray | memoryview) else payload
    with os.fdopen(fd, "wb") as f:
        for part in parts:
            view = memoryview(part).cast("B")
            for start in range(0, len(view), _WRITE_CHUNK):
                f.write(view[start:start + _WRITE_CHUNK])
        f.flush()
        os.fchmod(f.fileno(), 0o666 & ~_umask())  # mkstemp's 0600 is not what users expect
        os.fsync(f.fileno())


def _remove(tmp: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """While a temporary file exists, let SIGTERM unwind as SystemExit(143) so it is removed
    (by default SIGTERM ends the process at once; Ctrl-C already unwinds). Only where
    SIGTERM has its default action and in the main thread: a program's own handler wins."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL):
        yield
        return

    def unwind(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, unwind)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def owner_only_umask() -> int:
    """Files and folders this process creates from now on are their owner's only (0600,
    0700: umask 077 added to the current one); returns the umask before."""
    old = os.umask(0o077)
    os.umask(old | 0o077)
    return old


@contextlib.contextmanager
def private_files() -> Iterator[None]:
    """Files and folders created meanwhile are their owner's only (0600, 0700): a fused
    model is as private as the clients' models it is made of."""
    old = owner_only_umask()
    try:
        yield
    finally:
        os.umask(old)


def _fsync_directory(directory: Path) -> None:
    with contextlib.suppress(OSError):  # not every platform can open a directory
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
