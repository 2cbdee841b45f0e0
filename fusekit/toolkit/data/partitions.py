"""Splitting a training set across simulated clients (ALGORITHMS.md §8).

Every function returns one sorted int64 index array per client, into the training set.
All randomness comes from ``numpy.random.default_rng(seed)``, so a seed fixes the split.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from fusekit.core.errors import ParameterError

logger = logging.getLogger(__name__)

PARTITIONS = ("iid", "dirichlet", "labels")
MAX_DRAWS = 10_000


def iid_partition(
    labels: np.ndarray, n_clients: int, *, min_samples: int = 1, seed: int = 0
) -> list[np.ndarray]:
    """Uniform random split into ``n_clients`` parts of (almost) equal size.

    Raises:
        ParameterError: fewer than ``n_clients * min_samples`` samples.
    """
    labels = _check_labels(labels)
    _check_clients(n_clients, min_samples, labels.size)
    order = np.random.default_rng(seed).permutation(labels.size)
    return [np.sort(part).astype(np.int64) for part in np.array_split(order, n_clients)]


def dirichlet_partition(
    labels: np.ndarray,
    n_clients: int,
    alpha: float,
    *,
    min_samples: int = 10,
    seed: int = 0,
) -> list[np.ndarray]:
    """Hetero-dir split: for each class k, proportions p_k ~ Dir_S(alpha) of its samples go
    to the S clients; the whole draw is repeated until every client has at least
    ``min_samples`` samples (PFNM/NAFI experimental setup, ALGORITHMS.md §8).

    Args:
        labels: (N,) integer class labels of the training set.
        n_clients: S >= 1.
        alpha: Dirichlet concentration > 0; small values give very skewed clients.
        min_samples: minimum number of samples per client.
        seed: random seed.

    Raises:
        ParameterError: invalid arguments, or no valid split found in 10,000 draws (ask
            for fewer clients, a larger alpha or a smaller minimum).
    """
    labels = _check_labels(labels)
    _check_clients(n_clients, min_samples, labels.size)
    if not alpha > 0:
        raise ParameterError(f"alpha: expected a Dirichlet concentration > 0, found {alpha}")
    rng = np.random.default_rng(seed)
    by_class = [rng.permutation(np.flatnonzero(labels == k)) for k in np.unique(labels)]
    for _ in range(MAX_DRAWS):
        parts: list[list[np.ndarray]] = [[] for _ in range(n_clients)]
        for members in by_class:
            proportions = rng.dirichlet(np.full(n_clients, float(alpha)))
            cuts = (np.cumsum(proportions)[:-1] * members.size).astype(np.int64)
            for client, chunk in enumerate(np.split(members, cuts)):
                parts[client].append(chunk)
        sizes = [sum(c.size for c in chunks) for chunks in parts]
        if min(sizes) >= min_samples:
            return [np.sort(np.concatenate(chunks)).astype(np.int64) for chunks in parts]
    raise ParameterError(
        f"dirichlet partition: no split of {labels.size} samples into {n_clients} clients with "
        f"alpha={alpha} gave every client >= {min_samples} samples in {MAX_DRAWS} draws; use "
        "fewer clients, a larger alpha or a smaller --min-samples"
    )


def label_partition(
    labels: np.ndarray,
    n_clients: int,
    min_classes: int,
    max_classes: int,
    *,
    min_samples: int = 1,
    seed: int = 0,
) -> list[np.ndarray]:
    """Hetero-label split (AMS paper): each client draws a random set of ``min_classes`` ..
    ``max_classes`` classes; the samples of a class are divided evenly at random among the
    clients that drew it. Draws are repeated until every class is drawn by some client
    (when ``n_clients * max_classes`` allows it) and every client has ``min_samples``.

    Samples of a class no client drew (only possible when S * max_classes < K) are unused.

    Raises:
        ParameterError: invalid class counts, or no valid draw in 10,000 attempts.
    """
    labels = _check_labels(labels)
    _check_clients(n_clients, min_samples, labels.size)
    classes = np.unique(labels)
    n_classes = classes.size
    if not (1 <= min_classes <= max_classes <= n_classes):
        raise ParameterError(
            f"labels partition: expected 1 <= min_classes <= max_classes <= {n_classes} "
            f"(classes in the data), found {min_classes}..{max_classes}"
        )
    rng = np.random.default_rng(seed)
    can_cover = n_clients * max_classes >= n_classes
    for _ in range(MAX_DRAWS):
        drawn = [
            rng.choice(n_classes, size=rng.integers(min_classes, max_classes + 1), replace=False)
            for _ in range(n_clients)
        ]
        owners: list[list[int]] = [[] for _ in range(n_classes)]
        for client, chosen in enumerate(drawn):
            for k in chosen:
                owners[k].append(client)
        if can_cover and any(not o for o in owners):
            continue
        parts: list[list[np.ndarray]] = [[] for _ in range(n_clients)]
        for k, clients in enumerate(owners):
            if not clients:
                continue
            members = rng.permutation(np.flatnonzero(labels == classes[k]))
            for client, chunk in zip(clients, np.array_split(members, len(clients)), strict=True):
                parts[client].append(chunk)
        sizes = [sum(c.size for c in chunks) for chunks in parts]
        if min(sizes) >= min_samples:
            if not can_cover:
                unused = [int(classes[k]) for k, o in enumerate(owners) if not o]
                logger.warning("labels partition: classes %s are not held by any client", unused)
            return [np.sort(np.concatenate(chunks)).astype(np.int64) for chunks in parts]
    raise ParameterError(
        f"labels partition: no draw of {min_classes}..{max_classes} classes for {n_clients} "
        f"clients gave every client >= {min_samples} samples in {MAX_DRAWS} attempts"
    )


def partition(
    labels: np.ndarray,
    n_clients: int,
    method: str = "dirichlet",
    *,
    alpha: float = 0.5,
    min_classes: int | None = None,
    max_classes: int | None = None,
    min_samples: int = 10,
    seed: int = 0,
) -> list[np.ndarray]:
    """Split by name: ``iid``, ``dirichlet`` (uses ``alpha``) or ``labels`` (uses
    ``min_classes``/``max_classes``; default 3..6 of 10 classes as in the AMS paper, scaled
    to the number of classes).

    Raises:
        ParameterError: unknown method or invalid parameters.
    """
    if method == "iid":
        return iid_partition(labels, n_clients, min_samples=min_samples, seed=seed)
    if method == "dirichlet":
        return dirichlet_partition(labels, n_clients, alpha, min_samples=min_samples, seed=seed)
    if method == "labels":
        n_classes = int(np.unique(_check_labels(labels)).size)
        low = min_classes if min_classes is not None else max(1, round(0.3 * n_classes))
        high = max_classes if max_classes is not None else max(low, round(0.6 * n_classes))
        return label_partition(labels, n_clients, low, high, min_samples=min_samples, seed=seed)
    raise ParameterError(f"partition: expected one of {list(PARTITIONS)}, found {method!r}")


def class_counts(labels: np.ndarray, indices: np.ndarray, n_classes: int) -> list[int]:
    """Per-class sample counts of one client, length ``n_classes``."""
    return np.bincount(labels[indices], minlength=n_classes).astype(int).tolist()


def _check_labels(labels: Sequence[int] | np.ndarray) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim != 1 or labels.size == 0 or labels.dtype.kind not in "iu":
        raise ParameterError(
            f"labels: expected a non-empty 1-D integer array, found shape {labels.shape} "
            f"dtype {labels.dtype}"
        )
    return labels


def _check_clients(n_clients: int, min_samples: int, n_samples: int) -> None:
    if not isinstance(n_clients, (int, np.integer)) or n_clients < 1:
        raise ParameterError(f"clients: expected an integer >= 1, found {n_clients!r}")
    if min_samples < 1:
        raise ParameterError(f"min_samples: expected >= 1, found {min_samples}")
    if n_clients * min_samples > n_samples:
        raise ParameterError(
            f"clients: {n_clients} clients with >= {min_samples} samples each need "
            f"{n_clients * min_samples} samples; the training set has {n_samples}"
        )
