"""Empirical-Bayes hyperparameters of one layer: sigma^2, sigma0^2 and gamma0 from the clients.

Hard EM over the assignments (docs/ALGORITHMS.md §3, "Empirical Bayes"): starting from
sigma^2 = sigma0^2 = v/2 (v: the per-coordinate variance of the layer's neuron vectors, so
the marginal variance sigma0^2 + sigma^2 starts at v) and gamma0 = 1, repeat

* E-step: match the layer (width inferred) with the current values, with PFNM's cost plus
  the log-determinant terms Eq. 5 leaves out, so that the assignments maximise the model's
  marginal likelihood (without them a true match of a tight global costs more than a new
  neuron when sigma^2 << sigma0^2, and the estimate of sigma^2 collapses);
* M-step: the maximum-likelihood values given those assignments, with the small-sample
  corrections of a one-way random-effects model:
  sigma^2  = sum_i sum_{members} (w - mean_i)^2 / sum_i (n_i - 1)   (within globals),
  sigma0^2 = mean_i [ (mean_i - mu0)^2 - sigma^2 / n_i ]            (between globals),
  gamma0   = J / H_S                                                (IBP: E[J] = gamma0 H_S),
  per coordinate in units of v, pooled over the coordinates of the layer;

until the values move by less than 1 % or after ``MAX_ROUNDS`` rounds. Values the user
gives are kept fixed (and not estimated).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fusekit.methods.bayesian.layer import MatchingBackend, match_neurons

logger = logging.getLogger(__name__)

MAX_ROUNDS = 25
TOLERANCE = 1e-2
#: sigma0^2 never goes below this share of v (a prior of zero variance would pin every
#: global neuron to mu0).
MIN_RELATIVE_VARIANCE = 1e-4


@dataclass(frozen=True)
class Hyperparameters:
    """One layer's hyperparameters, sigma^2 and sigma0^2 in units of the layer's variance v.

    Attributes:
        sigma2: client noise variance sigma^2 / v (shared by the clients).
        sigma0_2: prior variance sigma0^2 / v.
        gamma0: Beta-process mass.
        rounds: EM rounds run (0 when nothing was estimated).
        estimated: the names of the values estimated (the others were given).
    """

    sigma2: float
    sigma0_2: float
    gamma0: float
    rounds: int = 0
    estimated: tuple[str, ...] = ()


def harmonic(n: int) -> float:
    """H_n = sum_{s=1}^n 1/s, the expected number of dishes per unit mass in an IBP."""
    return float(np.sum(1.0 / np.arange(1, n + 1)))


def moments(
    vectors: Sequence[np.ndarray],
    observed: Sequence[np.ndarray],
    unit: np.ndarray,
    assignments: Sequence[np.ndarray],
    n_global: int,
    mu0: float,
) -> tuple[float | None, float]:
    """(sigma^2, sigma0^2 + E[sigma^2/n_i]) moments of an assignment, in units of ``unit``.

    Returns the within-global variance (None when no global has two members observing a
    coordinate) and the mean squared distance of the member means to mu0.
    """
    n_coords = unit.size
    sums = np.zeros((n_global, n_coords))
    squares = np.zeros((n_global, n_coords))
    counts = np.zeros((n_global, n_coords))
    for vec, obs, rows in zip(vectors, observed, assignments, strict=True):
        seen = np.broadcast_to(obs, vec.shape)
        scaled = np.where(seen, vec / np.sqrt(unit), 0.0)
        np.add.at(sums, rows, scaled)
        np.add.at(squares, rows, scaled * scaled)
        np.add.at(counts, rows, seen.astype(np.float64))
    has = counts > 0
    means = np.where(has, sums / np.maximum(counts, 1), 0.0)
    within = squares - counts * means * means
    dof = float(np.sum(np.maximum(counts - 1, 0)))
    sigma2 = float(within.sum() / dof) if dof > 0 else None
    centred = means - mu0 / np.sqrt(unit)
    between = float(np.sum(np.where(has, centred * centred, 0.0)) / max(int(has.sum()), 1))
    inverse_n = float(np.sum(np.where(has, 1.0 / np.maximum(counts, 1), 0.0))
                      / max(int(has.sum()), 1))
    return sigma2, between - (sigma2 or 0.0) * inverse_n


def estimate(
    vectors: Sequence[np.ndarray],
    observed: Sequence[np.ndarray],
    unit: np.ndarray,
    *,
    sigma2: float | None = None,
    sigma0_2: float | None = None,
    gamma0: float | None = None,
    mu0: float = 0.0,
    sweeps: int = 5,
    seed: int = 0,
    backend: str | MatchingBackend = "core",
) -> Hyperparameters:
    """Empirical-Bayes sigma^2, sigma0^2, gamma0 of one layer (module docstring).

    Args:
        vectors: per client, (J_s, P) neuron vectors.
        observed: per client, (P,) bool, the coordinates the client observes.
        unit: (P,) positive per-coordinate variance unit v (all results are in units of v).
        sigma2, sigma0_2, gamma0: given values (relative to v for the variances), kept
            fixed; None: estimated.
        mu0: prior mean (weight units).
        sweeps, seed, backend: as :func:`match_neurons` for the E-steps.

    Returns:
        Hyperparameters.
    """
    wanted = tuple(name for name, value in
                   (("sigma", sigma2), ("sigma0", sigma0_2), ("gamma", gamma0)) if value is None)
    current = [0.5 if sigma2 is None else sigma2, 0.5 if sigma0_2 is None else sigma0_2,
               1.0 if gamma0 is None else gamma0]
    if not wanted:
        return Hyperparameters(*current)
    n_clients = len(vectors)
    rounds = 0
    for rounds in range(1, MAX_ROUNDS + 1):
        a, b, g = current
        precisions = [obs / (a * unit) for obs in observed]
        result = match_neurons(vectors, precisions, mu0=mu0, sigma0_2=b * unit, gamma0=g,
                               sweeps=sweeps, seed=seed, log_det=True, backend=backend)
        within, spread = moments(vectors, observed, unit, result.assignments, result.width,
                                 mu0)
        new = list(current)
        if sigma2 is None and within is not None:
            new[0] = max(within, MIN_RELATIVE_VARIANCE)
        if sigma0_2 is None:
            new[1] = max(spread, MIN_RELATIVE_VARIANCE)
        if gamma0 is None:
            new[2] = result.width / harmonic(n_clients)
        logger.debug("empirical Bayes round %d: sigma^2/v=%.4g sigma0^2/v=%.4g gamma0=%.4g "
                     "(width %d)", rounds, *new, result.width)
        change = max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(new, current, strict=True))
        current = new
        if change < TOLERANCE:
            break
    return Hyperparameters(*current, rounds=rounds, estimated=wanted)
