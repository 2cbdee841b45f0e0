"""Literal numpy transcriptions of ALGORITHMS.md §3-4 used until fusekit.reference lands."""

import numpy as np
from scipy.optimize import linear_sum_assignment


def _pfnm_parts(local, client_precision, global_sums, global_precisions, global_counts, n_clients,
                mu0, sigma0_2, gamma0):
    j_l, p = local.shape
    s = np.broadcast_to(np.asarray(client_precision, float), (p,))
    mu0 = np.broadcast_to(np.asarray(mu0, float), (p,))
    sigma0_2 = np.broadcast_to(np.asarray(sigma0_2, float), (p,))
    means = global_sums / global_precisions
    a = s * global_precisions / (s + global_precisions)
    diff = local[None, :, :] - means[:, None, :]
    existing = np.einsum("ip,ijp->ij", a, diff**2)
    existing += 2 * np.log((n_clients - global_counts) / global_counts)[:, None]
    new_col = ((s / (1 + s * sigma0_2)) * (local - mu0) ** 2).sum(1)
    k = np.arange(1, j_l + 1)
    new = new_col[None, :] + 2 * np.log(k * n_clients / gamma0)[:, None]
    return np.vstack([existing, new]), means, s, mu0, sigma0_2


def pfnm_cost(local, client_precision, global_sums, global_precisions, global_counts, *,
              n_clients, mu0=0.0, sigma0_2=1.0, gamma0=1.0):
    return _pfnm_parts(local, client_precision, global_sums, global_precisions, global_counts,
                       n_clients, mu0, sigma0_2, gamma0)[0]


def _kl(local, s, means, precisions):
    r = (precisions + s) / precisions
    diff = local[None, :, :] - means[:, None, :]
    const = (r - 1 - np.log(r)).sum(1)
    quad = np.einsum("ip,ijp->ij", s**2 / (precisions + s), diff**2)
    return 0.5 * (const[:, None] + quad)


def nafi_cost(local, client_precision, global_sums, global_precisions, global_counts, *,
              n_clients, mu0=0.0, sigma0_2=1.0, gamma0=1.0, lam=0.0):
    cost, means, s, mu0, sigma0_2 = _pfnm_parts(local, client_precision, global_sums,
                                                 global_precisions, global_counts, n_clients,
                                                 mu0, sigma0_2, gamma0)
    j_l = local.shape[0]
    kl_existing = _kl(local, s, means, global_precisions)
    kl_new = _kl(local, s, mu0[None, :], 1.0 / sigma0_2[None, :])
    kl = np.vstack([kl_existing, np.repeat(kl_new, j_l, axis=0)])
    return cost + lam * kl


def solve_assignment(cost):
    return linear_sum_assignment(cost)
