"""Run the app on a Flower deployment on this machine and compare fusion methods.

Starts one SuperLink and three SuperNodes on 127.0.0.1 (``fusekit.flower.local``), runs the
federation once per entry of ``--runs`` (``method``, ``method:rounds`` or
``method:rounds:rematch``, later rounds fused by the method again) with ``flwr run``,
shows each run's progress (rounds, fusions, scores) as it goes, prints each global model's
test accuracy and hidden widths per round, and stops every process it started.

    python examples/flower/demo.py [--runs avg,pfnm,nafi,pfnm:3] [--nodes 3] [--epochs 20]
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


def parse_runs(text: str) -> list[tuple[str, int, str]]:
    """``avg,pfnm:3,pfnm:3:rematch`` -> [("avg", 1, "avg"), ("pfnm", 3, "avg"),
    ("pfnm", 3, "rematch")]: method, rounds, what fuses the later rounds."""
    runs = []
    for entry in text.split(","):
        method, rounds, later = (entry.strip().split(":") + ["", ""])[:3]
        runs.append((method, int(rounds or 1), later or "avg"))
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default="avg,pfnm,nafi,pfnm:3",
                        help="comma-separated method[:rounds] (avg is FedAvg)")
    parser.add_argument("--nodes", type=int, default=3, help="SuperNodes (one per partition)")
    parser.add_argument("--epochs", type=int, default=20, help="local training epochs")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per run")
    parser.add_argument("--json", type=Path, help="also write every run's results here")
    args = parser.parse_args(argv)
    console = Console(stderr=True, highlight=False)

    progress = progress_lines(lambda line: console.print(f"    {escape(line)}", soft_wrap=True))
    rows = []
    console.print(f"starting a SuperLink and {args.nodes} SuperNodes on 127.0.0.1 ...")
    with LocalFederation(nodes=args.nodes) as federation:
        console.print(f"SuperLink on 127.0.0.1:{federation.port}, {args.nodes} SuperNodes")
        for method, rounds, later in parse_runs(args.runs):
            console.print(f"flwr run: {rounds} round(s) fused with [bold]{method}[/] "
                          f"(later rounds: {later}; each node trains {args.epochs} epochs "
                          f"per round)")
            start = time.perf_counter()
            result_file = federation.workdir / f"{method}-{rounds}-{later}.json"
            federation.run(APP, {"method": method, "min-nodes": args.nodes,
                                 "num-server-rounds": rounds, "later-rounds": later,
                                 "epochs": args.epochs, "result-file": str(result_file)},
                           timeout=args.timeout, on_line=progress)
            rows.append((json.loads(result_file.read_text()), time.perf_counter() - start))
        console.print("stopping the SuperLink, its SuperExec and the SuperNodes")
    # Wide enough for three rounds on one line where the output is not a terminal.
    Console(width=None if sys.stdout.isatty() else 110).print(results_table(rows, args.nodes))
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


def results_table(rows: list[tuple[dict, float]], nodes: int) -> Table:
    table = Table(title=f"Flower federation, {nodes} SuperNodes, non-iid digits")
    for column in ("method", "rounds", "test accuracy", "hidden widths", "nodes' own data",
                   "run (s)"):
        table.add_column(column)
    for result, seconds in rows:
        per_round = [result["per_round"][str(r)] for r in range(1, result["rounds"] + 1)]
        own = result["client_evaluation"].get(str(result["rounds"]), {}).get("accuracy")
        table.add_row(run_label(result),
                      str(result["rounds"]),
                      " → ".join(f"{r['accuracy']:.4f}" for r in per_round),
                      " → ".join(str(r["hidden_widths"]) for r in per_round),
                      "-" if own is None else f"{own:.4f}", f"{seconds:.0f}")
    return table


if __name__ == "__main__":
    sys.exit(main())
