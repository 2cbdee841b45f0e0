"""Transformers as Hugging Face saves them: small models trained here, fused from their
folders by every method that takes transformers, then calibrated from the clients'
statistics.

Each task has S clients trained on iid shares of the training data, either from
independent initialisations (a seed per client, trained from scratch) or fine-tuned from
one shared base model (trained first on a public share of the same size, then each client
fine-tuned on its own share for half the epochs at half the learning rate: the federated
fine-tuning case):

- ``vit``: a ViT (``ViTForImageClassification``: 2x2 patches of the bundled 8x8 digits,
  hidden 32, 2 layers, 4 heads, MLP 64), test accuracy on the digits' test split;
- ``sort``: a GPT-2 (``GPT2LMHeadModel``, tied LM head: vocabulary 16, hidden 32, 2 layers,
  4 heads, MLP 64) on sequences of 8 random tokens, a separator, then the same 8 tokens
  sorted: next-token accuracy on the sorted half of 600 held-out sequences (every output
  token depends on all the inputs: attention must compare them);
- ``copy``: the same GPT-2 on 16 tokens whose last 8 repeat the first 8 (easier: every
  method reaches 100 % from a shared base).

Every client is saved with ``save_pretrained``, fused from the folders with
``fusekit.fuse``, the result saved as a folder and loaded back with ``from_pretrained``,
then calibrated (``fusekit.toolkit.local.calibrate_locally``: layer by layer, one
round per MLP and LayerNorm; each client's statistics over its own training share, the
targets its statistics of its own model) and loaded back again. Peers in the same run:
every client, the softmax ensemble of the clients (mean of their probabilities), avg, and
AMS (top1 by max logit; ViT only: a language model's head answers per token and AMS
refuses it). ``distill`` (its defaults: pfnm's 1.5x fusion taught the clients' ensemble on
synthetic pixel values or token sequences, docs/ALGORITHMS.md §14) is scored as saved:
calibration maps client statistics through a fusion's assignments, which a trained
student does not have. Time is the fusion report's ``time_s``; peak memory how far the fusion raised
the process's resident peak (the report's ``peak_memory_mb``, Linux's VmHWM) above its
resident size just before the call (torch and the models already loaded are not counted).

    nice -n 10 python benchmarks/bench_transformers.py --seeds 0,1,2
    python benchmarks/bench_transformers.py --tasks vit --clients 3 --epochs 20
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from bench_support import machine_info, status_mb, write_json

import fusekit
from fusekit.core.checkpoint import load_checkpoint
from fusekit.core.model_spec import fused_spec
from fusekit.core.transformer import LAYERNORM, MLP_HIDDEN, calibration_points
from fusekit.toolkit.data import load_dataset
from fusekit.toolkit.local import calibrate_locally
from fusekit.toolkit.nn.hf import load_pretrained

#: (label, method, parameters) of every fusion measured.
FUSIONS = [
    ("avg", "avg", {}),
    ("ot", "ot", {}),
    ("rebasin", "rebasin", {}),
    ("pfnm 1.0x", "pfnm", {"width_ratio": 1.0}),
    ("pfnm 1.5x", "pfnm", {"width_ratio": 1.5}),
    ("nafi 1.5x", "nafi", {"width_ratio": 1.5}),
    ("distill", "distill", {}),
]
#: Fusions with no client-to-fused assignments: nothing for calibration to map targets
#: through (the distilled student is trained, not matched).
UNCALIBRATED = {"distill"}
VOCAB, LENGTH = 16, 16
HALF = LENGTH // 2  # copy: the repeated half; sort: the tokens to sort (then a separator)


def vit_model() -> torch.nn.Module:
    config = transformers.ViTConfig(
        image_size=8, patch_size=2, num_channels=1, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=64, num_labels=10)
    return transformers.ViTForImageClassification(config)


def gpt2_model(task: str) -> torch.nn.Module:
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=LENGTH + (task == "sort"), n_embd=32, n_layer=2,
        n_head=4, n_inner=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def sequences(task: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """copy: random halves repeated (3,000 to train, 600 to test); sort: 8 tokens from
    1..15, the separator 0, the 8 sorted (4,000 to train, 600 to test)."""
    rng = np.random.default_rng(seed)
    n_train = 3000 if task == "copy" else 4000
    half = rng.integers(0 if task == "copy" else 1, VOCAB, size=(n_train + 600, HALF))
    parts = [half, half] if task == "copy" else [half, np.zeros((len(half), 1), np.int64),
                                                 np.sort(half, axis=1)]
    data = torch.from_numpy(np.concatenate(parts, axis=1))
    return data[:n_train], data[n_train:]


def task_data(task: str, seed: int) -> dict[str, Any]:
    if task == "vit":
        digits = load_dataset("digits")
        mean, std = digits.normalization.mean[0], digits.normalization.std[0]
        x_train, x_test = ((x - mean) / std for x in (digits.x_train, digits.x_test))
        return {"train": (torch.from_numpy(x_train), torch.from_numpy(digits.y_train)),
                "test": (torch.from_numpy(x_test), torch.from_numpy(digits.y_test))}
    train, test = sequences(task, seed)
    return {"train": (train, train), "test": (test, test)}


def logits_and_targets(task: str, model, x, y) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, classes) logits and (N,) targets: images, or the next tokens of the decided
    half (copy: positions 8..15; sort: the sorted tokens after the separator)."""
    if task == "vit":
        return model(pixel_values=x).logits, y
    start = HALF if task == "sort" else HALF - 1  # position t predicts token t + 1
    out = model(input_ids=x).logits[:, start:-1]
    return out.reshape(-1, out.shape[-1]), y[:, start + 1:].reshape(-1)


def train(task: str, model, x, y, *, epochs: int, seed: int, lr: float = 1e-3) -> None:
    generator = torch.Generator().manual_seed(seed)
    optimiser = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for _ in range(epochs):
        for batch in torch.randperm(len(x), generator=generator).split(32):
            logits, target = logits_and_targets(task, model, x[batch], y[batch])
            loss = torch.nn.functional.cross_entropy(logits, target)
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
    model.eval()


@torch.no_grad()
def probabilities(task: str, model, x, y) -> tuple[torch.Tensor, torch.Tensor]:
    logits, target = logits_and_targets(task, model, x, y)
    return logits.softmax(dim=-1), target


def accuracy(probs: torch.Tensor, target: torch.Tensor) -> float:
    return round(100.0 * float((probs.argmax(dim=-1) == target).float().mean()), 1)


def run_case(task: str, init: str, n_clients: int, epochs: int, seed: int, root: Path
             ) -> dict[str, Any]:
    """Train the clients of one (task, init, seed), fuse them with every method,
    calibrate every fusion, score all."""
    data = task_data(task, seed)
    build = vit_model if task == "vit" else lambda: gpt2_model(task)
    x, y = data["train"]
    shares = torch.randperm(len(x), generator=torch.Generator().manual_seed(7 + seed)).chunk(
        n_clients + 1)  # shares[0]: the public data the shared base model is trained on
    if init == "shared":
        torch.manual_seed(100 + 1000 * seed)
        base = build()
        train(task, base, x[shares[0]], y[shares[0]], epochs=epochs, seed=99 + seed)
    folders, client_probs = [], []
    for s, share in enumerate(shares[1:]):
        if init == "shared":  # fine-tuned from the base, shorter and slower
            model = copy.deepcopy(base)
            train(task, model, x[share], y[share], epochs=epochs // 2, seed=s + 10 * seed,
                  lr=5e-4)
        else:
            torch.manual_seed(100 + 1000 * seed + s)
            model = build()
            train(task, model, x[share], y[share], epochs=epochs, seed=s + 10 * seed)
        folder = root / f"{task}-{init}-{seed}-client{s}"
        model.save_pretrained(folder)
        folders.append(folder)
        client_probs.append(probabilities(task, model, *data["test"]))
    target = client_probs[0][1]
    row: dict[str, Any] = {
        "task": task, "init": init, "seed": seed,
        "clients": [accuracy(p, target) for p, _ in client_probs],
        "ensemble": accuracy(torch.stack([p for p, _ in client_probs]).mean(0), target),
        "fused": {}}
    own_data = [x[share].numpy() for share in shares[1:]]
    clients = [load_checkpoint(folder) for folder in folders]
    for label, method, params in FUSIONS:
        before = status_mb("VmRSS")
        result = fusekit.fuse(folders, method=method, **params)
        out = result.save(root / f"{task}-{init}-{seed}-{label.replace(' ', '-')}")
        probs, _ = probabilities(task, load_pretrained(out), *data["test"])
        row["fused"][label] = {
            "accuracy": accuracy(probs, target), "widths": result.widths,
            "time_s": round(result.report["time_s"], 3),
            "peak_above_mb": round(result.report["peak_memory_mb"] - before, 1),
            **({} if label in UNCALIBRATED else
               calibrations(task, out, own_data, clients, data["test"], target))}
        print(f"{task} {init} seed {seed} {label}: {row['fused'][label]}", flush=True)
    if task == "vit":  # AMS keeps classifiers (an LM head answers per token: refused)
        before = status_mb("VmRSS")
        result = fusekit.fuse(folders, method="ams")
        path = result.save(root / f"{task}-{init}-{seed}-ams.safetensors")
        with torch.no_grad():
            probs = fusekit.load_fused(path, device="cpu")(data["test"][0]).softmax(-1)
        row["ams"] = {"accuracy": accuracy(probs, target),
                      "time_s": round(result.report["time_s"], 3),
                      "peak_above_mb": round(result.report["peak_memory_mb"] - before, 1)}
    return row


def calibrations(task: str, fused: Path, own_data: list[np.ndarray], clients: list,
                 test: tuple[torch.Tensor, torch.Tensor], target: torch.Tensor
                 ) -> dict[str, Any]:
    """Accuracy after layer-by-layer calibration of the MLPs only, the LayerNorms only,
    and both (``calibrated``), and the time of the last."""
    checkpoint = load_checkpoint(fused)
    points = calibration_points(fused_spec(checkpoint),
                                {name: info.shape for name, info in checkpoint.tensors.items()})
    out: dict[str, Any] = {}
    for name, kind in (("calibrated_mlp", MLP_HIDDEN), ("calibrated_ln", LAYERNORM),
                       ("calibrated", None)):
        layers = None if kind is None else [p.module for p in points if p.kind == kind]
        start = time.perf_counter()
        result = calibrate_locally(checkpoint, own_data, clients=clients, layers=layers)
        out["calibration_s"] = round(time.perf_counter() - start, 1)
        saved = result.save(fused.with_name(f"{fused.name}-{name}"))
        out[name] = accuracy(probabilities(task, load_pretrained(saved), *test)[0], target)
    return out


def markdown(rows: list[dict[str, Any]]) -> str:
    """Means over the seeds: clients, ensemble, every fusion uncalibrated -> calibrated
    (with the smallest change over the seeds), AMS; then widths and times."""
    labels = [label for label, _, _ in FUSIONS]
    cases: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        cases.setdefault((row["task"], row["init"]), []).append(row)

    def mean(values, digits: int = 1) -> float:
        return round(float(np.mean(list(values))), digits)

    lines = ["| task | init | seeds | mean / best client | ensemble | "
             + " | ".join(labels) + " | ams |",
             "|---|---|---|---|---|" + "---|" * len(labels) + "---|"]
    for (task, init), group in cases.items():
        cells = []
        for label in labels:
            fused = [r["fused"][label] for r in group]
            if label in UNCALIBRATED:
                cells.append(f"{mean(f['accuracy'] for f in fused)} (not calibrated)")
                continue
            worst = min(f["calibrated"] - f["accuracy"] for f in fused)
            cells.append(" / ".join(str(mean(f[key] for f in fused)) for key in (
                "accuracy", "calibrated_mlp", "calibrated_ln", "calibrated"))
                + f" ({worst:+.1f})")
        ams = (str(mean(r["ams"]["accuracy"] for r in group)) if "ams" in group[0]
               else "refused (LM head)")
        lines.append(
            f"| {task} | {init} | {len(group)} | {mean(np.mean(r['clients']) for r in group)}"
            f" / {mean(max(r['clients']) for r in group)} | "
            f"{mean(r['ensemble'] for r in group)} | " + " | ".join(cells) + f" | {ams} |")
    lines += ["", "| task | init | method | fused widths (stream, MLP per block) | fusion s | "
              "calibration s | peak MB above |", "|---|---|---|---|---|---|---|"]
    for (task, init), group in cases.items():
        for label in labels:
            fused = [r["fused"][label] for r in group]
            calibration = ("-" if label in UNCALIBRATED
                           else mean(f["calibration_s"] for f in fused))
            lines.append(f"| {task} | {init} | {label} | {fused[0]['widths']} | "
                         f"{mean((f['time_s'] for f in fused), 3)} | "
                         f"{calibration} | "
                         f"{max(f['peak_above_mb'] for f in fused)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", default="vit,sort")
    parser.add_argument("--inits", default="independent,shared")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--json", default="benchmarks/results/bench_transformers.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    start = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-transformers-") as tmp:
        for seed in map(int, args.seeds.split(",")):
            for task in args.tasks.split(","):
                for init in args.inits.split(","):
                    rows.append(run_case(task, init, args.clients, args.epochs, seed,
                                         Path(tmp)))
                    write_json(args.json, {  # after every case: a long run keeps its rows
                        "machine": machine_info(torch=torch.__version__,
                                                transformers=transformers.__version__),
                        "clients": args.clients, "epochs": args.epochs, "rows": rows,
                        "wall_s": round(time.perf_counter() - start, 1)})
    print(markdown(rows))


if __name__ == "__main__":
    main()
