"""The small end against the PFNM authors' code, in the same run.

S clients of a 784-100-10 MLP drawn from a pool of 150 true neurons (bench_truth's
generative clients, saved as float32 safetensors files as bench_scale's ``pool`` case), fused
three ways, alternating, each timed as the fastest of ``--repeats`` runs:

- ``authors``: the authors' ``layer_group_descent`` (``matching/pfnm.py`` of
  https://github.com/IBM/probabilistic-federated-neural-matching, run from a checkout of
  theirs: ``--authors-code`` or ``$FUSEKIT_AUTHORS_PFNM``; fusekit does not redistribute it)
  with the values and sweeps of their experiments (sigma = sigma0 = gamma = 1, ``it=5``) on
  the same weights read from the files, class counts as their frequencies;
- ``default``: ``fusekit.fuse(paths, "pfnm")`` from the files (estimated values, width 1.5x);
- ``fixed``: the same with the authors' values (``--sigma 1 --sigma0 1 --gamma 1
  --variance-units absolute``).

    git clone https://github.com/IBM/probabilistic-federated-neural-matching pfnm-authors
    python benchmarks/bench_authors.py --authors-code pfnm-authors/matching/pfnm.py
    python benchmarks/bench_authors.py --authors-code ... --clients 30 --repeats 5

Writes benchmarks/results/bench_authors.json and the "Against the authors' code" part of
benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from bench_scale import pool_inputs
from bench_support import add_output_arguments, machine_info, write_json, write_section
from bench_truth import AUTHORS

import fusekit
from fusekit.core.checkpoint import load_checkpoint

HERE = Path(__file__).resolve().parent
MARKERS = ("<!-- bench_authors:begin -->", "<!-- bench_authors:end -->")
#: The authors' experiments: sigma, sigma0, gamma and sweeps (experiment.py, it=5).
AUTHORS_RUN = {"sigma_layers": 1.0, "sigma0_layers": 1.0, "gamma_layers": 1.0, "it": 5}
TARGET = 100.0


def authors_inputs(paths: list[Path]) -> tuple[list[list[np.ndarray]], list[np.ndarray]]:
    """The clients in the authors' layout: [W1 (in, hidden), b1, W2 (hidden, out), b2] in
    float64, and each client's class counts (their batch frequencies)."""
    weights, frequencies = [], []
    for path in paths:
        client = load_checkpoint(path)
        weights.append([np.asarray(client.tensor(name), dtype=np.float64).T.copy()
                        if name.endswith("weight") else
                        np.asarray(client.tensor(name), dtype=np.float64)
                        for name in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")])
        frequencies.append(np.asarray(client.class_counts, dtype=np.float64))
    return weights, frequencies


def authors_code(path: str | os.PathLike) -> Any:
    """The authors' ``matching/pfnm.py``, loaded as a module from their checkout."""
    path = Path(path)
    if not path.is_file():
        raise SystemExit(f"{path}: the authors' matching/pfnm.py is not there; clone "
                         "https://github.com/IBM/probabilistic-federated-neural-matching and "
                         "pass --authors-code CLONE/matching/pfnm.py")
    spec = importlib.util.spec_from_file_location("authors_pfnm", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_authors(code, weights, frequencies) -> list[np.ndarray]:
    """Their fused model: [W1 (in, hidden), b1, W2 (hidden, out), b2]."""
    np.random.seed(0)  # their sweeps draw client orders from numpy's global generator
    with contextlib.redirect_stdout(io.StringIO()):  # they print every layer's width
        return code.layer_group_descent(weights, frequencies, **AUTHORS_RUN)


def measure(code, n_clients: int, cache: Path, repeats: int) -> dict[str, Any]:
    paths = pool_inputs(cache, n_clients)
    weights, frequencies = authors_inputs(paths)
    runs = {"authors": lambda: run_authors(code, weights, frequencies),
            "default": lambda: fusekit.fuse(paths, method="pfnm"),
            "fixed": lambda: fusekit.fuse(paths, method="pfnm", **AUTHORS)}
    fusekit.fuse(paths[:2], method="pfnm")  # imports and first calls out of the timings
    times: dict[str, list[float]] = {label: [] for label in runs}
    cpu: dict[str, list[float]] = {label: [] for label in runs}
    for _ in range(repeats):
        for label, run in runs.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            run()
            times[label].append(time.perf_counter() - start)
            cpu[label].append(time.process_time() - start_cpu)
    best = {label: min(values) for label, values in times.items()}
    best_cpu = {label: min(values) for label, values in cpu.items()}
    return {"clients": n_clients, "times_s": times, "cpu_s": cpu, "best_s": best,
            "best_cpu_s": best_cpu, "load_average": os.getloadavg()[0],
            "faster_default": best["authors"] / best["default"],
            "faster_fixed": best["authors"] / best["fixed"],
            "faster_default_cpu": best_cpu["authors"] / best_cpu["default"]}


def markdown(rows: list[dict[str, Any]], build: str) -> str:
    lines = ["| build | S | authors' code s | default s | fixed σ s | default faster | "
             "fixed σ faster | CPU s: authors' / default | default faster (CPU) | "
             "load average |", "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        best, cpu = row["best_s"], row["best_cpu_s"]
        cells = [build, row["clients"], f"{best['authors']:.2f}", f"{best['default']:.3f}",
                 f"{best['fixed']:.3f}", f"{row['faster_default']:.0f}x",
                 f"{row['faster_fixed']:.0f}x", f"{cpu['authors']:.2f} / {cpu['default']:.3f}",
                 f"**{row['faster_default_cpu']:.0f}x**", f"{row['load_average']:.1f}"]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", default="10,20,30", help="comma-separated S")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--build", default="this build", help="the rows' build label")
    parser.add_argument("--authors-code", default=os.environ.get("FUSEKIT_AUTHORS_PFNM"),
                        required="FUSEKIT_AUTHORS_PFNM" not in os.environ,
                        help="the authors' matching/pfnm.py in a checkout of their repository")
    add_output_arguments(parser, HERE / "results" / "bench_authors.json")
    args = parser.parse_args(argv)
    code = authors_code(args.authors_code)
    with tempfile.TemporaryDirectory() as scratch:
        rows = [measure(code, int(s), Path(scratch), args.repeats)
                for s in args.clients.split(",")]
    write_json(args.json_out, {"machine": machine_info(), "target_x": TARGET, "rows": rows})
    table = markdown(rows, args.build)
    print(table)
    if not args.no_write:
        write_section(args.results_md, table, *MARKERS)


if __name__ == "__main__":
    main()
