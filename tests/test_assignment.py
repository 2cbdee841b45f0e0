"""The assignment solver against SciPy and brute force, plus its error and threading contract."""

from __future__ import annotations

import itertools
import threading

import numpy as np
import pytest
from scipy.optimize import linear_sum_assignment

from fusekit.core.errors import InfeasibleAssignmentError, ParameterError
from fusekit.engine.matching import solve_assignment, solve_assignments


def random_cost(rng: np.random.Generator, n: int, m: int, kind: str, dtype=np.float64):
    if kind == "uniform":
        cost = rng.random((n, m))
    elif kind == "ties":
        cost = rng.integers(0, 3, (n, m)).astype(float)
    elif kind == "constant":
        cost = np.full((n, m), 1.5)
    elif kind == "negative":
        cost = rng.normal(scale=100.0, size=(n, m))
    elif kind == "forbidden":
        cost = rng.random((n, m))
        cost[rng.random((n, m)) < 0.35] = np.inf
    elif kind == "pfnm":  # existing neurons + a degenerate new-neuron block
        j_local = m
        existing = rng.random((n, j_local)) * 4
        new = rng.random(j_local)[None, :] + np.log(np.arange(1, j_local + 1))[:, None]
        cost = np.vstack([existing, new])
    else:
        raise AssertionError(kind)
    return cost.astype(dtype)


def optimum(cost: np.ndarray, maximize: bool = False) -> float | None:
    try:
        rows, cols = linear_sum_assignment(cost.astype(np.float64), maximize=maximize)
    except ValueError:
        return None
    return float(cost.astype(np.float64)[rows, cols].sum())


def check_solution(cost, rows, cols, maximize=False):
    cost = np.asarray(cost, dtype=np.float64)
    k = min(cost.shape)
    assert rows.dtype == np.int64 and cols.dtype == np.int64
    assert len(rows) == len(cols) == k
    assert np.all(np.diff(rows) > 0), "rows must be sorted and distinct"
    assert len(np.unique(cols)) == k
    total = cost[rows, cols].sum()
    expected = optimum(cost, maximize)
    assert expected is not None
    assert total == pytest.approx(expected, rel=1e-9, abs=1e-9)


def check_duals(cost, rows, cols, u, v, maximize=False):
    cost = np.asarray(cost, dtype=np.float64)
    sign = -1.0 if maximize else 1.0
    allowed = np.isfinite(cost)
    slack = sign * (cost - u[:, None] - v[None, :])
    scale = 1e-9 * (1 + np.abs(cost[allowed]).max(initial=0.0))
    assert (slack[allowed] >= -scale).all(), "dual infeasible"
    assert np.allclose(slack[rows, cols], 0.0, atol=scale), "assigned pairs must be tight"


KINDS = ["uniform", "ties", "constant", "negative", "forbidden"]


@pytest.mark.parametrize("kind", KINDS)
def test_matches_scipy_on_random_problems(kind):
    rng = np.random.default_rng(KINDS.index(kind))
    for trial in range(600):
        n, m = (int(x) for x in rng.integers(0, 12, size=2))
        dtype = np.float32 if trial % 3 == 0 else np.float64
        cost = random_cost(rng, n, m, kind, dtype)
        maximize = trial % 4 == 1 and kind != "forbidden"
        expected = optimum(cost, maximize)
        if expected is None:
            with pytest.raises(InfeasibleAssignmentError):
                solve_assignment(cost, maximize=maximize)
            continue
        rows, cols, (u, v) = solve_assignment(cost, maximize=maximize, return_duals=True)
        check_solution(cost, rows, cols, maximize)
        check_duals(cost, rows, cols, u, v, maximize)


def brute_force(cost: np.ndarray) -> float:
    n, m = cost.shape
    if n <= m:
        return min(
            sum(cost[i, p[i]] for i in range(n)) for p in itertools.permutations(range(m), n)
        )
    return brute_force(cost.T)


def test_matches_brute_force_up_to_seven():
    rng = np.random.default_rng(7)
    for _ in range(300):
        n, m = (int(x) for x in rng.integers(1, 8, size=2))
        cost = (
            rng.integers(-5, 6, (n, m)).astype(float) if rng.random() < 0.5 else rng.random((n, m))
        )
        rows, cols = solve_assignment(cost)
        assert cost[rows, cols].sum() == pytest.approx(brute_force(cost), abs=1e-12)


@pytest.mark.parametrize(
    "shape", [(40, 40), (30, 70), (70, 30), (300, 300), (100, 600), (600, 100)]
)
def test_larger_problems_and_structured_costs(shape):
    rng = np.random.default_rng(shape[0] * 1000 + shape[1])
    n, m = shape
    problems = [
        rng.random(shape),
        rng.integers(0, 10, shape).astype(float),
        rng.random(shape).astype(np.float32),
    ]
    if n > m:
        problems.append(random_cost(rng, n - m, m, "pfnm"))
    perm = rng.permutation(max(shape))[: min(shape)]
    near = rng.random(shape) + 1.0
    if n <= m:
        near[np.arange(n), perm] = 0.01 * rng.random(n)
    else:
        near[perm, np.arange(m)] = 0.01 * rng.random(m)
    problems.append(near)
    for cost in problems:
        rows, cols, (u, v) = solve_assignment(cost, return_duals=True)
        check_solution(cost, rows, cols)
        check_duals(cost, rows, cols, u, v)


def test_non_contiguous_and_integer_inputs():
    rng = np.random.default_rng(3)
    base = rng.random((30, 50))
    for view in [base.T, base[::2, ::3], base[:, 5:25], np.asfortranarray(base)]:
        check_solution(view, *solve_assignment(view))
    ints = rng.integers(0, 100, (12, 9))
    check_solution(ints, *solve_assignment(ints))
    check_solution(base.tolist(), *solve_assignment(base.tolist()))


@pytest.mark.parametrize("shape", [(0, 0), (2, 0), (0, 3)])
def test_empty_shapes_behave_like_scipy(shape):
    cost = np.zeros(shape)
    rows, cols = solve_assignment(cost)
    expected_rows, expected_cols = linear_sum_assignment(cost)
    assert rows.shape == expected_rows.shape == (0,)
    assert cols.shape == expected_cols.shape == (0,)
    rows, cols, (u, v) = solve_assignment(cost, return_duals=True)
    assert u.shape == (shape[0],) and v.shape == (shape[1],)


@pytest.mark.parametrize("bad", [np.nan, -np.inf])
def test_nan_and_negative_infinity_are_rejected(bad):
    cost = np.ones((3, 4))
    cost[1, 2] = bad
    with pytest.raises(ValueError, match="NaN or -inf"):
        solve_assignment(cost)
    with pytest.raises(ValueError):
        linear_sum_assignment(cost)


def test_positive_infinity_is_invalid_when_maximising():
    cost = np.ones((3, 3))
    cost[0, 0] = np.inf
    with pytest.raises(ValueError,
                       match=r"expected finite values or -inf when maximising, found \+inf"):
        solve_assignment(cost, maximize=True)
    cost[0, 0] = -np.inf  # forbidden when maximising
    _, cols = solve_assignment(cost, maximize=True)
    assert cols[0] != 0


def test_infeasible_problem_raises_clear_error():
    cost = np.array([[np.inf, 1.0, np.inf], [np.inf, 2.0, np.inf], [1.0, 1.0, 1.0]])
    with pytest.raises(InfeasibleAssignmentError, match="forbidden"):
        solve_assignment(cost)
    with pytest.raises(ValueError):  # also a ValueError, like SciPy's
        solve_assignment(np.full((2, 3), np.inf))


@pytest.mark.parametrize(
    "bad", [np.ones(3), np.ones((2, 2, 2)), np.array([["a", "b"]]), np.ones((2, 2), dtype=complex)]
)
def test_non_matrix_input_is_rejected(bad):
    with pytest.raises(ValueError, match="cost"):
        solve_assignment(bad)


@pytest.mark.parametrize("shape", [(50, 50), (30, 80), (80, 30), (300, 300), (100, 600)])
@pytest.mark.parametrize("maximize", [False, True])
def test_warm_start_from_a_similar_problem_finds_the_optimum(shape, maximize):
    rng = np.random.default_rng(shape[0] + 3 * shape[1] + maximize)
    for scale in [0.0, 1e-3, 0.1, 1.0]:
        cost = rng.random(shape)
        _, _, duals = solve_assignment(cost, maximize=maximize, return_duals=True)
        perturbed = cost + scale * rng.normal(size=shape)
        rows, cols, (u, v) = solve_assignment(
            perturbed, maximize=maximize, warm_start=duals, return_duals=True
        )
        check_solution(perturbed, rows, cols, maximize)
        check_duals(perturbed, rows, cols, u, v, maximize)


def test_warm_start_with_arbitrary_potentials_is_still_optimal():
    rng = np.random.default_rng(11)
    for _ in range(300):
        n, m = (int(x) for x in rng.integers(1, 9, size=2))
        cost = rng.integers(0, 4, (n, m)).astype(float)
        warm = (rng.normal(size=n) * 3, rng.normal(size=m) * 3)
        check_solution(cost, *solve_assignment(cost, warm_start=warm))


def test_warm_start_with_wrong_shapes_is_rejected():
    cost = np.ones((3, 4))
    with pytest.raises(ValueError, match="warm_start"):
        solve_assignment(cost, warm_start=(np.zeros(4), np.zeros(3)))
    with pytest.raises(ValueError, match="warm_start"):
        solve_assignment(cost, warm_start=np.zeros(3))
    with pytest.raises(ValueError):
        solve_assignment(cost, warm_start=(np.zeros(3), np.full(4, np.nan)))


def test_batch_matches_single_solves():
    rng = np.random.default_rng(5)
    costs = [
        random_cost(rng, int(rng.integers(1, 60)), int(rng.integers(1, 60)), "uniform")
        for _ in range(40)
    ]
    costs += [rng.random((20, 20)).astype(np.float32)]
    for n_threads in [None, 1, 3]:
        results = solve_assignments(costs, n_threads=n_threads)
        assert len(results) == len(costs)
        for cost, (rows, cols) in zip(costs, results, strict=True):
            check_solution(cost, rows, cols)
    float32_batch = [c.astype(np.float32) for c in costs[:5]]
    for cost, (rows, cols) in zip(float32_batch, solve_assignments(float32_batch), strict=True):
        check_solution(cost, rows, cols)
    for cost, (rows, cols) in zip(
        costs[:5], solve_assignments(costs[:5], maximize=True), strict=True
    ):
        check_solution(cost, rows, cols, maximize=True)
    assert solve_assignments([]) == []


def test_batch_errors_name_the_problem():
    good = np.ones((2, 2))
    with pytest.raises(InfeasibleAssignmentError, match=r"costs\[1\]"):
        solve_assignments([good, np.full((2, 2), np.inf)])
    with pytest.raises(ValueError, match=r"costs\[0\]"):
        solve_assignments([np.ones(3)])
    with pytest.raises(ParameterError, match="n_threads"):
        solve_assignments([good], n_threads=0)


def count_while_running(work) -> int:
    """How often this thread increments a counter while ``work`` runs in another thread.

    With the GIL held for the whole native call, this thread cannot run until the call
    returns, so the count stays near zero; released, it counts throughout.
    """
    started = threading.Event()
    finished = threading.Event()

    def target():
        started.set()
        work()
        finished.set()

    worker = threading.Thread(target=target)
    worker.start()
    started.wait()
    count = 0
    while not finished.is_set():
        count += 1
    worker.join()
    return count


def test_gil_is_released_during_solves():
    rng = np.random.default_rng(0)
    big = rng.random((1500, 1500))
    assert count_while_running(lambda: solve_assignment(big)) > 1000
    batch = [rng.random((700, 700)) for _ in range(4)]
    assert count_while_running(lambda: solve_assignments(batch, n_threads=1)) > 1000


def test_non_finite_warm_start_is_named():
    cost = np.arange(9.0).reshape(3, 3)
    with pytest.raises(ParameterError, match="warm_start: expected finite potentials"):
        solve_assignment(cost, warm_start=(np.array([np.nan, 0, 0]), np.zeros(3)))


def test_bad_input_is_a_fusekit_parameter_error():
    with pytest.raises(ParameterError, match=r"costs\[1\]: expected a 2-D cost matrix"):
        solve_assignments([np.ones((2, 2)), np.ones((2, 2, 2))])
