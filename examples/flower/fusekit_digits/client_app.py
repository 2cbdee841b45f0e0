"""The ClientApp: train on this node's part of the digits, reply with the model and its
sample and class counts (with calibration, also its per-channel statistics of that model:
REPAIR's targets), and keep it in the node's state; evaluate the global model (fused
widths) on the same data; answer the statistics queries of calibration, alignment and
refit rounds with aggregates of that data (nothing else)."""

from __future__ import annotations

from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fusekit.flower import (
    STATISTICS,
    WIDTHS,
    global_model,
    kept_model,
    statistics_reply,
    train_reply,
)
from fusekit.toolkit.data import class_counts
from fusekit.toolkit.evaluate import predict_logits, score_logits
from fusekit.toolkit.simulate import derive_seed, fresh_model
from fusekit.toolkit.train import TrainConfig, train_model
from fusekit_digits import task

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    config = context.run_config
    node = int(context.node_config["partition-id"])
    data = task.dataset()
    indices = task.node_indices(config, context.node_config, data)
    seed = int(config["seed"])
    arch = task.architecture(config, data)
    if WIDTHS in msg.content["config"]:
        model = global_model(msg.content, arch)  # after a fusion: the fused widths
    else:  # the digits' normalisation, applied by the model and recorded in its reply
        model = fresh_model(arch, data, seed=seed if config["shared-init"]
                            else derive_seed(seed, "init", node))
    training = train_model(
        model, data.x_train[indices], data.y_train[indices],
        TrainConfig(epochs=int(config["epochs"]), lr=float(config["lr"])),
        seed=derive_seed(seed, "order", node))
    content = train_reply(model, len(indices),
                          class_counts(data.y_train, indices, data.num_classes),
                          metrics={"train-loss": training.epoch_losses[-1]},
                          # REPAIR's targets for layers without BatchNorm
                          statistics_inputs=data.x_train[indices] if config["calibrate"]
                          else None, input_moments=bool(config["input-moments"]),
                          # the model, for alignment and refit queries
                          keep_in=context.state if config["alignment-rounds"] else None)
    return Message(content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    data = task.dataset()
    indices = task.node_indices(context.run_config, context.node_config, data)
    model = global_model(msg.content)
    logits = predict_logits(model, _tensor(data.x_train[indices]))
    score = score_logits(logits, _tensor(data.y_train[indices]), "global model", "fused")
    metrics = MetricRecord({"accuracy": score.accuracy, "loss": score.loss,
                            "num-examples": len(indices)})
    return Message(RecordDict({"metrics": metrics}), reply_to=msg)


@app.query(STATISTICS)
def statistics(msg: Message, context: Context) -> Message:
    """Calibration, alignment and refit queries (the strategy's ``calibrate`` and
    ``alignment_rounds``): the model the query carries run on this node's training inputs
    (beside the model this node trained, for alignment and refit); the reply holds
    aggregates only."""
    data = task.dataset()
    indices = task.node_indices(context.run_config, context.node_config, data)
    return Message(statistics_reply(msg.content, data.x_train[indices],
                                    own_model=kept_model(context.state)), reply_to=msg)


def _tensor(array):
    import torch

    return torch.as_tensor(array)
