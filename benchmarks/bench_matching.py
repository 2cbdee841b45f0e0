# ruff: noqa: B023  (benchmark closures are timed within the iteration that made them)
"""Benchmark of the matching engine against every assignment solver a Python user can reach.

Peers are measured in the same run, one right after the other on the same seeded matrices,
each the minimum of several repetitions (the machine is shared: the minimum is the least
disturbed run), assignment solvers on one BLAS thread: fusekit, SciPy
``linear_sum_assignment``, every solver lapx 0.11 has (``lapjv``, ``lapjvx``, ``lapjvxa``,
``lapjvc``, ``lapjvs``, ``lapjvsa``, ``lapjvh``, ``lapjvr``), gatagat's ``lap``, ``lapjv``
and POT's ``emd``. lapx and gatagat's lap both install a module named
``lap``: the one that is not importable normally is loaded from a ``pip install --target``
directory given with ``--lapx-path`` / ``--lap-path`` (or FUSEKIT_BENCH_LAPX_PATH /
FUSEKIT_BENCH_LAP_PATH). A peer that is missing is reported as such, never fatal.

Each assignment row also times one read of its matrix (numpy's ``min`` over it, a call
included), the floor of any exact solver, which reads every entry at least once: the table
gives fusekit's time in reads, and half the fastest lapx solver's ("below" where that is
less than one read: a target that no solver reading on one thread meets here).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import logging
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from bench_support import machine_info, write_json

from fusekit.engine import matching

logger = logging.getLogger(__name__)

Solver = Callable[[np.ndarray], object]


def _import_lap_from(path: str | None):
    """Import a module called ``lap`` from ``path`` (or the normal sys.path when None)."""
    saved_modules = {k: v for k, v in sys.modules.items() if k == "lap" or k.startswith("lap.")}
    for key in saved_modules:
        del sys.modules[key]
    saved_path = list(sys.path)
    try:
        if path:
            sys.path.insert(0, path)
        return importlib.import_module("lap")
    except ImportError:
        return None
    finally:
        sys.path[:] = saved_path
        for key in [k for k in sys.modules if k == "lap" or k.startswith("lap.")]:
            del sys.modules[key]
        sys.modules.update(saved_modules)


def load_peers(lapx_path: str | None, lap_path: str | None) -> tuple[dict[str, Solver], dict]:
    """Solvers keyed by name, and a note per peer (version or why it is missing)."""
    import scipy
    from scipy.optimize import linear_sum_assignment

    peers: dict[str, Solver] = {
        "fusekit": matching.solve_assignment,
        "scipy": linear_sum_assignment,
    }
    notes = {"fusekit": "this build", "scipy": scipy.__version__}
    lapx = gatagat = None
    for candidate in [
        _import_lap_from(None),
        _import_lap_from(lapx_path),
        _import_lap_from(lap_path),
    ]:
        if candidate is None:
            continue
        if hasattr(candidate, "lapjvh"):
            lapx = lapx or candidate
        else:
            gatagat = gatagat or candidate
    if lapx is not None:
        peers.update(lapx_peers(lapx))
        notes["lapx"] = getattr(lapx, "__version__", "?")
    else:
        notes["lapx"] = "not installed (pip install --target DIR lapx==0.11.*; --lapx-path DIR)"
    if gatagat is not None:
        peers["lap"] = lambda c: gatagat.lapjv(c, extend_cost=True)
        notes["lap"] = getattr(gatagat, "__version__", "installed")
    else:
        notes["lap"] = "not installed (pip install --target DIR lap; --lap-path DIR)"
    try:
        from lapjv import lapjv

        peers["lapjv"] = lambda c: lapjv(c) if c.shape[0] == c.shape[1] else None
        notes["lapjv"] = "square only"
    except ImportError:
        notes["lapjv"] = "not installed"
    try:
        import ot

        def emd(c):
            if c.shape[0] != c.shape[1] or c.shape[0] > 1000:
                return None
            w = np.full(c.shape[0], 1.0 / c.shape[0])
            return ot.emd(w, w, c.astype(np.float64))

        peers["POT emd"] = emd
        notes["POT emd"] = f"{ot.__version__}, square n <= 1000"
    except ImportError:
        notes["POT emd"] = "not installed"
    return peers, notes


# Every solver lapx offers, called so that it solves the problem as given: rectangular
# matrices natively or extended (extend_cost), float64 kept float64 (prefer_float32 off).
LAPX_CALLS = {
    "lapjv": lambda f, c: f(c, extend_cost=True, return_cost=False),
    "lapjvx": lambda f, c: f(c, extend_cost=True, return_cost=False),
    "lapjvxa": lambda f, c: f(c, extend_cost=True, return_cost=False),
    "lapjvc": lambda f, c: f(c, return_cost=False),
    "lapjvs": lambda f, c: f(c, extend_cost=True, return_cost=False,
                             prefer_float32=c.dtype == np.float32),
    "lapjvsa": lambda f, c: f(c, extend_cost=True, return_cost=False,
                              prefer_float32=c.dtype == np.float32),
    "lapjvh": lambda f, c: f(c, extend_cost=True, return_cost=False),
    "lapjvr": lambda f, c: f(c, extend_cost=True, return_cost=False),
}


def lapx_peers(lapx) -> dict[str, Solver]:
    """Each lapx solver this version has, keyed "lapx <name>"."""
    return {
        f"lapx {name}": functools.partial(call, getattr(lapx, name))
        for name, call in LAPX_CALLS.items()
        if hasattr(lapx, name)
    }


def best_time(fn: Callable[[], object], budget: float = 0.4, max_reps: int = 15) -> float | None:
    """Smallest wall time of fn() in seconds after one warm-up; None if fn returns None."""
    start = time.perf_counter()
    if fn() is None:
        return None
    first = time.perf_counter() - start
    reps = int(max(3, min(max_reps, budget / max(first, 1e-6))))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def pfnm_problem(
    rng, j_global: int, j_local: int = 100, p: int = 100, new_fraction: float = 0.1
) -> np.ndarray:
    """The PFNM cost (J_g + J_l) x J_l of one client against a global posterior, as PFNM
    builds it (the engine's pfnm_cost kernel), from the generative model of ALGORITHMS.md §3.

    A pool of neurons theta ~ N(0, 0.1^2 I); clients see noisy copies w = theta + N(0, 0.02^2 I)
    (the authors' synthetic setting). Global neuron i is the posterior of n_i ~ U{1..S-1}
    other clients' copies of one pool neuron; the client's neurons are copies of distinct
    global neurons except a fraction ``new_fraction`` drawn from fresh pool neurons
    (1.0: every neuron new; at least J_l - J_g are new). sigma^2 = sigma0^2 = 0.1^2, the
    regime where a true match costs far less than a new neuron, which costs far less than a
    wrong match.
    """
    n_clients, weight_std, noise_std = 10, 0.1, 0.02
    s, prior_precision = 1.0 / weight_std**2, 1.0 / weight_std**2
    pool = rng.normal(scale=weight_std, size=(j_global, p))
    counts = rng.integers(1, n_clients, j_global)
    sums = np.empty((j_global, p))
    for i, n_i in enumerate(counts):
        copies = pool[i] + rng.normal(scale=noise_std, size=(n_i, p))
        sums[i] = s * copies.sum(axis=0)  # + mu0 / sigma0^2 = 0
    precisions = np.repeat((prior_precision + counts * s)[:, None], p, axis=1)
    n_new = max(round(new_fraction * j_local), j_local - j_global)
    seen = pool[rng.choice(j_global, j_local - n_new, replace=False)]
    fresh = rng.normal(scale=weight_std, size=(n_new, p))
    local = np.vstack([seen, fresh])[rng.permutation(j_local)]
    local = local + rng.normal(scale=noise_std, size=local.shape)
    return matching.pfnm_cost(
        local, s, sums, precisions, counts, n_clients=n_clients, sigma0_2=weight_std**2
    )


def with_new_block(existing: np.ndarray, quantile: float, n_clients: int = 10) -> np.ndarray:
    """``existing`` (J_g x J_l) over PFNM's new-neuron block (J_l x J_l): a cost per local
    neuron plus a penalty growing with the slot, 2 log(k S / gamma0) as in ALGORITHMS.md §3;
    the per-neuron costs sit at a low quantile of their column, so that some neurons match
    and some are new."""
    j_local = existing.shape[1]
    per_neuron = np.quantile(existing, quantile, axis=0)
    penalty = 2.0 * np.log(np.arange(1, j_local + 1) * n_clients)
    penalty *= np.abs(per_neuron).mean() / penalty[-1] / 4
    return np.vstack([existing, per_neuron[None, :] + penalty[:, None]])


def random_vector_problem(rng, j_global: int, j_local: int, dim: int = 50) -> np.ndarray:
    """Squared distances between random N(0, I) vectors over a new-neuron block."""
    means, local = rng.normal(size=(j_global, dim)), rng.normal(size=(j_local, dim))
    return with_new_block(matching.sqeuclidean_cost(means, local), 0.02)


def uniform_top_problem(rng, j_global: int, j_local: int) -> np.ndarray:
    """A uniform random top block over a new-neuron block."""
    return with_new_block(rng.random((j_global, j_local)), 0.02)


def integer_tie_problem(rng, j_global: int, j_local: int) -> np.ndarray:
    """Integer costs with many ties: a top block in {0..19} and a new-neuron block of
    integer per-neuron costs plus a penalty rising by one every ten slots."""
    top = rng.integers(0, 20, (j_global, j_local)).astype(np.float64)
    new = rng.integers(0, 4, j_local)[None, :] + (np.arange(j_local) // 10)[:, None]
    return np.vstack([top, new.astype(np.float64)])


PFNM_FAMILIES = {
    "realistic": lambda rng, g, j: pfnm_problem(rng, g, j),
    "realistic all new": lambda rng, g, j: pfnm_problem(rng, g, j, new_fraction=1.0),
    "random vectors": random_vector_problem,
    "uniform top": uniform_top_problem,
    "integer ties": integer_tie_problem,
}


def pfnm_shaped_problems(rng, quick: bool):
    """Every family x J_global x J_local, tall ((J_g + J_l) x J_l, PFNM's orientation) and
    wide (its transpose)."""
    for family, make in PFNM_FAMILIES.items():
        for j_global in [100, 500] + ([] if quick else [2000]):
            for j_local in [50, 100] + ([] if quick else [500]):
                cost = make(rng, j_global, j_local)
                shape = f"{cost.shape[0]}x{cost.shape[1]}"
                yield f"PFNM {family} {shape}", cost
                yield f"PFNM {family} {shape} wide", np.ascontiguousarray(cost.T)


def near_permutation(rng, n: int) -> np.ndarray:
    cost = 1.0 + rng.random((n, n))
    cost[np.arange(n), rng.permutation(n)] = 0.1 * rng.random(n)
    return cost


def assignment_problems(rng, quick: bool):
    sizes = [100, 300, 1000, 2000] + ([] if quick else [4000])
    for n in sizes:
        yield f"uniform {n}x{n}", rng.random((n, n))
    for n in [1000] + ([] if quick else [4000]):
        yield f"uniform {n}x{n} f32", rng.random((n, n)).astype(np.float32)
    yield "PFNM realistic 600x100 f32", pfnm_problem(rng, 500).astype(np.float32)
    yield from pfnm_shaped_problems(rng, quick)
    for n in [1000] + ([] if quick else [4000]):
        yield f"near-permutation {n}x{n}", near_permutation(rng, n)
    yield "near-permutation 1000x1000 f32", near_permutation(rng, 1000).astype(np.float32)


# numpy's min over a row's matrix: one read of it, timed like the solvers (a call included).
ONE_READ = "one read"


def bench_assignment(peers, rng, quick):
    from threadpoolctl import threadpool_limits

    rows = []
    with threadpool_limits(limits=1):
        # Every peer warmed up first: the first problem's solver, timed first in a fresh
        # process, ran 10-15% slower over its first 0.2 s than once the process was warm.
        warm = np.random.default_rng(0).random((100, 100))
        for solve in peers.values():
            best_time(lambda s=solve: s(warm), budget=0.2, max_reps=2000)
        for name, cost in assignment_problems(rng, quick):
            result = {"problem": name}
            for peer, solve in peers.items():
                # Up to 2,000 repeats within the budget: a 5 us solve repeated only 100 times
                # is sampled for half a millisecond, which one disturbance can cover.
                result[peer] = best_time(lambda s=solve, c=cost: s(c), budget=0.2, max_reps=2000)
            # The floor of any exact solver: it must read every entry at least once.
            result[ONE_READ] = best_time(cost.min, budget=0.2, max_reps=2000)
            rows.append(result)
            logger.info("%s done", name)
    return rows


def bench_batch(peers, rng):
    costs = [pfnm_problem(rng, 500) for _ in range(64)]
    result = {"problem": "64 x PFNM 600x100"}
    with ThreadPoolExecutor() as pool:  # the solver releases the GIL
        result["fusekit thread pool"] = best_time(
            lambda: list(pool.map(matching.solve_assignment, costs))
        )
    for peer, solve in peers.items():
        if peer in {"POT emd", "lapjv"}:
            continue
        result[peer + " loop"] = best_time(lambda s=solve: [s(c) for c in costs], max_reps=5)
    return [result]


def bench_kernels(rng, quick):
    """Cost kernels against numpy's matmul of the same shape, (J_g, P) @ (P, J_l).

    GFLOP/s counts the useful work, the GEMM-shaped product: 2 J_g J_l P flops for every
    kernel, as for the matmul. PFNM/NAFI are timed twice: with scalar variances (every
    coordinate shares one weight per global neuron, the usual PFNM state: one product) and
    with per-coordinate variances (two products' worth of work by construction, so at most
    about 0.5 of matmul on this count). Each shape runs with all BLAS threads and with one
    (threadpoolctl), because threaded BLAS timings on a small shared machine are dominated
    by thread wake-ups.
    """
    from threadpoolctl import threadpool_limits

    rows = []
    for threads in ["all", 1]:
        with threadpool_limits(limits=None if threads == "all" else threads):
            for row in _bench_kernels_once(rng, quick):
                rows.append({"threads": threads, **row})
    return rows


def _bench_kernels_once(rng, quick):
    from fusekit.engine import reference

    rows = []
    shapes = [(100, 100, 800), (500, 100, 1000), (2000, 500, 1000)]
    if not quick:
        shapes.append((2000, 500, 5000))
    for j_global, j_local, p in shapes:
        local = rng.normal(size=(j_local, p))
        means = rng.normal(size=(j_global, p))
        counts = rng.integers(1, 10, j_global)
        scalar_precisions = np.repeat((1.0 + 4.0 * counts)[:, None], p, axis=1)
        coordinate_precisions = 1.0 + rng.random((j_global, p))
        s = rng.random(p) + 0.5
        cases = {
            "scalar": (4.0, means * scalar_precisions, scalar_precisions),
            "per-coordinate": (s, means * coordinate_precisions, coordinate_precisions),
        }
        matmul_t = best_time(lambda: means @ local.T)
        kernels = {"sqeuclidean_cost": lambda: matching.sqeuclidean_cost(means, local)}
        for variance, (prec, sums, precisions) in cases.items():
            kernels[f"pfnm_cost ({variance} variance)"] = lambda a=prec, b=sums, c=precisions: (
                matching.pfnm_cost(local, a, b, c, counts, n_clients=10)
            )
            kernels[f"nafi_cost ({variance} variance)"] = lambda a=prec, b=sums, c=precisions: (
                matching.nafi_cost(local, a, b, c, counts, n_clients=10)
            )
        if j_global * j_local * p <= 100 * 100 * 800:
            prec, sums, precisions = cases["per-coordinate"]
            kernels["pfnm_cost (numpy reference)"] = lambda: reference.pfnm_cost(
                local, prec, sums, precisions, counts, n_clients=10
            )
        flops = 2 * j_global * j_local * p
        matmul_gflops = flops / matmul_t / 1e9
        for name, fn in kernels.items():
            t = best_time(fn, max_reps=5)
            rows.append(
                {
                    "kernel": name,
                    "shape": f"{j_global}x{j_local}x{p}",
                    "seconds": t,
                    "gflops": flops / t / 1e9,
                    "matmul_gflops": matmul_gflops,
                    "ratio": matmul_t / t,
                }
            )
    return rows


def _ms(x):
    return "n/a" if x is None else f"{x * 1e3:.3f}"


def format_tables(results) -> str:
    lines = []
    peers = [k for k in results["assignment"][0] if k not in {"problem", ONE_READ}]
    lines.append("Assignment, ms, minimum over repeats, one BLAS thread (lower is better); the")
    lines.append("ratios divide fusekit's time by the fastest lapx solver's and the fastest")
    lines.append("peer's; one read: numpy's min over the matrix (a call included), as an exact")
    lines.append("solver reads every entry at least once; 0.5x lapx: half the fastest lapx")
    lines.append("solver's time in reads of the matrix, 'below' where it is less than one")
    lines.append("")
    lines.append(
        "| problem | " + " | ".join(peers)
        + " | / best lapx | / best peer | best peer | one read | / one read | 0.5x lapx |"
    )
    lines.append("|---" * (len(peers) + 7) + "|")
    for row in results["assignment"]:
        others = {
            k: v for k, v in row.items() if k not in {"problem", "fusekit", ONE_READ} and v
        }
        lapx = [v for k, v in others.items() if k.startswith("lapx")]
        best = min(others, key=others.get)
        to_lapx = f"{row['fusekit'] / min(lapx):.2f}" if lapx else "lapx missing"
        read = row.get(ONE_READ)
        to_read = f"{row['fusekit'] / read:.1f}" if read else "n/a"
        half_lapx = "n/a" if not lapx or not read else (
            "below" if 0.5 * min(lapx) < read else f"{0.5 * min(lapx) / read:.1f} reads")
        lines.append(
            f"| {row['problem']} | " + " | ".join(_ms(row[p]) for p in peers)
            + f" | {to_lapx} | {row['fusekit'] / others[best]:.2f} | {best} | {_ms(read)}"
            + f" | {to_read} | {half_lapx} |"
        )
    lines.append("")
    lines.append("Batch, ms (minimum over repeats)")
    lines.append("")
    for row in results["batch"]:
        for key, value in row.items():
            if key != "problem":
                lines.append(f"- {row['problem']}, {key}: {_ms(value)}")
    lines.append("")
    lines.append("Cost kernels; GFLOP/s counts 2 J_g J_l P flops for every kernel, the GEMM-shaped")
    lines.append("useful work, as for numpy's matmul of the same shape; ratio = kernel / matmul")
    lines.append("")
    lines.append("| threads | kernel | J_g x J_l x P | ms | GFLOP/s | matmul GFLOP/s | ratio |")
    lines.append("|---|---|---|---|---|---|---|")
    for row in results["kernels"]:
        lines.append(
            f"| {row['threads']} | {row['kernel']} | {row['shape']} | {row['seconds'] * 1e3:.2f} | "
            f"{row['gflops']:.1f} | {row['matmul_gflops']:.1f} | {row['ratio']:.2f} |"
        )
    lines.append("")
    lines.append("Peers: " + "; ".join(f"{k}: {v}" for k, v in results["peers"].items()))
    return "\n".join(lines)


def run(quick: bool = False, lapx_path: str | None = None, lap_path: str | None = None) -> dict:
    """Run every benchmark; returns a JSON-able dict (machine, versions, tables)."""
    peers, notes = load_peers(lapx_path, lap_path)
    rng = np.random.default_rng(20240601)
    return {
        "machine": machine_info(),
        "peers": notes,
        "assignment": bench_assignment(peers, rng, quick),
        "batch": bench_batch(peers, rng),
        "kernels": bench_kernels(rng, quick),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="skip the 4000x4000 problems")
    parser.add_argument("--lapx-path", default=os.environ.get("FUSEKIT_BENCH_LAPX_PATH"))
    parser.add_argument("--lap-path", default=os.environ.get("FUSEKIT_BENCH_LAP_PATH"))
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)
    results = run(args.quick, args.lapx_path, args.lap_path)
    table = format_tables(results)
    sys.stdout.write(table + "\n")
    if args.json:
        write_json(args.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
