"""Run the app on a Flower deployment on this machine and compare fusion methods.

Starts one SuperLink and three SuperNodes on 127.0.0.1 (``fusekit.flower.local``), runs the
federation once per entry of ``--runs`` with ``flwr run``, shows each run's progress
(rounds, fusions, calibrations, scores) as it goes, prints each global model's test
accuracy and hidden widths per round, and stops every process it started. An entry is
``method[:rounds[:later]]`` (``later``: ``rematch`` fuses the later rounds with the method
again) followed by options: ``+bn`` the BatchNorm MLP of ``--bn-arch`` in place of the
run config's MLP (``+conv`` the ConvNet of ``--conv-arch``), ``+calibrate`` each fused
model calibrated with the nodes' statistics in one query round, ``+layerwise`` in one
query round per calibrated layer (each BatchNorm
layer; every hidden layer when the nodes send REPAIR targets), ``+align`` calibrated, then
aligned to the nodes in an alignment round and refit in one round per layer, ``+moments``
the nodes' input moments sent with their models (layer by layer, the first layer then
needs no query round). The table puts each run's fused nodes' test accuracy (mean) and
their softmax ensemble beside the global model's.

    python examples/flower/demo.py [--runs avg,pfnm,pfnm:3,pfnm+bn+calibrate] [--nodes 3]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from fusekit.flower.local import LocalFederation, progress_lines
from fusekit.toolkit.rounds import EVERY_ROUND

APP = Path(__file__).resolve().parent


CALIBRATION = {"calibrate": "one-pass", "layerwise": "layerwise"}
DEFAULT_RUNS = "avg,pfnm,nafi,pfnm:3,avg+bn,pfnm+bn,pfnm+bn+calibrate"


def parse_runs(text: str, bn_arch: str, conv_arch: str = "conv:16,32/64") -> list[dict]:
    """``avg,pfnm:3:rematch,pfnm+bn+calibrate`` -> each run's run-config overrides."""
    runs = []
    for entry in text.split(","):
        head, *options = entry.strip().split("+")
        method, rounds, later = [*head.split(":"), "", ""][:3]
        config = {"method": method, "num-server-rounds": int(rounds or 1),
                  "later-rounds": later or "avg"}
        for option in options:
            if option == "bn":
                config.update({"arch": bn_arch, "batchnorm": True})
            elif option == "conv":
                config["arch"] = conv_arch
            elif option in CALIBRATION:
                config.update({"calibrate": True, "calibration-rounds": CALIBRATION[option]})
            elif option == "align":
                config.update({"calibrate": True, "alignment-rounds": 1})
            elif option == "moments":
                config["input-moments"] = True
            else:
                raise ValueError(f"--runs {entry}: unknown option +{option}; expected +bn, "
                                 f"+conv, +calibrate, +layerwise, +align or +moments")
        runs.append(config)
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default=DEFAULT_RUNS,
                        help="comma-separated method[:rounds[:later]][+bn|+conv][+calibrate|"
                        "+layerwise][+align][+moments] (avg is FedAvg)")
    parser.add_argument("--bn-arch", default="mlp:100,100",
                        help="the BatchNorm MLP of +bn runs (BatchNorm after each hidden layer)")
    parser.add_argument("--conv-arch", default="conv:16,32/64",
                        help="the ConvNet of +conv runs (conv channels / linear widths)")
    parser.add_argument("--nodes", type=int, default=3, help="SuperNodes (one per partition)")
    parser.add_argument("--epochs", type=int, default=20, help="local training epochs")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per run")
    parser.add_argument("--json", type=Path, help="also write every run's results here")
    args = parser.parse_args(argv)
    try:
        runs = parse_runs(args.runs, args.bn_arch, args.conv_arch)
    except ValueError as exc:
        parser.error(str(exc))
    console = Console(stderr=True, highlight=False)

    progress = progress_lines(lambda line: console.print(f"    {escape(line)}", soft_wrap=True))
    rows = []
    console.print(f"starting a SuperLink and {args.nodes} SuperNodes on 127.0.0.1 ...")
    with LocalFederation(nodes=args.nodes) as federation:
        console.print(f"SuperLink on 127.0.0.1:{federation.port}, {args.nodes} SuperNodes")
        for number, run in enumerate(runs):
            console.print(f"flwr run: {run['num-server-rounds']} round(s) fused with "
                          f"[bold]{run['method']}[/] ({escape(json.dumps(run))}; each node "
                          f"trains {args.epochs} epochs per round)")
            start = time.perf_counter()
            result_file = federation.workdir / f"run-{number}.json"
            federation.run(APP, {**run, "min-nodes": args.nodes, "epochs": args.epochs,
                                 "result-file": str(result_file)},
                           timeout=args.timeout, on_line=progress)
            rows.append((json.loads(result_file.read_text()), time.perf_counter() - start))
        console.print("stopping the SuperLink, its SuperExec and the SuperNodes")
    # Wide enough for three rounds on one line where the output is not a terminal.
    Console(width=None if sys.stdout.isatty() else 150).print(results_table(rows, args.nodes))
    if args.json:
        args.json.write_text(json.dumps([result for result, _ in rows], indent=2))
    return 0


def run_label(result: dict) -> str:
    """The table's name of a run: FedAvg (avg), pfnm, pfnm then avg, pfnm rematched."""
    if result["method"] == "avg":
        return "FedAvg (avg)"
    if result["rounds"] == 1 or result["method"] in EVERY_ROUND:
        return result["method"]
    later = "then avg" if result.get("later_rounds", "avg") == "avg" else "every round"
    return f"{result['method']} {later}"


def calibration_label(result: dict) -> str:
    label = {None: "-", "one-pass": "one pass", "layerwise": "layer by layer"}[
        result.get("calibration")]
    return label + (" + aligned + refit" if result.get("alignment_rounds") else "")


def results_table(rows: list[tuple[dict, float]], nodes: int) -> Table:
    table = Table(title=f"Flower federation, {nodes} SuperNodes, non-iid digits")
    for column in ("method", "model", "calibrated", "rounds", "test accuracy",
                   "hidden widths", "nodes' own data", "nodes (mean)", "ensemble", "run (s)"):
        table.add_column(column)
    for result, seconds in rows:
        per_round = [result["per_round"][str(r)] for r in range(1, result["rounds"] + 1)]
        own = result["client_evaluation"].get(str(result["rounds"]), {}).get("accuracy")
        table.add_row(run_label(result),
                      result["arch"] + (" + BN" if result["batchnorm"] else ""),
                      calibration_label(result),
                      str(result["rounds"]),
                      " → ".join(f"{r['accuracy']:.4f}" for r in per_round),
                      " → ".join(str(r["hidden_widths"]) for r in per_round),
                      "-" if own is None else f"{own:.4f}", *peer_cells(result),
                      f"{seconds:.0f}")
    return table


def peer_cells(result: dict) -> tuple[str, str]:
    """The last round's fused nodes' mean test accuracy and their softmax ensemble's."""
    nodes, ensemble = result.get("node_accuracy"), result.get("ensemble_accuracy")
    return (f"{sum(nodes) / len(nodes):.4f}" if nodes else "-",
            "-" if ensemble is None else f"{ensemble:.4f}")


if __name__ == "__main__":
    sys.exit(main())
