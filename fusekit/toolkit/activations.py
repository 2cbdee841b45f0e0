"""Inputs for activation-mode OT fusion, and the provider that runs clients on them.

:class:`ActivationInputs` is what ``fusekit.fuse(..., method="ot", activations=...)`` takes:
a callable ``(checkpoint, spec) -> per-hidden-layer pre-activations`` built from a fixed
batch of inputs. The fusion layers never import torch or data; this module does both.
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from fusekit.core.checkpoint import Checkpoint
from fusekit.core.errors import DataError, ParameterError
from fusekit.core.spec import PermutationSpec
from fusekit.toolkit.data.datasets import read_npy

ActivationSource = str | os.PathLike[str] | np.ndarray


class ActivationInputs:
    """Pre-activations of every client on one seeded batch of inputs.

    Args:
        source: see :func:`load_activation_inputs`.
        samples: at most this many inputs (a seeded random subset) are run.
        seed: seeds that subset (>= 0).
        data_dir: folder of a local data set named by ``source``.

    Raises:
        ParameterError: ``samples`` not a positive integer or ``seed`` not a non-negative one.
        DataError: see :func:`load_activation_inputs`.
    """

    def __init__(self, source: ActivationSource, samples: int = 256, seed: int = 0,
                 data_dir: str | os.PathLike[str] | None = None):
        _check_count("activation_samples", samples, 1)
        _check_count("seed", seed, 0)
        self.inputs = load_activation_inputs(source, samples, seed, data_dir)
        self.description: dict[str, Any] = {
            "source": _describe_source(source),
            "samples": samples,
            "seed": seed,
            "data_dir": os.fspath(data_dir) if data_dir is not None else None,
        }

    def __call__(self, checkpoint: Checkpoint, spec: PermutationSpec) -> list[np.ndarray]:
        from fusekit.toolkit.nn.fused import hidden_preactivations  # torch, only when run

        return hidden_preactivations(checkpoint, spec, self.inputs)

    def __repr__(self) -> str:
        return f"ActivationInputs({self.description})"


def _check_count(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ParameterError(f"{name}: expected an integer >= {minimum}, found {value!r}")


def load_activation_inputs(source: ActivationSource, samples: int, seed: int = 0,
                           data_dir: str | os.PathLike[str] | None = None) -> np.ndarray:
    """The inputs on which activation-mode OT compares neurons, float32 (N, ...).

    Args:
        source: an array (N, ...); a ``.npy`` file holding such an array; a ``.npz`` file
            holding ``x`` (or ``x_train``, fusekit's data-set format) of shape (N, ...); or
            the name of a :mod:`fusekit.toolkit.data` data set (its training inputs; mnist,
            fashion-mnist and cifar10 read their files from ``data_dir``).
        samples: at most this many rows are kept (a seeded random subset, in index order).
        seed: seeds the subset.
        data_dir: folder of a local data set's files.

    Raises:
        DataError: a missing, unreadable or malformed file (a directory, a broken archive,
            object arrays, a header claiming more data than the file holds), no
            ``x``/``x_train`` array, a non-numeric or empty array, or an unknown data-set name.
    """
    if isinstance(source, np.ndarray):
        inputs = source
    else:
        path = Path(os.fspath(source))
        if path.suffix in (".npy", ".npz") or path.exists():
            inputs = read_array_file(path)
        else:
            inputs = _dataset_inputs(os.fspath(source), data_dir)
    inputs = np.asarray(inputs)
    if inputs.ndim < 2 or len(inputs) == 0 or inputs.dtype.kind not in "fiu":
        raise DataError(
            f"activations: expected numeric inputs of shape (N, ...) with N >= 1, got "
            f"{inputs.dtype} array of shape {inputs.shape}"
        )
    if len(inputs) > samples:
        keep = np.sort(np.random.default_rng(seed).choice(len(inputs), samples, replace=False))
        inputs = inputs[keep]
    return np.ascontiguousarray(inputs, dtype=np.float32)


def _dataset_inputs(name: str, data_dir: str | os.PathLike[str] | None) -> np.ndarray:
    from fusekit.toolkit.data import load_dataset

    try:
        return load_dataset(name, data_dir=data_dir).x_train
    except ParameterError:
        raise DataError(
            f"activations: {name!r} is neither a .npy/.npz file nor a data set name "
            "of fusekit.toolkit.data"
        ) from None


def read_array_file(path: Path) -> np.ndarray:
    """The array of a ``.npy`` file, or ``x``/``x_train`` of a ``.npz`` file, checked first.

    Raises:
        DataError: naming the file: missing, a directory, not a .npy/.npz, unreadable,
            object arrays, or a header that claims more data than the file holds.
    """
    if path.is_dir():
        raise DataError(f"{path}: activation input is a directory; expected a .npy or .npz file")
    if not path.is_file():
        raise DataError(f"{path}: activation input file does not exist")
    if path.suffix not in (".npy", ".npz"):
        raise DataError(f"{path}: expected a .npy or .npz file, found suffix {path.suffix!r}")
    try:
        if path.suffix == ".npy":
            with path.open("rb") as f:
                return read_npy(f, path.stat().st_size, str(path))
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
            for key in ("x", "x_train"):
                if f"{key}.npy" in names:
                    with archive.open(f"{key}.npy") as f:
                        size = archive.getinfo(f"{key}.npy").file_size
                        return read_npy(f, size, f"{path}[{key}]")
    except DataError:
        raise
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise DataError(f"{path}: not a readable {path.suffix} file ({exc})") from None
    found = sorted(n.removesuffix(".npy") for n in names)
    raise DataError(f"{path}: expected an array named 'x' or 'x_train', found {found}")


def _describe_source(source: ActivationSource) -> str:
    if isinstance(source, np.ndarray):
        return f"<array {tuple(source.shape)}>"
    return os.fspath(source)
