"""Transformers as Hugging Face saves them: small models trained here, fused from their
folders by every method that takes transformers.

Two tasks, each with S clients trained on iid shares of the training data, either from
independent initialisations (a seed per client, trained from scratch) or fine-tuned from
one shared base model (trained first on a public share of the same size, then each client
fine-tuned on its own share for half the epochs at half the learning rate: the federated
fine-tuning case):

- ``vit``: a ViT (``ViTForImageClassification``: 2x2 patches of the bundled 8x8 digits,
  hidden 32, 2 layers, 4 heads, MLP 64), test accuracy on the digits' test split;
- ``gpt2``: a GPT-2 (``GPT2LMHeadModel``, tied LM head: vocabulary 16, hidden 32,
  2 layers, 4 heads, MLP 64) on sequences of 16 tokens whose last 8 repeat the first 8
  (random); next-token accuracy on the repeated half of 600 held-out sequences.

Every client is saved with ``save_pretrained``, fused from the folders with
``fusekit.fuse``, the result saved as a folder and loaded back with ``from_pretrained``.
Peers in the same run: every client, the softmax ensemble of the clients (mean of their
probabilities), avg, and AMS (top1 by max logit; ViT only: a language model's head answers
per token and AMS refuses it). Time is the fusion report's ``time_s``; peak memory how far
the fusion raised the process's resident peak (the report's ``peak_memory_mb``, Linux's
VmHWM) above its resident size just before the call (torch and the models already loaded
are not counted).

    nice -n 10 python benchmarks/bench_transformers.py            # about 4 minutes
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
from fusekit.toolkit.data import load_dataset
from fusekit.toolkit.nn.hf import load_pretrained

#: (label, method, parameters) of every fusion measured.
FUSIONS = [
    ("avg", "avg", {}),
    ("ot", "ot", {}),
    ("rebasin", "rebasin", {}),
    ("pfnm 1.0x", "pfnm", {"width_ratio": 1.0}),
    ("pfnm 1.5x", "pfnm", {"width_ratio": 1.5}),
    ("nafi 1.5x", "nafi", {"width_ratio": 1.5}),
]
VOCAB, LENGTH = 16, 16


def vit_model() -> torch.nn.Module:
    config = transformers.ViTConfig(
        image_size=8, patch_size=2, num_channels=1, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=64, num_labels=10)
    return transformers.ViTForImageClassification(config)


def gpt2_model() -> torch.nn.Module:
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=4, n_inner=64,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def copy_data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random sequences whose second half repeats the first: 3,000 to train, 600 to test."""
    rng = np.random.default_rng(seed)
    half = rng.integers(0, VOCAB, size=(3600, LENGTH // 2))
    data = torch.from_numpy(np.concatenate([half, half], axis=1))
    return data[:3000], data[3000:]


def task_data(task: str) -> dict[str, Any]:
    if task == "vit":
        digits = load_dataset("digits")
        return {"train": (torch.from_numpy(digits.x_train), torch.from_numpy(digits.y_train)),
                "test": (torch.from_numpy(digits.x_test), torch.from_numpy(digits.y_test))}
    train, test = copy_data()
    return {"train": (train, train), "test": (test, test)}


def logits_and_targets(task: str, model, x, y) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, classes) logits and (N,) targets: images, or next tokens at positions >= 2."""
    if task == "vit":
        return model(pixel_values=x).logits, y
    half = LENGTH // 2  # position t predicts token t + 1; the copied half is decided
    out = model(input_ids=x).logits[:, half - 1:-1]
    return out.reshape(-1, out.shape[-1]), y[:, half:].reshape(-1)


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


def run_case(task: str, init: str, n_clients: int, epochs: int, root: Path
             ) -> dict[str, Any]:
    """Train the clients of one (task, init), fuse them with every method, score all."""
    data = task_data(task)
    build = vit_model if task == "vit" else gpt2_model
    x, y = data["train"]
    shares = torch.randperm(len(x), generator=torch.Generator().manual_seed(7)).chunk(
        n_clients + 1)  # shares[0]: the public data the shared base model is trained on
    if init == "shared":
        torch.manual_seed(100)
        base = build()
        train(task, base, x[shares[0]], y[shares[0]], epochs=epochs, seed=99)
    folders, client_probs = [], []
    for s, share in enumerate(shares[1:]):
        if init == "shared":  # fine-tuned from the base, shorter and slower
            model = copy.deepcopy(base)
            train(task, model, x[share], y[share], epochs=epochs // 2, seed=s, lr=5e-4)
        else:
            torch.manual_seed(100 + s)
            model = build()
            train(task, model, x[share], y[share], epochs=epochs, seed=s)
        folder = root / f"{task}-{init}-client{s}"
        model.save_pretrained(folder)
        folders.append(folder)
        client_probs.append(probabilities(task, model, *data["test"]))
    target = client_probs[0][1]
    row: dict[str, Any] = {
        "task": task, "init": init, "clients": [accuracy(p, target) for p, _ in client_probs],
        "ensemble": accuracy(torch.stack([p for p, _ in client_probs]).mean(0), target),
        "fused": {}}
    for label, method, params in FUSIONS:
        before = status_mb("VmRSS")
        result = fusekit.fuse(folders, method=method, **params)
        out = result.save(root / f"{task}-{init}-{label.replace(' ', '-')}")
        probs, _ = probabilities(task, load_pretrained(out), *data["test"])
        row["fused"][label] = {
            "accuracy": accuracy(probs, target), "widths": result.widths,
            "time_s": round(result.report["time_s"], 3),
            "peak_above_mb": round(result.report["peak_memory_mb"] - before, 1)}
        print(f"{task} {init} {label}: {row['fused'][label]}", flush=True)
    if task == "vit":  # AMS keeps classifiers (an LM head answers per token: refused)
        before = status_mb("VmRSS")
        result = fusekit.fuse(folders, method="ams")
        path = result.save(root / f"{task}-{init}-ams.safetensors")
        with torch.no_grad():
            probs = fusekit.load_fused(path, device="cpu")(data["test"][0]).softmax(-1)
        row["ams"] = {"accuracy": accuracy(probs, target),
                      "time_s": round(result.report["time_s"], 3),
                      "peak_above_mb": round(result.report["peak_memory_mb"] - before, 1)}
    return row


def markdown(rows: list[dict[str, Any]]) -> str:
    labels = [label for label, _, _ in FUSIONS]
    lines = [
        "| task | init | clients | ensemble | " + " | ".join(labels) + " | ams |",
        "|---|---|---|---|" + "---|" * len(labels) + "---|"]
    for row in rows:
        cells = [f"{row['fused'][label]['accuracy']}" for label in labels]
        cells.append(str(row["ams"]["accuracy"]) if "ams" in row else "refused (LM head)")
        lines.append(f"| {row['task']} | {row['init']} | "
                     f"{' / '.join(map(str, row['clients']))} | {row['ensemble']} | "
                     + " | ".join(cells) + " |")
    lines += ["", "| task | init | method | fused widths (stream, MLP per block) | time s | "
              "peak MB above |", "|---|---|---|---|---|---|"]
    for row in rows:
        for label in labels:
            fused = row["fused"][label]
            lines.append(f"| {row['task']} | {row['init']} | {label} | {fused['widths']} | "
                         f"{fused['time_s']} | {fused['peak_above_mb']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", default="vit,gpt2")
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--json", default="benchmarks/results/bench_transformers.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    start = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-transformers-") as tmp:
        for task in args.tasks.split(","):
            for init in ("independent", "shared"):
                rows.append(run_case(task, init, args.clients, args.epochs, Path(tmp)))
    table = markdown(rows)
    print(table)
    write_json(args.json, {"machine": machine_info(torch=torch.__version__,
                                                   transformers=transformers.__version__),
                           "clients": args.clients, "epochs": args.epochs, "rows": rows,
                           "wall_s": round(time.perf_counter() - start, 1)})


if __name__ == "__main__":
    main()
