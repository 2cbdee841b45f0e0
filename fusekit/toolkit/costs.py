"""The engine's cost kernels in torch, for a CUDA device (docs/ALGORITHMS.md §3-5).

Each kernel takes the arguments of its C++ twin in ``fusekit._core`` (validated, contiguous
float64 numpy arrays, as :mod:`fusekit.engine.matching` hands them over) plus the torch
device, and returns what the twin returns: a float64 numpy matrix, equal to rounding. They
follow csrc/cost.cpp: every cost is a weighted squared distance expanded into matrix
products plus row and column terms, and entries that lost digits to cancellation (a neuron
close to another) are recomputed as sums of squared differences. Float64 throughout, so
assignments on a device are those of the CPU.

:func:`accelerator` binds them to a device for :func:`fusekit.engine.offload.set_accelerator`,
which the toolkit calls when it is imported.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np
import torch

from fusekit.core.errors import ParameterError
from fusekit.engine.offload import Accelerator
from fusekit.toolkit.train import resolve_device

__all__ = ["accelerator", "inner_products", "posterior_cost", "sqeuclidean_cost"]

#: csrc/cost.cpp's kCancellation: an entry below this fraction of the magnitude of its
#: terms has lost digits and is recomputed exactly.
CANCELLATION = 1.0 / 64
#: Pairs recomputed exactly per batch: at most this many (pair, coordinate) products.
_EXACT_BATCH = 1 << 24


def accelerator(device: str) -> Accelerator | None:
    """The kernels bound to ``device`` (``auto``: the current CUDA device, None without one).

    Raises:
        ParameterError: ``cuda[:N]`` without that CUDA device.
    """
    if device == "auto":
        if not torch.cuda.is_available():
            return None
        device = "cuda"
    target = resolve_device(device)
    if target.index is not None and target.index >= torch.cuda.device_count():
        raise ParameterError(f"device: {device!r} asked, torch sees "
                             f"{torch.cuda.device_count()} CUDA device(s)")
    if target.index is None:
        target = torch.device("cuda", torch.cuda.current_device())
    return Accelerator(str(target), partial(sqeuclidean_cost, device=target),
                       partial(posterior_cost, device=target),
                       partial(inner_products, device=target))


def _tensor(array: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """float64 on ``device``; a read-only array (a memory-mapped checkpoint's) is copied,
    as torch keeps no read-only tensors."""
    array = np.asarray(array, dtype=np.float64)
    if array.flags.writeable:
        return torch.as_tensor(array, device=device)
    return torch.tensor(array, device=device)


def _recompute(out: torch.Tensor, cancelled: torch.Tensor, p: int,
               exact: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
    """``out[i, j] = exact(i, j)`` in place where ``cancelled``, in batches of pairs."""
    rows, cols = cancelled.nonzero(as_tuple=True)
    batch = max(1, _EXACT_BATCH // max(p, 1))
    for start in range(0, rows.numel(), batch):
        i, j = rows[start:start + batch], cols[start:start + batch]
        out[i, j] = exact(i, j)


def sqeuclidean_cost(a: np.ndarray, b: np.ndarray, *, device: torch.device | str
                     ) -> np.ndarray:
    """``out[i, j] = sum_p (a[i, p] - b[j, p])**2`` for a (n, p), b (m, p) float64: the
    squared-Euclidean ground cost of OT fusion (ALGORITHMS.md §5), as
    :func:`fusekit.engine.matching.sqeuclidean_cost`; one product plus norms on ``device``."""
    with torch.inference_mode():
        left, right = _tensor(a, device), _tensor(b, device)
        scale = (left * left).sum(1)[:, None] + (right * right).sum(1)[None, :]
        out = torch.addmm(scale, left, right.T, alpha=-2.0)
        _recompute(out, out < CANCELLATION * scale, left.shape[1],
                   lambda i, j: ((left[i] - right[j]) ** 2).sum(1))
        return out.cpu().numpy()


def inner_products(pairs: list[tuple[np.ndarray, np.ndarray]], *,
                   device: torch.device | str) -> np.ndarray:
    """``sum_k a_k @ b_k.T`` in float64 on ``device``, as
    :func:`fusekit.engine.matching.inner_products` (weight matching's similarity)."""
    with torch.inference_mode():
        total = None
        for a, b in pairs:
            left, right = _tensor(a, device), _tensor(b, device)
            total = left @ right.T if total is None else total.addmm_(left, right.T)
        return total.cpu().numpy()


def _posterior_weight(s: torch.Tensor, precision: torch.Tensor, lam: float) -> torch.Tensor:
    """PFNM's s P / (s + P) plus lam/2 times the KL's s^2 / (P + s) (csrc/cost.cpp)."""
    return s * (precision + 0.5 * lam * s) / (s + precision)


def _kl_constant(s: torch.Tensor, precision: torch.Tensor) -> torch.Tensor:
    """The KL's terms that do not depend on the local neuron: 1/2 (r - 1 - ln r) per
    coordinate, r = (P + s) / P."""
    x = s / precision
    return 0.5 * (x - torch.log1p(x))


def posterior_cost(local: np.ndarray, client_precision: np.ndarray, global_sums: np.ndarray,
                   global_precisions: np.ndarray, global_counts: np.ndarray, mu0: np.ndarray,
                   sigma0_2: np.ndarray, n_clients: float, gamma0: float, lam: float, *,
                   device: torch.device | str) -> np.ndarray:
    """The PFNM / NAFI matching cost of one client against the global posterior (PFNM
    Eq. 5, NAFI Eq. 14) on ``device``: :func:`fusekit.engine.matching.nafi_cost`'s matrix.

    Args:
        local: (J_l, P) the client's neuron vectors.
        client_precision: (P,) s, 0 where the client does not observe a coordinate.
        global_sums, global_precisions: (J_g, P) the posteriors' running sums (prior
            included); precisions > 0.
        global_counts: (J_g,) n_i, clients other than this one in global neuron i.
        mu0, sigma0_2: (P,) the prior's mean and variance.
        n_clients, gamma0, lam: S, the Beta-process mass, NAFI's KL weight (0: PFNM).

    Returns:
        (J_g + J_l, J_l) float64: rows of the existing globals, then the new-neuron slots.
    """
    with torch.inference_mode():
        w, s = _tensor(local, device), _tensor(client_precision, device)
        precision = _tensor(global_precisions, device)
        means = _tensor(global_sums, device) / precision
        weight = _posterior_weight(s, precision, lam)  # (J_g, P); 0 where s = 0
        row_term = (weight * means * means).sum(1)
        squares = w * w
        out = torch.addmm(row_term[:, None], weight, squares.T)
        out.addmm_(weight * means, w.T, alpha=-2.0)
        if w.shape[1]:  # the magnitude of the terms, over the coordinates the client sees
            top = weight.amax(1) if weight.shape[0] else weight.new_zeros(0)
            seen = (squares * (s > 0)).sum(1)
            _recompute(out, out < CANCELLATION * (row_term[:, None] + top[:, None] * seen),
                       w.shape[1], lambda i, j: (weight[i] * (w[j] - means[i]) ** 2).sum(1))
        counts = _tensor(global_counts, device)
        offset = 2.0 * torch.log((n_clients - counts) / counts)
        if lam:
            offset += lam * _kl_constant(s, precision).sum(1)
        out += offset[:, None]
        # New-neuron slot k: the distance to the prior plus its penalty 2 log(k S / gamma0).
        prior_precision = 1.0 / _tensor(sigma0_2, device)
        to_prior = (_posterior_weight(s, prior_precision, lam)
                    * (w - _tensor(mu0, device)) ** 2).sum(1)
        if lam:
            to_prior += lam * _kl_constant(s, prior_precision).sum()
        slots = torch.arange(1, w.shape[0] + 1, dtype=torch.float64, device=w.device)
        new = to_prior[None, :] + 2.0 * torch.log(slots * n_clients / gamma0)[:, None]
        return torch.cat([out, new]).cpu().numpy()
