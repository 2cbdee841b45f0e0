"""Calibration from client statistics (ALGORITHMS §12): accuracy of fused models before and
after calibration, layer by layer (exact) and in one pass, and the cost of ``stats`` and
``calibrate`` on resnet50.

Accuracy cases (the bundled digits, clients trained here with Adam, batch 32, lr 3e-3; VGG
3e-4): ResNet-20 (one input channel) from independent and from one shared initialisation,
iid and Dirichlet α = 0.5 clients; a VGG-11 with BatchNorm at 1/4 of the standard widths
(digits upsampled to 32x32, classifier 128-128); MLPs 64-100-100-10 with BatchNorm; MLPs
without BatchNorm (REPAIR with the clients' own statistics as targets). Each row: every
client, the mean and best client, the softmax ensemble, and every fused model (named with
its widths) uncalibrated, calibrated layer by layer, and calibrated in one pass. Clients
compute their statistics on their own training split; accuracies are on the test split.

First layer (``--first-layer``): per fused model, its first layer calibrated from the
clients' input moments (no round) against a round of statistics of the fused model (test
accuracy with only that layer calibrated, the largest difference of a tensor relative to
its largest entry, times), and layer by layer with the first layer derived (one round
fewer). Every
layer-by-layer row also records the test loss and the paired change against the
uncalibrated model (images lost and won, McNemar's exact p), and both models' loss and
accuracy on the union of the clients' training data (what a round in which the clients
evaluated both would tell the server).

``--data mnist1d``: the MLP cases on MNIST-1D (40 features, 10 classes, generated offline
by the ``mnist1d`` package, a benchmark-only dependency: ``pip install mnist1d``), 16 000
training and 8 000 test sequences by default (``--mnist1d-samples``): 18 times the digits'
450 test images, to tell a change of a few tenths of a point from noise.

Cost (``--cost``): random-weight resnet50 (10 classes), per client ``client_statistics`` on
N 3x32x32 inputs, then ``fusekit.calibrate`` of the fused model with S statistics:
time and peak resident memory above the resident size before the call.

    python benchmarks/bench_calibration.py --cases resnet20,mlp_bn,mlp,vgg11_bn --cost
"""

from __future__ import annotations

import argparse
import ctypes
import math
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
from fusekit.core.checkpoint import Checkpoint, save_checkpoint
from fusekit.protocol import CALIBRATIONS
from fusekit.toolkit.calibration import client_statistics
from fusekit.toolkit.local import align_locally, calibrate_locally
from fusekit.toolkit.data import Dataset, load_dataset, partition
from fusekit.toolkit.nn import build_model
from fusekit.toolkit.simulate import fresh_model
from fusekit.toolkit.train import TrainConfig, train_model

METHODS = {  # label: (method, parameters)
    "avg": ("avg", {}),
    "ot": ("ot", {}),
    "rebasin": ("rebasin", {}),
    "pfnm 1.0x": ("pfnm", {"width_ratio": 1.0}),
    "pfnm 1.5x": ("pfnm", {"width_ratio": 1.5}),
}
VGG11_QUARTER = {"type": "vgg", "name": "vgg11_bn", "batchnorm": True, "hidden": [128, 128],
                 "config": [16, "M", 32, "M", 64, 64, "M", 128, 128, "M", 128, 128, "M"],
                 "in_channels": 1, "out_features": 10}


def mlp_arch(batchnorm: bool, in_features: int = 64) -> dict[str, Any]:
    return {"type": "mlp", "in_features": in_features, "hidden": [100, 100],
            "out_features": 10, "batchnorm": batchnorm}


CASES = {  # name: (architecture, input shape, epochs, Adam learning rate)
    "resnet20": (named_arch("resnet20", 10, in_channels=1), (1, 8, 8), 10, 3e-3),
    "vgg11_bn": (VGG11_QUARTER, (1, 32, 32), 15, 3e-4),  # at 3e-3 the clients do not learn
    "mlp_bn": (mlp_arch(True), (64,), 20, 3e-3),
    "mlp": (mlp_arch(False), (64,), 20, 3e-3),
}


#: Data sets of the accuracy cases: the bundled digits (every case), or MNIST-1D (the MLP
#: cases; generated offline by the ``mnist1d`` package, a benchmark-only dependency).
DATA = ("digits", "mnist1d")


def case_data(name: str, train: int, test: int) -> Dataset:
    """The digits, or ``train`` + ``test`` MNIST-1D sequences (40 features, 10 classes;
    the package's default generator and seed), standardised with the training split's
    per-feature mean and deviation."""
    if name == "digits":
        return load_dataset("digits")
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    args.num_samples, args.train_split = train + test, train / (train + test)
    raw = make_dataset(args)
    mean, std = raw["x"].mean(0), raw["x"].std(0)

    def scaled(x: np.ndarray) -> np.ndarray:
        return ((x - mean) / std).astype(np.float32)

    return Dataset("mnist1d", scaled(raw["x"]), raw["y"].astype(np.int64),
                   scaled(raw["x_test"]), raw["y_test"].astype(np.int64), 10)


def case_setup(case: str, data: Dataset) -> tuple[dict[str, Any], tuple[int, ...], int, float]:
    """The case's (architecture, input shape, epochs, learning rate) on ``data``."""
    arch, shape, epochs, lr = CASES[case]
    if data.name == "digits":
        return arch, shape, epochs, lr
    if arch["type"] != "mlp":
        raise SystemExit(f"--data {data.name}: only the MLP cases (mlp_bn, mlp), not {case}")
    features = int(np.prod(data.input_shape))
    return {**arch, "in_features": features}, (features,), epochs, lr


def inputs(x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Inputs (N, ...) in the case's input shape (digits upsampled 4x for 32x32)."""
    if shape == (1, 32, 32):
        x = x.reshape(-1, 1, 8, 8).repeat(4, axis=2).repeat(4, axis=3)
    return np.ascontiguousarray(x.reshape(-1, *shape), dtype=np.float32)


def accuracy(model: torch.nn.Module, x: np.ndarray, y: np.ndarray) -> float:
    return round(float((predictions(model, x) == y).mean()), 4)


def predictions(model: torch.nn.Module, x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model.eval()(torch.from_numpy(x)).argmax(1).numpy()


def test_loss(model: torch.nn.Module, x: np.ndarray, y: np.ndarray) -> float:
    """Mean cross-entropy on the test set: finer than accuracy on 450 images."""
    with torch.no_grad():
        logits = model.eval()(torch.from_numpy(x))
    return round(float(torch.nn.functional.cross_entropy(logits, torch.from_numpy(y).long())),
                 4)


def paired(before: torch.nn.Module, after: torch.nn.Module, x: np.ndarray,
           y: np.ndarray) -> dict[str, Any]:
    """The test images only one of two models gets right, and the two-sided sign-test
    p-value of the difference (McNemar's exact test): is a change more than noise?"""
    right_before, right_after = predictions(before, x) == y, predictions(after, x) == y
    lost = int((right_before & ~right_after).sum())
    won = int((right_after & ~right_before).sum())
    return {"lost": lost, "won": won, "p": round(_sign_test(lost, won), 3)}


def _sign_test(lost: int, won: int) -> float:
    n = lost + won
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(lost, won) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def loaded(result) -> torch.nn.Module:
    return fusekit.load_fused(Checkpoint.from_state_dict(result.state_dict, result.metadata),
                              device="cpu")


def run_case(case: str, n_clients: int, split: str, init: str, seed: int,
             methods: list[str], protocols: tuple[str, ...] = CALIBRATIONS,
             alignment_rounds: int = 0, ridges: tuple[float, ...] = (),
             first_layer: bool = False, data: Dataset | None = None) -> dict[str, Any]:
    """Train clients, fuse with each method, calibrate, evaluate (module docstring)."""
    data = data or load_dataset("digits")
    arch, shape, epochs, lr = case_setup(case, data)
    x_train, x_test = inputs(data.x_train, shape), inputs(data.x_test, shape)
    parts = partition(data.y_train, n_clients, split, alpha=0.5, seed=seed)
    clients, client_inputs, scores, logits = [], [], [], []
    start = time.perf_counter()
    for s, index in enumerate(parts):
        model = fresh_model(arch, data, seed=seed if init == "shared" else seed + 1 + s)
        train_model(model, x_train[index], data.y_train[index],
                    TrainConfig(epochs=epochs, batch_size=32, lr=lr), seed=seed + s)
        state = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
        metadata = {"fusekit.num_samples": str(len(index)), "fusekit.arch": _json(arch)}
        if data.normalization is not None:  # what the model applies to the data as stored
            metadata["fusekit.preprocess"] = data.normalization.to_json()
        clients.append(Checkpoint.from_state_dict(state, metadata))
        client_inputs.append(x_train[index])
        scores.append(accuracy(model, x_test, data.y_test))
        with torch.no_grad():
            logits.append(torch.softmax(model.eval()(torch.from_numpy(x_test)), 1))
    ensemble = float((sum(logits).argmax(1).numpy() == data.y_test).mean())
    row: dict[str, Any] = {
        "case": case, "data": data.name, "test_size": len(data.y_test), "clients": n_clients,
        "split": split, "init": init, "seed": seed,
        "client_accuracy": scores, "mean_client": round(float(np.mean(scores)), 4),
        "best_client": max(scores), "ensemble_softmax": round(ensemble, 4),
        "samples": [len(p) for p in parts], "train_s": round(time.perf_counter() - start, 1),
        "fused": []}
    smallest = min(len(p) for p in parts)
    union, union_labels = np.concatenate(client_inputs), data.y_train[np.concatenate(parts)]
    for label in methods:
        method, params = METHODS[label]
        result = fusekit.fuse(clients, method, **params)
        uncalibrated = loaded(result)
        entry = {"method": label, "widths": result.widths,
                 "uncalibrated": accuracy(uncalibrated, x_test, data.y_test),
                 "uncalibrated_loss": test_loss(uncalibrated, x_test, data.y_test)}
        fused = Checkpoint.from_state_dict(result.state_dict, result.metadata)
        for rounds in protocols:
            begin = time.perf_counter()
            calibrated = calibrate_locally(fused, client_inputs, clients=clients, rounds=rounds,
                                           min_samples=min(32, smallest))
            entry[rounds] = accuracy(loaded(calibrated), x_test, data.y_test)
            entry[f"{rounds}_s"] = round(time.perf_counter() - begin, 2)
            entry[f"{rounds}_rounds"] = calibrated.report["calibration"]["rounds"]
            if rounds == "layerwise":
                entry["layerwise_loss"] = test_loss(loaded(calibrated), x_test, data.y_test)
                entry["layerwise_paired"] = paired(uncalibrated, loaded(calibrated), x_test,
                                                   data.y_test)
                entry["clients_data"] = {  # what a guard round on the clients' data would see
                    name: [test_loss(model, union, union_labels),
                           accuracy(model, union, union_labels)]
                    for name, model in (("uncalibrated", uncalibrated),
                                        ("layerwise", loaded(calibrated)))}
        if first_layer:
            entry["first_layer"] = first_layer_case(fused, clients, client_inputs,
                                                    min(32, smallest), x_test, data.y_test)
        if alignment_rounds:
            entry.update(aligned(result, clients, client_inputs, alignment_rounds, ridges,
                                 protocols[-1], min(32, smallest), x_test, data.y_test))
        row["fused"].append(entry)
        print(case, split, init, entry, flush=True)
    return row


def aligned(result, clients, client_inputs, alignment_rounds: int, ridges: list[float],
            rounds: str, min_samples: int, x_test: np.ndarray, y_test: np.ndarray
            ) -> dict[str, Any]:
    """Calibrated, then 1..``alignment_rounds`` alignment rounds each followed by calibration
    (``rounds``): the accuracy after each round and its matched correlation; and one
    alignment round followed by refit rounds, per ridge. Each calibrated round is one
    ``align_locally`` call on the previous round's model (which calibrates that already
    calibrated model once more before its cross statistics)."""
    fused = Checkpoint.from_state_dict(result.state_dict, result.metadata)
    begin = time.perf_counter()
    current, scores, correlations = fused, [], []
    for _ in range(alignment_rounds):
        out = align_locally(current, clients, client_inputs, refit=False, rounds=rounds,
                            min_samples=min_samples)
        scores.append(accuracy(loaded(out), x_test, y_test))
        correlations.append(out.report["alignment"][0]["mean_correlation"])
        current = Checkpoint.from_state_dict(out.state_dict, out.metadata)
    entry = {"aligned": scores, "aligned_protocol": rounds,
             "aligned_correlation": correlations,
             "aligned_s": round(time.perf_counter() - begin, 2), "refit": {}, "refit_s": {}}
    for ridge in ridges:
        begin = time.perf_counter()
        out = align_locally(fused, clients, client_inputs, refit=True, ridge=ridge,
                            rounds=rounds, min_samples=min_samples)
        entry["refit"][str(ridge)] = accuracy(loaded(out), x_test, y_test)
        entry["refit_s"][str(ridge)] = round(time.perf_counter() - begin, 2)
    return entry


def first_layer_case(fused: Checkpoint, clients: list[Checkpoint],
                     client_inputs: list[np.ndarray], min_samples: int, x_test: np.ndarray,
                     y_test: np.ndarray) -> dict[str, Any]:
    """The fused first layer calibrated from the clients' input moments (no round) against
    a round of statistics of the fused model; then every layer, layer by layer, with the
    first one derived (one round fewer)."""
    begin = time.perf_counter()
    targets = [client_statistics(c, x, input_moments=True, min_samples=min_samples)
               for c, x in zip(clients, client_inputs, strict=True)]
    targets_s = time.perf_counter() - begin
    begin = time.perf_counter()
    derived = fusekit.calibrate(fused, [], targets=targets, min_samples=min_samples)
    derived_s = time.perf_counter() - begin
    first = derived.report["calibration"]["layers"]
    begin = time.perf_counter()
    stats = [client_statistics(fused, x, min_samples=min_samples) for x in client_inputs]
    with_round = fusekit.calibrate(fused, stats, targets=targets, layers=first,
                                   min_samples=min_samples)
    round_s = time.perf_counter() - begin
    difference = max(float(np.max(np.abs(derived.state_dict[name] - value))
                           / max(float(np.max(np.abs(value))), 1e-12))
                     for name, value in with_round.state_dict.items() if value.size)
    all_layers = calibrate_locally(fused, client_inputs, clients=clients,
                                   min_samples=min_samples, input_moments=True)
    return {"layer": first[0], "derived": accuracy(loaded(derived), x_test, y_test),
            "round": accuracy(loaded(with_round), x_test, y_test),
            "max_difference": difference,  # relative to each tensor's largest entry
            "derived_s": round(derived_s, 3),
            "round_s": round(round_s, 3), "targets_s": round(targets_s, 3),
            "layerwise_derived_first": accuracy(loaded(all_layers), x_test, y_test),
            "layerwise_derived_first_rounds": all_layers.report["calibration"]["rounds"]}


def _json(arch: dict[str, Any]) -> str:
    import json

    return json.dumps(arch)


class PeakMemory:
    """Peak resident memory above the resident size at the start (VmHWM reset, Linux)."""

    def __enter__(self) -> PeakMemory:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        self.before = status_mb("VmRSS")
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = round(time.perf_counter() - self.start, 2)
        self.mb = round(status_mb("VmHWM") - self.before, 1)


def cost(n_clients: int, samples: int) -> list[dict[str, Any]]:
    """Time and peak memory of stats (per client) and calibrate on a random resnet50."""
    torch.manual_seed(0)
    arch = named_arch("resnet50", 10)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        clients = []
        for s in range(n_clients):
            state = {k: v.numpy() for k, v in build_model(arch, seed=s).state_dict().items()}
            clients.append(save_checkpoint(Path(folder) / f"c{s}.safetensors", state,
                                           {"fusekit.num_samples": str(samples)}))
        fused = fusekit.fuse(clients, "rebasin", max_sweeps=1)
        fused_path = fused.save(Path(folder) / "fused.safetensors")
        stats = []
        rng = np.random.default_rng(0)
        for s in range(n_clients):
            x = rng.normal(size=(samples, 3, 32, 32)).astype(np.float32)
            with PeakMemory() as peak:
                stats.append(client_statistics(fused_path, x, batch_size=64))
            rows.append({"step": f"stats (client {s})", "inputs": samples,
                         "time_s": peak.seconds, "peak_mb": peak.mb})
            print(rows[-1], flush=True)
        with PeakMemory() as peak:
            fusekit.calibrate(fused_path, stats).save(Path(folder) / "calibrated.safetensors")
        rows.append({"step": f"calibrate ({n_clients} clients)", "inputs": samples * n_clients,
                     "time_s": peak.seconds, "peak_mb": peak.mb})
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="resnet20,mlp_bn,mlp,vgg11_bn")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--settings", default="iid/independent,iid/shared,dirichlet/independent,"
                        "dirichlet/shared", help="split/init pairs")
    parser.add_argument("--protocols", default=",".join(CALIBRATIONS),
                        help="calibration protocols to measure (the last one also calibrates "
                        "in the alignment rounds)")
    parser.add_argument("--alignment-rounds", type=int, default=0,
                        help="also measure 1..N alignment rounds (0: none), and one round "
                        "followed by refit rounds at each --ridges")
    parser.add_argument("--ridges", default="0.1", help="the refits' relative ridges")
    parser.add_argument("--cost", action="store_true", help="also the resnet50 cost rows")
    parser.add_argument("--first-layer", action="store_true",
                        help="also the first layer derived from input moments vs a round")
    parser.add_argument("--cost-samples", type=int, default=64)
    parser.add_argument("--data", choices=DATA, default="digits",
                        help="mnist1d: the MLP cases on MNIST-1D (pip install mnist1d)")
    parser.add_argument("--mnist1d-samples", default="16000,8000",
                        help="MNIST-1D training,test sequences")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json-out", default="benchmarks/results/bench_calibration.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    threadpool_limits(args.threads)
    payload: dict[str, Any] = {"machine": machine_info(threads=args.threads), "cases": []}
    data = case_data(args.data, *map(int, args.mnist1d_samples.split(",")))
    for case in filter(None, args.cases.split(",")):
        for setting in args.settings.split(","):
            split, init = setting.split("/")
            for seed in map(int, args.seeds.split(",")):
                payload["cases"].append(run_case(
                    case, args.clients, split, init, seed, args.methods.split(","),
                    tuple(args.protocols.split(",")), args.alignment_rounds,
                    tuple(map(float, args.ridges.split(","))), args.first_layer, data))
                write_json(args.json_out, payload)
    if args.cost:
        payload["cost"] = cost(2, args.cost_samples)
    write_json(args.json_out, payload)


if __name__ == "__main__":
    main()
