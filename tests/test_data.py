"""fusekit.toolkit.data: data sets and partitions (ALGORITHMS.md §8)."""

import gzip
import io
import pickle
import struct
import sys
import zipfile

import numpy as np
import pytest

from fusekit.core.errors import DataError, ParameterError
from fusekit.toolkit.data import (
    class_counts,
    digits,
    dirichlet_partition,
    iid_partition,
    label_partition,
    load_dataset,
    partition,
    synthetic,
)
from fusekit.toolkit.data.datasets import _read_digits

LABELS = np.repeat(np.arange(10), 60)


def _assert_disjoint_cover(parts, expected):
    joined = np.concatenate(parts)
    assert len(joined) == len(np.unique(joined)), "a sample is used twice"
    assert set(joined.tolist()) == set(np.asarray(expected).tolist())


@pytest.mark.parametrize("method", ["iid", "dirichlet", "labels"])
def test_partitions_are_seeded_and_use_each_sample_once(method):
    a = partition(LABELS, 7, method, alpha=0.3, min_samples=5, seed=3)
    b = partition(LABELS, 7, method, alpha=0.3, min_samples=5, seed=3)
    c = partition(LABELS, 7, method, alpha=0.3, min_samples=5, seed=4)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))
    assert len(a) == 7 and min(len(p) for p in a) >= 5
    assert all(p.dtype == np.int64 and np.all(np.diff(p) > 0) for p in a)
    _assert_disjoint_cover(a, np.arange(LABELS.size))


def test_iid_sizes_are_balanced():
    sizes = [len(p) for p in iid_partition(LABELS, 7, seed=0)]
    assert max(sizes) - min(sizes) <= 1


def test_dirichlet_small_alpha_is_skewed_large_alpha_is_not():
    def mean_max_share(alpha):
        parts = dirichlet_partition(LABELS, 5, alpha, min_samples=1, seed=0)
        return np.mean([np.bincount(LABELS[p], minlength=10).max() / len(p) for p in parts])

    assert mean_max_share(0.05) > 0.35 > 0.2 > mean_max_share(100.0)


def test_label_partition_class_sets_in_range():
    parts = label_partition(LABELS, 6, 2, 4, seed=1)
    seen = set()
    for p in parts:
        k = np.unique(LABELS[p]).size
        assert 2 <= k <= 4
        seen |= set(LABELS[p].tolist())
    assert seen == set(range(10))
    _assert_disjoint_cover(parts, np.arange(LABELS.size))


def test_label_partition_uncoverable_uses_only_drawn_classes():
    parts = label_partition(LABELS, 2, 3, 3, seed=0)
    assert all(np.unique(LABELS[p]).size == 3 for p in parts)
    drawn = np.unique(np.concatenate([LABELS[p] for p in parts]))
    _assert_disjoint_cover(parts, np.flatnonzero(np.isin(LABELS, drawn)))


def test_partition_errors():
    with pytest.raises(ParameterError, match="alpha"):
        partition(LABELS, 3, "dirichlet", alpha=0)
    with pytest.raises(ParameterError, match="need 700 samples"):
        partition(LABELS, 70, "iid", min_samples=10)
    with pytest.raises(ParameterError, match="min_classes"):
        partition(LABELS, 3, "labels", min_classes=5, max_classes=11)
    with pytest.raises(ParameterError, match="expected one of"):
        partition(LABELS, 3, "shards")
    with pytest.raises(ParameterError, match="no split"):
        dirichlet_partition(np.repeat(np.arange(2), 10), 10, 0.01, min_samples=2)


def test_class_counts():
    assert class_counts(np.array([0, 2, 2, 1]), np.array([1, 2, 3]), 4) == [0, 1, 2, 0]


def test_digits_is_as_stored_and_fixed():
    """scikit-learn's pixel values (0..16); the normalisation fusekit's models train with
    is the training split's mean and std, named beside the arrays."""
    from sklearn.datasets import load_digits

    ds = digits()
    assert ds.input_shape == (1, 8, 8) and ds.num_classes == 10
    assert (len(ds.y_train), len(ds.y_test)) == (1347, 450)
    assert set(np.unique(ds.x_train)) <= set(np.unique(load_digits().images))
    assert ds.normalization.mean == pytest.approx((float(ds.x_train.mean()),), rel=1e-6)
    assert ds.normalization.std == pytest.approx((float(ds.x_train.std()),), rel=1e-5)
    assert ds.x_train.dtype == np.float32 and ds.y_train.dtype == np.int64
    assert np.array_equal(digits().y_test, ds.y_test)


def test_digits_split_is_made_once_and_read_from_the_cache(tmp_path, monkeypatch):
    """The first call makes scikit-learn's split and caches it; later ones read it without
    importing scikit-learn; a damaged or foreign cache file is made again; a cache folder
    that cannot be written leaves the data as it is."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    expected = train_test_split(bunch.images.astype(np.float32)[:, None],
                                bunch.target.astype(np.int64), test_size=0.25,
                                random_state=0, stratify=bunch.target)
    expected = [expected[0], expected[2], expected[1], expected[3]]

    def assert_split(ds):
        for array, want in zip((ds.x_train, ds.y_train, ds.x_test, ds.y_test), expected,
                               strict=True):
            assert array.dtype == want.dtype and np.array_equal(array, want)

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert_split(digits())
    (cached,) = (tmp_path / "fusekit").iterdir()
    assert cached.name.startswith("digits-scikit-learn-")
    with monkeypatch.context() as without:
        for module in ("sklearn", "sklearn.datasets", "sklearn.model_selection"):
            without.setitem(sys.modules, module, None)  # importing it raises
        assert_split(digits())
    for damaged in (b"not an npz", _npz(x_train=np.zeros((3, 1, 8, 8), np.float32))):
        cached.write_bytes(damaged)
        assert_split(digits())
        assert _read_digits(cached) is not None
    (tmp_path / "fusekit").rename(tmp_path / "moved")
    (tmp_path / "fusekit").write_text("a file where the folder would be")
    assert_split(digits())


def _npz(**arrays) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def test_synthetic_is_seeded_and_sized():
    a = synthetic(samples=500, features=7, classes=4, seed=1)
    b = load_dataset("synthetic", samples=500, features=7, classes=4, seed=1)
    assert a.input_shape == (7,) and len(a.y_train) == 400 and a.num_classes == 4
    np.testing.assert_array_equal(a.x_train, b.x_train)
    assert not np.array_equal(a.x_train, synthetic(samples=500, features=7, classes=4).x_train)


def test_npz(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "d.npz"
    np.savez(
        path,
        x_train=rng.normal(size=(20, 3)),
        y_train=rng.integers(0, 3, 20),
        x_test=rng.normal(size=(5, 3)),
        y_test=np.array([0, 1, 2, 2, 1]),
    )
    ds = load_dataset("npz", path=path)
    assert ds.input_shape == (3,) and ds.num_classes == 3
    np.testing.assert_array_equal(ds.x_test, np.load(path)["x_test"].astype(np.float32))
    assert ds.normalization is None  # used as stored: no normalisation is named for it
    np.savez(tmp_path / "bad.npz", x_train=np.zeros((2, 2)))
    with pytest.raises(DataError, match="missing array"):
        load_dataset("npz", path=tmp_path / "bad.npz")


def _write_idx(path, array, gz):
    header = struct.pack(">HBB", 0, 8, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    data = header + array.astype(np.uint8).tobytes()
    with (gzip.open if gz else open)(path, "wb") as f:
        f.write(data)


@pytest.mark.parametrize("gz", [False, True])
def test_mnist_idx_files(tmp_path, gz):
    folder = tmp_path / "MNIST" / "raw"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    suffix = ".gz" if gz else ""
    _write_idx(folder / f"train-images-idx3-ubyte{suffix}", rng.integers(0, 256, (12, 28, 28)), gz)
    _write_idx(folder / f"train-labels-idx1-ubyte{suffix}", np.arange(12) % 10, gz)
    _write_idx(folder / f"t10k-images-idx3-ubyte{suffix}", rng.integers(0, 256, (4, 28, 28)), gz)
    _write_idx(folder / f"t10k-labels-idx1-ubyte{suffix}", np.arange(4), gz)
    ds = load_dataset("mnist", data_dir=tmp_path)
    assert ds.input_shape == (1, 28, 28) and ds.num_classes == 10 and len(ds.y_test) == 4


def test_missing_files_say_which_are_needed(tmp_path):
    with pytest.raises(DataError, match="train-images-idx3-ubyte"):
        load_dataset("fashion-mnist", data_dir=tmp_path)
    with pytest.raises(DataError, match="data_batch_1"):
        load_dataset("cifar10", data_dir=tmp_path)
    with pytest.raises(DataError, match="--data-dir"):
        load_dataset("mnist")


@pytest.mark.parametrize(("protocol", "numpy1"), [(2, False), (2, True),
                                                  (pickle.DEFAULT_PROTOCOL, False)])
def test_cifar10_batches(tmp_path, protocol, numpy1):
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {b"data": rng.integers(0, 256, (3, 3072), dtype=np.uint8), b"labels": [0, 5, 9],
                 b"batch_label": b"training batch 1 of 5", b"filenames": [b"a.png"] * 3}
        raw = pickle.dumps(batch, protocol=protocol)
        if numpy1:  # as the data set's own files (protocol 2) name numpy's array rebuilder
            raw = raw.replace(b"numpy._core.multiarray", b"numpy.core.multiarray")
        (tmp_path / name).write_bytes(raw)
    ds = load_dataset("cifar10", data_dir=tmp_path)
    assert ds.input_shape == (3, 32, 32) and len(ds.y_train) == 15 and ds.num_classes == 10


class _Hostile:
    """Unpickling this creates a file: what a hostile batch in a data folder would do."""

    def __init__(self, target):
        self.target = str(target)

    def __reduce__(self):
        return (open, (self.target, "w"))


@pytest.mark.parametrize("payload", [
    lambda marker: _Hostile(marker),
    lambda marker: {b"data": _Hostile(marker), b"labels": [0]},
    lambda marker: {b"data": np.array([_Hostile(marker)], dtype=object), b"labels": [0]},
])
def test_cifar10_hostile_pickle_executes_nothing(tmp_path, payload):
    marker = tmp_path / "pwned"
    data = tmp_path / "data"
    data.mkdir()
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        (data / name).write_bytes(pickle.dumps(payload(marker)))
    with pytest.raises(DataError, match=r"data_batch_1: not a CIFAR-10 python batch \(refused "
                                        r"global (builtins|_?io)\.open"):
        load_dataset("cifar10", data_dir=data)
    assert not marker.exists()


@pytest.mark.parametrize(("batch", "found"), [
    ({b"data": np.zeros((2, 3072), np.float64), b"labels": [0, 1]}, "float64"),
    ({b"data": np.zeros((2, 10), np.uint8), b"labels": [0, 1]}, r"\(2, 10\)"),
    ({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0]}, r"\(1,\)"),
    ({b"data": b"raw", b"labels": [0]}, "bytes"),
])
def test_cifar10_malformed_batch(tmp_path, batch, found):
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        (tmp_path / name).write_bytes(pickle.dumps(batch, protocol=2))
    with pytest.raises(DataError, match=rf"data_batch_1: not a CIFAR-10 python batch.*{found}"):
        load_dataset("cifar10", data_dir=tmp_path)


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def _archive_claiming(rows: int):
    """A real .npz whose array headers claim ``rows`` x 3 float32 over 64 bytes of data."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": "<f4", "fortran_order": False, "shape": (rows, 3)})

    def write(path):
        with zipfile.ZipFile(path, "w") as archive:
            for name in ("x_train", "y_train", "x_test", "y_test"):
                archive.writestr(f"{name}.npy", header.getvalue() + b"\0" * 64)

    return write


@pytest.mark.parametrize(("write", "message"), [
    (lambda p: p.write_bytes(b"PK\x03\x04" + b"\0" * 60),
     r"not a readable \.npz file \(File is not a zip"),
    (lambda p: p.write_bytes(b"just text"), r"not a readable \.npz file"),
    (_archive_claiming(10**12), r"x_train: header claims 12000000000000 bytes of float32 "
                                r"data of shape \(1000000000000, 3\); the file holds 64"),
    (_archive_claiming(1000), r"x_train: header claims 12000 bytes"),
    (lambda p: p.write_bytes(_npy(np.zeros(3))),
     r"not a readable \.npz file \(File is not a zip file\)"),
])
def test_npz_hostile_files(tmp_path, write, message):
    path = tmp_path / "bad.npz"
    write(path)
    with pytest.raises(DataError, match=rf"bad\.npz: {message}"):
        load_dataset("npz", path=path)
