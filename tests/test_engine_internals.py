"""The engine's internal fast paths: in-place row updates and unchecked cost kernels."""

import pickle

import numpy as np
import pytest

from fusekit.core.errors import ParameterError
from fusekit.engine import matching
from fusekit.engine.native import core
from fusekit.methods.bayesian import match_neurons


def test_add_rows_matches_fancy_index_bit_for_bit():
    rng = np.random.default_rng(0)
    target = rng.standard_normal((40, 13))
    rows = rng.permutation(40)[:17]
    values = rng.standard_normal((17, 13))
    expected = target.copy()
    expected[rows] += values
    core().add_rows(target, rows, values, 1.0)
    assert np.array_equal(target, expected)
    expected[rows] -= values[0]
    core().add_rows(target, rows, values[0], -1.0)
    assert np.array_equal(target, expected)
    scale = rng.random(13)
    expected[rows] -= values * scale
    core().add_rows(target, rows, values, -1.0, scale)
    assert np.array_equal(target, expected)


def test_add_rows_takes_float64_targets_whatever_their_dtype_object():
    """An array from a pickle holds its own float64 dtype object, not numpy's: still a
    float64 target. Other byte orders and types are refused, not converted (the update would
    be lost in the copy)."""
    target = pickle.loads(pickle.dumps(np.zeros((4, 3))))
    assert target.dtype is not np.dtype(np.float64)
    core().add_rows(target, np.array([0, 2]), np.ones((2, 3)), 1.0)
    assert target.sum() == 6.0
    for other in (np.zeros((4, 3), ">f8"), np.zeros((4, 3), np.float32)):
        with pytest.raises(ValueError, match="float64"):
            core().add_rows(other, np.array([0]), np.ones((1, 3)), 1.0)


@pytest.mark.parametrize(
    "rows, values, sign",
    [
        (np.array([40]), np.zeros((1, 13)), 1.0),
        (np.array([-1]), np.zeros((1, 13)), 1.0),
        (np.array([0, 1]), np.zeros((3, 13)), 1.0),
        (np.array([0]), np.zeros((1, 12)), 1.0),
        (np.array([0]), np.zeros((1, 13)), 2.0),
    ],
)
def test_add_rows_rejects_bad_arguments(rows, values, sign):
    target = np.zeros((40, 13))
    with pytest.raises((ValueError, IndexError)):
        core().add_rows(target, rows, values, sign)
    with pytest.raises(ValueError, match="scale"):
        core().add_rows(target, np.array([0]), np.ones((1, 13)), 1.0, np.ones(12))
    assert not target.any()


def test_add_moments_matches_add_rows_of_scaled_copies_bit_for_bit():
    rng = np.random.default_rng(1)
    targets = [rng.standard_normal((30, 11)) for _ in range(3)]
    rows = rng.permutation(30)[:8]
    values, scale = rng.standard_normal((8, 11)), rng.random(11) + 0.5
    seen = (rng.random(11) < 0.7).astype(np.float64)
    expected = [t.copy() for t in targets]
    scaled = values * scale
    matching.add_rows(expected[0], rows, scaled, 1.0, seen)
    matching.add_rows(expected[1], rows, scaled * scaled, 1.0, seen)
    matching.add_rows(expected[2], rows, seen)
    matching.add_moments(*targets, rows, values, scale, seen)
    for got, want in zip(targets, expected, strict=True):
        assert np.array_equal(got, want)


def test_add_moments_rejects_bad_arguments():
    sums, squares, counts = np.zeros((5, 4)), np.zeros((5, 4)), np.zeros((5, 3))
    with pytest.raises(ValueError, match="same shape"):
        matching.add_moments(sums, squares, counts, np.array([0]), np.ones((1, 4)),
                             np.ones(4), np.ones(4))
    counts = np.zeros((5, 4))
    with pytest.raises(IndexError, match="rows"):
        matching.add_moments(sums, squares, counts, np.array([5]), np.ones((1, 4)),
                             np.ones(4), np.ones(4))
    with pytest.raises(ValueError, match="seen"):
        matching.add_moments(sums, squares, counts, np.array([0]), np.ones((1, 4)),
                             np.ones(4), np.ones(3))
    with pytest.raises(ValueError, match="float64"):
        matching.add_moments(sums, squares, counts.astype(np.float32), np.array([0]),
                             np.ones((1, 4)), np.ones(4), np.ones(4))
    assert not (sums.any() or squares.any() or counts.any())


def test_log_det_rows_equal_the_logarithms_summed_over_observed_coordinates():
    """Runs of equal (s, P) share one logarithm; rows that differ anywhere, unobserved
    coordinates (s = 0) and coordinates of their own give the plain sum."""
    rng = np.random.default_rng(2)
    s = np.r_[np.full(40, 2.0), [0.0, 0.5, 0.0, 3.0, 3.0]]
    counts = rng.integers(1, 5, size=(9, 1))
    precisions = 1.0 + counts * s + np.r_[np.zeros(44), 0.25][None, :]
    precisions[3, 7] += 1.0  # one coordinate breaks a run
    seen = s > 0
    expected = np.log(1.0 / s[seen] + 1.0 / precisions[:, seen]).sum(axis=1)
    np.testing.assert_allclose(matching.log_det_rows(s, precisions), expected, rtol=1e-13)
    assert matching.log_det_rows(np.zeros(45), precisions).tolist() == [0.0] * 9
    with pytest.raises(ValueError, match="client_precision"):
        matching.log_det_rows(s[:-1], precisions)


def _cost_inputs(rng, nl=7, ng=9, p=12):
    s = np.r_[np.full(p - 3, 2.0), [0.5, 0.0, 3.0]]
    return dict(
        local=rng.standard_normal((nl, p)),
        client_precision=s,
        global_sums=rng.standard_normal((ng, p)),
        global_precisions=1.0 + rng.integers(1, 4, size=(ng, 1)) * s,
        global_counts=rng.integers(1, 5, size=ng),
    )


@pytest.mark.parametrize("kernel", ["pfnm_cost", "nafi_cost"])
def test_unchecked_kernels_give_the_same_costs(kernel):
    args = _cost_inputs(np.random.default_rng(1))
    fn = getattr(matching, kernel)
    checked = fn(**args, n_clients=6, sigma0_2=0.7)
    unchecked = fn(**args, n_clients=6, sigma0_2=0.7, check_finite=False)
    assert np.array_equal(checked, unchecked)


def test_checked_kernels_still_reject_non_finite_input():
    args = _cost_inputs(np.random.default_rng(2))
    args["local"][0, 0] = np.nan
    with pytest.raises(ValueError, match="local"):
        matching.pfnm_cost(**args, n_clients=6)


def test_engine_rejects_non_finite_vectors_once():
    rng = np.random.default_rng(3)
    vecs = [rng.standard_normal((5, 4)) for _ in range(3)]
    vecs[1][2, 3] = np.inf
    with pytest.raises(ParameterError, match=r"vectors\[1\]"):
        match_neurons(vecs, [1.0] * 3)


def test_kernels_restore_the_blas_thread_count():
    threadpoolctl = pytest.importorskip("threadpoolctl")
    args = _cost_inputs(np.random.default_rng(4))

    def scipy_blas_threads():
        info = threadpoolctl.threadpool_info()
        return [i["num_threads"] for i in info if "scipy_openblas" in i["filepath"]]

    matching.sqeuclidean_cost(args["local"], args["global_sums"])  # loads the BLAS they use
    with threadpoolctl.threadpool_limits(2, user_api="blas"):  # more than the one they use
        before = scipy_blas_threads()
        assert before and all(n == 2 for n in before), before
        matching.pfnm_cost(**args, n_clients=6)
        matching.sqeuclidean_cost(args["local"], args["global_sums"])
        assert scipy_blas_threads() == before


def test_add_rows_refuses_a_target_it_would_have_to_copy():
    from fusekit.core.errors import ParameterError

    target = np.zeros((4, 3), dtype=np.float32)
    with pytest.raises(ParameterError, match="writeable C-contiguous 2-D float64"):
        core().add_rows(target, np.array([0]), np.ones((1, 3)), 1.0)
    with pytest.raises(ParameterError, match="writeable C-contiguous 2-D float64"):
        core().add_rows(np.zeros((3, 4)).T, np.array([0]), np.ones((1, 3)), 1.0)


HOSTILE_CORE_INPUTS = """
import numpy as np
from fusekit.engine.native import core

c = core()
hostile = [
    np.array([[object(), 1.0], [2.0, 3.0]], dtype=object),
    np.array([[None, None], [None, None]], dtype=object),
    np.array([["a", "b"], ["c", "d"]]),
    np.array([["1", "2"], ["3", "4"]]),
    np.array([[b"a", b"b"], [b"c", b"d"]]),
    np.ones((2, 2), complex),
    np.zeros((2, 2), dtype=[("a", "f8"), ("b", "i4")]),
    np.zeros((2, 2), dtype="M8[D]"),
    np.zeros((2, 2), dtype="V8"),
    [[1.0, "x"], [2.0, 3.0]],
    None,
]
ones, vector = np.ones((2, 2)), np.ones(2)
calls = [
    lambda x: c.solve_assignment(x, False),
    lambda x: c.solve_assignment(x, True),
    lambda x: c.sqeuclidean_cost(x, ones),
    lambda x: c.sqeuclidean_cost(ones, x),
    lambda x: c.finite_min(x),
    lambda x: c.add_rows(np.zeros((3, 2)), np.array([0, 1]), x),
    lambda x: c.add_rows(np.zeros((3, 2)), x, ones),
    lambda x: c.add_rows(x, np.array([0, 1]), ones),
    # scale=None means "no scale": a string stands in for it.
    lambda x: c.add_rows(np.zeros((3, 2)), np.array([0, 1]), ones, 1.0, "x" if x is None else x),
]
for k in range(7):  # each array argument of posterior_cost in turn
    def posterior(x, k=k):
        args = [ones, vector, np.ones((3, 2)), np.ones((3, 2)), np.ones(3), np.zeros(2), vector]
        args[k] = x
        return c.posterior_cost(*args, 5.0, 1.0, 0.0)
    calls.append(posterior)
for i, call in enumerate(calls):
    for j, x in enumerate(hostile):
        try:
            call(x)
        except (TypeError, ValueError):
            continue
        raise SystemExit(f"call {i} accepted hostile input {j}")
print("all refused")
"""


def test_core_functions_refuse_non_numeric_arrays_without_crashing():
    """Object, string, bytes, complex, structured, datetime and void arrays, lists and None
    given to every _core function raise (a TypeError or ValueError); a crash of the
    interpreter would show as a signal exit of the subprocess."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", HOSTILE_CORE_INPUTS], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "all refused" in done.stdout


def test_the_core_is_checked_for_every_function_its_stubs_declare():
    """native.FUNCTIONS names what fusekit/_core.pyi declares, and the built core has them
    all (a core compiled from older sources is refused at import, naming what it lacks)."""
    import ast
    from pathlib import Path

    from fusekit.engine import native

    stubs = Path(native.__file__).parents[1] / "_core.pyi"
    declared = {node.name for node in ast.parse(stubs.read_text()).body
                if isinstance(node, ast.FunctionDef)}
    assert set(native.FUNCTIONS) == declared
    assert native.CORE_IMPORT_ERROR is None and all(hasattr(core(), f) for f in declared)


def test_a_forked_child_multiplies_in_blocks_on_threads_of_its_own(monkeypatch):
    """The product threads are the process's own: a child forked after its parent cut a
    product into blocks cuts its own on new threads (the parent's are not in it)."""
    import multiprocessing
    import os
    import signal

    monkeypatch.setattr(matching, "SERIAL_FLOPS", 0)
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((256, 64), dtype=np.float32) for _ in range(2))
    expected = matching.inner_products([(a, b)])
    child = multiprocessing.get_context("fork").Process(
        target=lambda: os._exit(0 if np.array_equal(matching.inner_products([(a, b)]),
                                                    expected) else 1))
    child.start()
    child.join(60)
    if child.is_alive():
        os.kill(child.pid, signal.SIGKILL)
        child.join(10)
    assert child.exitcode == 0


def test_products_run_on_one_blas_thread_in_blocks_of_rows_side_by_side(monkeypatch):
    """inner_products holds numpy's BLAS at one thread while it multiplies (the count it
    found is back after); from SERIAL_FLOPS on it cuts the rows into a block per thread
    the BLAS had (of BLOCK_ROWS rows at least), multiplied side by side: the same matrix,
    bit for bit, as one product on one thread, whatever the count."""
    threadpoolctl = pytest.importorskip("threadpoolctl")
    controller = matching._numpy_blas()
    if controller is None:
        pytest.skip("numpy shares its BLAS with SciPy here")
    rng = np.random.default_rng(0)
    pairs = [(rng.standard_normal((301, 700), dtype=np.float32),
              rng.standard_normal((250, 700), dtype=np.float32)) for _ in range(2)]
    with threadpoolctl.threadpool_limits(1, user_api="blas"):
        whole = pairs[0][0] @ pairs[0][1].T + pairs[1][0] @ pairs[1][1].T
    seen = []
    matmul = np.matmul

    def spy(a, b, **kwargs):  # the rows multiplied and numpy's BLAS thread count then
        seen.append((len(a), controller.info()[0]["num_threads"]))
        return matmul(a, b, **kwargs)

    monkeypatch.setattr(np, "matmul", spy)
    before = controller.info()[0]["num_threads"]
    cases = [(2, 1e18, [301]), (3, 0, [100, 100, 101]), (8, 0, [75, 75, 75, 76])]
    for threads, flops, rows in cases:  # 8 threads: 4 blocks of BLOCK_ROWS rows at least
        monkeypatch.setattr(matching, "SERIAL_FLOPS", flops)
        with threadpoolctl.threadpool_limits(threads, user_api="blas"):
            seen.clear()
            product = matching.inner_products(pairs)
            assert sorted(seen) == sorted((n, 1) for n in rows * 2)
            assert controller.info()[0]["num_threads"] == threads
        np.testing.assert_array_equal(product, whole)
    assert controller.info()[0]["num_threads"] == before
    out = np.full((301, 250), np.nan, dtype=np.float32)  # written into, the same values
    assert matching.inner_products(pairs, out=out) is out
    np.testing.assert_array_equal(out, whole)


def test_summed_inner_products_add_each_batch_in_order():
    rng = np.random.default_rng(0)
    pairs = [(rng.normal(size=(70, p)), rng.normal(size=(80, p))) for p in (3, 50, 9)]
    made = []

    def batches():
        for pair in pairs:
            made.append(pair)
            yield [pair]

    want = sum(a @ b.T for a, b in pairs)
    np.testing.assert_allclose(matching.summed_inner_products(batches()), want, rtol=1e-12)
    assert len(made) == 3
    with pytest.raises(ParameterError, match="at least one batch"):
        matching.summed_inner_products(iter(()))
