"""Cost matrices and whole fusions on a CUDA device against the CPU, measured in one run.

Two tables:

- ``kernels``: one cost matrix of each real-size shape, computed by the C++ core (the CPU
  path) and by the torch kernels on ``--device`` (host-to-device transfers and the copy back
  included), median of ``--repeats`` after one warm-up, and the largest difference between
  the two relative to the matrix's largest entry. The shapes are those real fusions ask for
  (recorded from fusekit's own calls): OT's ground costs of two ResNet-50s (the widest
  residual group, 2048 x 2048 over 1,538 coordinates, and the widest 3x3 convolution), the
  PFNM/NAFI posterior costs of a ResNet-50's widest group and of a BERT-base MLP group, and
  of the first layer of 784-100-10 MLPs at S = 100 (150 globals, below the ``auto`` size).
  Posterior costs come with scalar client precisions (one product on the CPU) and
  per-coordinate ones (the default's relative variance units: two).
- ``fusions``: ``--clients`` ResNet-50s (1,000 classes) built here from seeds 0, 1, ...
  by fusekit's builder, fused by ``fusekit.fuse(paths, METHOD, device=D, **params)`` for
  D = cpu and ``--device``, each in its own process (a fusion still running after
  ``--timeout`` seconds is stopped and reported so). ot and rebasin run at their defaults;
  pfnm with the ResNet benchmark's fixed hyperparameters and one sweep (``--pfnm-params``:
  from random initialisations its default estimation takes minutes on the CPU, mostly
  outside the cost matrices). The time is the ``fuse`` call alone; on the device, the CUDA
  context is started before it and its start timed apart. The two fused models are
  compared tensor by tensor (largest absolute difference).

Inputs and fused models go to ``--scratch``; the rows to ``--json-out`` and the tables, as
markdown, to ``--md-out`` (with ``--results-md`` also into that file between its
``bench_gpu`` markers; ``--from-json`` re-renders a saved run there without running).

    python benchmarks/bench_gpu.py --device cuda --json-out OUT/rows.json --md-out OUT/rows.md
    python benchmarks/bench_gpu.py --device cpu --methods ''   # a check of the script
    python benchmarks/bench_gpu.py --from-json OUT/bench_gpu.json --results-md benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from bench_support import machine_info, write_json, write_section

from fusekit.core.checkpoint import load_checkpoint, save_checkpoint
from fusekit.engine import matching

#: (case, kernel, rows (n or J_global), columns (m or J_local), coordinates p): the largest
#: matrices fusions of two ResNet-50s / BERT-bases ask for, as recorded from their calls.
SHAPES = [
    ("ResNet-50 widest group (ot)", "sqeuclidean", 2048, 2048, 1538),
    ("ResNet-50 3x3 conv, 512 ch (ot)", "sqeuclidean", 512, 512, 4609),
    ("ResNet-50 widest group (rebasin)", "inner", 2048, 2048, 4588),
    ("ResNet-50 widest group (pfnm)", "posterior", 2048, 2048, 3306),
    ("ResNet-50 3x3 conv, 512 ch (pfnm)", "posterior", 512, 512, 6913),
    ("BERT-base MLP group (pfnm)", "posterior", 3072, 3072, 1537),
    ("BERT-base MLP group (ot, rebasin)", "inner", 3072, 3072, 1537),
    ("BERT-base stream (ot, rebasin)", "inner", 768, 768, 31110),
    ("784-100-10, S = 100 (pfnm)", "posterior", 150, 100, 795),
]
#: method -> fusekit.fuse parameters of the fusion rows.
FIXED_PFNM = {"sigma": 1.0, "sigma0": 1.0, "gamma": 1.0, "sweeps": 1}
BEGIN, END = "<!-- bench_gpu:begin -->", "<!-- bench_gpu:end -->"


def _median_seconds(call, repeats: int) -> tuple[float, Any]:
    result = call()  # warm-up: first-call allocations, cuBLAS handles
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = call()
        times.append(time.perf_counter() - start)
    return float(np.median(times)), result


def _significant(value: float) -> float:
    return float(f"{value:.3g}")


def kernel_inputs(kind: str, rows: int, cols: int, p: int, per_coordinate: bool,
                  rng: np.random.Generator) -> tuple:
    """Arguments of the core kernel: neuron vectors at He scale, a quarter of the client's
    neurons close to globals (the entries the cancellation guard recomputes)."""
    scale = (2.0 / p) ** 0.5
    if kind in ("sqeuclidean", "inner"):
        a = rng.normal(0, scale, (rows, p))
        b = rng.normal(0, scale, (cols, p))
        b[: cols // 4] = a[: cols // 4] + rng.normal(0, scale / 10, (cols // 4, p))
        return a, b
    local = rng.normal(0, scale, (cols, p))
    means = rng.normal(0, scale, (rows, p))
    means[: cols // 4] = local[: cols // 4] + rng.normal(0, scale / 10, (cols // 4, p))
    variance = scale**2
    s = (rng.uniform(0.5, 2.0, p) if per_coordinate else np.ones(p)) / (variance / 4)
    precisions = np.tile(1.0 / variance + 3 * s, (rows, 1))
    counts = rng.integers(1, 4, rows).astype(np.float64)
    return (local, s, means * precisions, precisions, counts, np.zeros(p),
            np.full(p, variance), 4.0, 1.0, 0.0)


def kernel_rows(device: str, repeats: int) -> list[dict[str, Any]]:
    from fusekit.toolkit import costs

    rng = np.random.default_rng(0)
    rows = []
    for case, kind, n, m, p in SHAPES:
        for per_coordinate in ((False, True) if kind == "posterior" else (False,)):
            args = kernel_inputs(kind, n, m, p, per_coordinate, rng)
            flops, precision = 2.0 * n * m * p, "-"
            if kind == "sqeuclidean":
                cpu_s, want = _median_seconds(lambda a=args: matching.sqeuclidean_cost(*a),
                                              repeats)
                dev_s, got = _median_seconds(
                    lambda a=args: costs.sqeuclidean_cost(*a, device=device), repeats)
            elif kind == "inner":  # one group's tensors as one block: the same product
                cpu_s, want = _median_seconds(lambda a=args: matching.inner_products([a]),
                                              repeats)
                dev_s, got = _median_seconds(
                    lambda a=args: costs.inner_products([a], device=device), repeats)
            else:
                cpu_s, want = _median_seconds(lambda a=args: _core_posterior(*a), repeats)
                dev_s, got = _median_seconds(
                    lambda a=args: costs.posterior_cost(*a, device=device), repeats)
                flops = 2.0 * n * m * p * (2 if per_coordinate else 1)
                precision = "per coordinate" if per_coordinate else "scalar"
            rows.append({
                "case": case, "kernel": kind, "precision": precision,
                "shape": f"{n} x {m} x {p}", "gflop": round(flops / 1e9, 2),
                "cpu_ms": _significant(cpu_s * 1e3), "device_ms": _significant(dev_s * 1e3),
                "speedup": _significant(cpu_s / dev_s),
                "max_rel_diff": float(np.abs(got - want).max() / np.abs(want).max()),
            })
            print(rows[-1], flush=True)
    return rows


def _core_posterior(local, s, sums, precisions, counts, mu0, sigma0_2, n_clients, gamma0,
                    lam):
    return matching.nafi_cost(local, s, sums, precisions, counts, n_clients=int(n_clients),
                              mu0=mu0, sigma0_2=sigma0_2, gamma0=gamma0, lam=lam,
                              check_finite=False)  # as the PFNM engine calls it


def resnet_files(folder: Path, n_clients: int) -> list[Path]:
    """``n_clients`` ResNet-50 files (client s from seed s), written once into ``folder``."""
    from fusekit.core.arch import named_arch
    from fusekit.toolkit.nn import build_model

    folder.mkdir(parents=True, exist_ok=True)
    arch = named_arch("resnet50", 1000)
    paths = [folder / f"resnet50-{s}.safetensors" for s in range(n_clients)]
    for s, path in enumerate(paths):
        if not path.exists():
            model = build_model(arch, seed=s)
            state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
            save_checkpoint(path, state, {"fusekit.num_samples": str(1000 + s)}, force=True)
    return paths


def fuse_once(method: str, params: dict[str, Any], device: str, out: Path,
              paths: list[str]) -> None:
    """Child process: one fusion, its timings on stdout as JSON, the model into ``out``."""
    import torch

    import fusekit

    start = time.perf_counter()
    if device.startswith("cuda"):
        torch.zeros(1, device=device)  # the CUDA context, timed apart from the fusion
        torch.cuda.synchronize(device)
    context_s = time.perf_counter() - start
    start = time.perf_counter()
    result = fusekit.fuse(paths, method, device=device, **params)
    fuse_s = time.perf_counter() - start
    result.save(out, force=True)
    print(json.dumps({"fuse_s": fuse_s, "context_s": context_s,
                      "cost_matrices": result.report["cost_matrices"]}))


#: The fusion running in a child process (its own process group), stopped with this one.
_running: list[subprocess.Popen] = []


def _stop_children(signum: int, frame: Any) -> None:
    """SIGTERM (``timeout`` ending the run): the running fusion goes too, then this process."""
    for child in _running:
        os.killpg(child.pid, signal.SIGKILL)
    raise SystemExit(128 + signum)


def run_child(method: str, params: dict[str, Any], device: str, out: Path, paths: list[Path],
              timeout: float) -> dict[str, Any]:
    command = [sys.executable, __file__, "--child", method, json.dumps(params), device,
               str(out), *map(str, paths)]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             start_new_session=True, text=True)
    _running[:] = [child]
    try:
        stdout, stderr = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.communicate()
        return {"status": f"timeout ({timeout:g} s)"}
    finally:
        _running.clear()
    if child.returncode != 0:
        last = stderr.strip().splitlines()[-1:] or [str(child.returncode)]
        return {"status": f"failed ({last[0]})"}
    return {"status": "ok", **json.loads(stdout.strip().splitlines()[-1])}


def largest_difference(a: Path, b: Path) -> float:
    left, right = load_checkpoint(a), load_checkpoint(b)
    return max(float(np.abs(left.tensor(k).astype(np.float64)
                            - right.tensor(k).astype(np.float64)).max(initial=0))
               for k in left.tensors)


def fusion_rows(device: str, methods: dict[str, dict[str, Any]], n_clients: int,
                scratch: Path, timeout: float, rows: list[dict[str, Any]],
                save: Callable[[], None]) -> None:
    """Append one row per method to ``rows``, calling ``save`` after each."""
    scratch.mkdir(parents=True, exist_ok=True)
    paths = resnet_files(scratch / "inputs", n_clients)
    for method, params in methods.items():
        runs = {d: run_child(method, params, d, scratch / f"{method}-{d}.safetensors", paths,
                             timeout) for d in ("cpu", device)}
        cpu, dev = runs["cpu"], runs[device]
        row = {"model": "ResNet-50", "clients": n_clients, "method": method,
               "params": json.dumps(params) if params else "defaults",
               "cpu_s": round(cpu.get("fuse_s", float("nan")), 2),
               "device_s": round(dev.get("fuse_s", float("nan")), 2),
               "context_s": round(dev.get("context_s", float("nan")), 2),
               "status": f"cpu {cpu['status']}, {device} {dev['status']}"}
        if cpu["status"] == dev["status"] == "ok":
            row["speedup"] = round(cpu["fuse_s"] / dev["fuse_s"], 2)
            placed = dev["cost_matrices"]
            row["matrices"] = f"{placed['matrices_on_device']} / {placed['matrices_on_cpu']}"
            row["max_abs_diff"] = largest_difference(scratch / f"{method}-cpu.safetensors",
                                                     scratch / f"{method}-{device}.safetensors")
        print(row, flush=True)
        rows.append(row)
        save()


KERNEL_COLUMNS = {"case": "case", "precision": "client precision", "shape": "n x m x p",
                  "gflop": "GFLOP", "cpu_ms": "CPU ms (C++)", "device_ms": "device ms",
                  "speedup": "speedup", "max_rel_diff": "max rel diff"}
FUSION_COLUMNS = {"model": "model", "clients": "S", "method": "method", "params": "params",
                  "cpu_s": "CPU s",
                  "device_s": "device s", "speedup": "speedup", "context_s": "CUDA start s",
                  "matrices": "matrices device / CPU", "max_abs_diff": "max abs diff",
                  "status": "status"}


def table(rows: list[dict[str, Any]], columns: dict[str, str]) -> str:
    def cell(value: Any) -> str:
        return f"{value:.1e}" if isinstance(value, float) and 0 < abs(value) < 1e-3 else str(value)

    lines = ["| " + " | ".join(columns.values()) + " |", "|---" * len(columns) + "|"]
    lines += ["| " + " | ".join(cell(r.get(k, "-")) for k in columns) + " |" for r in rows]
    return "\n".join(lines)


def markdown(payload: dict[str, Any]) -> str:
    machine = payload["machine"]
    head = (f"Cost matrices on `{payload['device']}` ({machine.get('gpu', 'no GPU')}) against "
            f"the C++ core on {machine['cpus']} CPUs, torch {machine['torch']}; command: "
            f"`{payload['command']}`.")
    parts = [head, "", table(payload["kernels"], KERNEL_COLUMNS)]
    if payload["fusions"]:
        parts += ["", table(payload["fusions"], FUSION_COLUMNS)]
    return "\n".join(parts)


OUTPUT_OPTIONS = ("--json-out", "--md-out", "--results-md")


def run_command(argv: list[str]) -> str:
    """The run's command line as RESULTS shows it: its options, not where it wrote."""
    kept, value_follows = [], False
    for arg in argv:
        if value_follows:
            value_follows = False
        elif arg in OUTPUT_OPTIONS:
            value_follows = True
        elif arg.split("=", 1)[0] not in OUTPUT_OPTIONS:
            kept.append(arg)
    return " ".join(["python benchmarks/bench_gpu.py", *kept])


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        fuse_once(argv[1], json.loads(argv[2]), argv[3], Path(argv[4]), argv[5:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu (the torch "
                        "kernels on the CPU: a check of the script, not a measurement)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds each fusion may take")
    parser.add_argument("--methods", default="ot,pfnm,rebasin",
                        help="the fusion rows' methods, comma-separated ('' for none)")
    parser.add_argument("--pfnm-params", type=json.loads, default=FIXED_PFNM,
                        help="pfnm's parameters in the fusion rows, as JSON ({} for defaults)")
    parser.add_argument("--scratch", type=Path, default=Path("/tmp/fusekit-bench-gpu"))
    parser.add_argument("--json-out", type=Path, default=None)
    parser.add_argument("--md-out", type=Path, default=None)
    parser.add_argument("--results-md", type=Path, default=None,
                        help="also write the tables into this file's bench_gpu section")
    parser.add_argument("--from-json", type=Path, default=None,
                        help="no runs: the tables of a saved JSON (into --results-md)")
    args = parser.parse_args(argv)
    if args.from_json is not None:
        text = markdown(json.loads(args.from_json.read_text()))
        print(text)
        if args.results_md is not None:
            write_section(args.results_md, text, BEGIN, END)
        return
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: torch {torch.__version__} sees no CUDA device")
    args.scratch.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else None
    payload: dict[str, Any] = {
        "machine": machine_info(torch=torch.__version__, gpu=gpu, load=os.getloadavg()),
        "device": args.device, "command": run_command(argv),
        "kernels": kernel_rows(args.device, args.repeats), "fusions": []}
    json_out = args.json_out or args.scratch / "bench_gpu.json"
    md_out = args.md_out or args.scratch / "bench_gpu.md"

    def save() -> None:  # after every row: a run stopped early keeps the rows it made
        write_json(json_out, payload)
        md_out.parent.mkdir(parents=True, exist_ok=True)
        md_out.write_text(markdown(payload) + "\n")

    save()
    methods = {m: args.pfnm_params if m in ("pfnm", "nafi") else {}
               for m in args.methods.split(",") if m}
    if methods:
        fusion_rows(args.device, methods, args.clients, args.scratch / "fusions",
                    args.timeout, payload["fusions"], save)
    print(markdown(payload))
    if args.results_md is not None:
        write_section(args.results_md, markdown(payload), BEGIN, END)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _stop_children)  # the program's, not a caller's of main()
    main()
