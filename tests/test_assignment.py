"""The assignment solver against SciPy and brute force, plus its error and threading contract."""

from __future__ import annotations

import itertools
import os
import pickle
import subprocess
import sys
import textwrap
import threading
import tracemalloc

import numpy as np
import pytest
from scipy.optimize import linear_sum_assignment

from fusekit.core.errors import InfeasibleAssignmentError, ParameterError
from fusekit.engine.matching import solve_assignment
from fusekit.engine.native import core


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


def pfnm_shaped(rng: np.random.Generator, j_global: int, j_local: int, variant: str):
    """A (J_g + J_l) x J_l matrix with PFNM's structure: existing neurons over a new-neuron
    block (a cost per local neuron plus a penalty growing with the slot, so that each slot's
    row dominates the one before), in float, tied-integer or partly forbidden variants."""
    if variant == "ties":
        top = rng.integers(0, 6, (j_global, j_local)).astype(float)
        per_neuron = rng.integers(0, 3, j_local).astype(float)
        penalty = np.arange(j_local) // 3
    else:
        top = rng.random((j_global, j_local)) * 4
        per_neuron = rng.random(j_local) * 2
        penalty = np.log(np.arange(1, j_local + 1))
    if variant == "forbidden":
        top[rng.random(top.shape) < 0.3] = np.inf
    return np.vstack([top, per_neuron[None, :] + penalty[:, None]])


@pytest.mark.parametrize("variant", ["float", "ties", "forbidden"])
def test_pfnm_shaped_problems_match_scipy_in_both_orientations(variant):
    rng = np.random.default_rng(["float", "ties", "forbidden"].index(variant) + 100)
    for trial in range(500):
        j_global, j_local = int(rng.integers(0, 40)), int(rng.integers(1, 25))
        cost = pfnm_shaped(rng, j_global, j_local, variant)
        if trial % 2:
            cost = np.ascontiguousarray(cost.T)
        if trial % 5 == 0:
            cost = cost.astype(np.float32)
        maximize = trial % 7 == 3 and variant != "forbidden"
        rows, cols, (u, v) = solve_assignment(cost, maximize, return_duals=True)
        check_solution(cost, rows, cols, maximize)
        check_duals(cost, rows, cols, u, v, maximize)


@pytest.mark.parametrize("new_share", [0.0, 0.1, 0.5, 1.0])
def test_pfnm_shaped_problems_of_benchmark_size_take_every_route(new_share):
    """Sizes where the solver picks between orientations (a transposed copy for short tall
    problems, the tall solver for wide ones whose neurons are mostly new): the optimum and a
    dual certificate whichever route, as the share of new neurons moves the choice."""
    rng = np.random.default_rng(int(new_share * 10) + 200)
    for j_global, j_local in [(100, 50), (60, 40), (500, 100), (150, 100), (20, 60), (2000, 50)]:
        top = rng.random((j_global, j_local))
        per_neuron = np.where(rng.random(j_local) < new_share, -1.0, 2.0) + rng.random(j_local)
        slots = per_neuron[None, :] + 0.01 * np.log(np.arange(1, j_local + 1))[:, None]
        tall = np.vstack([top, slots])
        for cost in (tall, np.ascontiguousarray(tall.T), np.round(tall * 4)):
            rows, cols, (u, v) = solve_assignment(cost, return_duals=True)
            check_solution(cost, rows, cols, False)
            check_duals(cost, rows, cols, u, v, False)


def test_tall_problems_whose_columns_tie_on_the_same_rows():
    """Tall integer costs where each column has many tied cheapest rows: the columns compete
    for the same rows, their lists of cheapest rows run dry and are refilled, and tied rows
    are taken from each column's own starting row on. Forbidden pairs thin the ties."""
    rng = np.random.default_rng(300)
    for j_global, j_local, levels in [(2000, 500, 20), (1200, 300, 10), (400, 100, 3)]:
        top = rng.integers(0, levels, (j_global, j_local)).astype(float)
        slots = rng.integers(0, 4, j_local)[None, :] + (np.arange(j_local) // 10)[:, None]
        tall = np.vstack([top, slots.astype(float)])
        forbidden = tall.copy()
        forbidden[: j_global][rng.random(top.shape) < 0.5] = np.inf
        for cost in (tall, forbidden, tall[: j_global]):
            rows, cols, (u, v) = solve_assignment(cost, return_duals=True)
            check_solution(cost, rows, cols, False)
            check_duals(cost, rows, cols, u, v, False)


def test_searches_through_interchangeable_slots():
    """Most neurons new, on integer slots that are each the first slot plus a constant (a
    cost per neuron, a penalty per slot): a search need not go through an agent that merely
    swaps slots. Where the later slots' lines are not the first plus a constant (dearer on a
    third of the neurons, the slots still rising), or not exactly (fractional costs), it must
    go through them."""
    rng = np.random.default_rng(400)
    for j_global, j_local, step in [(100, 500, 10), (30, 200, 1), (60, 120, 4)]:
        top = rng.integers(0, 20, (j_global, j_local)).astype(float)
        per_neuron = rng.integers(0, 4, j_local).astype(float)
        slots = per_neuron[None, :] + (np.arange(j_local) // step)[:, None]
        uneven = slots.copy()
        uneven[j_local // 2 :, : j_local // 3] += 0.25
        fractional = slots + 0.1 * rng.random(j_local)[None, :]
        for block in (slots, uneven, fractional):
            tall = np.vstack([top, block])
            for cost in (tall, np.ascontiguousarray(tall.T)):
                rows, cols, (u, v) = solve_assignment(cost, return_duals=True)
                check_solution(cost, rows, cols, False)
                check_duals(cost, rows, cols, u, v, False)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_matrices_starting_anywhere_in_a_cache_line(dtype):
    """The dense solver's kernels read each row from a vector boundary on, its first
    entries up to there apart: matrices that start at every offset within a cache line (and
    rows of every length modulo a vector) are solved as SciPy solves them."""
    rng = np.random.default_rng(5)
    for rows, cols in [(7, 37), (30, 203), (16, 64), (5, 9)]:
        values = rng.random(rows * cols + 16).astype(dtype)
        values[rng.random(values.shape) < 0.02] = 0.0  # an early minimum, in the first entries
        for offset in range(16):
            cost = values[offset : offset + rows * cols].reshape(rows, cols)
            assert cost.flags.c_contiguous
            rows_, cols_ = solve_assignment(cost)
            check_solution(cost, rows_, cols_)


def test_runs_of_every_length_and_place():
    """Runs of rows each dominating the one before (found from every third step, then grown
    both ways) of 2-7 rows, at the first and last rows, back to back, one row apart, and one
    broken by a single falling entry: every solution and dual certificate matches SciPy."""
    rng = np.random.default_rng(21)
    for trial in range(40):
        width = int(rng.integers(3, 12))
        blocks = []
        while sum(len(b) for b in blocks) < 5 * width:
            length = int(rng.integers(1, 8))
            block = rng.random(width)[None, :] + np.cumsum(rng.random((length, width)), axis=0)
            if length > 3 and trial % 4 == 0:
                block[length // 2, int(rng.integers(width))] -= 10.0  # one step falls
            blocks.append(block * 0.2 if trial % 2 else np.round(block))
        tall = np.vstack(blocks)
        for cost in (tall, np.ascontiguousarray(tall.T)):
            rows, cols, (u, v) = solve_assignment(cost, return_duals=True)
            check_solution(cost, rows, cols, False)
            check_duals(cost, rows, cols, u, v, False)


def test_a_slot_run_broken_outside_the_sampled_rows_is_not_collapsed():
    """A wide problem's slot columns are found on a sample of its rows; when one row outside
    the sample breaks their order (a slot much cheaper than the one before it there), the
    tall solver must not take them as one run, whose first free member alone would be
    offered. Most neurons are new, so that the tall solver runs."""
    rng = np.random.default_rng(11)
    for j_global, j_local in [(500, 100), (150, 64), (40, 48)]:
        top = rng.random((j_global, j_local)) + 3.0
        old = rng.random(j_local) < 0.3  # these have an existing neuron at cost 0
        top[rng.integers(0, j_global, j_local)[old], np.flatnonzero(old)] = 0.0
        slots = rng.random(j_local)[None, :] + 0.01 * np.arange(j_local)[:, None]
        wide = np.ascontiguousarray(np.vstack([top, slots]).T)
        for row in (1, j_local // 2 + 1, j_local - 1):  # outside the 16 sampled rows
            for slot in (1, j_local // 2, j_local - 1):
                broken = wide.copy()
                broken[row, j_global + slot] = broken[row, j_global + slot - 1] - 2.0
                rows, cols, (u, v) = solve_assignment(broken, return_duals=True)
                check_solution(broken, rows, cols, False)
                check_duals(broken, rows, cols, u, v, False)


@pytest.mark.parametrize("bad", [np.nan, -np.inf])
def test_invalid_entries_are_found_on_every_route(bad):
    """Each route checks the values in a pass of its own (the tall solver while offering
    its candidates, having bounded them from a sample of the rows): NaN or -inf anywhere,
    a row outside the sample or the new-neuron slots included, is refused."""
    rng = np.random.default_rng(7)
    for j_global, j_local, new_share in [(2000, 50, 0.1), (100, 50, 0.0), (500, 100, 1.0)]:
        top = rng.random((j_global, j_local))
        per_neuron = np.where(rng.random(j_local) < new_share, -1.0, 2.0) + rng.random(j_local)
        slots = per_neuron[None, :] + 0.01 * np.log(np.arange(1, j_local + 1))[:, None]
        tall = np.vstack([top, slots])
        for row in (0, 1, j_global // 2 + 1, j_global - 1, j_global + 1, len(tall) - 1):
            broken = tall.copy()
            broken[row, row % j_local] = bad
            for cost in (broken, np.ascontiguousarray(broken.T)):
                with pytest.raises(ParameterError, match="invalid numeric entries"):
                    solve_assignment(cost)


def test_tall_value_check_beside_forbidden_and_huge_costs():
    """The tall solver checks the rows it offers through their sum, and entry by entry only
    when the sum says so: a NaN or -inf beside forbidden (+inf) pairs is still refused, and
    finite costs whose sum overflows to -inf, or forbidden pairs alone, are solved."""
    rng = np.random.default_rng(11)
    tall = rng.random((550, 50))
    forbidden = tall.copy()
    forbidden[rng.random(forbidden.shape) < 0.05] = np.inf
    for bad in (np.nan, -np.inf):
        broken = forbidden.copy()
        broken[300, 7] = bad
        with pytest.raises(ParameterError, match="invalid numeric entries"):
            solve_assignment(broken)
    huge = tall.copy()
    huge[::25, 3] = -1e307  # their sum overflows to -inf
    for cost in (forbidden, huge):
        rows, cols = solve_assignment(cost)
        check_solution(cost, rows, cols)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_long_rows_with_their_smallest_anywhere(dtype):
    """Rows of 256 entries and more keep one minimum per lane (32 lanes, entry j in lane
    j - head mod 32, the head's entries before the first vector boundary in the last lanes)
    and look again only at the winning lane: the smallest placed in the head, the body or
    the tail, alone, twice in one lane, beside another lane's equal, or with the second
    smallest in its own lane, at every offset in a cache line; solutions and duals match
    SciPy."""
    rng = np.random.default_rng(17)
    for cols in (256, 300, 517):
        places = sorted({0, 1, 5, 7, 8, 40, cols // 2, cols - 33, cols - 9, cols - 1})
        rows = len(places)
        values = (1.0 + rng.random(rows * cols + 16)).astype(dtype)
        for offset in range(16):
            cost = values.copy()[offset : offset + rows * cols].reshape(rows, cols)
            for i, j in enumerate(places):
                cost[i, j] = 0.25  # the smallest, alone
                shape = (i + offset) % 4
                if shape == 1 and j + 32 < cols:
                    cost[i, j + 32] = 0.25  # twice in one lane
                elif shape == 2:
                    cost[i, (j + 1) % cols] = 0.25  # in the next lane too
                elif shape == 3 and j + 64 < cols:
                    cost[i, j + 64] = 0.5  # the second smallest in its lane
            rows_, cols_, (u, v) = solve_assignment(cost, return_duals=True)
            check_solution(cost, rows_, cols_)
            check_duals(cost, rows_, cols_, u, v)


def test_portable_search_loops_match_scipy():
    """CPUs without AVX-512 run the searches' portable loops and 32-byte vector kernels;
    here FUSEKIT_NO_AVX512 forces them, in a fresh interpreter (the choice is made at
    import). Every third matrix is tall enough for the tall solver."""
    script = textwrap.dedent("""
        import numpy as np
        from scipy.optimize import linear_sum_assignment
        from fusekit.engine.matching import solve_assignment
        rng = np.random.default_rng(7)
        for trial in range(300):
            n, m = (int(x) for x in rng.integers(1, 60, size=2))
            if trial % 3 == 0:
                n, m = 4 * m + n, m
            cost = rng.integers(0, 5, (n, m)).astype(float) if trial % 2 else rng.random((n, m))
            rows, cols = solve_assignment(cost)
            expected = cost[linear_sum_assignment(cost)].sum()
            assert abs(cost[rows, cols].sum() - expected) < 1e-9, (trial, n, m)
        print("ok")
    """)
    env = dict(os.environ, FUSEKIT_NO_AVX512="1")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


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
    "shape", [(40, 40), (30, 70), (70, 30), (300, 300), (100, 600), (600, 100), (400, 40)]
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


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_similarities_of_independently_initialised_layers(dtype):
    """ot's and rebasin's square problems: minus the inner products of two layers' unit
    rows. Their optimum lies further down the rows than uniform matrices' does, so the
    candidate lists need a wider gap (grown, then narrowed when past the edge budget)."""
    rng = np.random.default_rng(7)
    for n in (500, 900):
        mine, theirs = rng.standard_normal((2, n, 3 * n // 2)).astype(dtype)
        cost = -(mine @ theirs.T)
        rows, cols, (u, v) = solve_assignment(cost, return_duals=True)
        check_solution(cost, rows, cols)
        check_duals(cost, rows, cols, u, v)


@pytest.mark.parametrize("shape", [(40, 120), (120, 40), (60, 60)])
def test_forbidden_pairs_in_the_row_reduction(shape):
    """The dense solver's row reduction runs beside forbidden (+inf) pairs: a row with one
    allowed column takes it as it is, a row with none is left to the search, which finds
    the problem infeasible (every row of a wide problem, every column of a tall one, must be
    assigned); NaN and -inf are still refused."""
    rng = np.random.default_rng(shape[0] * 7 + shape[1])
    for density in (0.2, 0.9):
        cost = rng.random(shape)
        cost[rng.random(shape) < density] = np.inf
        lines = cost if shape[0] <= shape[1] else cost.T  # the side that is assigned whole
        for i in range(0, min(shape), 3):
            allowed = rng.integers(lines.shape[1])
            lines[i] = np.inf
            lines[i, allowed] = rng.random()
        if np.isfinite(linear_sum_assignment_or_none(cost)):
            rows, cols, (u, v) = solve_assignment(cost, return_duals=True)
            check_solution(cost, rows, cols)
            check_duals(cost, rows, cols, u, v)
        lines[1] = np.inf
        with pytest.raises(InfeasibleAssignmentError):
            solve_assignment(cost)
        for bad in (np.nan, -np.inf):
            broken = cost.copy()
            broken[2, 5] = bad
            with pytest.raises(ParameterError, match="invalid numeric entries"):
                solve_assignment(broken)


def linear_sum_assignment_or_none(cost) -> float:
    """SciPy's optimal total, +inf where it finds the problem infeasible."""
    try:
        rows, cols = linear_sum_assignment(cost)
    except ValueError:
        return np.inf
    return cost[rows, cols].sum()


def test_float32_from_a_pickle_is_solved_without_a_float64_copy():
    """An array from a pickle (multiprocessing, joblib) holds its own float32 dtype object:
    it is still solved in float32 storage, as numpy's own float32 is, with no float64 copy
    of the matrix (numpy's allocations are traced); other byte orders are solved as well."""
    rng = np.random.default_rng(3)
    cost = pickle.loads(pickle.dumps(rng.random((700, 90)).astype(np.float32)))
    assert cost.dtype is not np.dtype(np.float32)
    tracemalloc.start()
    try:
        rows, cols = solve_assignment(cost)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < cost.size * 8 // 2, f"a copy of {peak} bytes was made"
    check_solution(cost, rows, cols, False)
    swapped = cost.astype(">f4")
    rows, cols = solve_assignment(swapped)
    check_solution(swapped, rows, cols, False)


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


def scipy_error(cost, *args):
    """The exception SciPy's linear_sum_assignment raises on these arguments."""
    try:
        linear_sum_assignment(cost, *args)
    except (TypeError, ValueError) as error:
        return error
    raise AssertionError("SciPy accepted the input")


def one_inf(value):
    cost = np.ones((3, 4))
    cost[1, 2] = value
    return cost


# (input, maximize): each refused by SciPy; fusekit must refuse it with the same class and
# a message that contains SciPy's.
REFUSED = {
    "1-D": (np.ones(3), False),
    "3-D": (np.ones((2, 2, 2)), True),
    "NaN": (one_inf(np.nan), False),
    "-inf when minimising": (one_inf(-np.inf), False),
    "+inf when maximising": (one_inf(np.inf), True),
    "infeasible": (np.array([[np.inf, 1.0, np.inf], [np.inf, 2.0, np.inf], [1.0] * 3]), False),
    "infeasible when maximising": (np.full((2, 3), -np.inf), True),
}


@pytest.mark.parametrize("case", REFUSED)
def test_refusals_follow_scipy(case):
    cost, maximize = REFUSED[case]
    expected = scipy_error(cost, maximize)
    with pytest.raises(type(expected)) as raised:
        solve_assignment(cost, maximize)
    assert isinstance(raised.value, ParameterError | InfeasibleAssignmentError)
    assert str(expected) in str(raised.value)
    if maximize:
        assert "+inf" not in str(raised.value) or "NaN or +inf" in str(raised.value)


def test_infeasible_message_names_the_forbidden_value_of_the_direction():
    with pytest.raises(InfeasibleAssignmentError, match=r"forbidden \(\+inf\)"):
        solve_assignment(np.full((2, 3), np.inf))
    with pytest.raises(InfeasibleAssignmentError, match=r"forbidden \(-inf\)") as raised:
        solve_assignment(np.full((2, 3), -np.inf), True)
    assert "+inf" not in str(raised.value)


@pytest.mark.parametrize(
    "bad",
    [np.array([["a", "b"]]), np.ones((2, 2), dtype=complex), np.array([[object(), 1]]),
     np.array([[b"x"]])],
)
def test_non_numeric_input_is_a_type_error(bad):
    expected = scipy_error(bad)
    assert isinstance(expected, TypeError)
    with pytest.raises(TypeError, match="expected a real numeric matrix") as raised:
        solve_assignment(bad)
    assert isinstance(raised.value, ParameterError)
    assert str(expected) in str(raised.value)


@pytest.mark.parametrize("shape", [(1, 1), (8, 8), (3, 5), (5, 3), (200, 40)])
@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.int64, bool])
@pytest.mark.parametrize("maximize", [False, True])
def test_constant_matrices_get_scipys_identity_assignment(shape, dtype, maximize):
    cost = np.full(shape, 7, dtype=dtype)
    rows, cols, (u, v) = solve_assignment(cost, maximize, return_duals=True)
    expected = linear_sum_assignment(cost, maximize)
    np.testing.assert_array_equal(rows, expected[0])
    np.testing.assert_array_equal(cols, expected[1])
    assert rows.dtype == cols.dtype == np.int64
    check_duals(cost.astype(np.float64), rows, cols, u, v, maximize)
    assert not np.delete(u, rows).any() and not np.delete(v, cols).any()  # unassigned: 0


def test_constant_forbidden_or_invalid_matrices_are_still_refused():
    with pytest.raises(InfeasibleAssignmentError):
        solve_assignment(np.full((3, 3), np.inf))
    with pytest.raises(ParameterError, match="invalid numeric entries"):
        solve_assignment(np.full((3, 3), np.nan))
    with pytest.raises(ParameterError, match="invalid numeric entries"):
        solve_assignment(np.full((3, 3), -np.inf))


def test_maximize_positionally_and_boolean_matrices():
    rng = np.random.default_rng(9)
    for _ in range(50):
        cost = rng.random((5, 7)) < 0.4
        for maximize in [False, True]:
            rows, cols = solve_assignment(cost, maximize)
            check_solution(cost, rows, cols, maximize)
    cost = np.array([[1.0, 5.0], [2.0, 1.0]])
    assert solve_assignment(cost, True)[1].tolist() == [1, 0]
    cost[0, 0] = -np.inf  # forbidden when maximising
    assert solve_assignment(cost, True)[1].tolist() == [1, 0]


def ran_during(call, calls: int = 500) -> bool:
    """Whether another thread ran Python code while ``call`` ran in this one.

    The switch interval is raised beyond any call here, so this thread is never made to
    hand the GIL over: the probe thread can run only if ``call`` releases the GIL itself.
    The probe is woken before the first call, and ``call`` is made again (``calls`` times at
    most) until the probe has run: held throughout, no call can let it run; released, it
    runs once the machine schedules it during one of them, however busy the machine is
    (the probe stays runnable across the calls). No clock is read.
    """
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    try:
        go, probed = threading.Event(), threading.Event()

        def probe():
            if go.wait(timeout=60):
                probed.set()

        thread = threading.Thread(target=probe)
        thread.start()
        go.set()  # keeps the GIL: the probe can take it only when a call releases it
        for _ in range(calls):
            call()
            if probed.is_set():  # read with the GIL held: the probe ran during a call
                break
        seen = probed.is_set()
        thread.join()  # lets the probe run now if it has not
        return seen
    finally:
        sys.setswitchinterval(interval)


def test_gil_is_released_during_solves():
    """The core's solve releases the GIL (the gatagat/lap trap: a kernel declared nogil
    but called with the GIL held). The core is called on C-contiguous float64 matrices, so
    no numpy conversion, which may release the GIL of its own, runs during the call."""
    rng = np.random.default_rng(0)
    square = rng.random((2000, 2000))
    assert ran_during(lambda: core().solve_assignment(square, False, False))
    tall = np.ascontiguousarray(rng.integers(0, 4, (3000, 600)).astype(float))
    assert ran_during(lambda: core().solve_assignment(tall, False, False))
    # The check itself: a native call that keeps the GIL is seen as such.
    assert not ran_during(lambda: sum(range(200_000)), calls=20)


@pytest.mark.parametrize("potentials", ["huge", "negative", "nan"])
def test_warm_potentials_are_refused_not_trusted(potentials):
    """The solver takes no warm start (none could be trusted: huge potentials once gave a
    non-optimal answer); passing one is a TypeError, never a silently different result."""
    rng = np.random.default_rng(4)
    cost = rng.random((30, 30))
    u = {"huge": np.full(30, 1e300), "negative": -rng.random(30) * 1e6,
         "nan": np.full(30, np.nan)}[potentials]
    with pytest.raises(TypeError, match="warm_start"):
        solve_assignment(cost, warm_start=(u, u))
    check_solution(cost, *solve_assignment(cost))
