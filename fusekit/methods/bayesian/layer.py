"""Beta-Bernoulli neuron matching of ONE layer across S clients (PFNM, NAFI).

:func:`match_neurons` follows the NAFI paper's Algorithm 1 with the cost of Proposition 1 /
Eq. 5, and Eq. 14 for NAFI (docs/ALGORITHMS.md §3-4):

1. Clients are visited by decreasing width (stable on the order given, which
   ``fusekit.fuse`` makes canonical). The first client's neurons seed the global set;
   every other client is matched in turn (greedy pass).
2. ``sweeps`` refinement sweeps: for each client, in an order drawn from
   ``numpy.random.default_rng(seed)``, remove it from the posteriors (globals left empty
   are dropped), rebuild its cost matrix, solve the assignment, add it back.
3. With a target ``width`` (ALGORITHMS.md §3, "Fused width"), steps 1-2 open at most
   :data:`GLOBALS_PER_WIDTH` x ``width`` globals; then the ``width`` globals with the
   largest posterior mass survive, every client is re-matched against them with at most
   ``width`` globals open, and a model that merged more than asked has globals split in
   two (the splits that remove the most within-global scatter), so the layer has exactly
   ``width`` neurons.
4. The result is the posterior mean of every global neuron (Eq. 4), or with
   ``shrink=False`` the precision-weighted mean of its members.

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
import mmap
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from fusekit.core.errors import ParameterError
from fusekit.engine import matching, reference

logger = logging.getLogger(__name__)

BACKENDS = ("core", "numpy")
# Values per block of a sum taken by blocks of rows (the objective's, the M-step's lone
# members): 2 MB of float64, in cache and few Python steps, never a temporary as large as
# the state or a client's vectors.
SUM_BLOCK_VALUES = 1 << 18
#: With a width asked, the greedy pass and the sweeps before it is imposed open at most this
#: many times that width of globals (a truncation of the Beta process, ALGORITHMS.md §3,
#: "Fused width"): above what the posterior opens on trained clients (at most 2.8 times the
#: width at ratio 1 on the frontier's digits and synthetic clients, greedy pass included), so
#: the bound holds only where nearly nothing matches (independent initialisations of
#: real-size models, random clients), where the globals would otherwise grow with S and
#: every assignment with them.
GLOBALS_PER_WIDTH = 4


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
    """
    if isinstance(backend, MatchingBackend):
        return backend
    if backend == "core":
        # The engine validates its inputs once (match_neurons) and owns the global state
        # it passes, so the kernels skip re-validating arrays on every call.
        return MatchingBackend(
            "core",
            partial(matching.pfnm_cost, check_finite=False),
            partial(matching.nafi_cost, check_finite=False),
            matching.solve_assignment,
        )
    if backend == "numpy":
        # imported here: scipy.optimize is 0.3 s and 45 MB at every start of the CLI
        from scipy.optimize import linear_sum_assignment

        return MatchingBackend(
            "numpy", reference.pfnm_cost, reference.nafi_cost, linear_sum_assignment
        )
    raise ParameterError(f"backend: expected one of {BACKENDS}, found {backend!r}")


@dataclass(frozen=True)
class Prior:
    """Values a matching runs with, as a refit hands them over between passes.

    Attributes:
        precisions: per client, (P,) observation precisions (0: unobserved).
        sigma0_2: (P,) prior variance.
        gamma0: Beta-process mass.
    """

    precisions: list[np.ndarray]
    sigma0_2: np.ndarray
    gamma0: float


#: The M-step a matching calls between its passes (:class:`.empirical.EmpiricalBayes`):
#: ``m_step(assignments, n_global, clients)`` gives new values from the assignment of the
#: clients matched so far, or None to keep those in use.
MStep = Callable[[list[np.ndarray], int, list[int]], Prior | None]


@dataclass
class LayerMatching:
    """Result of matching one layer.

    Attributes:
        means: (J, P) float64 posterior means of the J global neurons (Eq. 4), or their
            members' means (``match_neurons(shrink=False)``).
        precisions: (J, P) float64 posterior precisions (including ``1/sigma0^2``).
        counts: (J,) int number of local neurons (= clients) in each global neuron.
        assignments: per client (in the order given), (J_s,) int global index of each
            local neuron; injective within a client.
        report: JSON-able summary (see :func:`match_neurons`).
        base: when the clients are copies of one base model (:func:`base_neurons`), per
            global the base neuron it holds (-1: an inert padded global); else None. Then
            every global holding base neuron j has the same fused vector, the members'
            mean over all the neurons j (a copy of the neuron the average has).
    """

    means: np.ndarray
    precisions: np.ndarray
    counts: np.ndarray
    assignments: list[np.ndarray]
    report: dict[str, Any] = field(default_factory=dict)
    base: np.ndarray | None = None

    @property
    def width(self) -> int:
        return int(self.means.shape[0])

    def reader_shares(self) -> np.ndarray | None:
        """(J,) weights for the layers reading these neurons, or None to read them as they
        are. From one base, a neuron the average holds once may sit in several globals
        (copies made to reach the width, or counterparts the matching left apart); a
        reader weights each copy by its share of the clients, so the copies add up to the
        average's neuron instead of counting it once per copy (ALGORITHMS.md §3, "Clients
        from one base")."""
        n_clients = len(self.assignments)
        if self.base is None or (self.counts >= n_clients).all():
            return None
        return self.counts / n_clients


class _GlobalState:
    """Posterior statistics of the global neurons, with room to grow in place."""

    def __init__(self, n_coords: int, prior_sum: np.ndarray, prior_precision: np.ndarray,
                 capacity: int = 0):
        self.prior_sum = prior_sum
        self.prior_precision = prior_precision
        self.size = 0
        # Room for ``capacity`` globals up front: the pages of rows never written are never
        # resident, and growing by copies (which held two copies at once) is not needed.
        self.sums = _row_buffer(capacity, n_coords)
        self.precisions = _row_buffer(capacity, n_coords)
        self.counts = np.empty(capacity, dtype=np.int64)

    def _reserve(self, size: int) -> None:
        if size <= self.sums.shape[0]:
            return
        capacity = max(size, 2 * self.sums.shape[0], 16)
        for name in ("sums", "precisions", "counts"):
            old = getattr(self, name)
            new = (_row_buffer(capacity, old.shape[1]) if old.ndim == 2
                   else np.empty(capacity, dtype=old.dtype))
            new[: self.size] = old[: self.size]
            setattr(self, name, new)

    def release_from(self, row: int) -> None:
        """Hand the pages of rows ``row`` onwards back to the system: rows no global will
        use again (beyond a width imposed, beyond the fused globals) stop being resident.
        They read as zeros if ever opened again (:meth:`open_empty` writes them first)."""
        for array in (self.sums, self.precisions):
            _release_rows(array, row)

    def view(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Contiguous (J, P), (J, P), (J,) views of the live globals (no copy)."""
        return self.sums[: self.size], self.precisions[: self.size], self.counts[: self.size]

    def add(self, rows: np.ndarray, vectors: np.ndarray, precision: np.ndarray) -> None:
        """Add a client's neurons (J_s, P) with precision (P,) to globals ``rows``
        (``rows == size + k`` opens new ones)."""
        new_size = max(self.size, int(rows.max()) + 1) if rows.size else self.size
        if new_size > self.size:
            self.open_empty(new_size - self.size)
        matching.add_rows(self.sums, rows, vectors, 1.0, precision)
        matching.add_rows(self.precisions, rows, precision, 1.0)
        self.counts[rows] += 1

    def subtract(self, rows: np.ndarray, vectors: np.ndarray, precision: np.ndarray) -> None:
        """Take neurons (n, P) out of globals ``rows``; empty globals stay (see
        :meth:`drop_empty`)."""
        matching.add_rows(self.sums, rows, vectors, -1.0, precision)
        matching.add_rows(self.precisions, rows, precision, -1.0)
        self.counts[rows] -= 1

    def drop_empty(self) -> np.ndarray:
        """Drop globals without members. Returns old -> new index (-1 for dropped ones;
        index -1 itself maps to -1)."""
        empty = self.counts[: self.size] == 0
        keep = np.flatnonzero(~empty)
        remap = np.full(self.size + 1, -1, dtype=np.int64)  # remap[-1] == -1
        remap[keep] = np.arange(keep.size)
        if keep.size < self.size:
            # Slide each run of kept globals down over the gaps, in order (no gathered copy
            # of the whole state: a client's globals are mostly one run).
            gaps = np.flatnonzero(empty)
            ends = np.append(gaps[1:], self.size)
            to = int(gaps[0])
            for start, end in zip((gaps + 1).tolist(), ends.tolist(), strict=True):
                if end > start:
                    for array in (self.sums, self.precisions, self.counts):
                        array[to : to + end - start] = array[start:end]
                    to += end - start
            self.size = keep.size
        return remap

    def remove(self, rows: np.ndarray, vectors: np.ndarray, precision: np.ndarray) -> np.ndarray:
        """Remove a client's neurons (rows -1: not assigned, skipped); drop globals left
        empty. Returns old -> new index (-1 for dropped globals)."""
        placed = rows >= 0
        if placed.all():  # the usual case: no masked copy of the client's vectors
            self.subtract(rows, vectors, precision)
        else:
            self.subtract(rows[placed], vectors[placed], precision)
        return self.drop_empty()

    def open_empty(self, n: int) -> None:
        """Open n globals without members (their posterior is the prior)."""
        self._reserve(self.size + n)
        fresh = slice(self.size, self.size + n)
        self.sums[fresh] = self.prior_sum
        self.precisions[fresh] = self.prior_precision
        self.counts[fresh] = 0
        self.size += n


def _row_buffer(n_rows: int, n_coords: int) -> np.ndarray:
    """An uninitialised (n_rows, n_coords) float64 array on an anonymous mapping of its own,
    so that rows no longer needed can be handed back (:func:`_release_rows`); like
    ``np.empty``, its pages become resident when first written."""
    size = n_rows * n_coords * 8
    if size < mmap.PAGESIZE or not hasattr(mmap, "MADV_DONTNEED"):  # (Windows)
        return np.empty((n_rows, n_coords))
    # private: pages handed back are freed (a shared mapping would keep them as shmem)
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(mapping, dtype=np.float64).reshape(n_rows, n_coords)


def _release_rows(array: np.ndarray, row: int) -> None:
    """Drop the resident pages of ``array``'s rows ``row`` onwards (whole pages only) when
    the array lies on a mapping of its own (:func:`_row_buffer`)."""
    owner = array.base
    while isinstance(owner, np.ndarray):
        owner = owner.base
    owner = owner.obj if isinstance(owner, memoryview) else owner
    if not isinstance(owner, mmap.mmap):
        return
    offset = array.__array_interface__["data"][0] - np.frombuffer(owner, np.uint8).ctypes.data
    start = -(-(offset + row * array.strides[0]) // mmap.PAGESIZE) * mmap.PAGESIZE
    if start < len(owner):
        owner.madvise(mmap.MADV_DONTNEED, start, len(owner) - start)


def as_coordinate_vector(value: Any, n_coords: int, name: str) -> np.ndarray:
    """A scalar or (P,) parameter as a finite (P,) float64 vector (one-line errors)."""
    array = np.asarray(value, dtype=np.float64)
    if array.ndim == 0:
        array = np.full(n_coords, float(array))
    if array.shape != (n_coords,):
        raise ParameterError(
            f"{name}: expected a scalar or a vector of {n_coords} coordinates, "
            f"found shape {array.shape}"
        )
    bad = np.flatnonzero(~np.isfinite(array))
    if bad.size:
        raise ParameterError(
            f"{name}: expected finite values, found {array[bad[0]]} at coordinate {bad[0]} "
            f"({bad.size} non-finite of {n_coords})"
        )
    return array


def _validate_inputs(
    vectors: Sequence[np.ndarray], precisions: Sequence[Any]
) -> tuple[list[np.ndarray], list[np.ndarray]]:
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
        if not matching.all_finite(v):
            # Checked once here: the core kernels then skip re-checking (check_finite=False).
            raise ParameterError(f"vectors[{s}]: expected finite values, found NaN or inf")
    precs = []
    for s, p in enumerate(precisions):
        vec = as_coordinate_vector(p, n_coords, f"precisions[{s}]")
        if (vec < 0).any():
            raise ParameterError(
                f"precisions[{s}]: expected values >= 0, found minimum {vec.min():.3g}"
            )
        precs.append(vec)
    return vecs, precs


def check_width(width: int | None, widest: int, name: str = "width") -> None:
    """A target width must be an integer >= the widest client (every local neuron gets a
    global neuron, so none is dropped)."""
    if width is None:
        return
    if isinstance(width, bool) or not isinstance(width, (int, np.integer)):
        raise ParameterError(f"{name}: expected an integer, found {width!r}")
    if width < widest:
        raise ParameterError(
            f"{name}: expected at least the widest client's width ({widest}), found {width}"
        )


class _Matcher:
    """One layer's matching run: the global state, the assignments and the kernels."""

    def __init__(self, vecs, precs, *, mu0, sigma0_2, gamma0, lam, kernels, log_det, bound):
        self.vecs, self.mu0 = vecs, mu0
        self.log_det = log_det
        self.n_clients = len(vecs)
        self.lam, self.kernels = lam, kernels
        self.bound = bound
        self.truncated = False  # the bound held: a client took every slot left open
        # Every local neuron in a global of its own is the most globals a matching opens,
        # or the bound.
        self.state = _GlobalState(vecs[0].shape[1], mu0 / sigma0_2, 1.0 / sigma0_2,
                                  capacity=min(sum(v.shape[0] for v in vecs),
                                               bound or math.inf))
        self.assignments: list[np.ndarray] = [np.empty(0, dtype=np.int64)] * self.n_clients
        self.timing = {"cost": 0.0, "assignment": 0.0, "n": 0}
        self.squares = [np.einsum("jp,jp->p", v, v) for v in vecs]
        self._set_values(Prior(precs, sigma0_2, gamma0))

    def _set_values(self, prior: Prior) -> None:
        self.precs, self.sigma0_2, self.gamma0 = prior.precisions, prior.sigma0_2, prior.gamma0
        self.cost_kwargs = dict(n_clients=self.n_clients, mu0=self.mu0,
                                sigma0_2=self.sigma0_2, gamma0=self.gamma0)
        # sum over neurons and coordinates of s_p w_p^2, from each client's column sums of
        # squares (computed once: the precisions change at every M-step, the vectors never)
        self.data_term = sum(float(squares @ p)
                             for squares, p in zip(self.squares, self.precs, strict=True))
        # the new slots' log-determinant per client (_log_det_rows), fixed between M-steps
        self.new_log_det = [float(np.log(1.0 / p[p > 0] + self.sigma0_2[p > 0]).sum())
                            for p in self.precs] if self.log_det else []

    def refit(self, refit: MStep, clients: list[int]) -> bool:
        """Ask ``refit`` for new values given the assignment of ``clients`` (the others are
        not placed); with new values, rebuild the posteriors. Returns whether they changed."""
        prior = refit(self.assignments, self.state.size, clients)
        if prior is None:
            return False
        self._set_values(Prior([np.ascontiguousarray(p, dtype=np.float64)
                                for p in prior.precisions],
                               np.ascontiguousarray(prior.sigma0_2, dtype=np.float64),
                               float(prior.gamma0)))
        state = self.state
        state.prior_precision = 1.0 / self.sigma0_2
        state.prior_sum = self.mu0 * state.prior_precision
        placed = [s for s in clients if self.assignments[s].size]
        _posterior_sums(state.prior_sum, state.prior_precision, [self.vecs[s] for s in placed],
                        [self.precs[s] for s in placed], [self.assignments[s] for s in placed],
                        state.size, out=state.view()[:2])
        return True

    def assign(self, s: int, cap: int | None) -> float:
        """Match client s (not in the state) against the globals; at most ``cap`` globals
        may exist afterwards. Returns the optimal assignment's cost."""
        sums, global_precisions, counts = self.state.view()
        n_global = self.state.size
        start = time.perf_counter()
        if self.lam:
            cost = self.kernels.nafi_cost(self.vecs[s], self.precs[s], sums, global_precisions,
                                          counts, **self.cost_kwargs, lam=self.lam)
        else:
            cost = self.kernels.pfnm_cost(self.vecs[s], self.precs[s], sums, global_precisions,
                                          counts, **self.cost_kwargs)
        if self.log_det:
            cost += self._log_det_rows(s, global_precisions)[:, None]
        if cap is not None:
            # Only the first (cap - J) "new" slots stay open; since cap >= J_s, the rows
            # kept (min(J + J_s, cap) >= J_s) still give every local neuron a global.
            open_slots = min(self.vecs[s].shape[0], cap - n_global)
            cost = np.ascontiguousarray(cost[: n_global + open_slots])
        mid = time.perf_counter()
        rows, cols = self.kernels.solve_assignment(cost)
        self.timing["cost"] += mid - start
        self.timing["assignment"] += time.perf_counter() - mid
        self.timing["n"] += 1
        rows = np.asarray(rows, dtype=np.int64)
        cols = np.asarray(cols, dtype=np.int64)
        local_rows = np.empty(self.vecs[s].shape[0], dtype=np.int64)
        local_rows[cols] = rows
        # Every way of giving the chosen "new" slots to the new neurons costs the same;
        # number new globals in local-neuron order so no solver tie-break shows through.
        is_new = local_rows >= n_global
        n_new = int(is_new.sum())
        local_rows[is_new] = n_global + np.arange(n_new)
        # The bound held when the client took every slot it left open, fewer than it has:
        # with more it might have opened more (with fewer the cut changed nothing).
        if cap is not None and cap == self.bound:
            self.truncated |= n_new == cap - n_global < self.vecs[s].shape[0]
        self.assignments[s] = local_rows
        self.state.add(local_rows, self.vecs[s], self.precs[s])
        return float(cost[rows, cols].sum())

    def _log_det_rows(self, s: int, global_precisions: np.ndarray) -> np.ndarray:
        """Per row, sum_p ln(sigma_s^2 + 1/P_ip) over the coordinates client s observes
        (ln(sigma_s^2 + sigma0^2) for the new slots): the log-determinant of the Gaussian
        marginal of a local neuron, in the cost's units (2 x negative log likelihood)."""
        existing = matching.log_det_rows(self.precs[s], global_precisions)
        return np.concatenate([existing, np.full(self.vecs[s].shape[0], self.new_log_det[s])])

    def take_out(self, s: int) -> np.ndarray:
        """Remove client s from the state; returns its old globals under the new
        numbering (-1: the global is gone)."""
        mine = self.assignments[s]
        size = self.state.size
        remap = self.state.remove(mine, self.vecs[s], self.precs[s])
        if self.state.size < size:  # globals dropped: the others' indices move down
            for other in range(self.n_clients):
                if other != s:
                    self.assignments[other] = remap[self.assignments[other]]
        return remap[mine]

    def greedy(self, refit: MStep | None = None) -> float:
        """The greedy pass; with ``refit``, new values after 2, 4, 8, ... clients and at
        the end (the later clients are matched with values from the earlier ones)."""
        order = sorted(range(self.n_clients), key=lambda s: -self.vecs[s].shape[0])
        first = order[0]
        self.assignments[first] = np.arange(self.vecs[first].shape[0], dtype=np.int64)
        self.state.add(self.assignments[first], self.vecs[first], self.precs[first])
        total = 0.0
        for done, s in enumerate(order[1:], start=2):
            total += self.assign(s, self.bound)
            if refit is not None and (done & (done - 1) == 0 or done == self.n_clients):
                self.refit(refit, order[:done])
        return total

    def sweep(self, rng: np.random.Generator, cap: int | None) -> tuple[float, int]:
        """One refinement sweep; returns (total assignment cost, local neurons moved)."""
        total, moved = 0.0, 0
        for s in rng.permutation(self.n_clients):
            before = self.take_out(int(s))
            n_kept = self.state.size
            total += self.assign(int(s), cap)
            after = self.assignments[s]
            stayed = np.where(before < 0, after >= n_kept, after == before)
            moved += int(np.count_nonzero(~stayed))
        return total, moved

    def objective(self) -> float:
        return _objective(self.state, self.data_term, self.n_clients, self.gamma0)

    def unrelated(self) -> bool:
        """Whether the clients share nothing: the bound held, or no global has two members."""
        return self.truncated or bool(self.state.view()[2].max(initial=0) <= 1)

    def keep_most_massive(self, width: int) -> int:
        """Keep the ``width`` globals with the largest posterior mass (number of clients,
        then summed posterior precision, then age); the members of the others are taken
        out of the state and left unassigned (-1). Returns the number of globals pruned."""
        _, precisions, counts = self.state.view()
        mass = precisions.sum(axis=1)
        order = np.lexsort((np.arange(counts.size), -mass, -counts))
        if order.size <= width:
            return 0
        keep = np.zeros(counts.size, dtype=bool)
        keep[order[:width]] = True
        for s in range(self.n_clients):
            mine = self.assignments[s]
            drop = ~keep[mine]
            self.state.subtract(mine[drop], self.vecs[s][drop], self.precs[s])
        remap = self.state.drop_empty()
        self.assignments = [remap[a] for a in self.assignments]
        return int(order.size - width)

    def fill(self, width: int) -> tuple[int, int]:
        """Reach ``width`` globals when the model merged more than asked: split, one at a
        time, the shared global whose best two-way split of its members lowers the
        precision-weighted within-global scatter most (:func:`best_split`; at fixed values
        the Gaussian part of the objective, so the split that costs the least likelihood);
        when no global is shared any more, add globals at the prior (mu0 in, mu0 out:
        inert). Returns (globals split off, globals padded)."""
        split = self._split_until(width) if self.state.size < width else 0
        padded = width - self.state.size
        if padded > 0:
            self.state.open_empty(padded)
        return split, padded

    def _split_until(self, width: int) -> int:
        """Split shared globals, the best split first, until ``width`` globals exist or none
        is shared; returns the number of splits."""
        groups: dict[int, list[tuple[int, int]]] = {}
        for s in range(self.n_clients):
            for j, row in enumerate(self.assignments[s].tolist()):
                groups.setdefault(row, []).append((s, j))
        splits = {row: self._best_split(members) for row, members in groups.items()
                  if len(members) > 1}
        split = 0
        while self.state.size < width and splits:
            row = max(splits, key=lambda r: (splits[r][0], -r))
            _, leaving = splits.pop(row)
            new_row = self.state.size
            for s, j in leaving:
                self._move(s, j, row, new_row)
            split += 1
            groups[new_row] = leaving
            groups[row] = [m for m in groups[row] if m not in leaving]
            for changed in (row, new_row):
                if len(groups[changed]) > 1:
                    splits[changed] = self._best_split(groups[changed])
        return split

    def _best_split(self, members: list[tuple[int, int]]) -> tuple[float, list[tuple[int, int]]]:
        """(scatter removed, members of the smaller part) of a global's best two-way split."""
        points = np.stack([self.vecs[s][j] for s, j in members])
        weights = np.stack([self.precs[s] for s, _ in members])
        gain, part = best_split(points, weights)
        return gain, [m for m, leaves in zip(members, part, strict=True) if leaves]

    def _move(self, s: int, j: int, old: int, new: int) -> None:
        """Move local neuron j of client s from global ``old`` to ``new`` (new may open)."""
        one = self.vecs[s][j : j + 1]
        self.state.subtract(np.array([old]), one, self.precs[s])
        self.assignments[s] = self.assignments[s].copy()
        self.assignments[s][j] = new
        self.state.add(self.assignments[s][j : j + 1], one, self.precs[s])


#: Lloyd iterations of a two-way split (members are few: it settles in two or three).
SPLIT_ITERATIONS = 10


def best_split(points: np.ndarray, weights: np.ndarray) -> tuple[float, np.ndarray]:
    """Two-means split of one global's members under per-coordinate precision weights.

    Starts from the member farthest from the weighted mean and the member farthest from
    that one, then alternates assignment and weighted means (at most
    :data:`SPLIT_ITERATIONS` times).

    Args:
        points: (n, P) members, n >= 2.
        weights: (n, P) their precisions (0: unobserved).

    Returns:
        The weighted scatter the split removes, sum w (x - mean)^2 of the whole minus that
        of the two parts (>= 0), and an (n,) bool mask of the smaller part (the one that
        leaves; with equal parts, the one without the first member).
    """

    def centre(mask):
        w = weights[mask]
        return (w * points[mask]).sum(0) / np.maximum(w.sum(0), 1e-300)

    def distances(to):
        return np.einsum("np,np->n", weights, (points - to) ** 2)

    def scatter(mask):
        return float(np.sum(weights[mask] * (points[mask] - centre(mask)) ** 2))

    everyone = np.ones(len(points), dtype=bool)
    far = int(np.argmax(distances(centre(everyone))))
    other = int(np.argmax(distances(points[far])))
    first, second = points[far], points[other]
    part = None
    for _ in range(SPLIT_ITERATIONS):
        new = distances(first) < distances(second)
        if new.all() or not new.any():  # identical members: peel the farthest one off
            new = np.zeros(len(points), dtype=bool)
            new[far] = True
        if part is not None and np.array_equal(new, part):
            break
        part = new
        first, second = centre(part), centre(~part)
    gain = scatter(everyone) - scatter(part) - scatter(~part)
    smaller = part if (part.sum(), part[0]) < ((~part).sum(), (~part)[0]) else ~part
    return max(gain, 0.0), smaller


def match_neurons(
    vectors: Sequence[np.ndarray],
    precisions: Sequence[Any],
    *,
    mu0: float | np.ndarray = 0.0,
    sigma0_2: float | np.ndarray = 1.0,
    gamma0: float = 1.0,
    sweeps: int = 5,
    seed: int = 0,
    lam: float = 0.0,
    width: int | None = None,
    log_det: bool = False,
    refit: MStep | None = None,
    shrink: bool = True,
    backend: str | MatchingBackend = "core",
    true_labels: Sequence[np.ndarray] | None = None,
) -> LayerMatching:
    """Match the neurons of one layer across clients (PFNM, or NAFI when ``lam > 0``).

    Args:
        vectors: per client s, a (J_s, P) float array of neuron vectors (ALGORITHMS.md §2).
        precisions: per client, the observation precision ``1/sigma_s^2``: a scalar or a (P,)
            vector; 0 marks a coordinate the client does not observe.
        mu0: prior mean of the global neurons, scalar or (P,).
        sigma0_2: prior variance sigma0^2, scalar or (P,), > 0.
        gamma0: mass of the Beta process, > 0.
        sweeps: maximum number of refinement sweeps T after the greedy pass, >= 0 (and
            again after the width is imposed). Sweeps stop early at a fixed point (a sweep
            in which no local neuron changed its global neuron).
        seed: seed of the generator that orders the clients in each sweep.
        lam: KL weight lambda of NAFI's cost (Eq. 14), >= 0; 0 is PFNM's cost (Eq. 5).
        width: ``None`` infers the number of global neurons (the nonparametric posterior);
            an integer >= the widest client gives exactly that many (module docstring,
            step 3), inferred first among at most :data:`GLOBALS_PER_WIDTH` x ``width``.
        log_det: add the log-determinant terms of the Gaussian marginal likelihood that
            Eq. 5 leaves out (ALGORITHMS.md §3, "Empirical Bayes"): the exact marginal
            likelihood, which estimated values need; with values the user gives the
            methods match with the papers' cost (False).
        refit: estimate values while matching (:mod:`.empirical`): called in the greedy
            pass and after every sweep before the width is imposed; the values it returns
            replace ``precisions``, ``sigma0_2`` and ``gamma0`` (which are the starting
            values). Those sweeps then stop at a fixed point of the assignment and the
            values, still after at most ``sweeps``. They use PFNM's cost (the model's);
            with ``lam > 0`` up to ``sweeps`` more sweeps with NAFI's cost follow, at the
            values found.
        shrink: output the posterior means (Eq. 4, pulled towards mu0 by the prior);
            False: the members' precision-weighted means (ALGORITHMS.md §3, "Empirical
            Bayes"; mu0 where no member observes a coordinate).
        backend: ``"core"`` (C++), ``"numpy"`` (reference + SciPy) or a MatchingBackend.
        true_labels: optional per-client (J_s,) ground-truth neuron identities (synthetic
            data): the report then gives the matching purity.

    Returns:
        LayerMatching (``means`` as ``shrink`` says). ``report`` holds ``width``,
        ``inferred_width`` (before the width was imposed), ``globals_bound`` (the most
        globals open before it: None without a width), ``pruned`` / ``split`` (globals
        dropped / opened to reach ``width``), ``one_base`` (the clients are copies of one
        base model, :func:`base_neurons`: then every global holding base neuron j is the
        members' mean over all neurons j, and ``LayerMatching.base`` says which j),
        ``clients`` (per client in the order given: ``width``, ``matched`` = local neurons
        that share their global neuron with another client, ``new`` = the others),
        ``objective`` (per pass: 2 x negative log posterior up to constants, Eq. 3 with
        Eq. 4 plugged in), ``assignment_cost`` (per pass), ``moves`` (per sweep),
        ``sweeps_run``, ``time_cost_s`` / ``time_assignment_s``, ``n_assignments``, and
        ``purity`` when ``true_labels`` is given.

    Raises:
        ParameterError: inconsistent shapes or out-of-range parameters.
        InfeasibleAssignmentError: from the solver (cannot happen with finite inputs).
    """
    vecs, precs = _validate_inputs(vectors, precisions)
    n_clients = len(vecs)
    n_coords = vecs[0].shape[1]
    mu0_vec = as_coordinate_vector(mu0, n_coords, "mu0")
    sigma0_vec = as_coordinate_vector(sigma0_2, n_coords, "sigma0_2")
    if (sigma0_vec <= 0).any():
        raise ParameterError(
            f"sigma0_2: expected a prior variance > 0, found minimum {sigma0_vec.min():.3g}"
        )
    if not (gamma0 > 0 and math.isfinite(gamma0)):
        raise ParameterError(f"gamma0: expected a finite value > 0, found {gamma0}")
    if int(sweeps) != sweeps or sweeps < 0:
        raise ParameterError(f"sweeps: expected an integer >= 0, found {sweeps}")
    if not (lam >= 0 and math.isfinite(lam)):
        raise ParameterError(f"lam: expected a finite value >= 0, found {lam}")
    check_width(width, max(v.shape[0] for v in vecs))
    run = _Matcher(vecs, precs, mu0=mu0_vec, sigma0_2=sigma0_vec, gamma0=gamma0,
                   lam=0.0 if refit is not None else float(lam), kernels=get_backend(backend),
                   log_det=log_det, bound=None if width is None else GLOBALS_PER_WIDTH * width)
    objective, lap_totals, moves = [], [], []

    def refine(cap: int | None, at_least_one: bool, refit: MStep | None = None,
               budget: int = int(sweeps)) -> bool:
        """Sweeps until a fixed point (returns True) or ``budget`` sweeps are spent."""
        rng = np.random.default_rng(seed)
        n_sweeps = budget if n_clients > 1 else 0
        for _ in range(max(n_sweeps, 1 if at_least_one else 0)):
            total, moved = run.sweep(rng, cap)
            changed = refit is not None and run.refit(refit, list(range(n_clients)))
            objective.append(run.objective())
            lap_totals.append(total)
            moves.append(moved)
            if moved == 0 and not changed:
                # A fixed point: every client's assignment is optimal given the others.
                return True
        return False

    lap_totals.append(run.greedy(refit))
    objective.append(run.objective())
    # With a width asked, the sweeps before it is imposed are skipped between unrelated
    # clients: once the bound has cut a client's new slots they could only re-sort neurons
    # among the bound's globals, and where the greedy pass shared no global, the first
    # sweep shared none either on every case measured (ResNet-20s, BERT-bases) and only
    # renumbered the globals; the width's re-match places every neuron again.
    skip = width is not None and run.unrelated()
    fixed = not skip and refine(run.bound, False, refit)
    if refit is not None and lam:
        # NAFI's KL penalty is no part of the model whose likelihood the values maximise:
        # they are estimated with PFNM's cost, then NAFI's refines at the values found.
        run.lam = float(lam)
        fixed = not skip and refine(run.bound, False)
    inferred = run.state.size
    # judged on the inferred assignment: the splits that reach a width keep indices apart
    one_base = base_neurons(run.assignments, inferred, whole=0.5) is not None
    unrelated = run.unrelated()
    pruned = split = padded = 0
    if width is not None:
        pruned = run.keep_most_massive(width)
        run.state.release_from(width)  # no more than `width` globals from here on
        if pruned or not fixed:
            # Members of pruned globals are placed by the re-match (every client is taken
            # out and matched again, at most `width` globals open). At a fixed point with
            # none pruned there is nothing to re-match: each client's assignment is optimal
            # without the cap and keeps within it (it opened no more globals than it had).
            # Between unrelated clients (the bound held, or no global is shared) it pairs
            # neurons that share nothing: its first sweep places every pruned member, later
            # ones re-pair them for parts in 10^3-10^4 of the objective, so it stops there.
            refine(width, pruned > 0, budget=1 if unrelated else int(sweeps))
        split, padded = run.fill(width)

    base = base_neurons(run.assignments, run.state.size) if one_base else None
    if base is not None:  # first: the fused layer's posterior then takes the same rows
        identity = [np.arange(v.shape[0]) for v in vecs]
        whole = _final_posterior(run.state, vecs, run.precs, identity, shrink,
                                 n_global=vecs[0].shape[0])[0].copy()
    means, final_precisions, counts = _final_posterior(run.state, vecs, run.precs,
                                                    run.assignments, shrink)
    run.state.release_from(means.shape[0])
    if base is not None:
        means[base >= 0] = whole[base[base >= 0]]
    report = _report(run.assignments, counts, objective, lap_totals, run.timing,
                     run.kernels.name, true_labels)
    report.update(inferred_width=inferred, globals_bound=run.bound, unrelated=unrelated,
                  pruned=pruned, split=split, padded=padded,
                  one_base=base is not None, moves=moves, sweeps_run=len(moves))
    logger.debug("matched layer: %d clients -> %d global neurons (inferred %d)",
                 n_clients, means.shape[0], inferred)
    return LayerMatching(means, final_precisions, counts, run.assignments, report, base)


def base_neurons(assignments: Sequence[np.ndarray], n_global: int,
                 whole: float = 0.0) -> np.ndarray | None:
    """Per global, the neuron index of its members when the assignment is the identity of
    copies of one model up to neurons kept apart (-1: a global without members), else None.

    Copies of one model: every client has the same width J, no global holds neurons of two
    different indices, and for at least ``whole`` x J indices j every client's neuron j
    is in one global. Independently initialised clients never pass (a correspondence
    between them pairs different indices), nor do permuted copies of one model.
    """
    width = assignments[0].size
    if any(a.size != width for a in assignments):
        return None
    index = np.arange(width)
    base = np.full(n_global, -1)
    for rows in assignments:
        seen = base[rows]
        if ((seen >= 0) & (seen != index)).any():
            return None
        base[rows] = index
    together = np.all([rows == assignments[0] for rows in assignments], axis=0)
    return base if int(together.sum()) >= whole * width else None


def _final_posterior(
    state: _GlobalState,
    vecs: list[np.ndarray],
    precs: list[np.ndarray],
    assignments: list[np.ndarray],
    shrink: bool,
    n_global: int | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Means, posterior precisions and member counts recomputed from the assignments (no
    drift from add/remove). The means are the posterior means (Eq. 4), or without
    ``shrink`` the members' precision-weighted means (mu0 where no member observes a
    coordinate). They are computed in the state's own first ``n_global`` rows, which the
    matching no longer needs, and returned as views of them: resident already, so the
    layer's peak holds no second pair of state-sized arrays."""
    zero = np.zeros_like(state.prior_sum)
    n_global = state.size if n_global is None else n_global
    sums, precisions, counts = _posterior_sums(
        zero, zero, vecs, precs, assignments, n_global,
        out=(state.sums[:n_global], state.precisions[:n_global]))
    if shrink:
        sums += state.prior_sum
        precisions += state.prior_precision
        sums /= precisions
    else:
        member_means(sums, precisions, state.prior_sum / state.prior_precision, out=sums)
        precisions += state.prior_precision
    return sums, precisions, counts


def member_means(sums: np.ndarray, precisions: np.ndarray, fallback: np.ndarray,
                 out: np.ndarray | None = None) -> np.ndarray:
    """Precision-weighted member means ``sums / precisions``, ``fallback`` (a (P,) prior
    mean) where no member observes a coordinate (precision 0); written into ``out`` when
    given (``sums`` itself may be it)."""
    seen = precisions > 0
    means = np.divide(sums, precisions, out=np.zeros_like(sums) if out is None else out,
                      where=seen)
    np.copyto(means, fallback, where=~seen)
    return means


def _posterior_sums(prior_sum, prior_precision, vecs, precs, assignments, n_global, out=None):
    """(J, P) sums and precisions (starting from the prior's) and (J,) member counts of
    the globals, from the clients' assignments; written into ``out`` (two C-contiguous
    (J, P) arrays) when given."""
    sums, precisions = out if out is not None else (np.empty((n_global, prior_sum.size)),
                                                    np.empty((n_global, prior_sum.size)))
    sums[:] = prior_sum
    precisions[:] = prior_precision
    counts = np.zeros(n_global, dtype=np.int64)
    for rows, v, p in zip(assignments, vecs, precs, strict=True):
        matching.add_rows(sums, rows, v, 1.0, p)
        matching.add_rows(precisions, rows, p, 1.0)
        counts[rows] += 1
    return sums, precisions, counts


def _objective(state: _GlobalState, data_term: float, n_clients: int, gamma0: float) -> float:
    """2 x negative log posterior (Eq. 3 with Eq. 4), up to assignment-independent constants.

    Gaussian part: sum_i sum_p [ sum_{z in Z_i} s (w_z - m_i)^2 + (m_i - mu0)^2 / sigma0^2 ];
    IBP part: -2 [ J log gamma0 + sum_i log((S - m_i)! (m_i - 1)! / S!) ] with m_i the
    size of global i (the history-multiplicity factor of the IBP is left out);
    ``data_term`` = sum over all local neurons of sum_p s_p w_p^2 (fixed).
    """
    sums, precisions, counts = state.view()
    prior_term = float(np.sum(state.prior_sum * state.prior_sum / state.prior_precision))
    # sum m_i^2 P_i by blocks of rows: over the whole state at once, its temporary is as
    # large as the state (hundreds of MB on ten ResNet-50s' widest group, where nothing
    # matches).
    rows = max(1, SUM_BLOCK_VALUES // max(sums.shape[1], 1))
    fit = 0.0
    for start in range(0, sums.shape[0], rows):
        block = sums[start:start + rows]
        fit += float(np.sum(block * block / precisions[start:start + rows]))
    gaussian = data_term + sums.shape[0] * prior_term - fit
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
