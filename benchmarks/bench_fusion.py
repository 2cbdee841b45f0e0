"""PFNM / NAFI fusion benchmark (``python benchmarks/bench_fusion.py``).

1. Generative MLP clients (ALGORITHMS.md §3, the authors' synthetic setting): a pool of
   150 global neurons of a 784-100-10 MLP (weights N(0, 0.1^2)); each of S clients takes 100
   of them, adds N(0, 0.02^2) noise and shuffles them. Fused with fixed hyperparameters
   (sigma = sigma0 = 1 x the per-coordinate weight variance, gamma = 1, the width the
   posterior infers: ``ENGINE_PARAMS``), 5 sweeps, so the timings measure the matching
   engine alone (no empirical-Bayes rounds).
2. A 16-client CNN (3 conv layers of 64-128 channels with BatchNorm, 3x32x32 input): noisy,
   permuted copies of one random network.

Each case runs on the C++ backend ("core") and, for the sizes given by ``--numpy-clients``,
on the plain numpy backend (``fusekit.engine.reference`` kernels + SciPy) in the same run. Prints
a table and writes JSON with the machine, versions and backend.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import scipy
from bench_support import machine_info, permuted_copies, random_cnn, write_json

from fusekit.core import neurons
from fusekit.core.checkpoint import Checkpoint
from fusekit.core.spec import infer_spec
from fusekit.methods import get_method
from fusekit.methods.bayesian import match_neurons, matching_purity

POOL, TAKE, INPUTS, CLASSES = 150, 100, 784, 10
WEIGHT_STD, NOISE_STD = 0.1, 0.02


def generative_mlp_clients(n_clients: int, seed: int = 0) -> tuple[list[Checkpoint], list]:
    """S clients of a 784-100-10 MLP whose hidden neurons are noisy draws from a pool."""
    rng = np.random.default_rng(seed)
    w0 = rng.normal(0, WEIGHT_STD, (POOL, INPUTS))
    b0 = rng.normal(0, WEIGHT_STD, POOL)
    w1 = rng.normal(0, WEIGHT_STD, (CLASSES, POOL))
    clients, labels = [], []
    for _ in range(n_clients):
        ids = rng.choice(POOL, TAKE, replace=False)
        noise = lambda shape: rng.normal(0, NOISE_STD, shape)  # noqa: E731
        state = {
            "net.0.weight": w0[ids] + noise((TAKE, INPUTS)),
            "net.0.bias": b0[ids] + noise(TAKE),
            "net.2.weight": w1[:, ids] + noise((CLASSES, TAKE)),
            "net.2.bias": rng.normal(0, WEIGHT_STD, CLASSES),
        }
        clients.append(Checkpoint.from_state_dict(state, {"fusekit.num_samples": "100"}))
        labels.append(ids)
    return clients, labels


def cnn_clients(n_clients: int = 16, channels=(64, 96, 128), seed: int = 0) -> list[Checkpoint]:
    """Noisy permuted copies of one random 3-conv CNN with BatchNorm on 3x32x32 inputs."""
    return permuted_copies(random_cnn(channels, seed), n_clients, 0.05, seed)


ENGINE_PARAMS = {"sigma": 1.0, "sigma0": 1.0, "gamma": 1.0, "width": "unlimited"}


def _time_method(method: str, clients: Sequence[Checkpoint], **params: Any) -> dict[str, Any]:
    specs = [infer_spec({n: i.shape for n, i in c.tensors.items()}) for c in clients]
    fusion = get_method(method)
    start = time.perf_counter()
    result = fusion.fuse(clients, specs, **ENGINE_PARAMS, **params)
    wall = time.perf_counter() - start
    return {"wall_s": wall, "widths": result.widths,
            "time_cost_s": result.report["time_cost_s"],
            "time_assignment_s": result.report["time_assignment_s"]}


def _purity(clients: Sequence[Checkpoint], labels, lam: float, backend: str) -> float:
    """Matching purity of the hidden layer, matched exactly as the method does."""
    spec = infer_spec({n: i.shape for n, i in clients[0].tensors.items()})
    layers = [neurons.client_layers(c, spec) for c in clients]
    built = [neurons.neuron_vectors(lay[0], None, INPUTS, lay[1]) for lay in layers]
    vecs = [v for v, _, _ in built]
    unit = neurons.block_variances(vecs, [o for _, o, _ in built], built[0][2])
    result = match_neurons(vecs, [1 / unit] * len(vecs), sigma0_2=unit, sweeps=5, lam=lam,
                           backend=backend)
    return matching_purity(result.assignments, labels)


def run(sizes: Sequence[int], numpy_sizes: Sequence[int], cnn: bool, lam: float) -> list[dict]:
    rows = []
    for n_clients in sizes:
        clients, labels = generative_mlp_clients(n_clients)
        for method in ("pfnm", "nafi"):
            extra = {"lam": lam} if method == "nafi" else {}
            backends = ["core"] + (["numpy"] if n_clients in numpy_sizes else [])
            for backend in backends:
                _time_method(method, clients[:2], sweeps=1, backend=backend, **extra)  # warm-up
                row = {"case": f"mlp784-100-10 S={n_clients}", "method": method,
                       "backend": backend, "sweeps": 5,
                       **_time_method(method, clients, sweeps=5, backend=backend, **extra)}
                row["purity"] = _purity(clients, labels, extra.get("lam", 0.0), backend)
                rows.append(row)
                _print_row(row)
    if cnn:
        clients = cnn_clients()
        for method in ("pfnm", "nafi"):
            extra = {"lam": lam} if method == "nafi" else {}
            for backend in ("core", "numpy"):
                row = {"case": "cnn 3x(64,96,128) S=16", "method": method, "backend": backend,
                       "sweeps": 5,
                       **_time_method(method, clients, sweeps=5, backend=backend, **extra)}
                rows.append(row)
                _print_row(row)
    return rows


def from_files_vs_engine(n_clients: int = 30, reps: int = 15) -> dict[str, Any]:
    """``fusekit.fuse`` of S clients saved as safetensors files against the method alone on
    the same clients in memory (the engine: neuron vectors, matching, write-back), PFNM with
    the engine parameters and 5 sweeps. The two alternate, each timed ``reps`` times; the
    minimum of each is kept (the machine is shared, so the minimum is the least disturbed).
    """
    import tempfile

    import fusekit
    from fusekit.core.checkpoint import save_checkpoint

    clients, _ = generative_mlp_clients(n_clients)
    specs = [infer_spec({n: i.shape for n, i in c.tensors.items()}) for c in clients]
    params = {**ENGINE_PARAMS, "sweeps": 5}
    fusion = get_method("pfnm")
    with tempfile.TemporaryDirectory() as folder:
        paths = [Path(folder) / f"client_{k:02d}.safetensors" for k in range(n_clients)]
        for path, client in zip(paths, clients, strict=True):
            save_checkpoint(path, client.state_dict(), client.metadata)
        times = {"engine_s": [], "from_files_s": []}
        for _ in range(reps):
            start = time.perf_counter()
            fusion.fuse(clients, specs, **params)
            times["engine_s"].append(time.perf_counter() - start)
            start = time.perf_counter()
            fusekit.fuse(paths, "pfnm", **params)
            times["from_files_s"].append(time.perf_counter() - start)
    row = {"case": f"mlp784-100-10 S={n_clients}", **{k: min(v) for k, v in times.items()}}
    row["ratio"] = row["from_files_s"] / row["engine_s"]
    print(f"{row['case']}: engine {row['engine_s']:.4f} s, fusekit.fuse from files "
          f"{row['from_files_s']:.4f} s, ratio {row['ratio']:.2f}", flush=True)
    return row


def _print_row(row: dict[str, Any]) -> None:
    purity = f"{row['purity']:.3f}" if "purity" in row else "-"
    print(f"{row['case']:<24} {row['method']:<5} {row['backend']:<6} "
          f"wall {row['wall_s']:8.3f} s  cost {row['time_cost_s']:8.3f} s  "
          f"assign {row['time_assignment_s']:7.3f} s  widths {row['widths']}  purity {purity}",
          flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 20, 30])
    parser.add_argument("--numpy-clients", type=int, nargs="*", default=[10],
                        help="sizes also run on the numpy backend (slow: the reference "
                        "kernels broadcast a J x J_s x P array)")
    parser.add_argument("--no-cnn", action="store_true", help="skip the 16-client CNN")
    parser.add_argument("--lam", type=float, default=1e-2)
    parser.add_argument("--json", default="benchmarks/results/bench_fusion.json")
    parser.add_argument("--end-to-end-clients", type=int, default=30,
                        help="S for fusekit.fuse from files against the engine alone (0: skip)")
    parser.add_argument("--end-to-end-only", action="store_true",
                        help="only compare fusekit.fuse from files with the engine")
    args = parser.parse_args(argv)
    end_to_end = from_files_vs_engine(args.end_to_end_clients) if args.end_to_end_clients else {}
    if end_to_end:
        end_to_end["machine"] = machine_info(scipy=scipy.__version__)
    if args.end_to_end_only:  # the saved method rows stay, with the machine they ran on
        saved = json.loads(Path(args.json).read_text()) if Path(args.json).exists() else {}
        rows, machine = saved.get("rows", []), saved.get("machine", {})
    else:
        rows = run(args.clients, args.numpy_clients, not args.no_cnn, args.lam)
        machine = machine_info(scipy=scipy.__version__)
    write_json(args.json, {"machine": machine, "rows": rows, "from_files": end_to_end})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
