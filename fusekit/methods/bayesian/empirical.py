"""Empirical-Bayes hyperparameters of one layer: sigma^2, sigma0^2 and gamma0, estimated
while the layer is matched.

Hard (classification) EM over the assignments (docs/ALGORITHMS.md §3, "Empirical Bayes"),
run inside the layer's own matching: the matching passes are the E-steps and
:class:`EmpiricalBayes` holds the values in use and is the M-step
(:data:`~fusekit.methods.bayesian.layer.MStep`) that
:func:`~fusekit.methods.bayesian.layer.match_neurons` calls between them (in the greedy
pass after 2, 4, 8, ... clients and after it, then after every sweep). Starting from sigma^2 = sigma0^2 = v/2 (v: the per-coordinate variance of
the layer's neuron vectors, so the marginal variance sigma0^2 + sigma^2 starts at v) and
gamma0 = 1:

* E-step: the matching pass, with PFNM's cost plus the log-determinant terms Eq. 5 leaves
  out, so that every assignment maximises the model's marginal likelihood given the
  values (without them a true match of a tight global costs as much as a new neuron
  when sigma^2 << sigma0^2 and nearly every neuron opens a global of its own);
* M-step: the maximum-likelihood values given the assignment, with the small-sample
  corrections of a one-way random-effects model:
  sigma^2  = sum_i sum_{members} (w - mean_i)^2 / sum_i (n_i - 1)   (within globals, over
             the globals whose own such estimate is at most the upper quartile of the
             globals': :func:`trimmed_within`),
  sigma0^2 = mean_i [ (mean_i - mu0)^2 - sigma^2 / n_i ]            (between globals),
  gamma0   = J / H_S                                                (IBP: E[J] = gamma0 H_S),
  per coordinate in units of v, pooled over the coordinates of the layer (S: the clients
  matched so far).

The values are fixed once an M-step moves none of them by more than 1 % and a sweep moves
no neuron; the final assignment is the matching's result (no second matching). Values the
user gives are kept fixed (and not estimated).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fusekit.engine import matching
from fusekit.methods.bayesian.layer import (
    SUM_BLOCK_VALUES,
    LayerMatching,
    MatchingBackend,
    Prior,
    match_neurons,
)

logger = logging.getLogger(__name__)

TOLERANCE = 1e-2
#: The M-step's moments of the shared globals are taken this many (global, coordinate)
#: values at a time (32 MB an array): where nothing matches and the bound of the globals
#: forces members together (GLOBALS_PER_WIDTH), they are thousands of globals of thousands
#: of coordinates; the layers of the quality benchmarks fit one block.
MOMENT_BLOCK_VALUES = 1 << 22
#: sigma^2 and sigma0^2 never go below this share of v (a variance of zero would pin
#: every global neuron to mu0, or make every distance infinite).
MIN_RELATIVE_VARIANCE = 1e-4
#: Starting values in units of v: sigma^2 + sigma0^2 = v, the marginal variance observed.
START = (0.5, 0.5, 1.0)
#: sigma^2 is pooled over the globals whose own within-global variance is at most this
#: quantile of the globals' (the loosest quarter is left out; see :func:`trimmed_within`).
TRIM = 0.75


@dataclass(frozen=True)
class Hyperparameters:
    """One layer's hyperparameters, sigma^2 and sigma0^2 in units of the layer's variance v.

    Attributes:
        sigma2: client noise variance sigma^2 / v (shared by the clients; the mean of the
            given values when the user gave them).
        sigma0_2: prior variance sigma0^2 / v.
        gamma0: Beta-process mass.
        rounds: M-steps run (0 when nothing was estimated).
        estimated: the names of the values estimated (the others were given).
        converged: the last M-step moved no value by more than the tolerance.
    """

    sigma2: float
    sigma0_2: float
    gamma0: float
    rounds: int = 0
    estimated: tuple[str, ...] = ()
    converged: bool = True


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
) -> tuple[float | None, float, float]:
    """Moments of an assignment in units of ``unit``: within- and between-global variance.

    Args:
        vectors, observed, assignments: per client, (J_s, P) neuron vectors, (P,) bool
            observed coordinates and (J_s,) global index of each neuron (unique).
        unit: (P,) positive variance unit v.
        n_global: number of globals the assignments index.
        mu0: prior mean (weight units).

    Returns:
        The trimmed pooled within-global variance (:func:`trimmed_within`; None when no
        global has two members observing a coordinate), the mean of (member mean - mu0)^2 and the mean of 1/n over the
        (global, coordinate) pairs observed (E[(mean - mu0)^2] = sigma0^2 + sigma^2 / n).
    """
    scale = 1.0 / np.sqrt(unit)
    centre = mu0 * scale
    # A global of one member has that member as its mean and no within-global scatter:
    # it adds to the between-global moments alone, so only the shared globals get rows.
    shared = np.bincount(np.concatenate(assignments), minlength=n_global) > 1
    row_of = np.cumsum(shared) - 1
    n_shared = int(np.count_nonzero(shared))
    seen = [obs.astype(np.float64) for obs in observed]
    alone_between, alone_seen = 0.0, 0
    for vec, obs, rows, client_seen in zip(vectors, observed, assignments, seen, strict=True):
        alone = np.flatnonzero(~shared[rows])
        if alone.size:
            alone_between += _lone_between(vec, alone, scale, centre, client_seen)
            alone_seen += alone.size * int(np.count_nonzero(obs))
    scatter, dof = np.empty(n_shared), np.empty(n_shared)
    between = inverse_n = 0.0
    n_seen = alone_seen
    step = max(1, MOMENT_BLOCK_VALUES // max(unit.size, 1))
    for start in range(0, n_shared, step):
        stop = min(start + step, n_shared)
        scatter[start:stop], dof[start:stop], block_between, block_inverse_n, block_seen = (
            _shared_moments(vectors, seen, assignments, shared, row_of, start, stop, scale,
                            centre))
        between += block_between
        inverse_n += block_inverse_n
        n_seen += block_seen
    n_seen = max(n_seen, 1)
    return (trimmed_within(scatter, dof), (between + alone_between) / n_seen,
            (inverse_n + alone_seen) / n_seen)


def _shared_moments(vectors, seen, assignments, shared, row_of, start, stop, scale, centre):
    """The shared globals ``start:stop`` (in the order of ``row_of``): per global the
    scatter of its members about their mean and its degrees of freedom (over the
    coordinates), and over the block the sum of (mean - mu0)^2 and of 1/n, and the number
    of (global, coordinate) pairs observed."""
    sums, squares, counts = (np.zeros((stop - start, scale.size)) for _ in range(3))
    for vec, client_seen, rows in zip(vectors, seen, assignments, strict=True):
        local = row_of[rows]
        mine = shared[rows] & (local >= start) & (local < stop)
        if mine.any():
            part = slice(None) if mine.all() else mine  # a view when all are in the block
            matching.add_moments(sums, squares, counts, local[part] - start,
                                 np.ascontiguousarray(vec[part]), scale, client_seen)
    # The arithmetic of the plain expressions, written into the arrays above and one
    # buffer (an M-step runs several times a layer; fresh state-sized temporaries cost
    # more in allocation and page faults than the arithmetic on small layers).
    unseen = counts == 0
    safe = np.maximum(counts, 1)
    means = np.divide(sums, safe, out=sums)
    work = np.multiply(counts, means)
    work *= means
    scatter = np.subtract(squares, work, out=squares).sum(axis=1)  # within-global
    np.subtract(counts, 1, out=work)
    dof = np.maximum(work, 0, out=work).sum(axis=1)
    n_seen = counts.size - int(np.count_nonzero(unseen))
    between = _masked_sum_of_squares(np.subtract(means, centre, out=work), unseen)
    inverse_n = float(np.sum(_zeroed(np.divide(1.0, safe, out=safe), unseen)))
    return scatter, dof, between, inverse_n, n_seen


def _zeroed(array: np.ndarray, where: np.ndarray) -> np.ndarray:
    """``array`` with 0 written where ``where`` holds (``np.where(~where, array, 0.0)`` in
    place)."""
    np.copyto(array, 0.0, where=where)
    return array


def _masked_sum_of_squares(array: np.ndarray, unseen: np.ndarray) -> float:
    """sum of array**2 over the entries not ``unseen``, squared in place."""
    values = _zeroed(array, unseen)
    return float(np.sum(np.multiply(values, values, out=values)))


def _lone_between(vec, alone, scale, centre, seen) -> float:
    """sum over the rows ``alone`` of vec and the coordinates seen of ((w * scale) - centre)^2,
    by blocks of rows: each row's value as one product over all rows gives it, summed
    in the same order, without copies of the client's vectors (from independent
    initialisations nearly every neuron is alone, and the vectors are the layer's largest
    arrays after the global state)."""
    per_row = np.empty(alone.size)
    step = max(1, SUM_BLOCK_VALUES // max(vec.shape[1], 1))
    for start in range(0, alone.size, step):
        centred = vec[alone[start:start + step]] * scale - centre
        per_row[start:start + step] = (centred * centred) @ seen
    return float(np.sum(per_row))


def trimmed_within(scatter: np.ndarray, dof: np.ndarray) -> float | None:
    """Pooled within-global variance over the globals whose own estimate is at most the
    :data:`TRIM` quantile of the globals' estimates (docs/ALGORITHMS.md §3, "Empirical
    Bayes": the loosest globals hold members no common noise level explains).

    Args:
        scatter: (J,) per global, the sum of squared deviations of its members from their
            mean (over coordinates).
        dof: (J,) per global, its degrees of freedom (sum over coordinates of n - 1).

    Returns:
        sum scatter / sum dof over the globals kept; None when no global has two members.
    """
    shared = dof > 0
    if not shared.any():
        return None
    scatter, dof = scatter[shared], dof[shared]
    own = scatter / dof
    kept = own <= np.quantile(own, TRIM)
    return float(scatter[kept].sum() / dof[kept].sum())


class EmpiricalBayes:
    """One layer's empirical-Bayes estimator: the values in use and the M-step that updates
    them (module docstring).

    Args:
        vectors: per client, (J_s, P) neuron vectors.
        observed: per client, (P,) bool, the coordinates the client observes.
        unit: (P,) positive per-coordinate variance unit v.
        weights: per client, (P,) precision factors (1 where observed, 0 where not, the
            class share on outgoing weights): client s's precision is weights[s] / sigma_s^2.
        sigma2: given (S, P) noise variances in units of v, kept fixed; None: estimated.
        sigma0_2: given (P,) prior variance in units of v; None: estimated.
        gamma0: given Beta-process mass; None: estimated.
        mu0: prior mean (weight units).
    """

    def __init__(self, vectors, observed, unit, *, weights, sigma2=None, sigma0_2=None,
                 gamma0=None, mu0=0.0):
        self.vectors, self.observed, self.unit, self.weights = vectors, observed, unit, weights
        self.given = (sigma2, sigma0_2, gamma0)
        self.mu0 = mu0
        self.estimated = tuple(name for name, value in zip(("sigma", "sigma0", "gamma"),
                                                           self.given, strict=True)
                               if value is None)
        self.current = [START[k] if value is None else value
                        for k, value in enumerate(self.given)]
        self.rounds = 0
        self.converged = not self.estimated

    @property
    def estimates_variances(self) -> bool:
        """sigma^2 or sigma0^2 is estimated (the matching then needs the log-determinants)."""
        return "sigma" in self.estimated or "sigma0" in self.estimated

    @property
    def posterior_means(self) -> bool:
        """Fused neurons are posterior means (Eq. 4) when sigma^2 and sigma0^2 are both
        given; with either estimated, their members' means (docs/ALGORITHMS.md §3)."""
        return not self.estimates_variances

    def variances(self) -> tuple[np.ndarray, np.ndarray]:
        """(S, P) noise variances sigma_s^2 and (P,) prior variance sigma0^2 in use, in
        weight units."""
        sigma2, sigma0_2, _ = self.current
        shape = (len(self.vectors), self.unit.size)
        return (np.broadcast_to(np.asarray(sigma2, dtype=np.float64) * self.unit, shape),
                np.broadcast_to(np.asarray(sigma0_2, dtype=np.float64) * self.unit,
                                self.unit.shape))

    def prior(self) -> Prior:
        """Per-client precisions, sigma0^2 (P,) in weight units and gamma0 in use."""
        noise, sigma0_2 = self.variances()
        precisions = [w / n for w, n in zip(self.weights, noise, strict=True)]
        return Prior(precisions, np.array(sigma0_2), float(self.current[2]))

    def __call__(self, assignments: Sequence[np.ndarray], n_global: int,
                 clients: Sequence[int]) -> Prior | None:
        """M-step on the assignment of ``clients``; the new values when one moved by more
        than the tolerance, else None (the values in use stay)."""
        given_sigma2, given_sigma0_2, given_gamma0 = self.given
        within, between, inverse_n = moments(
            [self.vectors[s] for s in clients], [self.observed[s] for s in clients],
            self.unit, [assignments[s] for s in clients], n_global, self.mu0)
        sigma2 = self.current[0] if given_sigma2 is not None or within is None else max(
            within, MIN_RELATIVE_VARIANCE)
        new = [sigma2,
               self.current[1] if given_sigma0_2 is not None
               else max(between - float(np.mean(sigma2)) * inverse_n, MIN_RELATIVE_VARIANCE),
               self.current[2] if given_gamma0 is not None
               else n_global / harmonic(len(clients))]
        self.rounds += 1
        change = max(_relative_change(x, y) for x, y in zip(new, self.current, strict=True))
        logger.debug("empirical Bayes round %d (%d clients): sigma^2/v=%.4g sigma0^2/v=%.4g "
                     "gamma0=%.4g (width %d)", self.rounds, len(clients),
                     float(np.mean(new[0])), float(np.mean(new[1])), new[2], n_global)
        self.converged = change < TOLERANCE
        if self.converged:
            return None
        self.current = new
        return self.prior()

    def result(self) -> Hyperparameters:
        """The values in use, sigma^2 and sigma0^2 as their means over the coordinates."""
        sigma2, sigma0_2, gamma0 = self.current
        return Hyperparameters(float(np.mean(sigma2)), float(np.mean(sigma0_2)), float(gamma0),
                               rounds=self.rounds, estimated=self.estimated,
                               converged=self.converged)


def _relative_change(new, old) -> float:
    new, old = np.asarray(new, dtype=np.float64), np.asarray(old, dtype=np.float64)
    return float(np.max(np.abs(new - old) / np.maximum(np.abs(old), 1e-12)))


def estimate_and_match(
    vectors: Sequence[np.ndarray],
    observed: Sequence[np.ndarray],
    unit: np.ndarray,
    *,
    weights: Sequence[np.ndarray] | None = None,
    sigma2: float | np.ndarray | None = None,
    sigma0_2: float | np.ndarray | None = None,
    gamma0: float | None = None,
    mu0: float = 0.0,
    sweeps: int = 5,
    seed: int = 0,
    lam: float = 0.0,
    width: int | None = None,
    backend: str | MatchingBackend = "core",
) -> tuple[LayerMatching, EmpiricalBayes]:
    """Match one layer, estimating the values not given while matching (module docstring).

    Args:
        vectors: per client, (J_s, P) neuron vectors.
        observed: per client, (P,) bool, the coordinates the client observes.
        unit: (P,) positive per-coordinate variance unit v.
        weights: per client, (P,) precision factors (default: the observed masks).
        sigma2: given noise variance in units of v: a scalar, (P,) or (S, P); None:
            estimated.
        sigma0_2: given prior variance in units of v, scalar or (P,); None: estimated.
        gamma0: given Beta-process mass; None: estimated.
        mu0, sweeps, seed, lam, width, backend: as :func:`match_neurons`.

    Returns:
        The LayerMatching and the :class:`EmpiricalBayes` holding the values used
        (``refit.result()``, ``refit.variances()``). When sigma^2 or sigma0^2 is estimated
        the matching uses the marginal-likelihood cost (``log_det``) and outputs the
        members' means (``shrink=False``); when both are given, the papers' cost and
        posterior means (Eq. 5, Eq. 4).
    """
    refit = EmpiricalBayes(vectors, observed, unit,
                           weights=weights if weights is not None
                           else [np.asarray(o, dtype=np.float64) for o in observed],
                           sigma2=sigma2, sigma0_2=sigma0_2, gamma0=gamma0, mu0=mu0)
    start = refit.prior()
    result = match_neurons(
        vectors, start.precisions, mu0=mu0, sigma0_2=start.sigma0_2, gamma0=start.gamma0,
        sweeps=sweeps, seed=seed, lam=lam, width=width, log_det=refit.estimates_variances,
        refit=refit if refit.estimated else None, shrink=refit.posterior_means,
        backend=backend)
    return result, refit
