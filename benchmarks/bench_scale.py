"""Real-size models from files, by the CLI at its defaults: time against reading every
input once plus writing one model, and peak memory against the inputs' size.

Cases (``--cases``):

- ``resnet50``: 10 torchvision-named ResNet-50s (1,000 classes) built by fusekit's ResNet
  builder, each from its own random initialisation (seed s), float32 safetensors files;
- ``bert``: 4 BERT-base classifiers (``BertForSequenceClassification(BertConfig())``, two
  labels), each from its own random initialisation, saved as Hugging Face model folders;
- ``mlp``: S random 784-100-10 MLPs (independent initialisations) at S = 10, 100, 1000
  (``--scale-clients``), the default pfnm only: time and memory against S;
- ``pool``: the same at S clients drawn from one pool of true neurons (the truth
  benchmark's generative clients, where most neurons match).

Nothing is downloaded. The inputs are written once into ``--cache`` and reused by later
runs. The floor of each case is measured in the same run: reading every input file once
(unbuffered, into one reused buffer, the files in the page cache after a first untimed
pass) plus writing one model of one input's size (``write_atomic``: temporary file, fsync,
rename). Each fusion is ``python -m fusekit fuse INPUTS -m METHOD -o OUT --force`` in its
own process group at the method's defaults, timed by the wall clock; peak memory is the
child's maximum resident set (``os.wait4``'s ``ru_maxrss``: the interpreter and its
imports included); the child's CPU time (user + system) is in the JSON rows, the measure to
compare on a loaded machine. A fusion still running after ``--timeout`` seconds is stopped and
reported as such.

    python benchmarks/bench_scale.py --cases resnet50,bert --methods avg,ot,rebasin,pfnm,nafi
    python benchmarks/bench_scale.py --cases mlp,pool --scale-clients 10,100,1000
    python benchmarks/bench_scale.py --cases resnet50 --methods pfnm --clients 3 --no-write
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from bench_support import add_output_arguments, machine_info, write_json, write_section

from fusekit.core.checkpoint import save_checkpoint, write_atomic

RESNETS, BERTS = 10, 4
READ_CHUNK = 64 << 20

def markers(cases: str) -> tuple[str, str]:
    """RESULTS.md's markers of a run's table: the S-scaling rows have their own."""
    tag = "bench_scale_mlp" if set(cases.split(",")) <= {"mlp", "pool"} else "bench_scale"
    return f"<!-- {tag}:begin -->", f"<!-- {tag}:end -->"


def resnet_inputs(cache: Path, n_clients: int = RESNETS) -> list[Path]:
    """``n_clients`` ResNet-50 files, client s drawn from seed s (written once)."""
    paths = [cache / "resnet50" / f"resnet50-{s}.safetensors" for s in range(n_clients)]
    missing = [s for s, p in enumerate(paths) if not p.exists()]
    if missing:
        from fusekit.core.arch import named_arch
        from fusekit.toolkit.nn import build_model

        arch = named_arch("resnet50", 1000)
        paths[0].parent.mkdir(parents=True, exist_ok=True)
        for s in missing:
            state = {k: v.detach().numpy() for k, v in build_model(arch, seed=s).state_dict().items()}
            save_checkpoint(paths[s], state, {"fusekit.num_samples": str(1000 + s)}, force=True)
    return paths


def bert_inputs(cache: Path, n_clients: int = BERTS) -> list[Path]:
    """``n_clients`` BERT-base classifier folders, client s from seed s (written once)."""
    folders = [cache / "bert" / f"bert-{s}" for s in range(n_clients)]
    missing = [s for s, f in enumerate(folders) if not (f / "model.safetensors").exists()]
    if missing:
        import torch
        import transformers

        for s in missing:
            torch.manual_seed(s)
            model = transformers.BertForSequenceClassification(transformers.BertConfig())
            model.save_pretrained(folders[s], safe_serialization=True)
    return folders


def mlp_inputs(cache: Path, n_clients: int) -> list[Path]:
    """``n_clients`` random 784-100-10 MLP files (He-scaled, client s from seed s)."""
    folder = cache / "mlp"
    paths = [folder / f"mlp-{s}.safetensors" for s in range(n_clients)]
    folder.mkdir(parents=True, exist_ok=True)
    for s, path in enumerate(paths):
        if not path.exists():
            rng = np.random.default_rng(s)
            state = {"net.0.weight": rng.normal(0, (2 / 784) ** 0.5, (100, 784)),
                     "net.0.bias": np.zeros(100),
                     "net.2.weight": rng.normal(0, (2 / 100) ** 0.5, (10, 100)),
                     "net.2.bias": np.zeros(10)}
            save_checkpoint(path, {k: v.astype(np.float32) for k, v in state.items()},
                            {"fusekit.num_samples": str(100 + s)}, force=True)
    return paths


def pool_inputs(cache: Path, n_clients: int) -> list[Path]:
    """``n_clients`` 784-100-10 MLP files whose hidden neurons are noisy draws from a pool
    of 150 true neurons (the truth benchmark's clients: PFNM's generative setting)."""
    from bench_truth import pool_clients

    folder = cache / f"pool-{n_clients}"
    paths = [folder / f"pool-{s}.safetensors" for s in range(n_clients)]
    if not all(p.exists() for p in paths):
        folder.mkdir(parents=True, exist_ok=True)
        for path, client in zip(paths, pool_clients(n_clients, 0)[0], strict=True):
            save_checkpoint(path, {k: client.tensor(k).astype(np.float32) for k in client},
                            client.metadata, force=True)
    return paths


def input_files(inputs: list[Path]) -> list[Path]:
    """The files holding the inputs' bytes (a folder's safetensors files)."""
    return [f for p in inputs for f in ([p] if p.is_file() else sorted(p.glob("*.safetensors")))]


def read_floor(inputs: list[Path]) -> tuple[float, int]:
    """Seconds to read every input file once (unbuffered into one reused buffer; the files
    in the page cache after an untimed pass) and their total size in bytes."""
    files = input_files(inputs)
    buffer = memoryview(bytearray(READ_CHUNK))
    for timed in (False, True):
        start = time.perf_counter()
        for path in files:
            with open(path, "rb", buffering=0) as handle:
                while handle.readinto(buffer):
                    pass
        seconds = time.perf_counter() - start
    return seconds, sum(f.stat().st_size for f in files)


def write_floor(inputs: list[Path], out: Path) -> float:
    """Seconds to write one model of the first input's size atomically (fsync, rename)."""
    payload = b"".join(f.read_bytes() for f in input_files(inputs[:1]))
    start = time.perf_counter()
    write_atomic(out, payload)
    seconds = time.perf_counter() - start
    out.unlink()
    return seconds


def run_cli(inputs: list[Path], method: str, out: str, timeout: float) -> dict[str, Any]:
    """One ``fusekit fuse`` at its defaults in a child process: wall time, peak RSS, status."""
    command = [sys.executable, "-m", "fusekit", "fuse", *map(str, inputs), "-m", method,
               "-o", out, "--force"]
    start = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             start_new_session=True)
    deadline = start + timeout
    while True:
        pid, status, usage = os.wait4(child.pid, os.WNOHANG)
        if pid:
            break
        if time.perf_counter() > deadline:
            os.killpg(child.pid, signal.SIGKILL)
            pid, status, usage = os.wait4(child.pid, 0)
            break
        time.sleep(0.02)
    seconds = time.perf_counter() - start
    child.returncode = os.waitstatus_to_exitcode(status)
    error = child.stderr.read().decode(errors="replace").strip().splitlines()
    child.stderr.close()
    state = ("timeout" if seconds > timeout else "ok" if child.returncode == 0
             else f"failed ({error[-1] if error else child.returncode})")
    return {"time_s": round(seconds, 2), "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
            "peak_rss_mb": round(usage.ru_maxrss / 1024, 1), "status": state}


def measure_case(case: str, inputs: list[Path], methods: list[str], scratch: Path,
                 timeout: float) -> list[dict[str, Any]]:
    out = f"{scratch}/fused-{case}" + ("/" if inputs[0].is_dir() else ".safetensors")
    read_s, size = read_floor(inputs)
    floor = read_s + write_floor(inputs, scratch / "floor.bin")
    rows = []
    for method in methods:
        row = {"case": case, "clients": len(inputs), "method": method,
               "inputs_mb": round(size / 2**20, 1), "read_s": round(read_s, 3),
               "floor_s": round(floor, 3), **run_cli(inputs, method, out, timeout)}
        row["time_x_floor"] = round(row["time_s"] / floor, 1)
        row["rss_x_inputs"] = round(row["peak_rss_mb"] / row["inputs_mb"], 2)
        print(row, flush=True)
        rows.append(row)
    return rows


#: The table's columns: row key -> heading.
COLUMNS = {"case": "case", "clients": "S", "method": "method", "inputs_mb": "inputs MB",
           "read_s": "read s", "floor_s": "floor s", "time_s": "time s",
           "time_x_floor": "x floor", "peak_rss_mb": "peak RSS MB",
           "rss_x_inputs": "x inputs", "status": "status"}


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(COLUMNS.values()) + " |", "|---" * len(COLUMNS) + "|"]
    lines += ["| " + " | ".join(str(r[key]) for key in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_output_arguments(parser, Path(__file__).parent / "results" / "bench_scale.json")
    parser.add_argument("--cases", default="resnet50,bert")
    parser.add_argument("--methods", default="avg,ot,rebasin,pfnm,nafi")
    parser.add_argument("--scale-clients", default="10,100,1000")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/fusekit-bench-scale"))
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--clients", type=int, default=None,
                        help="resnet50/bert: fuse the first N clients only (default: all)")
    parser.add_argument("--label", default="", help="a name for this run in the JSON")
    args = parser.parse_args(argv)
    scratch = args.cache / "out"
    scratch.mkdir(parents=True, exist_ok=True)
    rows = []
    for case in args.cases.split(","):
        if case in ("mlp", "pool"):
            make = mlp_inputs if case == "mlp" else pool_inputs
            for n in map(int, args.scale_clients.split(",")):
                rows += measure_case(case, make(args.cache, n), ["pfnm"], scratch,
                                     args.timeout)
            continue
        inputs = {"resnet50": resnet_inputs, "bert": bert_inputs}[case](args.cache)
        inputs = inputs[: args.clients]
        rows += measure_case(case, inputs, args.methods.split(","), scratch, args.timeout)
    table = markdown(rows)
    print(table)
    write_json(args.json_out, {"machine": machine_info(load=os.getloadavg()),
                               "label": args.label, "rows": rows})
    if not args.no_write:
        write_section(args.results_md, table, *markers(args.cases))


if __name__ == "__main__":
    main()
