"""Plain numpy reference implementations of the matching cost kernels.

Same signatures and results as ``fusekit.engine.matching``; written for clarity, not speed (they
form (J_global, J_local, P) temporaries). Used by the tests and by an explicit
``backend="numpy"`` switch in benchmarks, never as a silent fallback for the C++ core.
"""

from __future__ import annotations

import numpy as np

__all__ = ["nafi_cost", "pfnm_cost", "sqeuclidean_cost"]


def sqeuclidean_cost(a, b) -> np.ndarray:
    """``out[i, j] = sum_p (a[i, p] - b[j, p])**2`` for a (n, p), b (m, p)."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return ((a[:, None, :] - b[None, :, :]) ** 2).sum(axis=2)


def pfnm_cost(*arrays, **prior) -> np.ndarray:
    """Reference of :func:`fusekit.engine.matching.pfnm_cost` (ALGORITHMS.md §3): the
    reference :func:`nafi_cost` without its KL term (``lam=0``), same arguments."""
    return nafi_cost(*arrays, **prior, lam=0.0)


def nafi_cost(
    local,
    client_precision,
    global_sums,
    global_precisions,
    global_counts,
    *,
    n_clients: int,
    mu0=0.0,
    sigma0_2=1.0,
    gamma0: float = 1.0,
    lam: float = 1e-2,
) -> np.ndarray:
    """Reference of :func:`fusekit.engine.matching.nafi_cost` (ALGORITHMS.md §4)."""
    w = np.asarray(local, dtype=np.float64)
    j_local, p = w.shape
    s = np.broadcast_to(np.asarray(client_precision, dtype=np.float64), (p,))
    mu0 = np.broadcast_to(np.asarray(mu0, dtype=np.float64), (p,))
    sigma0_2 = np.broadcast_to(np.asarray(sigma0_2, dtype=np.float64), (p,))
    big_p = np.asarray(global_precisions, dtype=np.float64)
    means = np.asarray(global_sums, dtype=np.float64) / big_p
    counts = np.asarray(global_counts, dtype=np.float64)

    def block(prec, centre):
        # prec, centre: (rows, P) -> (rows, J_local)
        weight = s * prec / (s + prec)  # 1 / (sigma_s^2 + 1/P)
        sq = (w[None, :, :] - centre[:, None, :]) ** 2
        cost = (weight[:, None, :] * sq).sum(axis=2)
        if lam:
            r = (prec + s) / prec
            trace_logdet = 0.5 * (r - 1.0 - np.log(r)).sum(axis=1)
            shift = 0.5 * ((s**2 / (prec + s))[:, None, :] * sq).sum(axis=2)
            cost = cost + lam * (trace_logdet[:, None] + shift)
        return cost

    existing = block(big_p, means) + 2.0 * np.log((n_clients - counts) / counts)[:, None]
    prior = block((1.0 / sigma0_2)[None, :], mu0[None, :])  # (1, J_local)
    slots = np.arange(1, j_local + 1, dtype=np.float64)
    new = prior + 2.0 * np.log(slots * n_clients / gamma0)[:, None]
    return np.vstack([existing.reshape(-1, j_local), new])
