"""Residual networks: fusion time and peak memory, a small trained case, and evaluation
throughput of fused ResNets.

Timing (random weights): S noisy (1% of each tensor's std), permuted copies of one random
torchvision resnet18 / resnet50, written as float32 safetensors files and fused from the
paths (read lazily, as ``fusekit fuse`` does) with avg, ot, rebasin and pfnm/nafi (fixed
hyperparameters sigma = sigma0 = gamma0 = 1, one sweep, the default width ratio 1.5: the
engine is timed, not the empirical-Bayes search) with fusekit's C++ engine and with the
numpy backend (SciPy's assignment solver; numpy cost kernels for pfnm), side by side, and
ams. Peak memory is how far ``fusekit.fuse`` raised the process's resident peak above its
resident size before the call (the fusion report's ``peak_memory_mb``, the kernel's VmHWM,
less VmRSS before, taken after ``malloc_trim``: the engine's buffers included, no
allocation traced, so the times are not slowed), shown beside the size of S float64
copies of the model.

Trained case: He et al.'s ResNet-20 (CIFAR layout, one input channel) trained on S iid
clients of the bundled digits, from independent initialisations and from one shared
initialisation, then fused with each method (distill: 100 steps of 64 synthetic 8x8
images); test accuracy of every client and fused model, each fusion's time and resident
peak, with the fused widths, and per stage (stem, layer1-3) the root mean square of each
fused model's hidden pre-activations on the test split over the clients' mean (1: the
scale the clients' layers expect; averaging drifted neurons shrinks it, counting one
feature in two fused neurons inflates it).

Throughput (``--eval-throughput``): two random clients of each model fused with avg
(the clients' widths) and pfnm (width ratio 1.5, fixed hyperparameters, no sweep), the
fused files loaded with ``fusekit.load_fused`` and run in inference mode on synthetic
images (224x224 for resnet18/50, 32x32 for ResNet-20) on the CPU and, when
``torch.cuda.is_available()``, on CUDA; prints a Markdown table of images/s.

    python benchmarks/bench_resnet.py --models resnet18,resnet50 --clients 5,10
    python benchmarks/bench_resnet.py --eval-throughput
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from bench_support import machine_info, status_mb, write_json
from threadpoolctl import threadpool_limits

import fusekit
from fusekit.core.arch import named_arch
from fusekit.core.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from fusekit.core.spec import infer_spec, permute
from fusekit.methods import METHODS as METHOD_CLASSES
from fusekit.toolkit.calibration import client_statistics
from fusekit.toolkit.data import load_dataset, partition
from fusekit.toolkit.nn import build_model
from fusekit.toolkit.simulate import client_checkpoint, fresh_model
from fusekit.toolkit.train import TrainConfig, train_model

#: PFNM/NAFI with fixed hyperparameters: the timing is the engine's, not the EM search's.
FIXED = {"sigma": 1.0, "sigma0": 1.0, "gamma": 1.0, "sweeps": 1}
METHODS = {  # label: (method, parameters)
    "avg": ("avg", {}),
    "ot": ("ot", {}),
    "rebasin": ("rebasin", {}),
    "rebasin-numpy": ("rebasin", {"backend": "numpy"}),
    "pfnm": ("pfnm", FIXED),
    "pfnm-numpy": ("pfnm", {**FIXED, "backend": "numpy"}),
    "nafi": ("nafi", FIXED),
    "ams": ("ams", {}),
}
#: Fused files whose throughput is measured: the clients' widths, and 1.5x wider.
THROUGHPUT = {"avg": ("avg", {}), "pfnm": ("pfnm", {**FIXED, "sweeps": 0, "width_ratio": 1.5})}
#: The trained case's parameters beyond the defaults: distill on the digits' 8x8 images, 100
#: steps of 64 (its default 200 x 256 takes half an hour on one busy CPU thread).
TRAINED_PARAMS = {"distill": {"image_size": 8, "steps": 100, "batch": 64}}
IMAGE_SIZE = {"resnet18": 224, "resnet50": 224, "resnet20": 32, "resnet56": 32}


def client_files(model: str, n_clients: int, folder: Path, seed: int = 0) -> list[Path]:
    """S noisy, permuted float32 copies of one random ``model`` (10 classes) on disk."""
    torch.manual_seed(seed)
    state = {k: v.numpy() for k, v in build_model(named_arch(model, 10)).state_dict().items()}
    spec = infer_spec(state)
    rng = np.random.default_rng(seed)
    paths = []
    for s in range(n_clients):
        copy = permute(state, spec, [rng.permutation(w) for w in spec.hidden_widths])
        copy = {k: v if v.dtype.kind != "f" or "running" in k
                else (v + 0.01 * v.std() * rng.standard_normal(v.shape)).astype(np.float32)
                for k, v in copy.items()}
        paths.append(save_checkpoint(folder / f"{model}-{s}.safetensors", copy,
                                     {"fusekit.num_samples": str(100 + s)}))
    return paths


def resident_mb() -> float:
    """The process's resident memory now (VmRSS, Linux), in MB, once the C heap has given
    its free memory back (else what earlier calls freed would hide part of the next peak)."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return status_mb("VmRSS")


def timing(models: list[str], clients: list[int], methods: list[str]) -> list[dict[str, Any]]:
    rows = []
    for model in models:
        for n_clients in clients:
            with tempfile.TemporaryDirectory() as folder:
                paths = client_files(model, n_clients, Path(folder))
                size = sum(int(np.prod(info.shape))
                           for info in load_checkpoint(paths[0]).tensors.values())
                for label in methods:
                    method, params = METHODS[label]
                    before = resident_mb()
                    start = time.perf_counter()
                    result = fusekit.fuse(paths, method, **params)
                    seconds = time.perf_counter() - start
                    peak = result.report["peak_memory_mb"]
                    row = {"model": model, "clients": n_clients, "method": label,
                           "time_s": round(seconds, 2),
                           "peak_memory_mb": None if peak is None else round(peak - before, 1),
                           "float64_copies_mb": round(n_clients * size * 8 / 2**20, 1)}
                    print(row, flush=True)
                    rows.append(row)
    return rows


def trained_case(n_clients: int = 4, epochs: int = 10, seed: int = 0, *,
                 shared_init: bool = False,
                 methods: tuple[str, ...] = ("avg", "ot", "rebasin", "pfnm", "nafi", "ams",
                                             "distill"),
                 ) -> list[dict]:
    """ResNet-20 clients on the digits; test accuracy of each client and fused model, each
    fusion's time and the process's resident peak during it (the report's peak_memory_mb)."""
    data = load_dataset("digits")
    x_train = data.x_train.reshape(-1, 1, 8, 8)
    x_test = torch.from_numpy(data.x_test.reshape(-1, 1, 8, 8))
    y_test = torch.from_numpy(data.y_test)
    arch = named_arch("resnet20", data.num_classes, in_channels=1)
    parts = partition(data.y_train, n_clients, "iid", seed=seed)
    clients, rows = [], []
    for s, index in enumerate(parts):
        model = fresh_model(arch, data, seed=seed if shared_init else seed + s)
        train_model(model, x_train[index], data.y_train[index],
                    TrainConfig(epochs=epochs, batch_size=32, lr=3e-3), seed=seed + s)
        clients.append(client_checkpoint(model, data, index))  # records the normalisation
        state = clients[-1].state_dict()
        rows.append({"model": f"client {s}", "accuracy": _accuracy(model, x_test, y_test),
                     "widths": infer_spec(state).hidden_widths})
    expected = [_stage_rms(c, x_test.numpy()) for c in clients]
    expected = {stage: np.mean([e[stage] for e in expected]) for stage in expected[0]}
    for method in methods:
        begin = time.perf_counter()
        result = fusekit.fuse(clients, method, **TRAINED_PARAMS.get(method, {}))
        seconds = time.perf_counter() - begin
        checkpoint = Checkpoint.from_state_dict(result.state_dict, result.metadata)
        fused = fusekit.load_fused(checkpoint, device="cpu")
        scale = None if not METHOD_CLASSES[method].makes_one_network else {
            stage: float(round(rms / expected[stage], 2))
            for stage, rms in _stage_rms(checkpoint, x_test.numpy()).items()}
        rows.append({"model": method, "accuracy": _accuracy(fused, x_test, y_test),
                     "widths": result.widths or "each client's", "activation_scale": scale,
                     "time_s": round(seconds, 1),
                     "peak_memory_mb": result.report.get("peak_memory_mb")})
    return rows


def _stage_rms(model: Checkpoint, x: np.ndarray) -> dict[str, float]:
    """Per stage (conv1, layer1, ...), the root mean square of the hidden pre-activations
    (after the BatchNorm, before the ReLU) on ``x``, averaged over the stage's layers."""
    stats = client_statistics(model, x, min_samples=1)
    stages: dict[str, list[float]] = {}
    for point, moments in stats.points.items():
        if point.startswith("preactivation:"):
            stage = point.partition(":")[2].split(".")[0]
            rms = float(np.sqrt(np.mean(moments.var + moments.mean ** 2)))
            stages.setdefault(stage, []).append(rms)
    return {stage: float(np.mean(values)) for stage, values in stages.items()}


def eval_throughput(models: list[str], batch: int, seconds: float) -> list[dict[str, Any]]:
    """Images/s of fused ResNets in inference mode, per device (see the module docstring)."""
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for model in models:
            paths = client_files(model, 2, Path(folder))
            for label, (method, params) in THROUGHPUT.items():
                start = time.perf_counter()
                path = fusekit.fuse(paths, method, **params).save(
                    Path(folder) / f"{model}-{label}.safetensors")
                fusion_s = round(time.perf_counter() - start, 2)
                for device in devices:
                    net = fusekit.load_fused(path, device=device)
                    rows.append({"model": model, "fused with": label,
                                 "widths": _width_ratio(path, model), "device": device,
                                 "batch": batch, "image": IMAGE_SIZE[model],
                                 "images_per_s": _images_per_s(net, device, batch,
                                                               IMAGE_SIZE[model], seconds),
                                 "fusion_s": fusion_s})
                    print(rows[-1], flush=True)
    return rows


def _width_ratio(path: Path, model: str) -> str:
    from fusekit.core.arch import hidden_widths

    widths = load_checkpoint(path).arch["widths"] or hidden_widths(named_arch(model, 10))
    return f"{max(widths) / max(hidden_widths(named_arch(model, 10))):.2f}x"


def _images_per_s(net: torch.nn.Module, device: str, batch: int, size: int,
                  seconds: float) -> float:
    """Forward passes on one synthetic batch for at least ``seconds``, after a warm-up of
    at least 3 passes and ``seconds / 3`` (kernel selection, caches)."""
    x = torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(0)).to(device)
    with torch.inference_mode():
        start, count = time.perf_counter(), 0
        while count < 3 or time.perf_counter() - start < seconds / 3:
            net(x)
            _synchronize(device)
            count += 1
        count, elapsed = 0, 0.0
        start = time.perf_counter()
        while count < 3 or elapsed < seconds:
            net(x)
            _synchronize(device)
            count, elapsed = count + 1, time.perf_counter() - start
    return round(count * batch / elapsed, 1)


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def markdown(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table, columns in the order of the first row."""
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(row[c]) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def _accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return round(float((model.eval()(x).argmax(1) == y).double().mean()), 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet18,resnet50")
    parser.add_argument("--clients", default="5,10")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--trained-clients", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--skip-trained", action="store_true")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch and BLAS threads (1 is fastest on a busy machine)")
    parser.add_argument("--eval-throughput", action="store_true",
                        help="only measure the evaluation throughput of fused ResNets (CPU, and "
                        "CUDA when available); uses every CPU thread unless --threads is given")
    parser.add_argument("--throughput-models", default="resnet18,resnet50,resnet20")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=3.0,
                        help="throughput: run each model at least this long per device")
    parser.add_argument("--json-out", default=None,
                        help="default: benchmarks/results/bench_resnet.json (or "
                        "bench_resnet_throughput.json with --eval-throughput)")
    args = parser.parse_args()
    if args.eval_throughput:
        threads = args.threads if "--threads" in sys.argv else torch.get_num_threads()
        torch.set_num_threads(threads)
        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
        rows = eval_throughput(args.throughput_models.split(","), args.batch, args.seconds)
        write_json(args.json_out or "benchmarks/results/bench_resnet_throughput.json",
                   {"machine": machine_info(threads=threads, gpu=gpu, torch=torch.__version__),
                    "throughput": rows})
        print(markdown(rows))
        return
    torch.set_num_threads(args.threads)
    threadpool_limits(args.threads)
    payload: dict[str, Any] = {"machine": machine_info(threads=args.threads)}
    if not args.skip_timing:
        payload["timing"] = timing(args.models.split(","), [int(c) for c in
                                                            args.clients.split(",")],
                                   args.methods.split(","))
    if not args.skip_trained:
        payload["trained"] = {
            init: trained_case(args.trained_clients, args.epochs, shared_init=init == "shared")
            for init in ("independent", "shared")}
        for init, rows in payload["trained"].items():
            for row in rows:
                print(init, row, flush=True)
    write_json(args.json_out or "benchmarks/results/bench_resnet.json", payload)


if __name__ == "__main__":
    main()
