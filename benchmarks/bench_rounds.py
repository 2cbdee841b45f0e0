"""Federated rounds: test accuracy against round for FedAvg, FedAvg + PANs, FedNLR and Fed².

Digits, S = 10 clients, hetero-dir alpha in {0.1, 0.5}, every client every round, one
shared initial model per seed (``fusekit.toolkit.rounds``). All four train the same MLP
64-100-100-10 with the same local SGD (lr 0.1, no momentum as in the FedNLR paper's
experiments, batch 32, E local epochs)
and differ only in what their paper changes:

  fedavg   plain clients, avg (sample-weighted FedAvg)
  pans     position-aware neurons (multiplicative, A = 0.1, T = 1), avg
  fednlr   neuron-wise learning rates (mu0 = 2, c1 = 1, c2 = 0.5), avg
  fed2     Fed² structure (G = 10 groups, one class each; last hidden layer and logit layer
           decoupled), fed2 (feature-paired averaging)

Each cell: mean ± std over seeds of the global model's test accuracy after each round, the
client drift (mean ||θ_s − θ̄|| / ||θ̄|| of the round's local models) and the share of
hidden neurons that local training dislocated (matched to another neuron of the round's
starting model; ``fusekit.toolkit.rounds.neuron_dislocation``).

    python benchmarks/bench_rounds.py               # 20 rounds, 3 seeds, E = 2
    python benchmarks/bench_rounds.py --quick       # 5 rounds, 2 seeds
Writes benchmarks/results/rounds.json, benchmarks/results/rounds.png and the "Federated
rounds" section of benchmarks/RESULTS.md (between marker comments).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from bench_support import add_output_arguments, machine_info, save_figure, write_json, write_section

from fusekit.toolkit.data import load_dataset
from fusekit.toolkit.rounds import RoundsConfig, run_rounds
from fusekit.toolkit.simulate import SimulationConfig
from fusekit.toolkit.train import FedNLRConfig, TrainConfig

HERE = Path(__file__).resolve().parent
BEGIN, END = "<!-- rounds:begin -->", "<!-- rounds:end -->"
ARCH = "mlp:100,100"
PAN = {"mode": "multiplicative", "amplitude": 0.1, "period": 1.0}
FED2 = {"groups": 10, "depth": 2}
METHODS = ("fedavg", "pans", "fednlr", "fed2")
ALPHAS = (0.1, 0.5)

log = logging.getLogger("bench_rounds")


def rounds_config(method: str, alpha: float, seed: int, args: argparse.Namespace) -> RoundsConfig:
    """The configuration of one run; only the method's own change differs between methods."""
    train = TrainConfig(epochs=args.epochs, batch_size=32, lr=args.lr, optimizer="sgd",
                        momentum=args.momentum)
    sim = SimulationConfig(clients=10, partition="dirichlet", alpha=alpha, arch=ARCH,
                           shared_init=True, train=train, seed=seed)
    fusion = "avg"
    if method == "pans":
        sim = replace(sim, pan=PAN)
    elif method == "fednlr":
        sim = replace(sim, train=replace(train, fednlr=FedNLRConfig()))
    elif method == "fed2":
        sim, fusion = replace(sim, fed2=FED2), "fed2"
    return RoundsConfig(rounds=args.rounds, method=fusion, simulation=sim)


def run_grid(args: argparse.Namespace) -> dict[str, Any]:
    data = load_dataset("digits")
    runs = []
    start = time.perf_counter()
    for alpha in ALPHAS:
        for seed in range(args.seeds):
            for method in METHODS:
                config = rounds_config(method, alpha, seed, args)
                begin = time.perf_counter()
                result = run_rounds(data, config, device=args.device)
                runs.append({
                    "method": method, "alpha": alpha, "seed": seed,
                    "accuracy": [r.accuracy for r in result.rounds],
                    "drift": [r.drift for r in result.rounds],
                    "dislocated": [r.dislocated for r in result.rounds],
                    "train_loss": [r.train_loss for r in result.rounds],
                    "widths": result.rounds[-1].widths,
                    "time_s": time.perf_counter() - begin,
                })
                log.info("alpha %g seed %d %-7s final %.4f (%.1fs)", alpha, seed, method,
                         runs[-1]["accuracy"][-1], runs[-1]["time_s"])
    return {
        "machine": machine_info(torch=torch.__version__, torch_threads=torch.get_num_threads(),
                                load_average=list(os.getloadavg())),
        "settings": {"rounds": args.rounds, "seeds": args.seeds, "epochs": args.epochs,
                     "arch": ARCH, "clients": 10, "pan": PAN, "fed2": FED2,
                     "fednlr": asdict(FedNLRConfig()), "device": args.device,
                     "train": asdict(rounds_config("fedavg", 0.1, 0, args).simulation.train)},
        "total_time_s": time.perf_counter() - start,
        "runs": runs,
    }


# Keys of files written before a rename, still read by --from-json.
_FORMER_KEYS = {"dislocated": "misaligned"}


def curves(payload: dict[str, Any], key: str) -> dict[tuple[float, str], np.ndarray]:
    """(alpha, method) -> (seeds, rounds) array of ``key``."""
    out: dict[tuple[float, str], list] = {}
    for run in payload["runs"]:
        value = run[key] if key in run else run[_FORMER_KEYS[key]]
        out.setdefault((run["alpha"], run["method"]), []).append(value)
    return {k: np.array(v) for k, v in out.items()}


def plot(payload: dict[str, Any], path: Path) -> bool:
    """Accuracy (top) and drift (bottom) against round, one panel per alpha."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib missing: no plot")
        return False
    accuracy, drift = curves(payload, "accuracy"), curves(payload, "drift")
    fig, axes = plt.subplots(2, len(ALPHAS), figsize=(6 * len(ALPHAS), 8), squeeze=False)
    for column, alpha in enumerate(ALPHAS):
        for method in METHODS:
            for row, (table, scale) in enumerate(((accuracy, 100.0), (drift, 1.0))):
                values = scale * table[(alpha, method)]
                rounds = np.arange(1, values.shape[1] + 1)
                mean, std = values.mean(axis=0), values.std(axis=0)
                ax = axes[row][column]
                ax.plot(rounds, mean, marker="o", markersize=3, label=method)
                ax.fill_between(rounds, mean - std, mean + std, alpha=0.2)
        axes[0][column].set_title(f"digits, Dirichlet alpha = {alpha:g}, S = 10")
        axes[0][column].set_ylabel("global test accuracy (%)")
        axes[1][column].set_ylabel("client drift ||θ_s − θ̄|| / ||θ̄||")
        for ax in axes[:, column]:
            ax.set_xlabel("round")
            ax.grid(alpha=0.3)
    axes[0][-1].legend(loc="lower right")
    save_figure(fig, path, dpi=110)
    return True


def render(payload: dict[str, Any], plotted: bool, plot_path: Path) -> str:
    s = payload["settings"]
    accuracy, drift = curves(payload, "accuracy"), curves(payload, "drift")
    dislocated = curves(payload, "dislocated")
    show = sorted({1, 2, 5, 10, s["rounds"]} & set(range(1, s["rounds"] + 1)))
    head = "| alpha | method | " + " | ".join(f"round {r}" for r in show)
    lines = [
        f"{s['rounds']} rounds on digits, S = {s['clients']} (every client every round), "
        f"MLP 64-100-100-10 (fused width 100, 100 for every method), shared initial model, "
        f"local SGD lr {s['train']['lr']}, momentum {s['train']['momentum']}, batch "
        f"{s['train']['batch_size']}, E = {s['epochs']} local epochs; {s['seeds']} seeds "
        f"(0..{s['seeds'] - 1}); mean ± std of the global model's test accuracy (%, 450 test "
        f"images). Device {s['device']}; whole grid {payload['total_time_s']:.0f} s; load "
        f"average at the end {payload['machine']['load_average'][0]:.1f} on "
        f"{payload['machine']['cpus']} cores shared with other jobs. Run: `python "
        f"benchmarks/bench_rounds.py --rounds {s['rounds']} --seeds {s['seeds']} --epochs "
        f"{s['epochs']} --lr {s['train']['lr']} --momentum {s['train']['momentum']}`.",
        "",
        head + " | mean over rounds | drift (mean) | dislocated neurons (mean) |",
        "|---|---|" + "---|" * (len(show) + 3),
    ]
    for alpha in ALPHAS:
        for method in METHODS:
            acc, dr = 100 * accuracy[(alpha, method)], drift[(alpha, method)]
            cells = [f"{acc[:, r - 1].mean():.1f} ± {acc[:, r - 1].std():.1f}" for r in show]
            area = acc.mean(axis=1)
            lines.append(f"| {alpha:g} | {method} | " + " | ".join(cells)
                         + f" | {area.mean():.1f} ± {area.std():.1f} | {dr.mean():.4f} | "
                         f"{100 * dislocated[(alpha, method)].mean():.2f} % |")
    lines += ["", "Measured direction of effect (final round and mean over rounds, points; "
              "paired by seed):", ""]
    for alpha in ALPHAS:
        base = 100 * accuracy[(alpha, "fedavg")]
        for method in METHODS[1:]:
            other = 100 * accuracy[(alpha, method)]
            final, area = other[:, -1] - base[:, -1], other.mean(1) - base.mean(1)
            wins = int((final > 0).sum())
            ratio = drift[(alpha, method)].mean() / drift[(alpha, "fedavg")].mean()
            lines.append(
                f"- alpha {alpha:g}, {method} − fedavg: final {final.mean():+.1f} ± "
                f"{final.std():.1f} (better in {wins}/{len(final)} seeds), mean over rounds "
                f"{area.mean():+.1f} ± {area.std():.1f}; drift × {ratio:.2f}")
    if plotted:
        lines += ["", f"![accuracy and drift against round](results/{plot_path.name})"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="5 rounds, 2 seeds")
    parser.add_argument("--rounds", type=int, default=None, help="rounds R [20; quick 5]")
    parser.add_argument("--seeds", type=int, default=None, help="seeds [3; quick 2]")
    parser.add_argument("--epochs", type=int, default=2, help="local epochs E [2]")
    parser.add_argument("--lr", type=float, default=0.1, help="local SGD learning rate [0.1]")
    parser.add_argument("--momentum", type=float, default=0.0,
                        help="local SGD momentum [0, as in the FedNLR paper]")
    parser.add_argument("--device", default="cpu", help="auto, cpu or cuda [cpu]")
    parser.add_argument("--plot", type=Path, default=HERE / "results" / "rounds.png")
    add_output_arguments(parser, HERE / "results" / "rounds.json", "the table and plot")
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (5 if args.quick else 20)
    args.seeds = args.seeds or (2 if args.quick else 3)
    if args.rounds < 1 or args.seeds < 1 or args.epochs < 1:
        print("error: --rounds, --seeds and --epochs: expected >= 1", file=sys.stderr)
        return 2
    if args.from_json is not None:
        payload = json.loads(args.from_json.read_text())
    else:
        payload = run_grid(args)
        write_json(args.json_out, payload)
    plotted = plot(payload, args.plot)
    section = "## Federated rounds\n\n" + render(payload, plotted, args.plot)
    print(section)
    if not args.no_write:
        write_section(args.results_md, section, BEGIN, END)
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sys.exit(main())
