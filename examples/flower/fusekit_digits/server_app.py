"""The ServerApp: rounds of a federation whose aggregation is fusekit's, the global model
scored on the digits test split after each, and (optionally) saved at the end."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp

import fusekit
from fusekit.core.checkpoint import write_atomic
from fusekit.flower import FusekitStrategy, log_to_flower
from fusekit.toolkit.evaluate import Evaluator
from fusekit.toolkit.nn import build_model
from fusekit_digits import task

app = ServerApp()
log = logging.getLogger("flwr")


@app.main()
def main(grid: Grid, context: Context) -> None:
    log_to_flower()  # fusekit's INFO lines (fusions, widths, accuracy) among Flower's
    config = context.run_config
    method = str(config["method"])
    nodes = int(config["min-nodes"])
    data = task.dataset()
    arch = task.architecture(config, data)
    strategy = FusekitStrategy(
        method, task.method_params(config, method), arch=arch,
        preprocess=data.normalization,  # what the initial model, like the nodes', expects
        min_train_nodes=nodes, min_available_nodes=nodes, min_evaluate_nodes=nodes,
        fraction_train=float(config["fraction-train"]),
        fraction_evaluate=float(config["fraction-evaluate"]),
        later_rounds=str(config["later-rounds"]), calibrate=bool(config["calibrate"]),
        calibration_rounds=str(config["calibration-rounds"]),
        alignment_rounds=int(config["alignment-rounds"]))
    rounds = int(config["num-server-rounds"])
    initial = ArrayRecord(build_model(arch, seed=int(config["seed"])).state_dict())
    result = strategy.start(grid=grid, initial_arrays=initial, num_rounds=rounds,
                            evaluate_fn=strategy.evaluate_fn(data))
    final = result.evaluate_metrics_serverapp[rounds]
    log.info("fusekit %s: global model accuracy %.4f on the %s test split after %d "
             "round(s), hidden widths %s", method, final["accuracy"], task.DATA, rounds,
             final["hidden-widths"])
    if config["model-file"]:
        fused = strategy.global_checkpoint(result.arrays)
        fusekit.save_checkpoint(str(config["model-file"]), fused.state_dict(),
                                fused.metadata, force=True)
    if config["models-dir"]:
        folder = Path(str(config["models-dir"]))
        folder.mkdir(parents=True, exist_ok=True)
        for node, model in strategy.fused_models.items():
            fusekit.save_checkpoint(folder / f"node-{node}.safetensors", model.state_dict(),
                                    model.metadata, force=True)
    if config["result-file"]:
        write_atomic(Path(str(config["result-file"])), json.dumps(
            {**summary(strategy, result, config), **peers(strategy, data)}, indent=2).encode())


def peers(strategy: FusekitStrategy, data) -> dict:
    """The test accuracy of the nodes' models the last round fused and of their softmax
    ensemble: the peers of the global model's."""
    if not strategy.fused_models:
        return {"node_accuracy": [], "ensemble_accuracy": None}
    evaluator = Evaluator(data, "cpu")
    logits = [evaluator.logits(model)[1] for _, model in sorted(strategy.fused_models.items())]
    return {"node_accuracy": [evaluator.score(x, "node", "client").accuracy for x in logits],
            "ensemble_accuracy": evaluator.softmax_ensemble(logits).accuracy}


def summary(strategy: FusekitStrategy, result, config) -> dict:
    """What the run did, per round: the server's score of the global model and its hidden
    widths (round 0: the initial model), the nodes' aggregated metrics."""
    rounds = int(config["num-server-rounds"])
    server = result.evaluate_metrics_serverapp
    return {
        "method": strategy.method,
        "params": strategy.params,
        "rounds": rounds,
        "later_rounds": strategy.later_rounds,
        "arch": str(config["arch"]),
        "batchnorm": bool(config["batchnorm"]),
        "calibration": strategy.calibration_rounds if strategy.calibrate else None,
        "alignment_rounds": strategy.alignment_rounds,
        "nodes": int(config["min-nodes"]),
        "fused_rounds": strategy.fused_rounds,
        "accuracy": server[rounds]["accuracy"],
        "loss": server[rounds]["loss"],
        "hidden_widths": server[rounds]["hidden-widths"],
        "per_round": {r: {"accuracy": m["accuracy"], "hidden_widths": m["hidden-widths"]}
                      for r, m in server.items()},
        "left_out": strategy.left_out,
        "left_out_statistics": strategy.left_out_statistics,
        "left_out_alignment": strategy.left_out_alignment,
        "train_metrics": {r: dict(m) for r, m in result.train_metrics_clientapp.items()},
        "client_evaluation": {r: dict(m)
                              for r, m in result.evaluate_metrics_clientapp.items()},
    }
