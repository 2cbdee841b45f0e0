"""Beta-Bernoulli neuron matching: the engine shared by PFNM and NAFI.

One call of :func:`match_neurons` matches the neurons of ONE layer across S clients
(NAFI paper, Algorithm 1 with the cost of Proposition 1 / Eq. 5, and Eq. 14 for NAFI;
docs/ALGORITHMS.md §3-4):

1. Clients are visited by decreasing width (stable on the order given, which
   ``fusekit.fuse`` makes canonical). The first client's neurons seed the global set;
   every other client is matched in turn (greedy pass).
2. ``sweeps`` refinement sweeps: for each client, in an order drawn from
   ``numpy.random.default_rng(seed)``, remove it from the posteriors (globals left empty
   are dropped), rebuild its cost matrix, solve the assignment, add it back.
3. The result is the posterior mean of every global neuron (Eq. 4).

Everything works on per-coordinate (diagonal) precisions: a client's precision vector
``s`` (P,) is ``1/sigma_s^2`` per coordinate and 0 where the client does not observe the
coordinate, so unobserved coordinates neither cost nor pull the estimate.

The posterior of global neuron i is kept as two running arrays that include the prior:
``sums[i] = mu0/sigma0^2 + sum_{(s,j) in Z_i} s_s * w_sj`` and
``precisions[i] = 1/sigma0^2 + sum s_s``; its mean is ``sums / precisions``. These are
exactly the ``global_sums`` / ``global_precisions`` arguments of ``fusekit.engine.matching``'s
cost kernels, so a cost matrix is built without any copy of the global state.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from fusekit.core.errors import ParameterError

logger = logging.getLogger(__name__)

BACKENDS = ("core", "numpy")


@dataclass(frozen=True)
class MatchingBackend:
    """The kernels one matching run uses (chosen explicitly, never as a fallback).

    ``pfnm_cost`` / ``nafi_cost`` follow the signatures of ``fusekit.engine.matching``;
    ``solve_assignment(cost) -> (row_ind, col_ind)`` follows SciPy's contract.
    """

    name: str
    pfnm_cost: Callable[..., np.ndarray]
    nafi_cost: Callable[..., np.ndarray]
    solve_assignment: Callable[..., tuple]


def get_backend(backend: str | MatchingBackend = "core") -> MatchingBackend:
    """The kernels named by ``backend``.

    Args:
        backend: ``"core"`` (fusekit's C++ cost kernels and assignment solver, the default),
            ``"numpy"`` (the vectorised numpy references of ``fusekit.engine.reference`` plus
            ``scipy.optimize.linear_sum_assignment``; for benchmarks and cross-checks), or a
            :class:`MatchingBackend` instance.

    Raises:
        ParameterError: an unknown backend name.
        ImportError: the C++ core is not built (``"core"``); never replaced silently.
    """
    if isinstance(backend, MatchingBackend):
        return backend
    if backend == "core":
        from fusekit.engine import matching

        # The engine validates its inputs once (match_neurons) and owns the global state
        # it passes, so the kernels skip re-validating arrays on every call.
        return MatchingBackend(
            "core",
            partial(matching.pfnm_cost, check_finite=False),
            partial(matching.nafi_cost, check_finite=False),
            matching.solve_assignment,
        )
    if backend == "numpy":
        from scipy.optimize import linear_sum_assignment

        from fusekit.engine import reference

        return MatchingBackend(
            "numpy", reference.pfnm_cost, reference.nafi_cost, linear_sum_assignment
        )
    raise ParameterError(f"backend: expected one of {BACKENDS}, found {backend!r}")


@dataclass
class LayerMatching:
    """Result of matching one layer.

    Attributes:
        means: (J, P) float64 posterior means of the J global neurons (Eq. 4).
        precisions: (J, P) float64 posterior precisions (including ``1/sigma0^2``).
        counts: (J,) int number of local neurons (= clients) in each global neuron.
        assignments: per client (in the order given), (J_s,) int global index of each
            local neuron; injective within a client.
        report: JSON-able summary (see :func:`match_neurons`).
    """

    means: np.ndarray
    precisions: np.ndarray
    counts: np.ndarray
    assignments: list[np.ndarray]
    report: dict[str, Any] = field(default_factory=dict)

    @property
    def width(self) -> int:
        return int(self.means.shape[0])


class _GlobalState:
    """Posterior statistics of the global neurons, with room to grow in place."""

    def __init__(self, n_coords: int, prior_sum: np.ndarray, prior_precision: np.ndarray):
        self.prior_sum = prior_sum
        self.prior_precision = prior_precision
        self.size = 0
        self.sums = np.empty((0, n_coords))
        self.precisions = np.empty((0, n_coords))
        self.counts = np.empty(0, dtype=np.int64)

    def _reserve(self, size: int) -> None:
        if size <= self.sums.shape[0]:
            return
        capacity = max(size, 2 * self.sums.shape[0], 16)
        for name in ("sums", "precisions", "counts"):
            old = getattr(self, name)
            new = np.empty((capacity, *old.shape[1:]), dtype=old.dtype)
            new[: self.size] = old[: self.size]
            setattr(self, name, new)

    def view(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Contiguous (J, P), (J, P), (J,) views of the live globals (no copy)."""
        return self.sums[: self.size], self.precisions[: self.size], self.counts[: self.size]

    def add(self, rows: np.ndarray, vectors: np.ndarray, precision: np.ndarray) -> None:
        """Add a client's neurons (J_s, P) with precision (P,) to globals ``rows``
        (``rows == size + k`` opens new ones)."""
        new_size = max(self.size, int(rows.max()) + 1) if rows.size else self.size
        self._reserve(new_size)
        if new_size > self.size:
            fresh = slice(self.size, new_size)
            self.sums[fresh] = self.prior_sum
            self.precisions[fresh] = self.prior_precision
            self.counts[fresh] = 0
            self.size = new_size
        _add_rows(self.sums, rows, vectors, 1.0, precision)
        _add_rows(self.precisions, rows, precision, 1.0)
        self.counts[rows] += 1

    def remove(self, rows: np.ndarray, vectors: np.ndarray, precision: np.ndarray) -> np.ndarray:
        """Remove a client's neurons; drop globals left empty. Returns old -> new index
        (-1 for dropped globals)."""
        _add_rows(self.sums, rows, vectors, -1.0, precision)
        _add_rows(self.precisions, rows, precision, -1.0)
        self.counts[rows] -= 1
        keep = np.flatnonzero(self.counts[: self.size] > 0)
        remap = np.full(self.size, -1, dtype=np.int64)
        remap[keep] = np.arange(keep.size)
        if keep.size < self.size:
            for name in ("sums", "precisions", "counts"):
                array = getattr(self, name)
                array[: keep.size] = array[keep]
            self.size = keep.size
        return remap


def _add_rows(
    target: np.ndarray,
    rows: np.ndarray,
    values: np.ndarray,
    sign: float,
    scale: np.ndarray | None = None,
) -> None:
    """``target[rows] += sign * values`` (``values * scale`` when scale is given) in place;
    rows are unique within one client; values (n, P), or (P,) added to every row. The C++
    core does it in one pass over the rows, where fancy-index += gathers, adds and scatters,
    and never stores ``values * scale`` (bit-identical to numpy's results)."""
    from fusekit.engine.native import core

    core().add_rows(target, rows, values, sign, scale)


def _as_coordinate_vector(value: Any, n_coords: int, name: str) -> np.ndarray:
    array = np.asarray(value, dtype=np.float64)
    if array.ndim == 0:
        array = np.full(n_coords, float(array))
    if array.shape != (n_coords,):
        raise ParameterError(
            f"{name}: expected a scalar or a vector of {n_coords} coordinates, "
            f"found shape {array.shape}"
        )
    if not np.isfinite(array).all():
        raise ParameterError(f"{name}: expected finite values, found {array}")
    return array


def _validate_inputs(
    vectors: Sequence[np.ndarray], precisions: Sequence[Any]
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    from fusekit.engine.native import core

    if len(vectors) < 1:
        raise ParameterError("vectors: expected at least one client, found none")
    if len(precisions) != len(vectors):
        raise ParameterError(
            f"precisions: expected one per client ({len(vectors)}), found {len(precisions)}"
        )
    vecs = [np.ascontiguousarray(v, dtype=np.float64) for v in vectors]
    n_coords = vecs[0].shape[1] if vecs[0].ndim == 2 else -1
    for s, v in enumerate(vecs):
        if v.ndim != 2 or v.shape[1] != n_coords or v.shape[0] < 1:
            raise ParameterError(
                f"vectors[{s}]: expected a non-empty (J_s, {n_coords}) matrix, found {v.shape}"
            )
        if np.isnan(core().finite_min(v)):
            # Checked once here: the core kernels then skip re-checking (check_finite=False).
            raise ParameterError(f"vectors[{s}]: expected finite values, found NaN or inf")
    precs = []
    for s, p in enumerate(precisions):
        vec = _as_coordinate_vector(p, n_coords, f"precisions[{s}]")
        if (vec < 0).any():
            raise ParameterError(f"precisions[{s}]: expected values >= 0, found a negative one")
        precs.append(vec)
    return vecs, precs


def match_neurons(
    vectors: Sequence[np.ndarray],
    precisions: Sequence[Any],
    *,
    mu0: float | np.ndarray = 0.0,
    sigma0_2: float | np.ndarray = 1.0,
    gamma0: float = 1.0,
    sweeps: int = 5,
    seed: int = 0,
    lam: float | None = None,
    max_width: int | None = None,
    backend: str | MatchingBackend = "core",
    true_labels: Sequence[np.ndarray] | None = None,
) -> LayerMatching:
    """Match the neurons of one layer across clients (PFNM, or NAFI when ``lam`` is given).

    Args:
        vectors: per client s, a (J_s, P) float array of neuron vectors (ALGORITHMS.md §2).
        precisions: per client, the observation precision ``1/sigma_s^2``: a scalar or a (P,)
            vector; 0 marks a coordinate the client does not observe.
        mu0: prior mean of the global neurons, scalar or (P,).
        sigma0_2: prior variance sigma0^2, scalar or (P,), > 0.
        gamma0: mass of the Beta process, > 0.
        sweeps: maximum number of refinement sweeps T after the greedy pass, >= 0. Sweeps
            stop early at a fixed point (a sweep in which no local neuron changed its
            global neuron): every later sweep would solve the same problems again.
        seed: seed of the generator that orders the clients in each sweep.
        lam: ``None`` for PFNM's cost (Eq. 5); a number >= 0 for NAFI's cost with KL weight
            lambda (Eq. 14). ``lam=0`` uses NAFI's kernel and gives PFNM's result.
        max_width: optional cap on the number of global neurons (>= the widest client);
            when it is reached a client can only match existing globals.
        backend: ``"core"`` (C++), ``"numpy"`` (reference + SciPy) or a MatchingBackend.
        true_labels: optional per-client (J_s,) ground-truth neuron identities (synthetic
            data): the report then gives the matching purity.

    Returns:
        LayerMatching. ``report`` holds ``width``, ``clients`` (per client in the order
        given: ``width``, ``matched`` = local neurons that share their global neuron with
        another client, ``new`` = the others), ``objective`` (per pass: the greedy pass then
        each sweep; 2 x negative log posterior up to constants, Eq. 3 with Eq. 4 plugged in),
        ``assignment_cost`` (per pass: the sum of the optimal assignment costs),
        ``moves`` (per sweep: local neurons that changed global neuron), ``sweeps_run``,
        ``time_cost_s`` / ``time_assignment_s`` (seconds building costs / solving),
        ``n_assignments``, and ``purity`` when ``true_labels`` is given.

    Raises:
        ParameterError: inconsistent shapes or out-of-range parameters.
        InfeasibleAssignmentError: from the solver (cannot happen with finite inputs).
    """
    vecs, precs = _validate_inputs(vectors, precisions)
    n_clients = len(vecs)
    n_coords = vecs[0].shape[1]
    mu0_vec = _as_coordinate_vector(mu0, n_coords, "mu0")
    sigma0_vec = _as_coordinate_vector(sigma0_2, n_coords, "sigma0_2")
    if (sigma0_vec <= 0).any():
        raise ParameterError("sigma0_2: expected a prior variance > 0")
    if not (gamma0 > 0 and math.isfinite(gamma0)):
        raise ParameterError(f"gamma0: expected a finite value > 0, found {gamma0}")
    if int(sweeps) != sweeps or sweeps < 0:
        raise ParameterError(f"sweeps: expected an integer >= 0, found {sweeps}")
    if lam is not None and not (lam >= 0 and math.isfinite(lam)):
        raise ParameterError(f"lam: expected a finite value >= 0, found {lam}")
    widest = max(v.shape[0] for v in vecs)
    if max_width is not None and max_width < widest:
        raise ParameterError(
            f"max_width: expected at least the widest client's width ({widest}), "
            f"found {max_width}"
        )
    kernels = get_backend(backend)

    prior_precision = 1.0 / sigma0_vec
    state = _GlobalState(n_coords, mu0_vec * prior_precision, prior_precision)
    assignments: list[np.ndarray] = [np.empty(0, dtype=np.int64)] * n_clients
    timing = {"cost": 0.0, "assignment": 0.0, "n": 0}
    cost_kwargs = dict(n_clients=n_clients, mu0=mu0_vec, sigma0_2=sigma0_vec, gamma0=gamma0)

    def assign(s: int) -> float:
        sums, global_precisions, counts = state.view()
        n_global = state.size
        start = time.perf_counter()
        if lam is None:
            cost = kernels.pfnm_cost(
                vecs[s], precs[s], sums, global_precisions, counts, **cost_kwargs
            )
        else:
            cost = kernels.nafi_cost(
                vecs[s], precs[s], sums, global_precisions, counts, **cost_kwargs, lam=lam
            )
        if max_width is not None:
            # Only the first (max_width - J) "new" slots stay open; since max_width is at
            # least J_s, the remaining rows still cover every local neuron.
            open_slots = min(vecs[s].shape[0], max_width - n_global)
            cost = np.ascontiguousarray(cost[: n_global + open_slots])
        mid = time.perf_counter()
        rows, cols = kernels.solve_assignment(cost)
        timing["cost"] += mid - start
        timing["assignment"] += time.perf_counter() - mid
        timing["n"] += 1
        rows = np.asarray(rows, dtype=np.int64)
        cols = np.asarray(cols, dtype=np.int64)
        local_rows = np.empty(vecs[s].shape[0], dtype=np.int64)
        local_rows[cols] = rows
        # Every way of giving the chosen "new" slots to the new neurons costs the same;
        # number new globals in local-neuron order so no solver tie-break shows through.
        is_new = local_rows >= n_global
        local_rows[is_new] = n_global + np.arange(int(is_new.sum()))
        assignments[s] = local_rows
        state.add(local_rows, vecs[s], precs[s])
        return float(cost[rows, cols].sum())

    order = sorted(range(n_clients), key=lambda s: -vecs[s].shape[0])
    first = order[0]
    assignments[first] = np.arange(vecs[first].shape[0], dtype=np.int64)
    state.add(assignments[first], vecs[first], precs[first])
    objective, lap_totals = [], []
    # sum_p s_p w_p^2 as (w * s) * w, the order of the posterior sums (same rounding).
    data_term = sum(float(np.sum(v * p * v)) for v, p in zip(vecs, precs, strict=True))
    moves: list[int] = []
    total = sum(assign(s) for s in order[1:])
    objective.append(_objective(state, data_term, n_clients, gamma0))
    lap_totals.append(total)

    rng = np.random.default_rng(seed)
    for _ in range(int(sweeps) if n_clients > 1 else 0):
        total, moved = 0.0, 0
        for s in rng.permutation(n_clients):
            remap = state.remove(assignments[s], vecs[s], precs[s])
            before = remap[assignments[s]]  # -1: was alone in its global (now dropped)
            for other in range(n_clients):
                if other != s:
                    assignments[other] = remap[assignments[other]]
            n_kept = state.size
            total += assign(int(s))
            after = assignments[s]
            stayed = np.where(before < 0, after >= n_kept, after == before)
            moved += int(np.count_nonzero(~stayed))
        objective.append(_objective(state, data_term, n_clients, gamma0))
        lap_totals.append(total)
        moves.append(moved)
        if moved == 0:
            # A fixed point: every client's assignment is optimal given the others, so
            # further sweeps would re-solve the same problems (Algorithm 1 has converged).
            break

    means, final_precisions, counts = _final_posterior(state, vecs, precs, assignments)
    report = _report(
        assignments, counts, objective, lap_totals, timing, kernels.name, true_labels
    )
    report["moves"] = moves
    report["sweeps_run"] = len(moves)
    logger.debug("matched layer: %d clients -> %d global neurons", n_clients, means.shape[0])
    return LayerMatching(means, final_precisions, counts, assignments, report)


def _final_posterior(
    state: _GlobalState,
    vecs: list[np.ndarray],
    precs: list[np.ndarray],
    assignments: list[np.ndarray],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Posterior means recomputed from the assignments (no drift from add/remove)."""
    n_global = state.size
    sums = np.tile(state.prior_sum, (n_global, 1))
    precisions = np.tile(state.prior_precision, (n_global, 1))
    counts = np.zeros(n_global, dtype=np.int64)
    for rows, v, p in zip(assignments, vecs, precs, strict=True):
        _add_rows(sums, rows, v, 1.0, p)
        _add_rows(precisions, rows, p, 1.0)
        counts[rows] += 1
    return sums / precisions, precisions, counts


def _objective(state: _GlobalState, data_term: float, n_clients: int, gamma0: float) -> float:
    """2 x negative log posterior (Eq. 3 with Eq. 4), up to assignment-independent constants.

    Gaussian part: sum_i sum_p [ sum_{z in Z_i} s (w_z - m_i)^2 + (m_i - mu0)^2 / sigma0^2 ];
    IBP part: -2 [ J log gamma0 + sum_i log((S - m_i)! (m_i - 1)! / S!) ] with m_i the
    size of global i (the history-multiplicity factor of the IBP is left out);
    ``data_term`` = sum over all local neurons of sum_p s_p w_p^2 (fixed).
    """
    sums, precisions, counts = state.view()
    prior_term = float(np.sum(state.prior_sum * state.prior_sum / state.prior_precision))
    gaussian = data_term + sums.shape[0] * prior_term - float(np.sum(sums * sums / precisions))
    log_ibp = sums.shape[0] * math.log(gamma0) + sum(
        math.lgamma(n_clients - m + 1) + math.lgamma(m) - math.lgamma(n_clients + 1)
        for m in counts.tolist()
    )
    return gaussian - 2.0 * log_ibp


def matching_purity(assignments: Sequence[np.ndarray], true_labels: Sequence[np.ndarray]) -> float:
    """Share of local neurons whose global neuron's majority true label is their own.

    Args:
        assignments: per client, (J_s,) global index of each local neuron.
        true_labels: per client, (J_s,) ground-truth identity of each local neuron.

    Returns:
        sum over globals of the size of their largest true-label group, / number of neurons.
    """
    glob = np.concatenate([np.asarray(a) for a in assignments])
    truth = np.concatenate([np.asarray(t) for t in true_labels])
    if glob.size == 0:
        return 1.0
    pairs = np.unique(np.stack([glob, truth]), axis=1, return_counts=True)
    (pair_glob, _), pair_counts = pairs
    best = np.zeros(int(glob.max()) + 1, dtype=np.int64)
    np.maximum.at(best, pair_glob, pair_counts)
    return float(best.sum() / glob.size)


def _report(
    assignments: list[np.ndarray],
    counts: np.ndarray,
    objective: list[float],
    lap_totals: list[float],
    timing: dict[str, float],
    backend: str,
    true_labels: Sequence[np.ndarray] | None,
) -> dict[str, Any]:
    clients = []
    for rows in assignments:
        matched = int(np.count_nonzero(counts[rows] > 1))
        clients.append(
            {"width": int(rows.size), "matched": matched, "new": int(rows.size) - matched}
        )
    report: dict[str, Any] = {
        "width": int(counts.size),
        "clients": clients,
        "objective": objective,
        "assignment_cost": lap_totals,
        "time_cost_s": timing["cost"],
        "time_assignment_s": timing["assignment"],
        "n_assignments": int(timing["n"]),
        "backend": backend,
    }
    if true_labels is not None:
        report["purity"] = matching_purity(assignments, true_labels)
    return report


# --------------------------------------------------------------------------------------
# Whole networks: layers matched bottom-up (ALGORITHMS.md §2-3), shared by pfnm and nafi.
# --------------------------------------------------------------------------------------

VARIANCE_UNITS = ("relative", "absolute")
UNOBSERVED = ("mask", "zeros")


@dataclass(frozen=True)
class BayesianParams:
    """Parameters of PFNM / NAFI; see :func:`fuse_network` for their meaning and units."""

    sigma: float | tuple[float, ...] = 1.0
    sigma0: float = 1.0
    gamma: float = 1.0
    mu0: float = 0.0
    sweeps: int = 5
    seed: int = 0
    lam: float | None = None
    max_width: int | None = None
    class_share: bool | None = None
    unobserved: str = "mask"
    variance_units: str = "relative"
    backend: str = "core"

    def as_json(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        out["sigma"] = list(self.sigma) if isinstance(self.sigma, tuple) else self.sigma
        if self.lam is None:
            del out["lam"]
        return out


def as_sigma(sigma: Any) -> float | tuple[float, ...]:
    """``sigma`` as one variance or a tuple of per-client variances (never a string)."""
    if isinstance(sigma, str):
        raise ParameterError(f"sigma: expected a number or one number per client, found {sigma!r}")
    try:
        values = np.asarray(sigma, dtype=np.float64)
    except (TypeError, ValueError):
        raise ParameterError(
            f"sigma: expected a number or one number per client, found {sigma!r}"
        ) from None
    if values.ndim > 1:
        raise ParameterError(f"sigma: expected a number or a 1-D list, found shape {values.shape}")
    return float(values) if values.ndim == 0 else tuple(values.tolist())


def _client_sigmas(sigma: float | Sequence[float], n_clients: int) -> np.ndarray:
    values = np.atleast_1d(np.asarray(sigma, dtype=np.float64))
    if values.ndim != 1 or values.size not in (1, n_clients):
        raise ParameterError(
            f"sigma: expected one variance or one per client ({n_clients}), found {values.size}"
        )
    if not (np.isfinite(values).all() and (values > 0).all()):
        raise ParameterError(f"sigma: expected finite variances > 0, found {values.tolist()}")
    return np.broadcast_to(values, (n_clients,)).copy()


def _check_params(params: BayesianParams, n_clients: int) -> np.ndarray:
    if params.variance_units not in VARIANCE_UNITS:
        raise ParameterError(
            f"variance_units: expected one of {VARIANCE_UNITS}, found {params.variance_units!r}"
        )
    if params.unobserved not in UNOBSERVED:
        raise ParameterError(
            f"unobserved: expected one of {UNOBSERVED}, found {params.unobserved!r}"
        )
    if not (params.sigma0 > 0 and math.isfinite(params.sigma0)):
        raise ParameterError(f"sigma0: expected a finite variance > 0, found {params.sigma0}")
    if params.backend not in BACKENDS:
        raise ParameterError(f"backend: expected one of {BACKENDS}, found {params.backend!r}")
    return _client_sigmas(params.sigma, n_clients)


def _class_shares(checkpoints, n_classes: int, wanted: bool | None) -> np.ndarray | None:
    """(S, K) class shares f_sk when class-share weighting is on, else None."""
    from fusekit.methods.avg import class_shares

    have = all(c.class_counts is not None for c in checkpoints)
    if wanted is None:
        wanted = have
    return class_shares(checkpoints, n_classes) if wanted else None


def fuse_network(checkpoints, specs, params: BayesianParams, method: str):
    """Fuse sequential MLP/CNN clients with PFNM (``params.lam is None``) or NAFI.

    Hidden layers are matched bottom-up: each client's incoming weights are first mapped
    into the global index space of the layer below (``fusekit.core.neurons``), BatchNorm folded.
    The last hidden layer's vectors also carry the outgoing weights (NAFI paper, Problem
    Formulation). Output layer: with one hidden layer, the outgoing part of the matched
    vectors; deeper, the output weights mapped to global indices and averaged over the
    clients that observe each column. Its weights use class shares f_sk = N_sk / sum_s N_sk
    when class-share weighting is on, else sample shares; the output bias likewise (NAFI
    Algorithm 2, line 7).

    Units: with ``variance_units="relative"`` (default), sigma^2 = ``sigma`` x v and
    sigma0^2 = ``sigma0`` x v, where v (per coordinate, constant within the incoming, bias
    and outgoing blocks) is the per-coordinate variance of all clients' neuron vectors of
    the layer averaged over the block (:func:`fusekit.core.neurons.block_variances`). With
    ``"absolute"`` they are variances in weight units. ``mu0`` is in weight units.
    Class-share precision: an outgoing weight to class k gets precision f_sk / sigma_s^2.

    Args:
        checkpoints: clients in canonical order.
        specs: their permutation specs (same structure, any hidden widths).
        params: BayesianParams.
        method: name used in messages.

    Returns:
        (state_dict, fused PermutationSpec, report dict).

    Raises:
        IncompatibleModelsError: PAN checkpoints, or tensors outside the layers that differ.
        ParameterError: out-of-range parameters.
    """
    from fusekit.core import neurons
    from fusekit.methods.base import sample_weights

    neurons.refuse_position_aware(checkpoints, specs, method)
    n_clients = len(checkpoints)
    sigmas = _check_params(params, n_clients)
    spec = specs[0]
    clients = [neurons.client_layers(c, sp) for c, sp in zip(checkpoints, specs, strict=True)]
    n_hidden = len(spec.layers) - 1
    shares = _class_shares(checkpoints, spec.out_features, params.class_share)
    alphas = sample_weights(checkpoints)
    fused: list[neurons.UnitLayer] = []
    below: list[np.ndarray | None] = [None] * n_clients
    n_below = spec.in_features
    layer_reports = []
    outgoing = None
    for index in range(n_hidden):
        last = index == n_hidden - 1
        vecs, observed = [], []
        for s in range(n_clients):
            vec, obs, layout = neurons.neuron_vectors(
                clients[s][index], below[s], n_below, clients[s][index + 1] if last else None
            )
            vecs.append(vec)
            observed.append(obs)
        unit = (neurons.block_variances(vecs, observed, layout)
                if params.variance_units == "relative" else np.ones(layout.size))
        precisions = []
        for s in range(n_clients):
            seen = observed[s] if params.unobserved == "mask" else np.ones(layout.size, bool)
            precision = seen / (sigmas[s] * unit)
            if last and shares is not None:
                precision[layout.outgoing] *= np.repeat(shares[s], layout.block_out)
            precisions.append(precision)
        result = match_neurons(
            vecs, precisions, mu0=params.mu0, sigma0_2=params.sigma0 * unit, gamma0=params.gamma,
            sweeps=params.sweeps, seed=params.seed + index, lam=params.lam,
            max_width=params.max_width, backend=params.backend,
        )
        incoming, bias, outgoing = layout.split(result.means)
        fused.append(neurons.UnitLayer(incoming, bias))
        layer_reports.append({"layer": spec.layers[index].name, **result.report,
                              "variance_unit": sorted({float(u) for u in unit})})
        below, n_below = result.assignments, result.width
    head = [c[-1] for c in clients]
    fused.append(_output_layer(head, below, n_below, outgoing if n_hidden == 1 else None,
                               shares, alphas))
    widths = [layer.out_features for layer in fused[:-1]]
    fused_spec = spec.with_hidden_widths(widths)
    state_dict = neurons.to_state_dict(checkpoints, spec, fused)
    state_dict.update(_other_tensors(checkpoints, spec, alphas))
    report = {
        "layers": layer_reports,
        "class_share": shares is not None,
        "time_cost_s": sum(r["time_cost_s"] for r in layer_reports),
        "time_assignment_s": sum(r["time_assignment_s"] for r in layer_reports),
    }
    return state_dict, fused_spec, report


def _output_layer(head, below, n_below, matched_outgoing, shares, alphas):
    """The fused output layer in unit form (see :func:`fuse_network`)."""
    from fusekit.core import neurons

    n_clients = len(head)
    weights = shares if shares is not None else np.repeat(alphas[:, None], head[0].bias.size, 1)
    bias = np.einsum("sk,sk->k", weights, np.stack([h.bias for h in head]))
    bias /= weights.sum(0)
    if matched_outgoing is not None:
        return neurons.UnitLayer(matched_outgoing, bias)
    mapped = [neurons.map_incoming(h.weight, below[s], n_below) for s, h in enumerate(head)]
    stacked = np.stack([m for m, _ in mapped])  # (S, K, J, block)
    seen = np.stack([o for _, o in mapped]).astype(np.float64)  # (S, J)

    def average(w):  # w: (S, K)
        num = np.einsum("sk,sj,skjb->kjb", w, seen, stacked)
        den = np.einsum("sk,sj->kj", w, seen)
        return num, den

    num, den = average(weights)
    if (den <= 0).any():  # no observer of column j has data of class k: use sample shares
        fallback_num, fallback_den = average(np.repeat(alphas[:, None], num.shape[0], 1))
        num = np.where((den > 0)[..., None], num, fallback_num)
        den = np.where(den > 0, den, fallback_den)
    del n_clients
    return neurons.UnitLayer(num / den[..., None], bias)


def _other_tensors(checkpoints, spec, alphas) -> dict[str, np.ndarray]:
    """Tensors outside the layers (never width-dependent here): sample-weighted average."""
    from fusekit.core.errors import IncompatibleModelsError
    from fusekit.methods.avg import average_tensor

    out = {}
    for name in spec.other:
        arrays = [c.tensor(name) for c in checkpoints]
        if any(a.shape != arrays[0].shape for a in arrays):
            raise IncompatibleModelsError(
                f"tensor {name!r} is outside the matched layers and its shape differs between "
                "clients; describe it in a JSON spec file (--spec) or fuse with avg"
            )
        out[name] = average_tensor(arrays, alphas, name)
    return out
