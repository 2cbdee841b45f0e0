"""Checkpoints: safetensors files with fusekit's metadata conventions.

Loading is lazy (``safe_open``): headers are validated at once, tensors are read on demand.
Writing is atomic: a temporary file in the target directory, fsync, then a rename, so a
failed or interrupted fusion never leaves a partial output and inputs are never touched.

Metadata (string -> string):
    fusekit.num_samples   number of training samples of the client (int)
    fusekit.class_counts  JSON list of per-class sample counts
    fusekit.arch          JSON architecture description (see fusekit.core.arch)
Fused outputs add fusekit.method, fusekit.params (JSON), fusekit.inputs (JSON list of
content hashes) and fusekit.version.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import struct
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import safetensors
import safetensors.numpy

from fusekit.core import metadata as meta
from fusekit.core.errors import CheckpointError, CheckpointNotFoundError, OutputError

# A safetensors header is a few KB per hundred tensors; anything near this is an attack or
# a corrupt length field, and reading it would allocate that much memory.
MAX_HEADER_BYTES = 100 * 1024 * 1024

# Integer tensors that are counters, not weights (BatchNorm's step counter).
INTEGER_BUFFER_SUFFIXES = ("num_batches_tracked",)


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

    @classmethod
    def from_state_dict(
        cls, state_dict: Mapping[str, Any], metadata: Mapping[str, str] | None = None
    ) -> Checkpoint:
        arrays = {k: _as_numpy(v) for k, v in state_dict.items()}
        ckpt = cls(
            path=None,
            metadata=dict(metadata or {}),
            tensors={k: TensorInfo(_dtype_name(a.dtype), a.shape) for k, a in arrays.items()},
            _arrays=arrays,
        )
        ckpt._validate_header()
        return ckpt

    @property
    def label(self) -> str:
        """How messages name this checkpoint: its path, or '<in-memory checkpoint>'."""
        return str(self.path) if self.path is not None else "<in-memory checkpoint>"

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
        if name not in self._arrays:
            self._arrays[name] = self._read(name)
        array = self._arrays[name]
        if array.dtype.kind == "f" and not np.isfinite(array).all():
            bad = int(np.size(array) - np.isfinite(array).sum())
            raise CheckpointError(
                f"{self.label}: tensor {name!r} has {bad} non-finite value(s) (NaN or Inf); "
                "expected finite weights"
            )
        view = array.view()  # read-only for the caller, without freezing an array it passed in
        view.flags.writeable = False
        return view

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
    def content_hash(self) -> str:
        """sha256 over sorted tensor names, dtypes, shapes and bytes (not the file's bytes:
        safetensors orders metadata differently in each process). Streams the file: it
        keeps no tensor it did not already hold."""
        digest = hashlib.sha256()
        for name in sorted(self.tensors):
            held = name in self._arrays
            array = np.ascontiguousarray(self.tensor(name))
            digest.update(name.encode())
            digest.update(f"|{array.dtype.str}|{array.shape}|".encode())
            digest.update(array.tobytes())
            if not held:
                self.release(name)
        return digest.hexdigest()

    def _read(self, name: str) -> np.ndarray:
        if self.path is None:
            raise CheckpointError(f"{self.label}: tensor {name!r} was never loaded")
        try:
            with safetensors.safe_open(self.path, framework="numpy") as f:
                return f.get_tensor(name)
        except (safetensors.SafetensorError, OSError, ValueError, TypeError) as exc:
            if self.tensors[name].dtype != "BF16":
                raise CheckpointError(
                    f"{self.label}: cannot read tensor {name!r}: {exc}"
                ) from None
        return _read_bf16(self.path, name)

    def _validate_header(self) -> None:
        for name, info in self.tensors.items():
            if not info.dtype.startswith(("F", "BF")) and not is_integer_buffer(name):
                raise CheckpointError(
                    f"{self.label}: tensor {name!r} has dtype {info.dtype}; expected a "
                    "floating-point weight (only counters like num_batches_tracked may be "
                    "integers)"
                )


def _read_bf16(path: Path, name: str) -> np.ndarray:
    # numpy has no bfloat16: read through torch and widen to float32.
    with safetensors.safe_open(path, framework="pt") as f:
        return f.get_tensor(name).float().numpy()


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


def load_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Open and validate a safetensors checkpoint without reading its tensors.

    Raises:
        CheckpointNotFoundError: the path does not exist or is not a file.
        CheckpointError: the file is truncated, corrupt, has an absurd header, holds
            non-floating-point weights, or has malformed fusekit metadata.
    """
    path = Path(path)
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "does not exist"
        raise CheckpointNotFoundError(f"{path}: checkpoint file {what}")
    _check_header_length(path)
    try:
        with safetensors.safe_open(path, framework="numpy") as f:
            metadata = dict(f.metadata() or {})
            tensors = {}
            for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                sl = f.get_slice(name)
                tensors[name] = TensorInfo(sl.get_dtype(), tuple(sl.get_shape()))
    except (safetensors.SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: not a valid safetensors file ({exc})") from None
    ckpt = Checkpoint(path=path, metadata=metadata, tensors=tensors)
    ckpt._validate_header()
    for prop in ("num_samples", "class_counts", "arch"):
        getattr(ckpt, prop)  # validate metadata now, not halfway through a fusion
    return ckpt


def _check_header_length(path: Path) -> None:
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read the checkpoint ({exc.strerror})") from None
    if len(prefix) < 8:
        raise CheckpointError(
            f"{path}: not a valid safetensors file (expected an 8-byte header length, found "
            f"a file of {size} bytes)"
        )
    (header_len,) = struct.unpack("<Q", prefix)
    if header_len > MAX_HEADER_BYTES:
        raise CheckpointError(
            f"{path}: safetensors header claims {header_len} bytes; expected at most "
            f"{MAX_HEADER_BYTES} (corrupt or malicious file)"
        )
    if header_len > size - 8:
        raise CheckpointError(
            f"{path}: truncated safetensors file (header claims {header_len} bytes, only "
            f"{size - 8} follow)"
        )


def save_checkpoint(
    path: str | os.PathLike[str],
    tensors: Mapping[str, Any],
    metadata: Mapping[str, str] | None = None,
    *,
    force: bool = False,
) -> Path:
    """Write ``tensors`` to ``path`` atomically (temporary file, fsync, rename).

    Refuses to replace an existing file unless ``force``; never leaves a partial file.
    """
    path = Path(path)
    check_output_path(path, force=force)
    # np.require keeps 0-d tensors 0-d (np.ascontiguousarray would make them 1-d).
    arrays = {k: np.require(_as_numpy(v), requirements="C") for k, v in tensors.items()}
    return write_atomic(path, safetensors.numpy.save(arrays, metadata=dict(metadata or {})),
                        force=force)


def check_output_path(path: Path, *, force: bool) -> None:
    """Fail before any work if ``path`` cannot be written (missing folder, existing file)."""
    directory = path.parent if str(path.parent) else Path(".")
    if not directory.is_dir():
        raise OutputError(f"{path}: output directory {directory} does not exist")
    if path.is_dir():
        raise OutputError(f"{path}: is a directory; expected a file name for the output")
    if path.exists() and not force:
        raise OutputError(f"{path}: output file exists; pass --force (force=True) to replace it")


def write_atomic(path: str | os.PathLike[str], payload: bytes, *, force: bool = True) -> Path:
    """Write ``payload`` to ``path`` through a temporary file in the same folder, fsync and
    rename: readers see the old file or the new one, never a partial one."""
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fchmod(f.fileno(), 0o666 & ~_umask())  # mkstemp's 0600 is not what users expect
            os.fsync(f.fileno())
        if force:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)  # atomic, and fails instead of clobbering a file made meanwhile
            os.unlink(tmp)
    except FileExistsError:
        os.unlink(tmp)
        raise OutputError(f"{path}: output file exists; pass --force to replace it") from None
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_directory(directory)
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync_directory(directory: Path) -> None:
    with contextlib.suppress(OSError):  # not every platform can open a directory
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
