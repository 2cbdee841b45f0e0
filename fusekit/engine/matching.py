"""Matching engine: linear assignment and neuron cost matrices, computed in ``fusekit._core``.

The assignment solver follows SciPy's ``linear_sum_assignment`` contract, so SciPy is a
drop-in oracle, and can also return its dual potentials as a certificate. It releases the
GIL, so independent problems solve in parallel from a thread pool. The cost kernels compute
the PFNM / NAFI matching costs of ALGORITHMS.md sections 3-4 and the squared-Euclidean
ground cost of OT fusion.

Numpy reference implementations with the same signatures live in ``fusekit.engine.reference``.
Inside a ``fusekit.engine.offload.on_device`` block, the cost matrices may be computed on a
CUDA device instead (the toolkit's torch kernels, same results to rounding); the inputs are
validated here either way.

The cost kernels call the BLAS that SciPy ships. numpy's products (:func:`inner_products`)
run on one BLAS thread each, the large ones cut into blocks of rows computed side by side
(two threads on busy cores waited for each other); OpenBLAS's thread count is process-wide,
so other threads' BLAS calls also run on one thread during such a call.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from fusekit.core.errors import ParameterError, ParameterTypeError
from fusekit.engine.native import core
from fusekit.engine.offload import accelerator_for

__all__ = [
    "add_moments",
    "add_rows",
    "all_finite",
    "inner_products",
    "log_det_rows",
    "nafi_cost",
    "pfnm_cost",
    "solve_assignment",
    "sqeuclidean_cost",
    "summed_inner_products",
]


def _as_cost_matrix(cost, maximize: bool) -> np.ndarray:
    """``cost`` as a float32/float64 matrix (a view when it is one), negated when
    maximising; the core makes it C-contiguous if it is not."""
    array = np.asarray(cost)
    if array.ndim != 2:
        # SciPy's wording, as the rest of linear_sum_assignment's contract.
        raise ParameterError(f"cost: expected a matrix (2-D array), got a {array.ndim} array")
    if array.dtype.char not in "fd":  # not float32 or float64
        if array.dtype.kind not in "fiub":
            raise ParameterTypeError(  # ends with SciPy's wording
                f"cost: expected a real numeric matrix, got dtype {array.dtype}: Cannot cast "
                f"array data from {array.dtype!r} to dtype('float64') according to the rule "
                "'safe'")
        array = array.astype(np.float64)
    if maximize:
        array = -array  # -inf, forbidden when maximising, becomes +inf
    return array


def _is_constant(matrix: np.ndarray) -> bool:
    """Whether every entry is one finite value; the corners are compared first, so that
    other matrices cost no pass over their entries (almost always)."""
    if matrix.size == 0:
        return False
    first = matrix[0, 0]
    return bool(matrix[-1, -1] == first and matrix[0, -1] == first and matrix[-1, 0] == first
                and np.isfinite(first) and (matrix == first).all())


def _identity_assignment(matrix: np.ndarray):
    """SciPy's answer to a constant matrix (every assignment is optimal): row i to column i,
    with duals that certify it (the constant on the rows of a wide or square matrix, on the
    columns of a tall one, so that unassigned rows and columns keep 0)."""
    n, m = matrix.shape
    pairs = np.arange(min(n, m), dtype=np.int64)
    value = float(matrix[0, 0])
    u, v = np.zeros(n), np.zeros(m)
    if n <= m:
        u[:] = value
    else:
        v[:] = value
    return pairs, pairs.copy(), u, v


def solve_assignment(cost, maximize: bool = False, *, return_duals: bool = False):
    """Solve the linear assignment problem (Jonker-Volgenant shortest augmenting paths).

    A drop-in for SciPy's ``linear_sum_assignment(cost, maximize=False)``: the same
    arguments (``maximize`` also positionally), inputs (any real or boolean array_like,
    any strides), outputs, error classes and messages; SciPy's own test file passes
    against it. Among several optimal assignments the columns may differ from SciPy's
    (ties are broken differently; a constant matrix gets SciPy's row i to column i); the
    total is the same optimum.

    Parameters
    ----------
    cost : array_like, shape (n, m)
        Real or boolean matrix (float32 is solved in float32 storage, anything else as
        float64). ``+inf`` (``-inf`` when maximising) marks a forbidden pair. Rectangular
        matrices assign ``min(n, m)`` pairs.
    maximize : bool
        Maximise the total instead of minimising it.
    return_duals : bool
        Also return dual potentials ``(u, v)``: ``u[i] + v[j] <= cost[i, j]`` (``>=``
        when maximising) with equality on assigned pairs, and 0 on the rows (columns) a
        rectangular problem leaves unassigned: a certificate of optimality, to within
        rounding (tall problems count distances within 64 units in the last place of the
        costs' scale as tied, so that PFNM's interchangeable slots end a search at once).

    Returns
    -------
    row_ind, col_ind : ndarray of int64, shape (min(n, m),)
        Assigned pairs, rows sorted increasingly.
    (u, v) : tuple of ndarray of float64, only with ``return_duals=True``.

    Raises
    ------
    ParameterError (a ValueError)
        ``cost`` is not 2-D, or holds NaN or the non-forbidding infinity (``-inf`` when
        minimising, ``+inf`` when maximising): SciPy's "expected a matrix" and "matrix
        contains invalid numeric entries".
    ParameterTypeError (a ParameterError and a TypeError)
        ``cost`` is not numeric (strings, objects, complex numbers).
    InfeasibleAssignmentError (a ValueError)
        Every complete assignment uses a forbidden pair (SciPy's "cost matrix is
        infeasible").

    Notes
    -----
    What a call needs, whatever the values (ties included): the matrix (a float64 copy
    unless it is C-contiguous float32/float64; a negated copy when maximising) plus
    O(n + m): a few vectors of n and m entries, and for tall matrices (n > m) 6 candidate
    rows per column (8 from 64 columns, 16 from 256). Square problems from 384 x 384 keep
    at most 64 candidate pairs per row on average (16 bytes each, about 1 KiB per row) and
    otherwise solve densely in O(n). PFNM-shaped matrices of at most 2,097,152 entries
    (16 MiB in float64) may be solved through a transposed copy.

    Rectangular matrices are never padded: a wide one (n < m) augments row by row, each
    search step reading one row; a tall one augments over its m columns, each free row
    entering through the columns' few cheapest free rows, and runs of rows that each
    dominate the next (PFNM's new-neuron slots) enter as one row, their first free member.
    Up to that size each is solved in its faster orientation, by how many of its neurons
    are new (at least those the existing neurons cannot take; else estimated from the dense
    solver's first reduction rows, up to 16, whose cheapest column is a slot): with half of
    them or 32 new, on the tall solver; with fewer, a tall matrix less than four times
    taller than wide on the dense solver (one without slot runs up to ten times, and 65,536
    entries). The values are checked in a pass each solver makes anyway.
    """
    matrix = _as_cost_matrix(cost, maximize)
    if _is_constant(matrix):
        rows, cols, u, v = _identity_assignment(matrix)
    else:
        rows, cols, u, v = core().solve_assignment(matrix, return_duals, maximize)
    if not return_duals:
        return rows, cols
    if maximize:
        u, v = -u, -v
    return rows, cols, (u, v)


def add_rows(
    target: np.ndarray,
    rows: np.ndarray,
    values: np.ndarray,
    sign: float = 1.0,
    scale: np.ndarray | None = None,
) -> None:
    """In place: ``target[rows] += sign * values`` (``values * scale`` when scale is given).

    One pass over the rows in the C++ core, where numpy's fancy-index ``+=`` gathers, adds
    and scatters, and ``values * scale`` is never stored (bit-identical to numpy's result).

    Parameters
    ----------
    target : ndarray, float64, C-contiguous, (n_rows, p); written in place.
    rows : ndarray of int64, (n,); unique indices into ``target``.
    values : ndarray of float64, (n, p), or (p,) added to every row.
    sign : 1.0 or -1.0.
    scale : ndarray of float64, (p,), optional.

    Raises
    ------
    ParameterError (a ValueError)
        ``target`` not writeable float64 C-contiguous 2-D, or shapes that disagree.
    IndexError
        A row outside ``target``.
    """
    core().add_rows(target, rows, values, sign, scale)


def add_moments(
    sums: np.ndarray,
    squares: np.ndarray,
    counts: np.ndarray,
    rows: np.ndarray,
    values: np.ndarray,
    scale: np.ndarray,
    seen: np.ndarray,
) -> None:
    """In place, with ``x = values * scale``: ``sums[rows] += x * seen``,
    ``squares[rows] += (x * x) * seen``, ``counts[rows] += seen``: the per-global moments of
    one client's assigned neurons in one pass of the C++ core, without the scaled copies
    (bit-identical to :func:`add_rows` of ``x`` and ``x * x``).

    Parameters
    ----------
    sums, squares, counts : ndarray, float64, C-contiguous, (n_rows, p); written in place.
    rows : ndarray of int64, (n,); unique indices into the targets.
    values : ndarray of float64, (n, p).
    scale, seen : ndarray of float64, (p,); seen is 1 (observed) or 0.

    Raises
    ------
    ParameterError (a ValueError)
        A target not writeable float64 C-contiguous 2-D, or shapes that disagree.
    IndexError
        A row outside the targets.
    """
    core().add_moments(sums, squares, counts, rows, values, scale, seen)


def log_det_rows(client_precision: np.ndarray, global_precisions: np.ndarray) -> np.ndarray:
    """Per global neuron i, ``sum_p ln(1/s_p + 1/P_ip)`` over the coordinates the client
    observes (s_p > 0): the log-determinant of a local neuron's Gaussian marginal under
    global i, one pass in the C++ core (one logarithm per run of equal arguments).

    Parameters
    ----------
    client_precision : ndarray of float64, (p,); s >= 0.
    global_precisions : ndarray of float64, (J, p); P > 0.

    Returns
    -------
    ndarray of float64, (J,)
    """
    return core().log_det_rows(client_precision, global_precisions)


def all_finite(x) -> bool:
    """Whether every value of a float64 array is finite (one pass in the C++ core)."""
    array = np.ascontiguousarray(np.asarray(x, dtype=np.float64))
    return array.size == 0 or not np.isnan(core().finite_min(array))


def sqeuclidean_cost(a, b) -> np.ndarray:
    """Pairwise squared Euclidean distances, the ground cost of OT fusion (ALGORITHMS.md §5).

    Parameters
    ----------
    a : array_like, shape (n, p)
    b : array_like, shape (m, p)

    Returns
    -------
    ndarray of float64, shape (n, m)
        ``out[i, j] = sum_p (a[i, p] - b[j, p])**2``, computed as one BLAS product plus
        norms; entries that would lose digits to cancellation (near-equal rows) are
        recomputed as differences, so the result is never negative.

    Raises
    ------
    ParameterError (a ValueError)
        Not 2-D, different numbers of columns, or non-finite values.
    """
    a = _finite_matrix(a, "a")
    b = _finite_matrix(b, "b")
    if a.shape[1] != b.shape[1]:
        raise ParameterError(
            f"a and b: expected the same number of columns, got {a.shape[1]} and {b.shape[1]}"
        )
    kernels = accelerator_for(2.0 * a.shape[0] * b.shape[0] * a.shape[1]) or core()
    return kernels.sqeuclidean_cost(a, b)


def inner_products(pairs: Iterable[tuple[np.ndarray, np.ndarray]],
                   out: np.ndarray | None = None) -> np.ndarray:
    """``sum_k a_k @ b_k.T``: how alike the units of two models are over every tensor they
    appear in, the similarity weight matching maximises (Git Re-Basin §3.2).

    Parameters
    ----------
    pairs : iterable of (a_k (n, p_k), b_k (m, p_k)) arrays, at least one.
    out : optional (n, m) C-contiguous array of the products' dtype that numpy's products
        are written into (the same values): memory already in use is not faulted in and
        zeroed page by page again. A device's products ignore it.

    Returns
    -------
    ndarray, shape (n, m): numpy's products summed in order (their dtype), or float64 from a
        device (inside ``fusekit.engine.offload.on_device``, for large enough problems).
    """
    pairs = list(pairs)
    flops = sum(2.0 * a.shape[0] * b.shape[0] * a.shape[1] for a, b in pairs)
    kernels = accelerator_for(flops)
    if kernels is not None:
        return kernels.inner_products(pairs)
    parts = 1 if flops < SERIAL_FLOPS else _numpy_blas_threads()
    with _serial_numpy_blas():
        first, second = pairs[0]
        total = _rows_side_by_side(first, second, out, parts)
        for a, b in pairs[1:]:
            total += _rows_side_by_side(a, b, None, parts)  # in place: total + a @ b.T
    return total


def summed_inner_products(batches: Iterable[list[tuple[np.ndarray, np.ndarray]]],
                          out: np.ndarray | None = None) -> np.ndarray:
    """:func:`inner_products` of each batch of pairs, summed in order: where one call holds
    every pair's arrays, here only one batch's need exist at a time (a generator of batches
    makes the next after this one's product). ``out`` as :func:`inner_products`' for the
    first batch, which the others are added to."""
    total = None
    for pairs in batches:
        if total is None:
            total = inner_products(pairs, out=out)
        else:
            total += inner_products(pairs)  # in place
        del pairs  # before the next batch is made
    if total is None:
        raise ParameterError("batches: expected at least one batch of pairs, found none")
    return total


#: numpy's products below this many flops are not cut into blocks, as the core's below its
#: kSerialFlops (csrc/cost.cpp) run on one thread: a second thread gains little on them.
SERIAL_FLOPS = 256e6


def _rows_side_by_side(a: np.ndarray, b: np.ndarray, out: np.ndarray | None,
                       parts: int) -> np.ndarray:
    """``a @ b.T`` (into ``out`` if given), ``a``'s rows cut into ``parts`` blocks whose
    products run side by side on as many threads, each on one BLAS thread (the caller
    holds :func:`_serial_numpy_blas`). OpenBLAS's own threads waited for each other in a
    spin that took a third of ot's CPU on ten ResNet-50s (benchmarks/RESULTS.md); and a
    block of rows on one BLAS thread gives those rows of the whole product on one thread
    bit for bit, so the values do not depend on the number of cores."""
    if out is None:
        out = np.empty((a.shape[0], b.shape[0]), dtype=np.result_type(a, b))
    parts = max(1, min(parts, len(a) // BLOCK_ROWS)) if len(b) >= BLOCK_ROWS else 1
    cuts = [len(a) * k // parts for k in range(parts + 1)]
    others = [_product_threads(parts - 1).submit(np.matmul, a[lo:hi], b.T, out=out[lo:hi])
              for lo, hi in itertools.pairwise(cuts[1:])]
    np.matmul(a[:cuts[1]], b.T, out=out[:cuts[1]])
    for future in others:
        future.result()
    return out


#: Rows (and columns) of a block of a product at least: OpenBLAS multiplies a single row
#: by another kernel (gemv) and small blocks by others again, whose sums round otherwise.
BLOCK_ROWS = 64


@functools.cache
def _product_threads(count: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max(count, 1), thread_name_prefix="fusekit-product")


# A forked child has none of its parent's threads: it makes its own pools.
os.register_at_fork(after_in_child=_product_threads.cache_clear)


def _numpy_blas_threads() -> int:
    """The threads numpy's own BLAS would use (1 while :func:`_serial_numpy_blas` holds it,
    or when numpy shares SciPy's BLAS, whose thread count the core's kernels set)."""
    controller = _numpy_blas()
    return 1 if controller is None else max(1, min(i["num_threads"] for i in controller.info()))


def _serial_numpy_blas() -> contextlib.AbstractContextManager:
    """One thread for numpy's own BLAS (its wheel's OpenBLAS) while in the block; nothing
    when numpy shares a BLAS with SciPy, whose thread count the core's kernels set."""
    controller = _numpy_blas()
    return contextlib.nullcontext() if controller is None else controller.limit(limits=1)


@functools.cache
def _numpy_blas() -> Any:
    from threadpoolctl import ThreadpoolController  # looked up when first asked

    blas = ThreadpoolController().select(user_api="blas")
    mine = [c.filepath for c in blas.lib_controllers if "numpy" in Path(c.filepath).parent.name]
    return blas.select(filepath=mine) if mine else None


def _finite_matrix(x, name: str, check_finite: bool = True) -> np.ndarray:
    array = np.ascontiguousarray(np.asarray(x, dtype=np.float64))
    if array.ndim != 2:
        raise ParameterError(f"{name}: expected a 2-D array, got shape {array.shape}")
    if check_finite and np.isnan(core().finite_min(array)):
        raise ParameterError(f"{name}: expected finite values, found NaN or inf")
    return array


def _per_coordinate(
    x, p: int, name: str, *, bound: str | None, check_finite: bool = True
) -> np.ndarray:
    """Broadcast a scalar or (p,) argument to a contiguous (p,) float64 vector."""
    array = np.asarray(x, dtype=np.float64)
    if array.ndim == 0:
        array = np.full(p, float(array))
    elif array.shape != (p,):
        raise ParameterError(f"{name}: expected a scalar or shape ({p},), got {array.shape}")
    if not check_finite:
        return np.ascontiguousarray(array)
    if not np.isfinite(array).all():
        raise ParameterError(f"{name}: expected finite values")
    if bound == "positive" and not (array > 0).all():
        raise ParameterError(f"{name}: expected values > 0, found min {array.min()}")
    if bound == "non-negative" and not (array >= 0).all():
        raise ParameterError(f"{name}: expected values >= 0, found min {array.min()}")
    return np.ascontiguousarray(array)


def pfnm_cost(*arrays, **options) -> np.ndarray:
    """PFNM matching cost of one client against the global posterior (NAFI paper Eq. 5):
    :func:`nafi_cost` without its KL term (``lam=0``), with the same arrays and the same
    keyword arguments but ``lam``.

    Returns
    -------
    ndarray of float64, shape (J_g + J_l, J_l)
        Cost to minimise (up to a per-column constant):
        row i < J_g: ``sum_p a_ip (w_jp - m_ip)^2 + 2 log((S - n_i) / n_i)`` with
        ``a = s P / (s + P)``, ``m = sums / P``; row J_g + k - 1 (new-neuron slot k):
        ``sum_p s/(1 + s sigma0^2) (w_jp - mu0_p)^2 + 2 log(k S / gamma0)``.

    Raises
    ------
    ParameterError (a ValueError)
        Shapes disagree, values are non-finite or out of range.
    """
    return nafi_cost(*arrays, **options, lam=0.0)


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
    check_finite: bool = True,
) -> np.ndarray:
    """NAFI matching cost: PFNM's cost (:func:`pfnm_cost`) plus ``lam`` times a KL term
    (NAFI paper Eq. 14).

    The KL between the global neuron's posterior before and after adding w_j is
    ``1/2 sum_p [r - 1 - ln r + s^2 (w_jp - m_ip)^2 / (P_ip + s_p)]`` with
    ``r = (P_ip + s_p) / P_ip``; new slots use P = 1/sigma0^2 and m = mu0 (Lemma 5.1).

    Parameters
    ----------
    local : array_like, shape (J_l, P)
        The client's neuron vectors w_j.
    client_precision : float or array_like, shape (P,)
        Client precision s = 1/sigma_s^2 per coordinate; 0 marks an unobserved coordinate.
    global_sums : array_like, shape (J_g, P)
        Precision-weighted sums of the members of each global neuron, including the prior
        term mu0/sigma0^2.
    global_precisions : array_like, shape (J_g, P)
        Posterior precisions P_i (including 1/sigma0^2), all > 0.
    global_counts : array_like, shape (J_g,)
        n_i, the number of OTHER clients in global neuron i (1 <= n_i < n_clients).
    n_clients : int
        S, the number of clients.
    mu0, sigma0_2 : float or array_like, shape (P,)
        Prior mean and variance of global neurons.
    gamma0 : float
        Mass of the Beta-Bernoulli process.
    lam : float
        The KL weight (>= 0).
    check_finite : bool
        Check that the arrays are finite and in range (precisions > 0, counts in
        [1, n_clients), client_precision >= 0, sigma0_2 > 0), as SciPy's ``check_finite``.
        ``False`` skips these value checks (shapes are still checked) for callers that own
        validated state, such as the PFNM / NAFI engine re-building a matrix every step;
        invalid values then give meaningless costs, never an out-of-bounds access.

    Returns
    -------
    ndarray of float64, shape (J_g + J_l, J_l)
        :func:`pfnm_cost`'s cost plus ``lam`` times the KL. Where the matrix product
        inside takes at least ``_core.SINGLE_PRECISION_FLOPS`` (10^9, real-size layers:
        about 0.01 s of double-precision products on two cores) it runs in single
        precision, at about twice the rate; each entry keeps about sqrt(P) x 6e-8 of its
        terms' magnitude, and entries the expansion cancels (a local neuron near a global)
        are computed exactly, as in double precision.

    Raises
    ------
    ParameterError (a ValueError)
        Shapes disagree, values are non-finite or out of range, or ``lam`` negative.
    """
    local = _finite_matrix(local, "local", check_finite)
    p = local.shape[1]
    sums = _finite_matrix(global_sums, "global_sums", check_finite)
    precisions = _finite_matrix(global_precisions, "global_precisions", check_finite)
    if sums.shape[1:] != (p,) or precisions.shape != sums.shape:
        raise ParameterError(
            f"global_sums {sums.shape} and global_precisions {precisions.shape}: expected "
            f"the same shape (J_global, {p})"
        )
    if check_finite and not core().finite_min(precisions) > 0:
        raise ParameterError(
            "global_precisions: expected values > 0 (they include the prior 1/sigma0^2)"
        )
    counts = np.ascontiguousarray(np.asarray(global_counts, dtype=np.float64))
    if counts.shape != (sums.shape[0],):
        raise ParameterError(
            f"global_counts: expected shape ({sums.shape[0]},), got {counts.shape}"
        )
    if isinstance(n_clients, bool) or not isinstance(n_clients, (int, np.integer)) or n_clients < 2:
        raise ParameterError(f"n_clients: expected an integer >= 2, got {n_clients!r}")
    if check_finite and counts.size and not ((counts >= 1).all() and (counts < n_clients).all()):
        raise ParameterError(
            f"global_counts: expected 1 <= n_i < n_clients={n_clients} (clients other than "
            f"this one), found range [{counts.min()}, {counts.max()}]"
        )
    if not (np.isfinite(gamma0) and gamma0 > 0):
        raise ParameterError(f"gamma0: expected a finite value > 0, got {gamma0!r}")
    if not (np.isfinite(lam) and lam >= 0):
        raise ParameterError(f"lam: expected a finite value >= 0, got {lam!r}")
    checked = {"check_finite": check_finite}
    kernels = accelerator_for(2.0 * sums.shape[0] * local.shape[0] * p) or core()
    return kernels.posterior_cost(
        local,
        _per_coordinate(client_precision, p, "client_precision", bound="non-negative", **checked),
        sums,
        precisions,
        counts,
        _per_coordinate(mu0, p, "mu0", bound=None, **checked),
        _per_coordinate(sigma0_2, p, "sigma0_2", bound="positive", **checked),
        float(n_clients),
        float(gamma0),
        float(lam),
    )
