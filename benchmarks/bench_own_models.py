"""fusekit on models it did not train, through the command line: clients trained in plain
torch on raw arrays (scikit-learn's digits, pixels / 16, nothing else), saved with
``safetensors.torch.save_file`` and ``np.savez`` as a user holds them, then the documented
file-based protocol run command by command (docs, "Calibration").

Per case and method, beside peers measured in the same run (each client, the mean client,
the softmax ensemble; avg and ot among the methods), with the fused widths named:

- ``fused``: ``fusekit fuse``; ``one-shot``: one round, ``fusekit stats --mode batch`` on
  each client's file, then ``fusekit calibrate``; ``aligned + refit``: that calibrated model,
  an alignment round (``stats --against``, ``align``) and one refit round per layer
  (``stats --layer``, ``refit``), every command the one the previous step printed;
- ``evaluate - torch``: the largest difference over the case's files between ``fusekit
  evaluate --data-path test.npz`` and torch's accuracy of the same tensors in the author's
  own module on the same arrays (points).

Cases: ``bn_mlp`` (64-100-100-10 with BatchNorm, 20 epochs), ``resnet20`` (the CIFAR
ResNet-20 at widths 16/32/64, one input channel, 10 epochs); Adam lr 3e-3, batches of 32,
each client from its own initialisation on an iid third of the training split.

    python benchmarks/bench_own_models.py --cases bn_mlp,resnet20 --seeds 0,1
"""

from __future__ import annotations

import argparse
import json
import shlex
import tempfile
import time
from pathlib import Path

import numpy as np
import safetensors.torch
import torch
from bench_support import machine_info, write_json
from threadpoolctl import threadpool_limits
from torch import nn
from typer.testing import CliRunner

from fusekit._cli.app import app
from fusekit.toolkit.nn.zoo import resnet20

CASES = {"bn_mlp": ("rebasin,ot,pfnm,avg", 20), "resnet20": ("rebasin,ot,avg", 10)}
runner = CliRunner()


def raw_digits() -> tuple[np.ndarray, ...]:
    """Digits as a user holds them: pixels / 16, images (N, 1, 8, 8); a stratified 75/25
    split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    images = (bunch.images / 16.0).astype(np.float32)[:, None]
    return tuple(train_test_split(images, bunch.target.astype(np.int64), test_size=0.25,
                                  random_state=0, stratify=bunch.target))


def build(case: str, seed: int, widths: list[int] | None = None) -> nn.Module:
    torch.manual_seed(seed)
    if case == "bn_mlp":
        a, b = widths or [100, 100]
        return nn.Sequential(nn.Linear(64, a), nn.BatchNorm1d(a), nn.ReLU(), nn.Linear(a, b),
                             nn.BatchNorm1d(b), nn.ReLU(), nn.Linear(b, 10))
    return resnet20(10, in_channels=1)


def train(model: nn.Module, x: np.ndarray, y: np.ndarray, epochs: int, seed: int) -> nn.Module:
    """Plain torch: Adam, cross-entropy, batches of 32, ``epochs`` passes; eval mode after
    (also the tests' foreign models, tests/foreign.py)."""
    generator = torch.Generator().manual_seed(seed)
    inputs, targets = torch.from_numpy(x), torch.from_numpy(y)
    optimiser = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(epochs):
        for batch in torch.randperm(len(x), generator=generator).split(32):
            if len(batch) > 1:  # BatchNorm needs two samples
                optimiser.zero_grad()
                nn.functional.cross_entropy(model(inputs[batch]), targets[batch]).backward()
                optimiser.step()
    return model.eval()


def logits(model: nn.Module, x: np.ndarray) -> torch.Tensor:
    with torch.inference_mode():
        return model.eval()(torch.from_numpy(x))


def accuracy(scores: torch.Tensor, y: np.ndarray) -> float:
    return float((scores.argmax(1) == torch.from_numpy(y)).double().mean())


def fusekit_cli(*args: object) -> dict:
    result = runner.invoke(app, [*map(str, args), "--json"])
    if result.exit_code != 0:
        raise RuntimeError(f"fusekit {' '.join(map(str, args))}: {result.output}")
    return json.loads(result.stdout)


def follow(step: dict, data: list[Path], own: list[Path]) -> dict:
    """Run what a server-side step printed: client k's line on its own data file, then the
    server's command; returns the server command's report."""
    def words(line: str, k: int | None) -> list[str]:
        if k is not None:
            line = line.replace("DATA.npz", str(data[k]))
        for i, path in enumerate(own):
            line = line.replace(f"CLIENT{i}.safetensors", str(path))
        return shlex.split(line)[1:]

    for k, line in enumerate(step["clients"]):
        fusekit_cli(*words(line, k))
    return fusekit_cli(*words(step["then"], None))


def run_case(case: str, seed: int, folder: Path) -> dict:
    methods, epochs = CASES[case]
    x_train, x_test, y_train, y_test = raw_digits()
    if case == "bn_mlp":
        x_train, x_test = x_train.reshape(len(x_train), -1), x_test.reshape(len(x_test), -1)
    np.savez(folder / "test.npz", x_train=x_test, y_train=y_test, x_test=x_test, y_test=y_test)
    parts = np.array_split(np.random.default_rng(seed).permutation(len(x_train)), 3)
    own, data, models = [], [], []
    start = time.perf_counter()
    for k, part in enumerate(parts):
        models.append(train(build(case, 100 * seed + k), x_train[part], y_train[part], epochs, k))
        own.append(folder / f"c{k}.safetensors")
        safetensors.torch.save_file({n: t.contiguous() for n, t in
                                     models[-1].state_dict().items()}, str(own[-1]))
        data.append(folder / f"client{k}.npz")
        np.savez(data[-1], x_train=x_train[part], y_train=y_train[part], x_test=x_test,
                 y_test=y_test)
    trained_s = time.perf_counter() - start
    clients = [accuracy(logits(m, x_test), y_test) for m in models]
    ensemble = accuracy(sum(logits(m, x_test).softmax(1) for m in models), y_test)
    rows = []
    for method in methods.split(","):
        row = run_method(case, method, folder / method, own, data, x_test, y_test)
        print(f"{case} seed {seed} {method} {row['widths']}: fused {row['fused']:.4f} "
              f"one-shot {row['one-shot']:.4f} aligned+refit {row['aligned + refit']:.4f}",
              flush=True)
        rows.append(row)
    return {"case": case, "seed": seed, "clients": clients, "mean client": float(np.mean(clients)),
            "ensemble": ensemble, "train_s": trained_s, "methods": rows,
            "evaluate - torch": max(evaluated_against_torch(dict(zip(own, clients)), folder),
                                    *(row["evaluate - torch"] for row in rows))}


def evaluated_against_torch(torch_of: dict[Path, float], folder: Path) -> float:
    """The largest difference between ``fusekit evaluate``'s accuracy of each file and
    torch's (``torch_of``), on the case's test.npz (files of one folder: distinct names)."""
    scores = {s["name"]: s["accuracy"] for s in fusekit_cli(
        "evaluate", *torch_of, "--data-path", folder / "test.npz", "--device", "cpu")["scores"]}
    return max(abs(scores[path.name] - score) for path, score in torch_of.items())


def run_method(case: str, method: str, folder: Path, own: list[Path], data: list[Path],
               x_test: np.ndarray, y_test: np.ndarray) -> dict:
    folder.mkdir()
    fused = folder / "fused.safetensors"
    widths = fusekit_cli("fuse", *own, "-m", method, "-o", fused)["widths"]
    stats = [fusekit_cli("stats", fused, "--mode", "batch", "--data-path", path, "-o",
                         folder / f"c{k}.stats.safetensors")["output"]
             for k, path in enumerate(data)]
    start = time.perf_counter()
    step = fusekit_cli("calibrate", fused, *stats, "-o", folder / "calibrated.safetensors")
    rounds = 1
    while step["next"]["then"] is not None:
        step = follow(step["next"], data, own)
        rounds += 1
    files = {"fused": fused, "one-shot": folder / "calibrated.safetensors",
             "aligned + refit": Path(step["output"])}
    row = {"method": method, "widths": widths, "rounds": rounds,
           "protocol_s": time.perf_counter() - start}
    torch_of = {}
    for name, path in files.items():
        model = build(case, 0, widths)
        model.load_state_dict(safetensors.torch.load_file(str(path)))
        row[name] = torch_of[path] = accuracy(logits(model, x_test), y_test)
    row["evaluate - torch"] = evaluated_against_torch(torch_of, folder.parent)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json-out", default="benchmarks/results/bench_own_models.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    runs = []
    with threadpool_limits(args.threads), tempfile.TemporaryDirectory() as tmp:
        for case in args.cases.split(","):
            for seed in map(int, args.seeds.split(",")):
                folder = Path(tmp) / f"{case}-{seed}"
                folder.mkdir()
                runs.append(run_case(case, seed, folder))
    write_json(args.json_out, {"machine": machine_info(threads=args.threads), "runs": runs})
    print(table(runs))


def table(runs: list[dict]) -> str:
    lines = ["| case, seed | mean client | ensemble | method (widths) | fused | one-shot | "
             "aligned + refit (rounds) | evaluate - torch |",
             "|---|---|---|---|---|---|---|---|"]
    for run in runs:
        for row in run["methods"]:
            lines.append(
                f"| {run['case']}, {run['seed']} | {run['mean client']:.4f} | "
                f"{run['ensemble']:.4f} | {row['method']} ({', '.join(map(str, row['widths']))})"
                f" | {row['fused']:.4f} | {row['one-shot']:.4f} | {row['aligned + refit']:.4f} "
                f"({row['rounds']}) | {run['evaluate - torch']:.4f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
