"""The ServerApp: one (or more) rounds of a federation whose aggregation is fusekit's, then
the fused global model scored on the digits test split."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp

from fusekit.core.checkpoint import write_atomic
from fusekit.flower import FusekitStrategy
from fusekit.toolkit.nn import build_model
from fusekit_digits import task

app = ServerApp()
log = logging.getLogger("flwr")


@app.main()
def main(grid: Grid, context: Context) -> None:
    # fusekit logs with the standard logging module: show its lines among Flower's.
    fusekit_log = logging.getLogger("fusekit")
    fusekit_log.setLevel(logging.INFO)
    for handler in log.handlers:
        fusekit_log.addHandler(handler)
    config = context.run_config
    method = str(config["method"])
    nodes = int(config["min-nodes"])
    data = task.dataset()
    arch = task.architecture(config, data)
    strategy = FusekitStrategy(
        method, task.method_params(config, method), arch=arch,
        min_train_nodes=nodes, min_available_nodes=nodes, min_evaluate_nodes=nodes,
        fraction_evaluate=float(config["fraction-evaluate"]))
    rounds = int(config["num-server-rounds"])
    initial = ArrayRecord(build_model(arch, seed=int(config["seed"])).state_dict())
    result = strategy.start(grid=grid, initial_arrays=initial, num_rounds=rounds,
                            evaluate_fn=strategy.evaluate_fn(data))
    final = result.evaluate_metrics_serverapp[rounds]
    summary = {
        "method": method,
        "params": strategy.params,
        "rounds": rounds,
        "nodes": nodes,
        "accuracy": final["accuracy"],
        "loss": final["loss"],
        "hidden_widths": final["hidden-widths"],
        "left_out": strategy.left_out,
        "train_metrics": {r: dict(m) for r, m in result.train_metrics_clientapp.items()},
        "client_evaluation": {r: dict(m)
                              for r, m in result.evaluate_metrics_clientapp.items()},
    }
    log.info("fusekit %s: global model accuracy %.4f on the %s test split, hidden "
                "widths %s", method, final["accuracy"], task.DATA, final["hidden-widths"])
    if config["result-file"]:
        write_atomic(Path(str(config["result-file"])),
                     json.dumps(summary, indent=2).encode())
