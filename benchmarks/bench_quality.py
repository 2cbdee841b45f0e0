"""Fusion quality: test accuracy of every registered fusion method on simulated clients.

Studies (each cell: mean ± std over seeds):
  main     data x partition (hetero-dir alpha 0.1/0.5/1.0, hetero-label), S = 10, 1 hidden layer
  clients  digits, hetero-dir 0.5, S in {5, 10, 20}
  depth    digits, hetero-dir 0.5 and hetero-label, S = 10, 1 and 2 hidden layers
  pans     digits, hetero-dir 0.5, S = 10, shared initial model: avg of plain clients vs avg
           of PAN clients (multiplicative, A = 0.1, T = 1; the PANs paper's defaults)
  lambda   NAFI's lambda from 1e-8 to 1 on the main digits cells
  mnist    (only with --data-dir holding the MNIST files) hetero-dir 0.5 and hetero-label
  full     (only with --full) data x partition x S in {5, 10, 20} x {1, 2} hidden layers
  frontier (only with --frontier, which runs it alone) accuracy against the fused width:
           pfnm and nafi at width ratio 1.0, 1.25, 1.5, 2 and unlimited (pfnm at 1.5 also
           with the paper's class shares), ot and avg (the clients' width), next to the
           softmax and logit ensembles, AMS (class-share mixture, max logit, max
           probability), distill and the mean client; data digits / digits28 (the digits
           at MNIST's 28x28 format: 784-100-10 clients) / synthetic / npz (--data-path),
           Dirichlet alpha 0.05 / 0.1 / 0.5 / 1.0, label skew (3-6 and 1-3 classes per
           client), S = 10 and 20; the non-iid floor (pfnm/nafi at the default width against
           avg/ot, AMS against the softmax ensemble) on alpha <= 0.1 and 1-3 classes; NAFI's
           lambda at ratio 1.0 on digits, alpha 0.5, S = 10; with --calibrate, every fused
           model also calibrated (ALGORITHMS.md §12), before/after per cell, no lambda study

Every method in fusekit.METHODS at run time is included with its default parameters, plus
variants: avg with the class-weighted output layer, and AMS-full next to AMS's default.

    python benchmarks/bench_quality.py            # default grid (< 10 min on 2 cores)
    python benchmarks/bench_quality.py --quick    # smaller grid, 2 seeds
    python benchmarks/bench_quality.py --frontier --data digits   # accuracy against width
    python benchmarks/bench_quality.py --frontier --calibrate --data digits  # calibrated too
    python benchmarks/bench_truth.py              # estimated hyperparameters (its own file)
Writes benchmarks/results/quality.json, benchmarks/results/quality_alpha.png and the
"Fusion quality" section of benchmarks/RESULTS.md (between marker comments); with
--frontier, benchmarks/results/frontier-<data>.json, benchmarks/results/frontier-<data>.png
and the "Accuracy against fused width (<data>)" section; with --frontier --calibrate,
benchmarks/results/frontier-calibration-<data>.json and the "On the frontier benchmark
(<data>)" subsection of "Calibration from client statistics".
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import tempfile
import time
from collections import defaultdict
import dataclasses
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from bench_support import add_output_arguments, machine_info, save_figure, write_section

import fusekit
from fusekit.core.checkpoint import write_atomic
from fusekit.core.errors import DataError
from fusekit.core.stats import DEFAULT_MIN_SAMPLES
from fusekit.methods import METHODS
from fusekit.methods.bayesian import ratio_width
from fusekit.toolkit.local import calibrate_locally
from fusekit.toolkit.data import Dataset, load_dataset
from fusekit.toolkit.data.datasets import training_normalization
from fusekit.toolkit.evaluate import Evaluator
from fusekit.toolkit.simulate import SimulationConfig, simulate_clients
from fusekit.toolkit.train import TrainConfig

HERE = Path(__file__).resolve().parent
BEGIN, END = "<!-- fusion-quality:begin -->", "<!-- fusion-quality:end -->"
RATIOS = (1.0, 1.25, 1.5, 2.0, "unlimited")
FRONTIER_LAMBDAS = (0.0, 0.01, 0.1, 1.0, 10.0)
CLIENT_WIDTH = 100  # the frontier's clients: one hidden layer of 100
PAN = {"mode": "multiplicative", "amplitude": 0.1, "period": 1.0}
LAMBDAS = (1e-8, 1e-6, 1e-4, 1e-2, 1.0)
PARTITIONS = {
    "dir-0.1": {"partition": "dirichlet", "alpha": 0.1},
    "dir-0.5": {"partition": "dirichlet", "alpha": 0.5},
    "dir-1.0": {"partition": "dirichlet", "alpha": 1.0},
    "labels": {"partition": "labels", "min_classes": 3, "max_classes": 6},
}
#: The frontier's strongly non-iid cells (with dir-0.1): where the floor and AMS targets of
#: the "Non-iid floor" checks apply.
NONIID_PARTITIONS = {
    "dir-0.05": {"partition": "dirichlet", "alpha": 0.05},
    "labels-1-3": {"partition": "labels", "min_classes": 1, "max_classes": 3},
}
ALL_PARTITIONS = {**PARTITIONS, **NONIID_PARTITIONS}
NONIID = ("dir-0.05", "dir-0.1", "labels-1-3")
DEFAULT_RATIO_LABELS = ("pfnm@1.5", "nafi@1.5")  # the default width, 1.5 x the widest client
DISTILL = "distill@1.5"
AMS_RULES = {"ams-class": "class-share", "ams-logit": "logit", "ams-prob": "probability"}
EPOCHS = {"digits": 20, "digits28": 20, "synthetic": 10, "mnist": 3, "npz": 3}
LR = 3e-3  # Adam; brings digits clients close to zero training loss in 20 epochs

log = logging.getLogger("bench_quality")


@dataclass(frozen=True)
class Cell:
    """One simulated federation."""

    data: str
    partition: str
    clients: int
    arch: str
    seed: int
    pan: bool = False
    shared_init: bool = False


def variants() -> dict[str, tuple[str, dict[str, Any]]]:
    """Label -> (method, params): every registered method with its defaults (README order
    first), with avg-cw after avg and ams-full after ams."""
    from fusekit.toolkit.demo import registered_methods

    out: dict[str, tuple[str, dict[str, Any]]] = {}
    for name in registered_methods():
        out[name] = (name, {})
        if name == "avg":
            out["avg-cw"] = ("avg", {"class_weighted": True})
        if name == "ams":
            out["ams-full"] = ("ams", {"mode": "full", "confidence": "logit"})
    return out


def methods_for(
    cell: Cell, methods: dict[str, tuple[str, dict[str, Any]]]
) -> dict[str, tuple[str, dict[str, Any]]]:
    """PAN clients only go to methods that do not permute neurons (the others refuse them)."""
    if not cell.pan:
        return methods
    return {k: v for k, v in methods.items() if not METHODS[v[0]].permutes_neurons}


def load(name: str, data_dir: Path | None, data_path: Path | None = None) -> Dataset:
    if name == "digits28":
        return digits_at_mnist_format()
    if name == "synthetic":
        return load_dataset("synthetic", samples=5000, features=20, classes=10, seed=0)
    if name == "npz":
        return load_dataset("npz", path=data_path)
    return load_dataset(name, data_dir=data_dir)


def digits_at_mnist_format() -> Dataset:
    """The digits at MNIST's format, for 784-100-10 clients where no MNIST files are at hand:
    each 8x8 image resized to 28x28 (bilinear), pixels scaled to 0..1 as MNIST's bytes / 255
    are, the same split, normalised as fusekit's MNIST models are (the training split's mean
    and standard deviation, recorded in the clients' fusekit.preprocess)."""
    digits = load_dataset("digits")

    def resized(x: np.ndarray) -> np.ndarray:
        big = torch.nn.functional.interpolate(torch.from_numpy(x), size=(28, 28),
                                              mode="bilinear", align_corners=False)
        return (big / 16).numpy()

    x_train = resized(digits.x_train)
    return dataclasses.replace(digits, name="digits28", x_train=x_train,
                               x_test=resized(digits.x_test),
                               normalization=training_normalization(x_train))


class Runner:
    """Simulates each cell once (client files kept in one temporary folder for the whole
    run) and fuses/evaluates any set of method variants on it, caching every result."""

    def __init__(self, datasets: dict[str, Dataset], device: str, workspace: Path,
                 calibrate: bool = False):
        self.datasets = datasets
        self.evaluators = {name: Evaluator(d, device) for name, d in datasets.items()}
        self.workspace = workspace
        self.calibrate = calibrate  # also score each fused model calibrated (§12)
        self.clients: dict[Cell, tuple[list[Path], dict[str, Any]]] = {}
        self.client_inputs: dict[Cell, list[np.ndarray]] = {}
        self.results: dict[tuple[Cell, str], dict[str, Any]] = {}

    def row(self, cell: Cell, methods: dict[str, tuple[str, dict[str, Any]]]) -> dict[str, Any]:
        """Local/ensemble accuracy of a cell and the accuracy/time of each variant."""
        paths, base = self._simulate(cell)
        evaluator = self.evaluators[cell.data]
        row = {**base, "methods": {}}
        for label, (method, params) in methods.items():
            if (cell, label) not in self.results:
                self.results[cell, label] = self._fuse(
                    cell, paths, evaluator, label, method, params
                )
            row["methods"][label] = self.results[cell, label]
        return row

    def _simulate(self, cell: Cell) -> tuple[list[Path], dict[str, Any]]:
        if cell in self.clients:
            return self.clients[cell]
        evaluator = self.evaluators[cell.data]
        config = SimulationConfig(
            clients=cell.clients,
            arch=cell.arch,
            seed=cell.seed,
            pan=PAN if cell.pan else None,
            shared_init=cell.shared_init,
            min_samples=10,
            train=TrainConfig(epochs=EPOCHS[cell.data], batch_size=32, lr=LR),
            **ALL_PARTITIONS[cell.partition],
        )
        folder = self.workspace / f"cell{len(self.clients)}"
        start = time.perf_counter()
        clients = simulate_clients(
            self.datasets[cell.data], config, out_dir=folder, device=str(evaluator.device)
        )
        train_s = time.perf_counter() - start
        paths = [c.path for c in clients]
        self.client_inputs[cell] = [self.datasets[cell.data].x_train[c.indices] for c in clients]
        logits = [evaluator.logits(p)[1] for p in paths]
        base = {
            "cell": asdict(cell),
            "train_s": train_s,
            "local_mean": float(
                np.mean([evaluator.score(z, "", "client").accuracy for z in logits])
            ),
            "ensemble": evaluator.ensemble(logits).accuracy,
            "ensemble_softmax": evaluator.softmax_ensemble(logits).accuracy,
        }
        self.clients[cell] = (paths, base)
        return paths, base

    def _fuse(
        self,
        cell: Cell,
        paths: list[Path],
        evaluator: Evaluator,
        label: str,
        method: str,
        params: dict[str, Any],
    ) -> dict[str, Any]:
        try:
            begin = time.perf_counter()
            result = fusekit.fuse(paths, method=method, **params)
            seconds = time.perf_counter() - begin
            fused = result.save(paths[0].parent / f"fused-{label}.safetensors")
            accuracy = evaluator.score(evaluator.logits(fused)[1], label, "fused").accuracy
            calibrated = (self._calibrated(cell, paths, fused, evaluator, label)
                          if self.calibrate and result.assignments is not None else {})
            fused.unlink()
            layers = result.report.get("layers", [])
            return {"accuracy": accuracy, "time_s": seconds, "widths": list(result.widths),
                    "peak_memory_mb": result.report.get("peak_memory_mb"),
                    "inferred": [layer["inferred_width"] for layer in layers
                                 if "inferred_width" in layer],
                    **clients_differ(result.report), **calibrated}
        except Exception as exc:  # a failing method is reported, not hidden
            log.error("%s on %s: %s: %s", label, cell, type(exc).__name__, exc)
            return {"error": f"{type(exc).__name__}: {exc}"}

    def _calibrated(self, cell: Cell, paths: list[Path], fused: Path, evaluator: Evaluator,
                    label: str) -> dict[str, Any]:
        """The fused model calibrated layer by layer with each client's statistics of its
        own training split (REPAIR's targets: of its own model), and its test accuracy."""
        inputs = self.client_inputs[cell]
        begin = time.perf_counter()
        try:
            result = calibrate_locally(fused, inputs, clients=paths,
                                       device=str(evaluator.device),
                                       min_samples=min(DEFAULT_MIN_SAMPLES, *map(len, inputs)))
        except Exception as exc:  # reported next to the uncalibrated accuracy
            log.error("calibrating %s on %s: %s: %s", label, cell, type(exc).__name__, exc)
            return {"calibration_error": f"{type(exc).__name__}: {exc}"}
        seconds = time.perf_counter() - begin
        path = result.save(fused.with_name(f"calibrated-{label}.safetensors"))
        accuracy = evaluator.score(evaluator.logits(path)[1], label, "fused").accuracy
        path.unlink()
        return {"calibrated": accuracy, "calibration_s": seconds}


def clients_differ(report: dict[str, Any]) -> dict[str, Any]:
    """The class contrast and compact_ok of a PFNM/NAFI report (empty for other methods)."""
    differ = report.get("heterogeneity")
    if not differ:
        return {}
    return {"class_contrast": differ["class_contrast"], "compact_ok": differ["compact_ok"]}


def grid(quick: bool, full: bool, seeds: int, have_mnist: bool) -> dict[str, list[Cell]]:
    """The cells of every study (cells shared between studies run once)."""
    seed_list = range(seeds)
    partitions = ["dir-0.1", "dir-0.5", "labels"] if quick else list(PARTITIONS)
    datasets = ["digits"] if quick else ["digits", "synthetic"]
    one = "mlp:100"
    studies = {
        "main": [Cell(d, p, 10, one, s) for d in datasets for p in partitions for s in seed_list],
        "clients": [
            Cell("digits", "dir-0.5", n, one, s)
            for n in ((5, 10) if quick else (5, 10, 20))
            for s in seed_list
        ],
        "depth": [
            Cell("digits", p, 10, a, s)
            for p in ("dir-0.5", "labels")
            for a in (one, "mlp:100,100")
            for s in seed_list
        ],
        "pans": [
            Cell("digits", "dir-0.5", 10, one, s, pan=pan, shared_init=True)
            for pan in (False, True)
            for s in seed_list
        ],
    }
    if quick:
        studies["depth"] = [c for c in studies["depth"] if c.partition == "dir-0.5"]
    if full:
        studies["full"] = [
            Cell(d, p, n, a, s)
            for d in datasets
            for p in partitions
            for n in (5, 10, 20)
            for a in (one, "mlp:100,100")
            for s in seed_list
        ]
    if have_mnist:
        studies["mnist"] = [
            Cell("mnist", p, 10, one, s) for p in ("dir-0.5", "labels") for s in seed_list
        ]
    return studies


def lambda_variants() -> dict[str, tuple[str, dict[str, Any]]]:
    """NAFI with lambda from 1e-8 to 1, and PFNM (lambda = 0) for reference."""
    out = {f"nafi-{lam:g}": ("nafi", {"lam": lam}) for lam in LAMBDAS}
    if "pfnm" in METHODS:
        out["pfnm"] = ("pfnm", {})
    return out


def summarise(rows: list[dict[str, Any]], key_fields: tuple[str, ...]) -> dict[tuple, dict]:
    """(cell fields) -> {label: (mean, std, n)} over seeds, for local/ensemble/methods."""
    groups: dict[tuple, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    times: dict[tuple, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        key = tuple(row["cell"][f] for f in key_fields)
        groups[key]["local (mean)"].append(row["local_mean"])
        groups[key]["ensemble"].append(row["ensemble"])
        if "ensemble_softmax" in row:
            groups[key]["ensemble-softmax"].append(row["ensemble_softmax"])
        for label, res in row["methods"].items():
            if "accuracy" in res:
                groups[key][label].append(res["accuracy"])
                times[key][label].append(res["time_s"])
            else:
                groups[key].setdefault(label, [])
    out = {}
    for key, labels in groups.items():
        out[key] = {
            label: (
                float(np.mean(v)) if v else math.nan,
                float(np.std(v)) if v else math.nan,
                len(v),
                float(np.mean(times[key][label])) if times[key].get(label) else None,
            )
            for label, v in labels.items()
        }
    return out


NAFI_ORDER = ("avg", "ot", "pfnm", "nafi")  # NAFI paper Table 2, non-iid MNIST, worst first


def paper_checks(rows: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Lines comparing the measured orderings with the papers' (computed, not written)."""
    lines = []
    main = summarise(rows["main"], ("data", "partition"))
    for (data, partition), cells in main.items():
        if not partition.startswith("dir-") or not all(m in cells for m in NAFI_ORDER):
            continue
        means = {m: cells[m][0] for m in NAFI_ORDER}
        order = " < ".join(sorted(means, key=means.get))
        verdict = "matches" if tuple(sorted(means, key=means.get)) == NAFI_ORDER else "differs"
        gap = 100 * (means["nafi"] - means["pfnm"])
        lines.append(
            f"- NAFI Table 2 ordering (avg < ot < pfnm < nafi), {data} {partition}: measured "
            f"{order} ({verdict}; nafi - pfnm = {gap:+.1f} points)"
        )
    for (data, partition), cells in main.items():
        if partition == "labels" and "ams" in cells:
            gap = 100 * (cells["ams"][0] - cells["ensemble"][0])
            lines.append(
                f"- AMS Tables 2-3 (AMS-top1 well above the ensemble under hetero-label), "
                f"{data}: ams - ensemble = {gap:+.1f} points"
            )
    pans = summarise(rows["pans"], ("pan",))
    if (False,) in pans and (True,) in pans and "avg" in pans[(True,)]:
        gap = 100 * (pans[(True,)]["avg"][0] - pans[(False,)]["avg"][0])
        lines.append(f"- PANs + avg against plain avg (shared initial model): {gap:+.1f} points")
    return lines


def markdown_table(summary: dict[tuple, dict], key_names: tuple[str, ...]) -> str:
    labels: list[str] = []
    for cells in summary.values():
        labels += [lab for lab in cells if lab not in labels]
    head = "| " + " | ".join([*key_names, *labels]) + " |"
    sep = "|" + "---|" * (len(key_names) + len(labels))
    lines = [head, sep]
    for key, cells in summary.items():
        values = []
        for lab in labels:
            if lab not in cells:
                values.append("-")
                continue
            mean, std, n, _ = cells[lab]
            values.append("failed" if n == 0 else f"{100 * mean:.1f} ± {100 * std:.1f}")
        lines.append("| " + " | ".join([*map(str, key), *values]) + " |")
    return "\n".join(lines)


def time_table(summary: dict[tuple, dict], key_names: tuple[str, ...]) -> str:
    labels: list[str] = []
    for cells in summary.values():
        labels += [lab for lab, v in cells.items() if v[3] is not None and lab not in labels]
    lines = [
        "| " + " | ".join([*key_names, *labels]) + " |",
        "|" + "---|" * (len(key_names) + len(labels)),
    ]
    for key, cells in summary.items():
        values = [
            f"{cells[lab][3]:.3f}" if lab in cells and cells[lab][3] is not None else "-"
            for lab in labels
        ]
        lines.append("| " + " | ".join([*map(str, key), *values]) + " |")
    return "\n".join(lines)


def width_table(rows: list[dict[str, Any]], key_names: tuple[str, ...]) -> str:
    """Mean fused hidden widths per method (methods that keep the clients' widths show them)."""
    widths: dict[tuple, dict[str, list[list[int]]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        key = tuple(row["cell"][f] for f in key_names)
        for label, res in row["methods"].items():
            if res.get("widths"):
                widths[key][label].append(res["widths"])
    labels: list[str] = []
    for cells in widths.values():
        labels += [lab for lab in cells if lab not in labels]
    lines = [
        "| " + " | ".join([*key_names, *labels]) + " |",
        "|" + "---|" * (len(key_names) + len(labels)),
    ]
    for key, cells in widths.items():
        values = [
            ", ".join(str(round(float(w))) for w in np.mean(cells[lab], axis=0))
            if lab in cells
            else "-"
            for lab in labels
        ]
        lines.append("| " + " | ".join([*map(str, key), *values]) + " |")
    return "\n".join(lines)


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None (with a warning) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib missing: no plot")
        return None
    return plt


def log_axis(ax, xlabel: str, title: str) -> None:
    """A panel with a log x axis, accuracy on y, a title and a light grid."""
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3)


def plot_alpha(rows: list[dict[str, Any]], path: Path) -> bool:
    """Accuracy against the Dirichlet alpha, one line per method, one panel per data set."""
    plt = pyplot()
    if plt is None:
        return False
    dir_rows = [r for r in rows if r["cell"]["partition"].startswith("dir-")]
    summary = summarise(dir_rows, ("data", "partition"))
    datasets = sorted({k[0] for k in summary})
    fig, axes = plt.subplots(1, len(datasets), figsize=(6 * len(datasets), 4.5), squeeze=False)
    for ax, data in zip(axes[0], datasets, strict=True):
        keys = sorted((k for k in summary if k[0] == data), key=lambda k: float(k[1][4:]))
        alphas = [float(k[1][4:]) for k in keys]
        # ams-full has the ensemble's accuracy exactly (argmax of a logit sum = of a mean).
        labels = [lab for lab in summary[keys[0]] if lab != "ams-full"]
        for label in labels:
            means = [100 * summary[k][label][0] for k in keys]
            stds = [100 * summary[k][label][1] for k in keys]
            style = "--" if label in ("local (mean)", "ensemble") else "-"
            ax.errorbar(
                alphas, means, yerr=stds, marker="o", capsize=3, label=label, linestyle=style
            )
        log_axis(ax, "Dirichlet alpha (larger = closer to iid)", f"{data}, S = 10, 1 hidden layer")
        ax.set_xticks(alphas, [f"{a:g}" for a in alphas])
    axes[0][-1].legend(fontsize=7, loc="lower right")
    save_figure(fig, path)
    return True


def write_results_md(section: str, path: Path,
                     markers: tuple[str, str] = (BEGIN, END)) -> None:
    write_section(path, section, *markers)

# --------------------------------------------------------------------------------------
# Frontier: accuracy against the fused width
# --------------------------------------------------------------------------------------


def ratio_label(method: str, ratio: float | str) -> str:
    return f"{method}@{ratio:g}" if isinstance(ratio, float) else f"{method}@{ratio}"


def frontier_variants() -> dict[str, tuple[str, dict[str, Any]]]:
    """pfnm / nafi at every width ratio, pfnm at the default width with the NAFI paper's
    class shares, ot / avg (the clients' width, ratio 1), and the data-free baselines that
    keep every client (AMS under each confidence rule)."""
    out: dict[str, tuple[str, dict[str, Any]]] = {}
    for method in ("pfnm", "nafi"):
        for ratio in RATIOS:
            width = {"width_ratio": ratio} if isinstance(ratio, float) else {"width": ratio}
            out[ratio_label(method, ratio)] = (method, width)
    out["pfnm-counts@1.5"] = ("pfnm", {"class_weights": "counts"})  # the paper's shares
    out["ot@1"] = ("ot", {})
    out["avg@1"] = ("avg", {})
    out.update({label: ("ams", {"confidence": rule}) for label, rule in AMS_RULES.items()})
    out[DISTILL] = ("distill", {})  # its defaults: pfnm's default width, 1.5 x
    return out


def frontier_lambda_variants() -> dict[str, tuple[str, dict[str, Any]]]:
    """NAFI's lambda at width ratio 1.0 (lambda 0 is PFNM's cost)."""
    return {f"nafi-λ{lam:g}@1": ("nafi", {"lam": lam, "width_ratio": 1.0})
            for lam in FRONTIER_LAMBDAS}


def asked_width(label: str) -> int | None:
    """The hidden width a frontier variant asks for (None: inferred or a baseline)."""
    if "@" not in label or label.endswith("@unlimited"):
        return None
    return ratio_width(float(label.rsplit("@", 1)[1]), CLIENT_WIDTH)


def frontier_cells(datasets: list[str], partitions: list[str], clients: list[int],
                   seeds: int) -> list[Cell]:
    return [Cell(d, p, n, f"mlp:{CLIENT_WIDTH}", s)
            for d in datasets for p in partitions for n in clients for s in range(seeds)]


def frontier_checks(rows: list[dict[str, Any]]) -> list[str]:
    """The three targets, cell by cell (met or not, with the gap)."""
    summary = summarise(rows, ("data", "partition", "clients"))
    lines = []
    for key, cells in summary.items():
        name = f"{key[0]} {key[1]} S={key[2]}"
        bayes = max(cells[m][0] for m in ("pfnm@1", "nafi@1") if m in cells)
        rivals = max(cells[m][0] for m in ("ot@1", "avg@1") if m in cells)
        gap = 100 * (bayes - rivals)
        lines.append(f"- width ratio 1.0, {name}: best of pfnm/nafi - best of ot/avg = "
                     f"{gap:+.1f} points ({'met' if gap > 0 else 'NOT met'})")
    for key, cells in summary.items():
        fused = {m: v[0] for m, v in cells.items()
                 if (asked_width(m) or 10**9) <= 1.5 * CLIENT_WIDTH or m in ("ot@1", "avg@1")}
        if not fused or "ensemble-softmax" not in cells:
            continue
        best = max(fused, key=fused.get)
        gap = 100 * (cells["ensemble-softmax"][0] - fused[best])
        target = key[1] == "dir-0.5" and key[2] == 10
        verdict = (" (target: within 3 points: " + ("met" if gap <= 3 else "NOT met") + ")"
                   if target else "")
        lines.append(f"- ratio <= 1.5, {key[0]} {key[1]} S={key[2]}: softmax ensemble - best "
                     f"fused ({best}) = {gap:+.1f} points{verdict}")
    mismatches = [
        (row["cell"], label, res["widths"])
        for row in rows for label, res in row["methods"].items()
        if asked_width(label) is not None and "widths" in res
        and res["widths"] != [asked_width(label)]
    ]
    checked = sum(1 for row in rows for label, res in row["methods"].items()
                  if asked_width(label) is not None and "widths" in res)
    lines.append(f"- width asked = width delivered: {checked - len(mismatches)} of {checked} "
                 f"fused models ({'met' if not mismatches else 'NOT met: ' + str(mismatches)})")
    return lines


def distill_checks(rows: list[dict[str, Any]]) -> list[str]:
    """Issue 44's targets for distill at its default width, cell by cell: at least the
    softmax ensemble, within 5 points of AMS's class-share rule; its time and peak memory
    (the process's resident peak during the fusion) beside pfnm's."""
    lines = []
    for key, cells in summarise(rows, ("data", "partition", "clients")).items():
        if DISTILL not in cells or "ensemble-softmax" not in cells or "ams-class" not in cells:
            continue
        mine = cells[DISTILL][0]
        above = 100 * (mine - cells["ensemble-softmax"][0])
        below = 100 * (cells["ams-class"][0] - mine)
        cost = {label: _mean_cost(rows, key, label) for label in (DISTILL, "pfnm@1.5")}
        lines.append(
            f"- distill, {key[0]} {key[1]} S={key[2]}: distill - ensemble-softmax = {above:+.1f} "
            f"points ({'met' if above >= 0 else 'NOT met'}), ams-class - distill = {below:+.1f} "
            f"points ({'met' if below <= 5 else 'NOT met'}); "
            + ", ".join(f"{label} {t:.1f} s, {m:.0f} MB" for label, (t, m) in cost.items()))
    return lines


def _mean_cost(rows: list[dict[str, Any]], key: tuple, label: str) -> tuple[float, float]:
    """Mean time (s) and peak memory (MB) of one variant over a cell's seeds."""
    found = [row["methods"][label] for row in rows
             if tuple(row["cell"][f] for f in ("data", "partition", "clients")) == key
             and "time_s" in row["methods"].get(label, {})]
    memory = [r["peak_memory_mb"] for r in found if r.get("peak_memory_mb") is not None]
    return (float(np.mean([r["time_s"] for r in found])) if found else math.nan,
            float(np.mean(memory)) if memory else math.nan)


def noniid_section(rows: list[dict[str, Any]]) -> list[str]:
    """The "Non-iid floor" subsection: its table and its two targets, cell by cell (empty
    when the run has none of the non-iid cells)."""
    keys = ("data", "partition", "clients")
    summary = {k: v for k, v in summarise(rows, keys).items() if k[1] in NONIID}
    all_cells = summarise(rows, keys)
    if not summary:
        return []
    widths = mean_widths(rows, keys)
    contrast = mean_contrast(rows, keys)
    return ["", "### Non-iid floor", "",
            "Strongly non-iid cells, same runs as above; accuracy (%) mean ± std over seeds "
            "with the fused hidden width in brackets; class contrast = the PFNM report's "
            "`heterogeneity.class_contrast` (1: balanced clients, 0: one class each) and how "
            "many seeds its `compact_ok` flag was false (clients too different for a compact "
            "model):", "",
            noniid_table(summary, widths, contrast), "",
            "Targets, cell by cell (mean over seeds):", "",
            *floor_checks(summary), *ams_checks(all_cells)]


NONIID_COLUMNS = ("ensemble-softmax", *AMS_RULES, DISTILL, *DEFAULT_RATIO_LABELS, "pfnm-counts@1.5",
                  "pfnm@1", "nafi@1", "avg@1", "ot@1")


def noniid_table(summary: dict[tuple, dict], widths: dict[tuple, dict[str, float]],
                 contrast: dict[tuple, tuple[float, int, int]]) -> str:
    lines = ["| data | partition | S | class contrast (not ok) | " + " | ".join(NONIID_COLUMNS)
             + " |", "|" + "---|" * (4 + len(NONIID_COLUMNS))]
    for key, cells in sorted(summary.items()):
        value, flagged, seeds = contrast.get(key, (math.nan, 0, 0))
        entries = []
        for label in NONIID_COLUMNS:
            mean, std = cells.get(label, (math.nan, math.nan))[:2]
            width = widths.get(key, {}).get(label)
            entries.append(f"{100 * mean:.1f} ± {100 * std:.1f}"
                           + (f" ({width:.0f})" if width else ""))
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {value:.2f} ({flagged}/{seeds}) | "
                     + " | ".join(entries) + " |")
    return "\n".join(lines)


def floor_checks(summary: dict[tuple, dict]) -> list[str]:
    """pfnm and nafi at the default width against the better of avg and ot."""
    lines = []
    for key, cells in sorted(summary.items()):
        rival = max(("avg@1", "ot@1"), key=lambda m: cells.get(m, (-1.0,))[0])
        for label in DEFAULT_RATIO_LABELS:
            if label not in cells or rival not in cells:
                continue
            gap = 100 * (cells[label][0] - cells[rival][0])
            lines.append(f"- floor, {key[0]} {key[1]} S={key[2]}: {label} - {rival} = "
                         f"{gap:+.1f} points ({'met' if gap >= 0 else 'NOT met'})")
    return lines


def ams_checks(summary: dict[tuple, dict]) -> list[str]:
    """AMS's default rule with class counts (ams-class) against the softmax ensemble, in
    every cell of the run."""
    lines = []
    for key, cells in sorted(summary.items()):
        if "ams-class" not in cells or "ensemble-softmax" not in cells:
            continue
        gap = 100 * (cells["ams-class"][0] - cells["ensemble-softmax"][0])
        lines.append(f"- AMS, {key[0]} {key[1]} S={key[2]}: ams-class - ensemble-softmax = "
                     f"{gap:+.1f} points ({'met' if gap >= 0 else 'NOT met'})")
    return lines


def mean_widths(rows: list[dict[str, Any]], keys: tuple[str, ...]) -> dict[tuple, dict]:
    """(cell fields) -> label -> mean delivered width of the first hidden layer."""
    found: dict[tuple, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        key = tuple(row["cell"][f] for f in keys)
        for label, res in row["methods"].items():
            if res.get("widths"):
                found[key][label].append(res["widths"][0])
    return {k: {lab: float(np.mean(v)) for lab, v in cells.items()} for k, cells in found.items()}


def mean_contrast(rows: list[dict[str, Any]], keys: tuple[str, ...]
                  ) -> dict[tuple, tuple[float, int, int]]:
    """(cell fields) -> (mean class contrast, seeds flagged not compact_ok, seeds), from
    the default pfnm's report."""
    found: dict[tuple, list[tuple[float, bool]]] = defaultdict(list)
    for row in rows:
        res = row["methods"].get(DEFAULT_RATIO_LABELS[0], {})
        if res.get("class_contrast") is not None:
            found[tuple(row["cell"][f] for f in keys)].append(
                (res["class_contrast"], res["compact_ok"]))
    return {k: (float(np.mean([c for c, _ in v])), sum(not ok for _, ok in v), len(v))
            for k, v in found.items()}


def plot_frontier(rows: list[dict[str, Any]], path: Path) -> bool:
    """Accuracy against the fused width, one panel per (data, partition), at the smallest S."""
    plt = pyplot()
    if plt is None:
        return False
    fewest = min(r["cell"]["clients"] for r in rows)
    rows = [r for r in rows if r["cell"]["clients"] == fewest]
    summary = summarise(rows, ("data", "partition"))
    widths = mean_widths(rows, ("data", "partition"))
    keys = sorted(summary)
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 4), squeeze=False)
    for ax, key in zip(axes[0], keys, strict=True):
        cells = summary[key]
        for method, marker in (("pfnm", "o"), ("nafi", "s")):
            labels = [ratio_label(method, r) for r in RATIOS if ratio_label(method, r) in cells]
            xs = [widths[key][lab] for lab in labels]
            ax.errorbar(xs, [100 * cells[lab][0] for lab in labels],
                        yerr=[100 * cells[lab][1] for lab in labels], marker=marker,
                        capsize=3, label=method)
        for label, marker in (("ot@1", "^"), ("avg@1", "v")):
            if label in cells:
                ax.errorbar([CLIENT_WIDTH], [100 * cells[label][0]],
                            yerr=[100 * cells[label][1]], marker=marker, capsize=3,
                            linestyle="none", label=label.split("@")[0])
        for label, style in (("ensemble-softmax", "--"), ("ensemble", ":"), ("ams-prob", "-."),
                             ("local (mean)", (0, (1, 3)))):
            if label in cells:
                ax.axhline(100 * cells[label][0], linestyle=style, color="grey", label=label)
        log_axis(ax, "fused hidden width (clients: 100)", f"{key[0]} {key[1]}, S = {fewest}")
    axes[0][-1].legend(fontsize=7, loc="lower right")
    save_figure(fig, path)
    return True


def run_frontier(args: argparse.Namespace) -> int:
    names = args.data or ["digits"]
    datasets = {name: load(name, args.data_dir, args.data_path) for name in names}
    seeds = args.seeds or 3
    cells = frontier_cells(names, args.partitions, args.clients, seeds)
    lam_cells = [] if args.calibrate else [
        c for c in cells if c.data == names[0] and c.partition == "dir-0.5" and c.clients == 10]
    start = time.perf_counter()
    rows: dict[str, list[dict[str, Any]]] = {"frontier": [], "lambda": []}
    with tempfile.TemporaryDirectory(prefix="fusekit-frontier-") as tmp:
        runner = Runner(datasets, args.device, Path(tmp), calibrate=args.calibrate)
        for index, cell in enumerate(cells):
            rows["frontier"].append(runner.row(cell, frontier_variants()))
            log.info("[%d/%d] %s  %.0fs", index + 1, len(cells), cell,
                     time.perf_counter() - start)
        rows["lambda"] = [runner.row(c, frontier_lambda_variants()) for c in lam_cells]
    payload = {"machine": machine(), "seeds": seeds, "epochs": EPOCHS, "frontier": True,
               "calibrate": args.calibrate,
               "elapsed_s": time.perf_counter() - start, "studies": rows,
               "grid": {"data": names, "partitions": args.partitions, "clients": args.clients}}
    kind = "frontier-calibration" if args.calibrate else "frontier"
    out = args.json_out.with_name(f"{kind}-{'-'.join(names)}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, json.dumps(payload, indent=1).encode())
    return publish_frontier(payload, args)


def publish_frontier(payload: dict[str, Any], args: argparse.Namespace) -> int:
    rows = payload["studies"]
    tag = "-".join(payload["grid"]["data"])
    if payload.get("calibrate"):
        section = render_calibration(rows["frontier"], payload, args.note)
        print(section)
        if not args.no_write:
            write_results_md(section, args.results_md, (
                f"<!-- frontier-calibration-{tag}:begin -->",
                f"<!-- frontier-calibration-{tag}:end -->"))
        return 0
    plot = args.plot.with_name(f"frontier-{tag}.png")
    plotted = plot_frontier(rows["frontier"], plot)
    section = render_frontier(rows, payload, plot if plotted else None, args.note)
    print(section)
    if not args.no_write:
        markers = (f"<!-- fusion-frontier-{tag}:begin -->", f"<!-- fusion-frontier-{tag}:end -->")
        write_results_md(section, args.results_md, markers)
    return 0


def render_frontier(rows: dict[str, list], payload: dict[str, Any], plot: Path | None,
                    note: str) -> str:
    m = payload["machine"]
    grid = payload["grid"]
    keys = ("data", "partition", "clients")
    summary = summarise(rows["frontier"], keys)
    parts = [
        f"## Accuracy against fused width ({', '.join(grid['data'])})",
        "",
        f"`python benchmarks/bench_quality.py --frontier --data {' '.join(grid['data'])} "
        f"--partitions {' '.join(grid['partitions'])} --clients "
        f"{' '.join(map(str, grid['clients']))} --seeds {payload['seeds']}` — test accuracy (%) "
        f"mean ± std over {payload['seeds']} seeds; clients: one hidden layer of "
        f"{CLIENT_WIDTH}, independent initialisations, Adam as in the quality study. A label "
        "`method@r` is the method at fused width r x the widest client (`@1.25` = 125 "
        "neurons, `@unlimited` = the width the posterior infers; ot and avg keep the "
        "clients' 100); pfnm-counts@1.5 = pfnm at the default width with the NAFI paper's "
        "class shares N_sk instead of N_sk (1 - N_sk / N_s). ensemble-softmax / ensemble = "
        "mean of the clients' probabilities / logits; ams-class = AMS's class-share mixture "
        "(its default with class counts), ams-logit = AMS-top1 by max logit (the paper's), "
        "ams-prob = AMS-top1 by max softmax probability; these keep all S client models "
        "(S x 100 hidden neurons); distill@1.5 = distill's defaults (pfnm at 1.5x taught "
        "ams-class on synthetic inputs, no data). Partitions: dir-α = Dirichlet(α) class shares; labels = "
        "3-6 classes per client; labels-1-3 = 1-3 classes per client. "
        f"{m['platform']}, torch {m['torch']}, {m['core']}; total {payload['elapsed_s']:.0f} s."
        + (f" {note}" if note else ""),
        "",
        markdown_table(summary, ("data", "partition", "S")),
        "",
        "Fused hidden widths delivered (mean over seeds; `@unlimited` rows show what the "
        "posterior infers, the other rows the width asked):",
        "",
        width_table(rows["frontier"], keys),
        "",
        "Targets, cell by cell:",
        "",
        *frontier_checks(rows["frontier"]),
        *distill_checks(rows["frontier"]),
        *noniid_section(rows["frontier"]),
    ]
    if plot is not None:
        parts += ["", f"![accuracy against fused width](results/{plot.name})"]
    if rows.get("lambda"):
        parts += [
            "",
            "NAFI's λ at width ratio 1.0 (fused width 100; λ 0 = PFNM's cost), "
            f"{rows['lambda'][0]['cell']['data']} dir-0.5 S = 10; second table: the width the "
            "posterior infers before the width is imposed (λ changes the assignments):",
            "",
            markdown_table(summarise(rows["lambda"], ("partition",)), ("partition",)),
            "",
            inferred_table(rows["lambda"]),
        ]
    return "\n".join(parts) + "\n"


#: Calibration on the frontier (issue 32): no cell may lose more than this (accuracy, 0-1).
CALIBRATION_FLOOR = 0.005


def calibration_pairs(rows: list[dict[str, Any]]) -> dict[tuple, dict[str, dict[str, list]]]:
    """(data, partition, S) -> fused column -> per seed, uncalibrated and calibrated accuracy
    and the delivered widths (seeds where both were measured)."""
    found: dict[tuple, dict[str, dict[str, list]]] = defaultdict(
        lambda: defaultdict(lambda: defaultdict(list)))
    for row in rows:
        key = tuple(row["cell"][f] for f in ("data", "partition", "clients"))
        for label, res in row["methods"].items():
            if "calibrated" in res:
                pair = found[key][label]
                pair["uncalibrated"].append(res["accuracy"])
                pair["calibrated"].append(res["calibrated"])
                pair["widths"].append(res["widths"][0])
                pair["seconds"].append(res["calibration_s"])
    return found


def calibration_table(rows: list[dict[str, Any]], pairs: dict) -> str:
    """Peers and, per fused column, uncalibrated -> calibrated (change), mean over seeds."""
    peers = summarise(rows, ("data", "partition", "clients"))
    labels: list[str] = []
    for cells in pairs.values():
        labels += [lab for lab in cells if lab not in labels]
    heads = [f"{lab} ({asked_width(lab)})" if asked_width(lab) else lab for lab in labels]
    peer_labels = ("local (mean)", "ensemble-softmax", "ensemble")
    lines = ["| data | partition | S | " + " | ".join([*peer_labels, *heads]) + " |",
             "|" + "---|" * (3 + len(peer_labels) + len(labels))]
    for key, cells in pairs.items():
        entries = [f"{100 * peers[key][lab][0]:.1f}" for lab in peer_labels]
        for lab in labels:
            pair = cells.get(lab)
            if pair is None:
                entries.append("-")
                continue
            before, after = np.mean(pair["uncalibrated"]), np.mean(pair["calibrated"])
            width = "" if asked_width(lab) else f" [{np.mean(pair['widths']):.0f}]"
            entries.append(f"{100 * before:.1f} → {100 * after:.1f} "
                           f"({100 * (after - before):+.1f}){width}")
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | " + " | ".join(entries) + " |")
    return "\n".join(lines)


def calibration_checks(pairs: dict) -> list[str]:
    """Issue 32's frontier targets: no cell (data, partition, S, fused column; mean over
    seeds) more than 0.5 point lower after calibration, and the mean over cells higher."""
    changes = {(*key, lab): (np.mean(p["calibrated"]) - np.mean(p["uncalibrated"]),
                             np.subtract(p["calibrated"], p["uncalibrated"]))
               for key, cells in pairs.items() for lab, p in cells.items()}
    if not changes:
        return ["- no calibrated fused model in this run"]
    lower = {cell: v for cell, v in changes.items() if v[0] < -CALIBRATION_FLOOR}
    worst = min(changes, key=lambda c: changes[c][0])
    befores = [np.mean(p["uncalibrated"]) for cells in pairs.values() for p in cells.values()]
    afters = [np.mean(p["calibrated"]) for cells in pairs.values() for p in cells.values()]
    gain = 100 * (np.mean(afters) - np.mean(befores))
    seeds = np.concatenate([v[1] for v in changes.values()])
    lines = [
        f"- never more than 0.5 point lower in any cell: {len(changes) - len(lower)} of "
        f"{len(changes)} cells ({'met' if not lower else 'NOT met'}); the smallest change "
        f"{100 * changes[worst][0]:+.1f} points ({' '.join(map(str, worst))})",
        *[f"  - NOT met: {' '.join(map(str, cell))}: {100 * mean:+.1f} points (per seed "
          f"{', '.join(f'{100 * d:+.1f}' for d in per_seed)})"
          for cell, (mean, per_seed) in sorted(lower.items(), key=lambda kv: kv[1][0])],
        f"- the mean over cells rises: {100 * np.mean(befores):.2f} → {100 * np.mean(afters):.2f} "
        f"% ({gain:+.2f} points; {'met' if gain > 0 else 'NOT met'})",
        f"- single seeds (not a target): {int(np.sum(seeds < -CALIBRATION_FLOOR))} of "
        f"{seeds.size} calibrated models more than 0.5 point under their uncalibrated model, "
        f"{int(np.sum(seeds > CALIBRATION_FLOOR))} more than 0.5 point above",
    ]
    return lines


def calibration_by_column(pairs: dict) -> str:
    """Per fused column: the mean change over cells, the worst cell, cells below -0.5."""
    columns: dict[str, list[tuple[float, tuple]]] = defaultdict(list)
    for key, cells in pairs.items():
        for lab, p in cells.items():
            columns[lab].append((np.mean(p["calibrated"]) - np.mean(p["uncalibrated"]), key))
    lines = ["| fused column | mean change | worst cell | cells more than 0.5 lower | "
             "calibration s (mean) |", "|---|---|---|---|---|"]
    for lab, found in columns.items():
        worst = min(found, key=lambda c: c[0])
        seconds = np.mean([s for cells in pairs.values() if lab in cells
                           for s in cells[lab]["seconds"]])
        lines.append(f"| {lab} | {100 * np.mean([c for c, _ in found]):+.2f} | "
                     f"{100 * worst[0]:+.1f} ({' '.join(map(str, worst[1]))}) | "
                     f"{sum(c < -CALIBRATION_FLOOR for c, _ in found)} of {len(found)} | "
                     f"{seconds:.2f} |")
    return "\n".join(lines)


def render_calibration(rows: list[dict[str, Any]], payload: dict[str, Any], note: str) -> str:
    """The frontier's fused models before and after calibration, and issue 32's targets."""
    m = payload["machine"]
    grid = payload["grid"]
    pairs = calibration_pairs(rows)
    return "\n".join([
        f"### On the frontier benchmark ({', '.join(grid['data'])})",
        "",
        f"`python benchmarks/bench_quality.py --frontier --calibrate --data "
        f"{' '.join(grid['data'])} --partitions {' '.join(grid['partitions'])} --clients "
        f"{' '.join(map(str, grid['clients']))} --seeds {payload['seeds']}`: the frontier's "
        "clients (one hidden layer of 100, independent initialisations) and fused models, "
        "each fused model also calibrated layer by layer "
        "(`fusekit.toolkit.local.calibrate_locally`: REPAIR, its targets each client's "
        "statistics of its own model on its own training split, paired with the same "
        "client's statistics of the fused model; ALGORITHMS §12). Test accuracy (%), mean over "
        f"{payload['seeds']} seeds: uncalibrated → calibrated (change); fused widths in "
        "brackets in the header (`@unlimited`: the mean inferred width in the entry); peers "
        "in the same run: the mean client, the softmax and logit ensembles, avg@1 and ot@1. "
        "A cell is (data, partition, S, fused column). "
        f"{m['platform']}, torch {m['torch']}, {m['core']}; total {payload['elapsed_s']:.0f} s."
        + (f" {note}" if note else ""),
        "",
        calibration_table(rows, pairs),
        "",
        "Per fused column, over the cells above:",
        "",
        calibration_by_column(pairs),
        "",
        "Targets (issue 32, MLPs without BatchNorm), cell by cell:",
        "",
        *calibration_checks(pairs),
    ]) + "\n"


def inferred_table(rows: list[dict[str, Any]]) -> str:
    """Mean inferred width per variant (before the asked width is imposed)."""
    inferred: dict[str, list[int]] = defaultdict(list)
    for row in rows:
        for label, res in row["methods"].items():
            if res.get("inferred"):
                inferred[label].append(res["inferred"][0])
    labels = list(inferred)
    return "\n".join([
        "| " + " | ".join(["inferred width", *labels]) + " |",
        "|" + "---|" * (len(labels) + 1),
        "| mean | " + " | ".join(f"{np.mean(inferred[lab]):.0f}" for lab in labels) + " |",
    ])



def machine() -> dict[str, Any]:
    cuda = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return machine_info(torch=torch.__version__, torch_threads=torch.get_num_threads(),
                        cuda=cuda)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller grid, 2 seeds")
    parser.add_argument(
        "--full",
        action="store_true",
        help="also the full factorial data x partition x S x depth (slow)",
    )
    parser.add_argument("--seeds", type=int, default=None, help="seeds per cell [3; quick 2]")
    parser.add_argument("--data-dir", type=Path, default=None, help="folder with MNIST files")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--plot", type=Path, default=HERE / "results" / "quality_alpha.png")
    add_output_arguments(parser, HERE / "results" / "quality.json", "the tables and plot")
    parser.add_argument("--frontier", action="store_true",
                        help="run only the accuracy-against-width study")
    parser.add_argument("--data", nargs="+", choices=("digits", "digits28", "synthetic", "npz", "mnist"),
                        help="frontier: data sets [digits]")
    parser.add_argument("--data-path", type=Path, default=None,
                        help="frontier: the MNIST-format .npz for --data npz")
    parser.add_argument("--partitions", nargs="+", default=list(ALL_PARTITIONS),
                        choices=list(ALL_PARTITIONS), help="frontier: partitions [all]")
    parser.add_argument("--clients", nargs="+", type=int, default=[10, 20],
                        help="frontier: numbers of clients [10 20]")
    parser.add_argument("--calibrate", action="store_true",
                        help="frontier: also calibrate every fused model (layer by layer, "
                        "REPAIR with the clients' statistics of their own models) and report "
                        "the change per cell instead of the width study (no λ study)")
    parser.add_argument("--note", default="", help="frontier: a sentence added to RESULTS.md "
                        "(for instance the machine's load)")
    args = parser.parse_args(argv)
    if args.from_json is not None:
        payload = json.loads(args.from_json.read_text())
        if payload.get("frontier"):
            return publish_frontier(payload, args)
        args.quick = payload["quick"]
        return publish(payload, args)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    logging.getLogger("fusekit").setLevel(logging.WARNING)  # per-layer progress lines
    if args.frontier:
        return run_frontier(args)
    seeds = args.seeds or (2 if args.quick else 3)

    datasets = {"digits": load("digits", None), "synthetic": load("synthetic", None)}
    have_mnist = False
    if args.data_dir is not None:
        try:
            datasets["mnist"] = load("mnist", args.data_dir)
            have_mnist = True
        except DataError as exc:
            log.warning("MNIST study skipped: %s", exc)
    methods = variants()
    log.info("methods: %s", ", ".join(methods))
    studies = grid(args.quick, args.full, seeds, have_mnist)
    start = time.perf_counter()
    rows: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="fusekit-quality-") as tmp:
        runner = Runner(datasets, args.device, Path(tmp))
        total = len({c for cells in studies.values() for c in cells})
        for name, cells in studies.items():
            rows[name] = []
            for cell in cells:
                rows[name].append(runner.row(cell, methods_for(cell, methods)))
                log.info(
                    "[%d/%d] %s  %.0fs",
                    len(runner.clients),
                    total,
                    cell,
                    time.perf_counter() - start,
                )
        if "nafi" in METHODS:
            lam_cells = [
                c
                for c in studies["main"]
                if c.data == "digits" and c.partition in ("dir-0.1", "dir-0.5", "labels")
            ]
            rows["lambda"] = [runner.row(c, lambda_variants()) for c in lam_cells]
    elapsed = time.perf_counter() - start

    payload = {
        "machine": machine(),
        "seeds": seeds,
        "quick": args.quick,
        "epochs": EPOCHS,
        "full": args.full,
        "elapsed_s": elapsed,
        "studies": rows,
    }
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(args.json_out, json.dumps(payload, indent=1).encode())
    return publish(payload, args)


def publish(payload: dict[str, Any], args: argparse.Namespace) -> int:
    """Plot, print the markdown section, and write it into RESULTS.md."""
    rows = payload["studies"]
    plotted = plot_alpha(rows["main"], args.plot)
    section = render(rows, payload, args, plotted)
    print(section)
    if not args.no_write:
        write_results_md(section, args.results_md)
    return 0


def summary_section(title: str, rows: list, keys: tuple[str, ...],
                    headers: tuple[str, ...] | None = None) -> list[str]:
    """A ``### title`` section: the mean ± std table of ``rows`` grouped by ``keys`` (its
    columns headed ``headers``, default the keys)."""
    return ["", f"### {title}", "", markdown_table(summarise(rows, keys), headers or keys)]


def render(
    rows: dict[str, list], payload: dict[str, Any], args: argparse.Namespace, plotted: bool
) -> str:
    m = payload["machine"]
    epochs = ", ".join(f"{k} {v}" for k, v in payload["epochs"].items())
    parts = [
        "## Fusion quality",
        "",
        f"`python benchmarks/bench_quality.py{' --quick' if args.quick else ''}` — test accuracy "
        f"(%) mean ± std over {payload['seeds']} seeds; every client trains an MLP with Adam "
        f"(lr {LR:g}, batch 32; epochs: {epochs}), independent initialisations unless "
        "noted. Local (mean) = average test accuracy of the client models; ensemble = logit "
        "average of all client models. Methods run with their default parameters; avg-cw = "
        "class-weighted output layer; ams-full = AMS summing every model's logits (always "
        "the ensemble's accuracy; left out of the plot). "
        f"{m['platform']}, torch {m['torch']}, {m['core']}; total {payload['elapsed_s']:.0f} s.",
        "",
        "### Heterogeneity (S = 10 clients, 1 hidden layer of 100)",
        "",
        markdown_table(summarise(rows["main"], ("data", "partition")), ("data", "partition")),
    ]
    parts += [
        "",
        "Fused hidden widths (mean over seeds; clients have 100):",
        "",
        width_table(rows["main"], ("data", "partition")),
    ]
    if plotted:
        parts += ["", f"![accuracy against alpha](results/{args.plot.name})"]
    parts += [
        "",
        "### Number of clients (digits, hetero-dir alpha = 0.5)",
        "",
        markdown_table(summarise(rows["clients"], ("clients",)), ("S",)),
        "",
        "Fusion time (s, mean over seeds):",
        "",
        time_table(summarise(rows["clients"], ("clients",)), ("S",)),
        *summary_section("Depth (digits, S = 10)", rows["depth"], ("partition", "arch")),
        *summary_section("PANs (digits, hetero-dir alpha = 0.5, S = 10, shared initial model)",
                         rows["pans"], ("pan",), ("PANs",)),
    ]
    checks = paper_checks(rows)
    if checks:
        parts += ["", "### Against the papers (computed from the tables above)", "", *checks]
    if "lambda" in rows:
        parts += summary_section("NAFI's λ (digits, S = 10, 1 hidden layer; pfnm = λ 0)",
                                 rows["lambda"], ("partition",))
    if "full" in rows:
        parts += summary_section("Full grid", rows["full"],
                                 ("data", "partition", "clients", "arch"))
    if "mnist" in rows:
        parts += summary_section("MNIST (S = 10, 1 hidden layer)", rows["mnist"], ("partition",))
    return "\n".join(parts) + "\n"


if __name__ == "__main__":
    sys.exit(main())
