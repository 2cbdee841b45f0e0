"""Run the app on a Flower deployment on this machine and compare fusion methods.

Starts one SuperLink and three SuperNodes on 127.0.0.1 (``fusekit.flower.local``), runs the
same one-round federation once per method with ``flwr run``, prints each fused global
model's test accuracy with its hidden widths, and stops every process it started.

    python examples/flower/demo.py [--methods avg,pfnm,nafi] [--nodes 3] [--epochs 20]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from fusekit.flower.local import LocalFederation

APP = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="avg,pfnm,nafi",
                        help="comma-separated fusekit methods (avg is FedAvg)")
    parser.add_argument("--nodes", type=int, default=3, help="SuperNodes (one per partition)")
    parser.add_argument("--epochs", type=int, default=20, help="local training epochs")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per run")
    args = parser.parse_args(argv)
    console = Console(stderr=True)
    rows = []
    with LocalFederation(nodes=args.nodes) as federation:
        console.print(f"SuperLink on 127.0.0.1:{federation.port}, {args.nodes} SuperNodes")
        for method in args.methods.split(","):
            console.print(f"flwr run: one round fused with [bold]{method}[/]")
            start = time.perf_counter()
            result_file = federation.workdir / f"{method}.json"
            federation.run(APP, {"method": method, "min-nodes": args.nodes,
                                 "epochs": args.epochs, "result-file": str(result_file)},
                           timeout=args.timeout)
            rows.append((json.loads(result_file.read_text()), time.perf_counter() - start))
    table = Table(title=f"Flower federation, {args.nodes} SuperNodes, non-iid digits, one round")
    for column in ("method", "test accuracy", "hidden widths", "nodes' own data", "run (s)"):
        table.add_column(column)
    for result, seconds in rows:
        own = result["client_evaluation"].get("1", {}).get("accuracy")
        table.add_row("FedAvg (avg)" if result["method"] == "avg" else result["method"],
                      f"{result['accuracy']:.4f}", str(result["hidden_widths"]),
                      "-" if own is None else f"{own:.4f}", f"{seconds:.0f}")
    Console().print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
