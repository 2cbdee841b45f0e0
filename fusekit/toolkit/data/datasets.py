"""Data sets for simulation and evaluation. Nothing is ever downloaded.

- ``digits``: scikit-learn's bundled 8x8 digits (1797 images, embedded, the default).
- ``mnist``, ``fashion-mnist``: the standard IDX files (optionally .gz) in ``data_dir``.
- ``cifar10``: the standard python pickle batches (``cifar-10-batches-py/``) in ``data_dir``,
  read with an unpickler that admits only the format's types (nothing in them is executed).
- ``npz``: any .npz file with ``x_train, y_train, x_test, y_test``.
- ``synthetic``: seeded Gaussian-mixture classification of any size and dimension.

Images are float32 (N, C, H, W), vectors float32 (N, D); labels int64 in 0..K-1. Inputs are
returned as stored (digits: pixel values 0..16; mnist, fashion-mnist, cifar10: bytes / 255;
npz: the file's arrays, unchanged). Preprocessing belongs to the model: each built-in data
set names the normalisation fusekit's own models train with (:attr:`Dataset.normalization`,
its training split's mean and standard deviation, per channel for images, one value for
vectors), which training records in the checkpoint (``fusekit.preprocess``) and every front
door applies from there. An ``npz`` file names none: models trained on it see its arrays.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import io
import os
import pickle
import struct
import zipfile
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from pathlib import Path
from typing import BinaryIO

import numpy as np

from fusekit.core.checkpoint import write_atomic
from fusekit.core.errors import DataError, FusekitError, ParameterError
from fusekit.core.metadata import Normalization

DATASETS = ("digits", "mnist", "fashion-mnist", "cifar10", "npz", "synthetic")

_IDX_FILES = {
    "x_train": "train-images-idx3-ubyte",
    "y_train": "train-labels-idx1-ubyte",
    "x_test": "t10k-images-idx3-ubyte",
    "y_test": "t10k-labels-idx1-ubyte",
}
_IDX_SUBDIRS = {
    "mnist": ("", "mnist", "MNIST/raw", "MNIST"),
    "fashion-mnist": ("", "fashion-mnist", "FashionMNIST/raw", "FashionMNIST", "fashion_mnist"),
}


@dataclass(frozen=True)
class Dataset:
    """A train/test split.

    Attributes:
        name: data set name (for reports).
        x_train: float32 (N, *input_shape).
        y_train: int64 (N,), values in 0..num_classes-1.
        x_test: float32 (M, *input_shape).
        y_test: int64 (M,).
        num_classes: K.
        normalization: what fusekit's own models trained on it expect of their inputs
            (recorded in their checkpoints), or None: the arrays as they are.
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    normalization: Normalization | None = None

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])

    def __repr__(self) -> str:
        return (
            f"Dataset({self.name!r}, train={len(self.y_train)}, test={len(self.y_test)}, "
            f"input_shape={self.input_shape}, classes={self.num_classes})"
        )


def dataset_name(name: str | None, path: str | os.PathLike[str] | None) -> str:
    """The data set a front door means: ``name``, else ``npz`` when a file is given, else
    the embedded ``digits``."""
    if name is not None:
        return name
    return "npz" if path is not None else "digits"


def load_dataset(
    name: str | None = None,
    *,
    data_dir: str | os.PathLike[str] | None = None,
    path: str | os.PathLike[str] | None = None,
    samples: int = 10_000,
    features: int = 20,
    classes: int = 10,
    seed: int = 0,
) -> Dataset:
    """Load a data set by name.

    Args:
        name: one of ``digits, mnist, fashion-mnist, cifar10, npz, synthetic``; None:
            ``npz`` when ``path`` is given, else ``digits``.
        data_dir: folder holding the mnist / fashion-mnist / cifar10 files.
        path: the .npz file for ``npz``.
        samples, features, classes, seed: size, dimension, class count and seed of
            ``synthetic`` (80% train, 20% test).

    Raises:
        DataError: files missing or malformed (the message lists the files needed).
        ParameterError: unknown name or invalid synthetic sizes.
    """
    name = dataset_name(name, path)
    if name == "digits":
        return digits()
    if name in ("mnist", "fashion-mnist"):
        return idx_dataset(name, _require_dir(name, data_dir))
    if name == "cifar10":
        return cifar10(_require_dir(name, data_dir))
    if name == "npz":
        if path is None:
            raise DataError(
                "npz: pass the file with --data-path (x_train, y_train, x_test, y_test)"
            )
        return npz_dataset(path)
    if name == "synthetic":
        return synthetic(samples=samples, features=features, classes=classes, seed=seed)
    raise ParameterError(f"data: expected one of {list(DATASETS)}, found {name!r}")


def digits() -> Dataset:
    """scikit-learn's bundled digits: 8x8 grey images, 10 classes; a fixed stratified
    75/25 train/test split (1347/450).

    The split is made once per scikit-learn version and kept in fusekit's cache folder
    (:func:`cache_dir`): importing scikit-learn costs a process about a second of CPU,
    which every Flower ClientApp and every command on the digits paid."""
    try:
        path = cache_dir() / f"digits-scikit-learn-{package_version('scikit-learn')}.npz"
    except PackageNotFoundError:
        return _built_in("digits", *_digits_split())
    arrays = _read_digits(path)
    if arrays is None:
        arrays = _digits_split()
        buffer = io.BytesIO()
        np.savez(buffer, **dict(zip(_DIGITS_ARRAYS, arrays, strict=True)))
        with contextlib.suppress(OSError, FusekitError):  # a cache that cannot be written
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, buffer.getvalue())
    return _built_in("digits", *arrays)


def cache_dir() -> Path:
    """fusekit's cache folder: ``$XDG_CACHE_HOME/fusekit``, else ``~/.cache/fusekit``."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fusekit"


#: The digits split's arrays, their shapes and dtypes (x as stored: pixel values 0..16).
_DIGITS_ARRAYS = {"x_train": ((1347, 1, 8, 8), np.float32), "y_train": ((1347,), np.int64),
                  "x_test": ((450, 1, 8, 8), np.float32), "y_test": ((450,), np.int64)}


def _digits_split() -> tuple[np.ndarray, ...]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    images = bunch.images.astype(np.float32)[:, None, :, :]
    x_train, x_test, y_train, y_test = train_test_split(
        images,
        bunch.target.astype(np.int64),
        test_size=0.25,
        random_state=0,
        stratify=bunch.target,
    )
    return x_train, y_train, x_test, y_test


def _read_digits(path: Path) -> tuple[np.ndarray, ...] | None:
    """The cached split, or None where there is none or it is not the split's arrays."""
    try:
        with np.load(path) as stored:
            arrays = tuple(stored[name] for name in _DIGITS_ARRAYS)
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
        return None
    expected = [(shape, np.dtype(dtype)) for shape, dtype in _DIGITS_ARRAYS.values()]
    return arrays if [(a.shape, a.dtype) for a in arrays] == expected else None


def synthetic(
    *, samples: int = 10_000, features: int = 20, classes: int = 10, seed: int = 0
) -> Dataset:
    """Seeded Gaussian mixture: each class is a mixture of two unit-variance Gaussian blobs
    with centres drawn from N(0, 1.5^2 I), so classes are not linearly separable in
    general; classes are drawn uniformly; 80% train, 20% test.

    Raises:
        ParameterError: fewer than 2*classes samples, features < 1 or classes < 2.
    """
    if samples < 2 * classes or features < 1 or classes < 2:
        raise ParameterError(
            f"synthetic: expected samples >= 2*classes, features >= 1, classes >= 2; found "
            f"samples={samples}, features={features}, classes={classes}"
        )
    rng = np.random.default_rng(seed)
    centres = rng.normal(0.0, 1.5, size=(classes, 2, features))
    y = rng.integers(0, classes, size=samples)
    blob = rng.integers(0, 2, size=samples)
    x = centres[y, blob] + rng.normal(0.0, 1.0, size=(samples, features))
    n_train = round(0.8 * samples)
    return _built_in(
        f"synthetic-{features}d-{classes}c",
        x[:n_train].astype(np.float32),
        y[:n_train].astype(np.int64),
        x[n_train:].astype(np.float32),
        y[n_train:].astype(np.int64),
    )


def token_ids(path: str | os.PathLike[str]) -> np.ndarray:
    """A token model's inputs: ``x_train`` of an .npz, integer token ids (N, L), as they
    are (not standardised; padding is the model's ``pad_token_id``).

    Raises:
        DataError: no readable file, no ``x_train``, or not a 2-D integer array.
    """
    path = Path(path)
    ids = _npz_arrays(path, ("x_train",)).get("x_train")
    if ids is None or ids.ndim != 2 or ids.dtype.kind not in "iu" or not len(ids):
        raise DataError(f"{path}: expected x_train, integer token ids of shape (N, L), found "
                        f"{'none' if ids is None else f'{ids.dtype} {ids.shape}'}")
    return ids.astype(np.int64)


def _npz_arrays(path: Path, keys: tuple[str, ...]) -> dict[str, np.ndarray]:
    """Those of ``keys`` an .npz holds, read with :func:`read_npy`'s bounds."""
    if not path.is_file():
        raise DataError(f"{path}: npz data file does not exist")
    try:
        with zipfile.ZipFile(path) as archive:
            arrays = {}
            for key in keys:
                if f"{key}.npy" in archive.namelist():
                    with archive.open(f"{key}.npy") as f:
                        size = archive.getinfo(f"{key}.npy").file_size
                        arrays[key] = read_npy(f, size, f"{path}: {key}")
    except DataError:
        raise
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise DataError(f"{path}: not a readable .npz file ({exc})") from None
    return arrays


def npz_dataset(path: str | os.PathLike[str]) -> Dataset:
    """Any .npz with ``x_train, y_train, x_test, y_test`` (labels integers 0..K-1)."""
    path = Path(path)
    arrays = _npz_arrays(path, ("x_train", "y_train", "x_test", "y_test"))
    missing = sorted({"x_train", "y_train", "x_test", "y_test"} - set(arrays))
    if missing:
        raise DataError(
            f"{path}: missing array(s) {missing}; expected x_train, y_train, x_test, y_test"
        )
    for split in ("train", "test"):
        x, y = arrays[f"x_{split}"], arrays[f"y_{split}"]
        if y.ndim != 1 or y.dtype.kind not in "iu" or len(x) != len(y) or x.ndim < 2:
            raise DataError(
                f"{path}: expected x_{split} (N, ...) and integer y_{split} (N,); found shapes "
                f"{x.shape} and {y.shape} ({y.dtype})"
            )
    return _as_stored(
        path.stem,
        arrays["x_train"].astype(np.float32),
        arrays["y_train"].astype(np.int64),
        arrays["x_test"].astype(np.float32),
        arrays["y_test"].astype(np.int64),
    )


def read_npy(f: BinaryIO, size: int, label: str) -> np.ndarray:
    """One .npy stream of ``size`` bytes, its header checked against the bytes really there
    before anything is allocated.

    Raises:
        DataError: naming ``label``: an unknown format version, Python objects, or a header
            that claims more data than the stream holds.
    """
    version = np.lib.format.read_magic(f)
    read_header = {(1, 0): np.lib.format.read_array_header_1_0,
                   (2, 0): np.lib.format.read_array_header_2_0}.get(version)
    if read_header is None:
        raise DataError(f"{label}: unsupported .npy format version {version}")
    shape, fortran, dtype = read_header(f)
    if dtype.hasobject:
        raise DataError(f"{label}: holds Python objects ({dtype}); expected a numeric array")
    claimed = int(np.prod(shape, dtype=object)) * dtype.itemsize
    available = size - f.tell()
    if claimed > available:
        raise DataError(
            f"{label}: header claims {claimed} bytes of {dtype} data of shape {shape}; "
            f"the file holds {available}"
        )
    data = np.frombuffer(f.read(claimed), dtype=dtype)
    return data.reshape(shape, order="F" if fortran else "C")


def idx_dataset(name: str, data_dir: Path) -> Dataset:
    """MNIST or Fashion-MNIST from the four standard IDX files (``.gz`` accepted), looked
    up in ``data_dir`` and its usual subfolders (``mnist/``, torchvision's ``MNIST/raw/``)."""
    for sub in _IDX_SUBDIRS[name]:
        folder = data_dir / sub
        found = {k: _find_file(folder, base) for k, base in _IDX_FILES.items()}
        if all(found.values()):
            arrays = {k: _read_idx(p) for k, p in found.items()}  # type: ignore[arg-type]
            return _built_in(
                name,
                arrays["x_train"].astype(np.float32)[:, None] / 255.0,
                arrays["y_train"].astype(np.int64),
                arrays["x_test"].astype(np.float32)[:, None] / 255.0,
                arrays["y_test"].astype(np.int64),
            )
    raise DataError(
        f"{name}: files not found under {data_dir} (also looked in "
        f"{[s for s in _IDX_SUBDIRS[name] if s]}); expected {sorted(_IDX_FILES.values())} "
        "(optionally .gz). fusekit never downloads data: fetch them yourself"
    )


def cifar10(data_dir: Path) -> Dataset:
    """CIFAR-10 from the python pickle batches: ``data_batch_1..5`` and ``test_batch`` in
    ``data_dir`` or ``data_dir/cifar-10-batches-py``."""
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for folder in (data_dir, data_dir / "cifar-10-batches-py"):
        if all((folder / n).is_file() for n in names):
            batches = [_read_cifar_batch(folder / n) for n in names]
            x_train = np.concatenate([b[0] for b in batches[:5]])
            y_train = np.concatenate([b[1] for b in batches[:5]])
            return _built_in(
                "cifar10", x_train / 255.0, y_train, batches[5][0] / 255.0, batches[5][1]
            )
    raise DataError(
        f"cifar10: files not found under {data_dir} or {data_dir / 'cifar-10-batches-py'}; "
        f"expected {names} (the 'python version' of CIFAR-10). fusekit never downloads data"
    )


# numpy's array rebuilder, taken from an array so no (deprecated) module path is imported.
_RECONSTRUCT = np.zeros(0).__reduce__()[0]
_CIFAR_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"): _RECONSTRUCT,  # numpy 1.x pickles (the data set)
    ("numpy._core.multiarray", "_reconstruct"): _RECONSTRUCT,  # numpy 2.x pickles
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
}


class _CifarUnpickler(pickle.Unpickler):
    """Unpickles only what a CIFAR-10 python batch holds (a dict of bytes, lists and one
    uint8 ndarray): any other global (``os.system``, ``builtins.eval``...) is refused
    before it can be called, so a hostile file in a data folder runs nothing."""

    def find_class(self, module: str, name: str):
        if (module, name) == ("_codecs", "encode"):  # how Python 3 pickles bytes (protocol 2)
            return _latin1_encode
        try:
            return _CIFAR_GLOBALS[module, name]
        except KeyError:
            raise pickle.UnpicklingError(
                f"refused global {module}.{name}; a CIFAR-10 batch holds only a dict of "
                "bytes, lists and a uint8 array"
            ) from None


def _latin1_encode(text: str, encoding: str = "latin1") -> bytes:
    if encoding != "latin1":
        raise pickle.UnpicklingError(f"refused codec {encoding!r} (expected latin1)")
    return text.encode("latin1")


def _read_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        with open(path, "rb") as f:
            batch = _CifarUnpickler(f, encoding="bytes").load()
        data, labels = batch[b"data"], np.asarray(batch[b"labels"])
        if (not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2
                or data.shape[1] != 3 * 32 * 32 or labels.dtype.kind not in "iu"
                or labels.shape != (len(data),)):
            raise ValueError(
                f"expected uint8 data (N, 3072) and N integer labels, found "
                f"{getattr(data, 'dtype', type(data).__name__)} {np.shape(data)} and "
                f"{labels.dtype} {labels.shape}"
            )
    except (OSError, pickle.UnpicklingError, KeyError, TypeError, ValueError, EOFError,
            AttributeError, IndexError) as exc:
        raise DataError(f"{path}: not a CIFAR-10 python batch ({exc})") from None
    return data.astype(np.float32).reshape(-1, 3, 32, 32), labels.astype(np.int64)


def _find_file(folder: Path, base: str) -> Path | None:
    for candidate in (
        base,
        base.replace("-idx", ".idx"),
        base + ".gz",
        base.replace("-idx", ".idx") + ".gz",
    ):
        if (folder / candidate).is_file():
            return folder / candidate
    return None


def _read_idx(path: Path) -> np.ndarray:
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
        zero, dtype_code, ndim = struct.unpack(">HBB", raw[:4])
        if zero != 0 or dtype_code != 0x08:
            raise ValueError(f"magic {raw[:4].hex()} is not an unsigned-byte IDX file")
        shape = struct.unpack(f">{ndim}I", raw[4 : 4 + 4 * ndim])
        data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
        return data.reshape(shape)
    except (OSError, ValueError, struct.error, EOFError) as exc:
        raise DataError(f"{path}: not a valid IDX file ({exc})") from None


def _require_dir(name: str, data_dir: str | os.PathLike[str] | None) -> Path:
    if data_dir is None:
        raise DataError(f"{name}: pass --data-dir, the folder holding its files (never downloaded)")
    folder = Path(data_dir)
    if not folder.is_dir():
        raise DataError(f"{name}: --data-dir {folder} is not a directory")
    return folder


def _as_stored(
    name: str, x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray, y_test: np.ndarray
) -> Dataset:
    if x_train.shape[1:] != x_test.shape[1:]:
        raise DataError(
            f"{name}: train samples have shape {x_train.shape[1:]}, test samples "
            f"{x_test.shape[1:]}; expected the same"
        )
    labels = np.concatenate([y_train, y_test])
    if labels.min() < 0:
        raise DataError(f"{name}: labels must be 0..K-1, found {int(labels.min())}")
    return Dataset(name=name, x_train=x_train.astype(np.float32),
                   y_train=y_train.astype(np.int64), x_test=x_test.astype(np.float32),
                   y_test=y_test.astype(np.int64), num_classes=int(labels.max()) + 1)


def _built_in(
    name: str, x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray, y_test: np.ndarray
) -> Dataset:
    """A built-in data set as stored, naming the normalisation fusekit's models train with."""
    dataset = _as_stored(name, x_train, y_train, x_test, y_test)
    return dataclasses.replace(dataset, normalization=training_normalization(dataset.x_train))


def training_normalization(x_train: np.ndarray) -> Normalization:
    """The mean and standard deviation of training inputs: per channel for images
    (N, C, H, W), one value for anything else; a constant's std is taken as 1. Computed in
    the inputs' float32, so normalised inputs are bit for bit those fusekit's models
    trained on when loaders standardised the data themselves."""
    axes = (0, 2, 3) if x_train.ndim == 4 else tuple(range(x_train.ndim))
    mean = x_train.mean(axis=axes).reshape(-1)
    std = x_train.std(axis=axes).reshape(-1)
    std = np.where(std > 0, std, 1.0)
    return Normalization(tuple(mean.tolist()), tuple(std.tolist()))
