"""Models fusekit did not train: plain torch on raw arrays, as a user brings them.

scikit-learn's digits, pixels divided by 16 (values in [0, 1]) and nothing else; the same
stratified 75/25 split as fusekit's ``digits`` data set; the training split divided between
clients. Each model family is trained in plain torch (Adam, cross-entropy) from an
independent initialisation per client, saved with ``safetensors.torch.save_file`` (no
fusekit metadata), and the arrays written with ``np.savez``: exactly what a newcomer holds.

- ``mlp``: ``nn.Sequential`` 64-64-10 on vectors (N, 64).
- ``bn_mlp``: ``nn.Sequential`` 64-100-100-10 with BatchNorm1d, on vectors.
- ``cnn``: a small CNN with its own module names (``stem``, ``mix``, ``head``) on images
  (N, 1, 8, 8); fusekit cannot rebuild it (padding and pooling are not in the tensors), so
  it is evaluated by loading tensors back into :class:`OwnCNN`.
- ``resnet20``: the CIFAR ResNet-20 built by fusekit's torchvision-named builder (the
  tensor names let fusekit infer the architecture), narrow, on images.

Small and fast: the whole set trains in seconds on one CPU core.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import safetensors.torch
import torch
from bench_own_models import raw_digits as digits_as_stored
from bench_own_models import train
from threadpoolctl import threadpool_limits
from torch import nn

KINDS = ("mlp", "bn_mlp", "cnn", "resnet20")
VECTOR_KINDS = ("mlp", "bn_mlp")


@dataclass(frozen=True)
class Arrays:
    """Raw digits: x float32 in [0, 1], images (N, 1, 8, 8); y int64."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray

    def as_vectors(self) -> Arrays:
        return Arrays(self.x_train.reshape(len(self.x_train), -1), self.y_train,
                      self.x_test.reshape(len(self.x_test), -1), self.y_test)

    def subset(self, index: np.ndarray) -> Arrays:
        """The training rows ``index``; the test split whole."""
        return Arrays(self.x_train[index], self.y_train[index], self.x_test, self.y_test)

    def save(self, path: Path) -> Path:
        np.savez(path, x_train=self.x_train, y_train=self.y_train,
                 x_test=self.x_test, y_test=self.y_test)
        return path


def raw_digits() -> Arrays:
    """scikit-learn's digits as a user holds them: pixels / 16, no standardisation."""
    x_train, x_test, y_train, y_test = digits_as_stored()
    return Arrays(x_train, y_train, x_test, y_test)


def client_indices(labels: np.ndarray, clients: int, seed: int = 0) -> list[np.ndarray]:
    """An iid split of ``labels``' rows into ``clients`` sorted index arrays."""
    order = np.random.default_rng(seed).permutation(len(labels))
    return [np.sort(part) for part in np.array_split(order, clients)]


class OwnCNN(nn.Module):
    """A CNN whose module names are its author's, not fusekit's."""

    def __init__(self, width: int = 16, hidden: int = 32, classes: int = 10):
        super().__init__()
        self.stem = nn.Conv2d(1, width, 3, padding=1)
        self.stem_norm = nn.BatchNorm2d(width)
        self.mix = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.mix_norm = nn.BatchNorm2d(2 * width)
        self.hidden = nn.Linear(2 * width * 2 * 2, hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.max_pool2d(torch.relu(self.stem_norm(self.stem(x))), 2)
        x = nn.functional.max_pool2d(torch.relu(self.mix_norm(self.mix(x))), 2)
        return self.head(torch.relu(self.hidden(x.flatten(1))))


def build(kind: str, seed: int) -> nn.Module:
    """A freshly initialised model of ``kind`` (seeded: each client its own init)."""
    torch.manual_seed(seed)
    if kind == "mlp":
        return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    if kind == "bn_mlp":
        return nn.Sequential(nn.Linear(64, 100), nn.BatchNorm1d(100), nn.ReLU(),
                             nn.Linear(100, 100), nn.BatchNorm1d(100), nn.ReLU(),
                             nn.Linear(100, 10))
    if kind == "cnn":
        return OwnCNN()
    if kind == "resnet20":
        from fusekit.toolkit.nn.zoo import resnet20

        return resnet20(10, in_channels=1, widths=[8] * 4 + [16] * 4 + [32] * 4)
    raise ValueError(f"kind: expected one of {KINDS}, found {kind!r}")


# Enough to train each kind well past chance (resnet20: 0.90 test accuracy after 4 epochs, 0.95
# after 8 at twice the CPU).
EPOCHS = {"mlp": 30, "bn_mlp": 20, "cnn": 15, "resnet20": 4}


def accuracy(model: nn.Module, x: np.ndarray, y: np.ndarray) -> float:
    """torch's accuracy of ``model`` on the arrays as they are."""
    model.eval()
    with torch.inference_mode():
        return float((model(torch.from_numpy(x)).argmax(1) == torch.from_numpy(y))
                     .double().mean())


def save_state(model: nn.Module, path: Path) -> Path:
    """``safetensors.torch.save_file`` of the state_dict: no metadata at all."""
    safetensors.torch.save_file({k: v.detach().contiguous() for k, v in
                                 model.state_dict().items()}, str(path))
    return path


@dataclass
class Family:
    """One kind's clients: their models (eval mode), files, and each client's data file."""

    kind: str
    arrays: Arrays
    models: list[nn.Module] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)
    client_data: list[Path] = field(default_factory=list)
    data: Path | None = None

    def accuracy(self, model: nn.Module) -> float:
        return accuracy(model, self.arrays.x_test, self.arrays.y_test)


def make_family(kind: str, folder: Path, clients: int = 2, seed: int = 0) -> Family:
    """Train ``clients`` models of ``kind`` on an iid split of the raw digits and write them
    (``<kind>_<i>.safetensors``), each client's arrays (``<kind>_client<i>.npz``) and the
    whole split (``<kind>.npz``) under ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    arrays = raw_digits()
    arrays = arrays.as_vectors() if kind in VECTOR_KINDS else arrays
    family = Family(kind, arrays, data=arrays.save(folder / f"{kind}.npz"))
    for i, index in enumerate(client_indices(arrays.y_train, clients, seed)):
        own = arrays.subset(index)
        with one_thread():
            model = train(build(kind, seed=100 * seed + i), own.x_train, own.y_train,
                          EPOCHS[kind], seed=i)
        family.models.append(model)
        family.files.append(save_state(model, folder / f"{kind}_{i}.safetensors"))
        family.client_data.append(own.save(folder / f"{kind}_client{i}.npz"))
    return family


def load_family(kind: str, folder: Path, clients: int = 2) -> Family:
    """The family :func:`make_family` wrote under ``folder``, read back from its files."""
    arrays = raw_digits()
    arrays = arrays.as_vectors() if kind in VECTOR_KINDS else arrays
    family = Family(kind, arrays, data=folder / f"{kind}.npz")
    for i in range(clients):
        family.files.append(folder / f"{kind}_{i}.safetensors")
        family.models.append(load_into(kind, family.files[-1]))
        family.client_data.append(folder / f"{kind}_client{i}.npz")
    return family


def make_shared_family(kind: str, folder: Path, clients: int = 3, seed: int = 0) -> Family:
    """Clients fine-tuned from one base model (federated fine-tuning): the base is trained
    on a first share of the training split, then each client continues from a copy of it on
    its own share for half the epochs; written as :func:`make_family` writes them, under
    the names ``<kind>_shared_<i>.safetensors``."""
    folder.mkdir(parents=True, exist_ok=True)
    arrays = raw_digits()
    arrays = arrays.as_vectors() if kind in VECTOR_KINDS else arrays
    family = Family(kind, arrays, data=arrays.save(folder / f"{kind}_shared.npz"))
    public, *shares = client_indices(arrays.y_train, clients + 1, seed)
    with one_thread():
        base = train(build(kind, seed=100 * seed), arrays.x_train[public],
                     arrays.y_train[public], EPOCHS[kind], seed=seed)
    for i, index in enumerate(shares):
        own = arrays.subset(index)
        with one_thread():
            model = train(copy.deepcopy(base), own.x_train, own.y_train,
                          max(EPOCHS[kind] // 2, 1), seed=i)
        family.models.append(model)
        family.files.append(save_state(model, folder / f"{kind}_shared_{i}.safetensors"))
        family.client_data.append(own.save(folder / f"{kind}_shared_client{i}.npz"))
    return family


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Small models train several times faster on one torch and one BLAS thread on a busy
    machine (threads spinning for each other's cores)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with threadpool_limits(1):
            yield
    finally:
        torch.set_num_threads(previous)


def load_into(kind: str, path: Path) -> nn.Module:
    """A file's tensors loaded back into the author's own module (``strict``), as a user
    evaluates a model fusekit cannot rebuild."""
    model = build(kind, seed=0)
    model.load_state_dict(safetensors.torch.load_file(str(path)))
    return model.eval()
