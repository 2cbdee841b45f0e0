"""FusekitStrategy and the ClientApp helpers on real Flower Messages (no network)."""

from __future__ import annotations

import importlib
import json
import logging
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("flwr", reason="needs the [flower] extra")

from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Error,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.supercore.task_identity import TaskIdentity

import fusekit
from conftest import mlp, write, write_raw
from fusekit.core.checkpoint import Checkpoint
from fusekit.core.errors import (
    CheckpointError,
    DataError,
    IncompatibleModelsError,
    ParameterError,
    UnknownMethodError,
)
from fusekit.flower import (
    ARCH,
    WIDTHS,
    FusekitStrategy,
    arrays_to_state_dict,
    global_model,
    log_to_flower,
    statistics_reply,
    train_reply,
)
from fusekit.flower.records import (
    query_checkpoint,
    reply_checkpoint,
    statistics_content,
    statistics_query,
)
from fusekit.toolkit.calibration import client_statistics
from fusekit.toolkit.local import calibrate_locally
from fusekit.toolkit.data import load_dataset
from fusekit.toolkit.nn import build_model, load_model
from fusekit.toolkit.nn.fused import load_fused
from fusekit.toolkit.simulate import SimulationConfig, simulate_clients
from fusekit.toolkit.train import TrainConfig

ANSI = re.compile(r"\x1b\[[0-9;]*m")


@pytest.fixture(autouse=True)
def serverapp_identity(monkeypatch):
    """Messages are stamped with the run and node of the process, as in a ServerApp."""
    monkeypatch.setattr(TaskIdentity, "_run_id", 1)
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)


def reply(node_id: int, content: RecordDict | Error) -> Message:
    """What the SuperLink hands the ServerApp: node ``node_id``'s reply to a train message."""
    instruction = Message(RecordDict({"config": ConfigRecord()}), dst_node_id=node_id,
                          message_type=MessageType.TRAIN)
    return Message(content, reply_to=instruction)


class NodeIds:
    """The part of a Grid that configure_train/evaluate use: the connected node ids."""

    def get_node_ids(self):
        return [10, 11, 12]


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


@pytest.fixture(scope="module")
def trained(digits):
    """Three MLP clients trained from their own initial weights on non-iid digits."""
    config = SimulationConfig(clients=3, partition="dirichlet", alpha=0.5, arch="mlp:32",
                              train=TrainConfig(epochs=5))
    return with_modules(simulate_clients(digits, config))


@pytest.fixture(scope="module")
def trained_fed2(digits):
    """Three Fed² clients: their last two layers split into 5 groups of two classes."""
    config = SimulationConfig(clients=3, arch="mlp:20,20", fed2={"groups": 5, "depth": 2},
                              shared_init=True, train=TrainConfig(epochs=1))
    return with_modules(simulate_clients(digits, config))


def with_modules(clients):
    """The clients' modules, as a node holds them: normalising their inputs as trained."""
    return clients, [load_model(client.checkpoint) for client in clients]


def trained_replies(trained, first_node: int = 10, inputs=None, **options) -> list[Message]:
    """Each client's train reply; with ``inputs`` (node id -> its inputs or None) carrying
    its statistics of its own model on them; ``options``: further ``train_reply``
    arguments."""
    clients, models = trained
    return [reply(first_node + c.index,
                  train_reply(model, len(c.indices),
                              c.checkpoint.class_counts.astype(int).tolist(),
                              statistics_inputs=None if inputs is None
                              else inputs[first_node + c.index], **options))
            for c, model in zip(clients, models, strict=True)]


def test_every_public_name_resolves_and_a_superexec_imports_no_torch():
    """fusekit.flower's names are imported on first use: each of ``__all__`` is its
    module's object, and a SuperExec (fusekit.flower.superexec, one per node) imports
    neither torch nor the strategy."""
    import fusekit.flower as package

    assert sorted(package.__all__) == sorted(package._HOMES)
    for name in package.__all__:
        assert getattr(package, name) is getattr(
            importlib.import_module(package._HOMES[name]), name)
    code = ("import sys, fusekit.flower.superexec; "
            "print(sorted({'torch', 'fusekit.flower.strategy'} & set(sys.modules)))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, timeout=60).stdout.strip() == "[]"


def test_the_warm_process_runs_each_command_it_is_sent_as_a_process_of_its_own():
    """fusekit.flower.superexec's warm process forks a child per line it reads, which runs
    Flower's command with those arguments (here ``--help``: argparse names the command
    from ``sys.argv``), its output silenced where the line asks; it ends with its input."""
    lines = "".join(json.dumps([["flwr-clientapp", "--help"], quiet]) + "\n"
                    for quiet in (False, True, False))
    warm = subprocess.run([sys.executable, "-m", "fusekit.flower.superexec", "--warm"],
                          input=lines, capture_output=True, text=True, timeout=120, check=True)
    assert warm.stdout.count("usage: flwr-clientapp") == 2


def test_avg_keeps_tensor_names_and_weights_by_num_examples():
    models = [mlp(batchnorm=True, seed=s) for s in range(2)]
    replies = [reply(1, train_reply(models[0], 30)), reply(2, train_reply(models[1], 10))]
    arrays, metrics = FusekitStrategy("avg").aggregate_train(1, replies)
    assert list(arrays) == list(models[0].state_dict())
    fused = arrays_to_state_dict(arrays)
    expected = (0.75 * models[0][0].weight + 0.25 * models[1][0].weight).detach().numpy()
    np.testing.assert_allclose(fused["0.weight"], expected, rtol=1e-6)
    assert fused["1.num_batches_tracked"].dtype == np.int64
    assert fused["1.num_batches_tracked"].shape == ()  # as torch has it: nodes load it
    assert metrics["avg.fused-widths"] == [5]
    assert metrics["avg.fused-replies"] == 2 and metrics["avg.left-out-replies"] == 0


def test_class_counts_reach_the_fusion():
    """avg --class-weighted reads the per-class counts the replies carry."""
    models = [mlp(seed=s) for s in range(2)]
    replies = [reply(1, train_reply(models[0], 10, [10, 0, 0])),
               reply(2, train_reply(models[1], 10, [0, 4, 6]))]
    arrays, _ = FusekitStrategy("avg", {"class_weighted": True}).aggregate_train(1, replies)
    head = arrays_to_state_dict(arrays)["2.weight"]
    np.testing.assert_allclose(head[0], models[0][2].weight[0].detach().numpy(), rtol=1e-6)
    np.testing.assert_allclose(head[2], models[1][2].weight[2].detach().numpy(), rtol=1e-6)


def test_bad_replies_are_left_out_with_the_reason_fusekit_fuse_gives(tmp_path, caplog):
    good = [mlp(seed=s) for s in range(2)]
    nan_model = mlp(seed=3)
    with torch.no_grad():
        nan_model[0].weight[0, 0] = float("nan")
    missing_count = train_reply(mlp(seed=4), 5)
    del missing_count["metrics"]["num-examples"]
    replies = [
        reply(1, train_reply(good[0], 10)),
        reply(2, Error(code=1, reason="out of memory")),
        reply(3, train_reply(nan_model, 10)),
        reply(4, train_reply(mlp(widths=(6, 5, 4, 3), seed=5), 10)),
        reply(5, missing_count),
        reply(6, train_reply(good[1], 10)),
        # A SuperNode's words for what its ClientApp raised.
        reply(7, Error(code=2, reason="<class 'FileNotFoundError'>:<'[Errno 2] No such file "
                                      "or directory: '/data/x.npy''>")),
    ]
    strategy = FusekitStrategy("pfnm")
    arrays, metrics = strategy.aggregate_train(3, replies)
    assert arrays is not None and metrics["pfnm.fused-replies"] == 2
    assert metrics["pfnm.left-out-replies"] == 5
    reasons = strategy.left_out
    assert sorted(reasons) == [2, 3, 4, 5, 7]
    assert reasons[2] == "the ClientApp failed (error 1: out of memory)"
    assert reasons[7] == ("the ClientApp failed (error 2: FileNotFoundError: [Errno 2] No such "
                          "file or directory: '/data/x.npy')")
    assert "num-examples" in reasons[5]
    # The reason is the one `fusekit fuse` gives for the same model in a file.
    path = write_raw(tmp_path / "nan.safetensors", nan_model)
    with pytest.raises(CheckpointError) as file_error:
        fusekit.fuse([path, write(tmp_path / "good.safetensors", good[0])], method="pfnm")
    assert reasons[3] == str(file_error.value).replace(str(path), "node 3")
    assert reasons[4] == "architectures cannot be fused: node 1 has 2 layers, node 4 has 3"
    assert all(f"node {n} left out: {r}" in caplog.text for n, r in reasons.items())
    assert all("\n" not in r for r in reasons.values())


def test_an_architecture_tie_goes_to_the_global_models_not_the_first_reply(trained):
    """One NaN reply, one deeper network arriving first, one node training the global
    model's architecture: the global model's architecture wins the tie, the deeper node is
    the one left out (and named), in any order of arrival."""
    clients, models = trained
    deeper = mlp(widths=(64, 16, 16, 10), seed=7)
    nan_model = mlp(widths=(64, 32, 10), seed=8)
    with torch.no_grad():
        nan_model[0].weight[0, 0] = float("nan")
    for order in ((10, 11, 12), (12, 11, 10)):
        replies = {10: train_reply(deeper, 50), 11: train_reply(nan_model, 50),
                   12: trained_replies(trained)[2].content}

        def train(node, message, replies=replies):
            return replies[node]

        class Arriving(Federation):
            def send_and_receive(self, messages, timeout=None, order=order):
                answers = super().send_and_receive(messages, timeout)
                return sorted(answers, key=lambda m: order.index(m.metadata.src_node_id))

        strategy = FusekitStrategy("pfnm", arch=clients[0].checkpoint.arch,
                                   min_fused_replies=1, fraction_evaluate=0)
        result = strategy.start(Arriving(train), train_reply(models[0], 1)["arrays"],
                                num_rounds=1)
        assert sorted(strategy.left_out) == [10, 11] and list(strategy.fused_models) == [12]
        assert strategy.left_out[10] == ("architectures cannot be fused: node 12 has 2 "
                                         "layers, node 10 has 3")
        assert result.train_metrics_clientapp[1]["pfnm.fused-replies"] == 1


def test_the_round_fails_only_when_too_few_replies_remain(caplog):
    replies = [reply(1, train_reply(mlp(seed=1), 10)), reply(2, Error(code=1, reason="x"))]
    strategy = FusekitStrategy("avg", min_fused_replies=2)
    assert strategy.aggregate_train(1, replies) == (None, None)
    assert "round failed" in caplog.text
    assert FusekitStrategy("avg", min_fused_replies=1).aggregate_train(1, replies)[0] is not None


def test_bad_method_or_parameters_fail_before_any_node_trains():
    """Checked against the method's declaration, as ``fusekit.fuse`` checks them."""
    with pytest.raises(UnknownMethodError):
        FusekitStrategy("fedprox")
    with pytest.raises(ParameterError, match=r"'avg' does not take parameter.* sigma"):
        FusekitStrategy("avg", {"sigma": 1.0})
    with pytest.raises(ParameterError, match="sweeps"):
        FusekitStrategy("pfnm", {"sweeps": 2.5})
    with pytest.raises(ParameterError, match="unobserved"):
        FusekitStrategy("nafi", {"unobserved": "drop-them"})
    with pytest.raises(ParameterError, match="sigma: expected one value for every node"):
        FusekitStrategy("pfnm", {"sigma": [1.0, 2.0, 3.0]})
    with pytest.raises(ParameterError, match="min_fused_replies"):
        FusekitStrategy("avg", min_fused_replies=0)
    assert FusekitStrategy("pfnm", {"sigma": 2, "sweeps": 3}).params == {"sigma": 2, "sweeps": 3}


def test_pfnm_round_reports_widths_and_sends_them_to_clients(trained, digits):
    clients, _ = trained
    strategy = FusekitStrategy("pfnm", arch=clients[0].checkpoint.arch)
    arrays, metrics = strategy.aggregate_train(1, trained_replies(trained))
    expected = fusekit.fuse([c.checkpoint for c in clients], method="pfnm")
    widths = metrics["pfnm.fused-widths"]
    assert widths == expected.widths == [48]  # PFNM grew the layer to 1.5 × 32
    assert arrays_to_state_dict(arrays)["net.0.weight"].shape == (widths[0], 64)
    np.testing.assert_array_equal(arrays_to_state_dict(arrays)["net.2.weight"],
                                  expected.state_dict["net.2.weight"])
    assert metrics["pfnm.fuse-time-s"] > 0

    for message in strategy.configure_train(2, arrays, ConfigRecord({"lr": 0.1}),
                                            NodeIds()):
        config = message.content["config"]
        assert config[WIDTHS] == widths and config["lr"] == 0.1
        assert json.loads(config[ARCH])["hidden"] == widths
        model = global_model(message.content)  # what a ClientApp rebuilds
        assert model.net[0].out_features == widths[0]

    scores = strategy.evaluate_fn(digits)(1, arrays)
    assert scores["hidden-widths"] == widths
    assert scores["accuracy"] > 0.75  # width 48: 0.77-0.80 over the six orders of these clients


def test_server_evaluation_before_the_first_round_uses_the_initial_architecture(trained,
                                                                                 digits):
    clients, models = trained
    strategy = FusekitStrategy("pfnm", arch=clients[0].checkpoint.arch)
    scores = strategy.evaluate_fn(digits)(0, train_reply(models[0], 1)["arrays"])
    assert scores["hidden-widths"] == [32]
    assert 0 < scores["accuracy"] < 1


def test_server_evaluation_before_the_first_round_applies_the_given_preprocess(digits):
    """A plain torch MLP trained on normalised digits, as the initial model: told its
    preprocessing, the round-0 server evaluation scores it as torch does on the same
    arrays; untold, it sees the data as stored."""
    mean, std = float(digits.x_train.mean()), float(digits.x_train.std())
    model = mlp((64, 32, 10), seed=3)
    flat = lambda a: torch.tensor((a.reshape(len(a), -1) - mean) / std)  # noqa: E731
    x, y = flat(digits.x_train), torch.tensor(digits.y_train)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(100):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    with torch.no_grad():
        predicted = model(flat(digits.x_test)).argmax(1).numpy()
    expected = float((predicted == digits.y_test).mean())
    arrays = train_reply(model, 1)["arrays"]
    told = FusekitStrategy("avg", preprocess={"mean": [mean], "std": [std]})
    assert told.evaluate_fn(digits)(0, arrays)["accuracy"] == pytest.approx(expected, abs=1e-9)
    assert expected > 0.9
    untold = FusekitStrategy("avg").evaluate_fn(digits)(0, arrays)["accuracy"]
    assert untold < expected - 0.1
    for bad, found in (({"mean": [0.0]}, "exactly the keys"), ({"mean": [0], "std": [0]},
                       "positive standard deviations"), ("0,1", "expected {")):
        with pytest.raises(ParameterError, match=f"preprocess: .*{re.escape(found)}"):
            FusekitStrategy("avg", preprocess=bad)


def test_train_reply_packs_counts_and_architecture():
    model = build_model(json.loads(json.dumps(
        {"type": "mlp", "in_features": 4, "hidden": [3], "out_features": 2})))
    content = train_reply(model, 7, [3, 4], metrics={"train-loss": 0.5})
    assert list(content["arrays"]) == list(model.state_dict())
    metrics = content["metrics"]
    assert isinstance(metrics, MetricRecord)
    assert dict(metrics) == {"train-loss": 0.5, "num-examples": 7, "class-counts": [3, 4]}
    assert json.loads(content["fusekit"][ARCH])["hidden"] == [3]
    assert "fusekit" not in train_reply(mlp(), 7)  # a plain torch model has no fusekit.arch
    for bad in ([3, 3], [8, -1], [3.5, 3.5]):
        with pytest.raises(ParameterError, match="class_counts"):
            train_reply(model, 7, bad)
    with pytest.raises(ParameterError, match="num_examples"):
        train_reply(model, 0)


def test_global_model_without_architecture_is_read_from_its_tensors():
    model = mlp(widths=(6, 9, 3))
    content = RecordDict({"arrays": train_reply(model, 1)["arrays"],
                          "config": ConfigRecord()})
    rebuilt = global_model(content)
    x = torch.randn(4, 6)
    torch.testing.assert_close(rebuilt(x), model(x))


def test_each_reply_is_screened_as_the_method_screens_a_client(trained, trained_fed2, digits):
    """fed2 leaves plain models out, PFNM leaves Fed² models out, with fusekit's reasons."""
    plain, grouped = trained_replies(trained), trained_replies(trained_fed2, first_node=20)
    strategy = FusekitStrategy("fed2")
    arrays, metrics = strategy.aggregate_train(1, plain[:1] + grouped)
    assert metrics["fed2.fused-replies"] == 3 and sorted(strategy.left_out) == [10]
    expected = fusekit.fuse([c.checkpoint for c in trained_fed2[0]], method="fed2")
    for name, value in arrays_to_state_dict(arrays).items():
        np.testing.assert_array_equal(value, expected.state_dict[name])
    first = trained[0][0].checkpoint
    with pytest.raises(IncompatibleModelsError) as refusal:
        fusekit.fuse([Checkpoint.from_state_dict(first.state_dict(), first.metadata,
                                                 source="node 10")], method="fed2")
    assert strategy.left_out[10] == str(refusal.value)
    assert_nodes_rebuild_the_global_model(strategy, arrays, digits)

    strategy = FusekitStrategy("pfnm")
    _, metrics = strategy.aggregate_train(1, grouped[:1] + plain)
    assert metrics["pfnm.fused-replies"] == 3 and sorted(strategy.left_out) == [20]
    assert strategy.left_out[20].startswith("node 20: a Fed² model")


@pytest.mark.parametrize("method", sorted(name for name, cls in fusekit.METHODS.items()
                                          if cls.client_structure is None))
def test_every_method_fuses_a_round_that_the_server_scores(trained, digits, method):
    clients, _ = trained
    strategy = FusekitStrategy(method, arch=clients[0].checkpoint.arch)
    arrays, metrics = strategy.aggregate_train(1, trained_replies(trained))
    expected = fusekit.fuse([c.checkpoint for c in clients], method=method)
    assert list(arrays) == list(expected.state_dict)
    assert metrics[f"{method}.fused-widths"] == expected.widths
    scores = strategy.evaluate_fn(digits)(1, arrays)
    assert scores["hidden-widths"] == expected.widths
    assert scores["accuracy"] > 0.5
    assert_nodes_rebuild_the_global_model(strategy, arrays, digits)


def assert_nodes_rebuild_the_global_model(strategy, arrays, digits):
    """Each node rebuilds, from the evaluate message alone, the model the server scores."""
    x = torch.as_tensor(digits.x_test[:20])
    server_model = load_fused(strategy.global_checkpoint(arrays), "cpu")
    for message in strategy.configure_evaluate(1, arrays, ConfigRecord(), NodeIds()):
        torch.testing.assert_close(global_model(message.content)(x), server_model(x))


#: A handler's answer for a node that stopped: the SuperLink answers in its stead.
STOPPED = object()


class Federation:
    """A Grid stand-in for ``strategy.start``: nodes 10-12 answer each train message with
    ``train(node, message)`` and each query (calibration's) with ``query(node, message)``
    (a RecordDict, an Error, or :data:`STOPPED`: the SuperLink's own error reply for a
    node whose heartbeats lapsed); evaluate messages are not sent
    (``fraction_evaluate=0``). Each message gets its id as a Grid's push gives it.
    ``sent`` lists the type of every message sent."""

    def __init__(self, train, query=None):
        self.handlers = {MessageType.TRAIN: train, MessageType.QUERY: query}
        self.sent = []

    def get_node_ids(self):
        return [10, 11, 12]

    def send_and_receive(self, messages, timeout=None):
        # Here, not at collection: the SuperLink's state (SQLAlchemy, alembic, FastAPI)
        # costs every pytest worker a second to import.
        from flwr.server.superlink.linkstate.utils import (
            create_message_error_unavailable_res_message,
        )

        answers = []
        for m in messages:
            m.metadata.__dict__["_message_id"] = m.object_id
            self.sent.append(m.metadata.message_type)
            handler = self.handlers[m.metadata.message_type.split(".")[0]]
            answer = handler(m.metadata.dst_node_id, m)
            answers.append(
                create_message_error_unavailable_res_message(m.metadata, "node_unavail")
                if answer is STOPPED else Message(answer, reply_to=m))
        return answers


def test_a_run_without_a_fused_round_returns_the_initial_model(trained):
    clients, models = trained
    initial = train_reply(models[0], 1)["arrays"]
    strategy = FusekitStrategy("pfnm", arch=clients[0].checkpoint.arch, fraction_evaluate=0)
    result = strategy.start(Federation(lambda node, _: Error(code=1, reason="no data")),
                            initial, num_rounds=2)
    assert strategy.fused_rounds == 0 and list(result.arrays) == list(initial)
    checkpoint = strategy.global_checkpoint(result.arrays)
    for name, value in arrays_to_state_dict(initial).items():
        np.testing.assert_array_equal(checkpoint.tensor(name), value)
    assert load_fused(checkpoint, "cpu").net[0].out_features == 32
    with pytest.raises(CheckpointError, match="global model: the ArrayRecord is empty"):
        strategy.global_checkpoint(type(initial)())


def test_later_rounds_average_at_the_first_fusions_width(trained):
    """PFNM fuses round 1 (32 -> 48 hidden units); the nodes train that model and rounds 2
    and 3 average their updates (as simulate --rounds does): 48 wide, not 72 and 108. Those
    rounds are screened as avg screens: a node replying its own 32-wide model is left out."""
    clients, models = trained
    sent = []

    def train(node, message):
        index = node - 10
        if WIDTHS not in message.content["config"]:  # before a fusion: own models
            return trained_replies(trained)[index].content
        model = global_model(message.content)
        sent.append(model.net[0].out_features)
        if node == 12:
            return train_reply(models[index], 10)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(0.01 * (index + 1))  # each node's "training"
        return train_reply(model, 10 * (index + 1))

    strategy = FusekitStrategy("pfnm", arch=clients[0].checkpoint.arch, fraction_evaluate=0)
    initial = train_reply(models[0], 1)["arrays"]
    result = strategy.start(Federation(train), initial, num_rounds=3)
    metrics = result.train_metrics_clientapp
    widths = [metrics[r][f"{m}.fused-widths"] for r, m in ((1, "pfnm"), (2, "avg"), (3, "avg"))]
    assert widths == [[48], [48], [48]] and sent == [48] * 6 and strategy.fused_rounds == 3
    assert metrics[3]["avg.fused-replies"] == 2  # named by the method that fused the round
    assert not any(key.startswith("pfnm.") for key in metrics[3])
    assert "needs equal shapes" in strategy.left_out[12]
    fused = arrays_to_state_dict(result.arrays)["net.0.weight"]
    assert fused.shape == (48, 64)
    assert strategy.round_fusion()[0].name == "avg" and strategy.round_fusion()[1] == {}
    # avg fuses every round with its own parameters.
    avg = FusekitStrategy("avg", {"class_weighted": True})
    avg.fused_rounds = 4
    assert avg.round_fusion()[0].name == "avg" and avg.round_fusion()[1] == {
        "class_weighted": True}


@pytest.fixture
def flower_console():
    """Flower's console handler writing to a buffer; the fusekit logger restored after."""
    from io import StringIO

    from flwr.common.logger import console_handler

    logger = logging.getLogger("fusekit")
    saved = (console_handler.stream, logger.level, logger.propagate, list(logger.handlers))
    console_handler.stream = StringIO()
    yield console_handler.stream
    console_handler.stream = saved[0]
    logger.setLevel(saved[1])
    logger.propagate = saved[2]
    logger.handlers[:] = saved[3]


def test_log_to_flower_shows_fusekit_lines_with_their_level(flower_console):
    strategy_log = logging.getLogger("fusekit.flower.strategy")
    strategy_log.info("before: dropped")
    log_to_flower()
    log_to_flower()  # once is enough; twice does not double the lines
    strategy_log.info("round %d: fused", 1)
    strategy_log.warning("reply left out")
    strategy_log.debug("not at INFO")
    lines = [ANSI.sub("", line) for line in flower_console.getvalue().splitlines()]
    assert [line.split(":", 1)[0].strip() for line in lines] == ["INFO", "WARNING"]
    assert lines[0].endswith("round 1: fused") and lines[1].endswith("reply left out")


def test_an_ensemble_method_runs_one_round_only():
    with pytest.raises(ParameterError, match="num_rounds: method 'ams' returns an ensemble"):
        FusekitStrategy("ams").start(Federation(None), ArrayRecord(), num_rounds=2)


def test_a_strategy_started_again_starts_from_its_initial_model(trained):
    """The second run's first round fuses with PFNM again (its nodes send their own
    models), not with the average that follows the first run's fusion."""
    clients, models = trained
    strategy = FusekitStrategy("pfnm", arch=clients[0].checkpoint.arch, fraction_evaluate=0)
    initial = train_reply(models[0], 1)["arrays"]
    own_models = Federation(lambda node, _: trained_replies(trained)[node - 10].content)
    for _ in range(2):
        result = strategy.start(own_models, initial, num_rounds=1)
        assert strategy.fused_rounds == 1
        assert result.train_metrics_clientapp[1]["pfnm.fused-widths"] == [48]


def test_later_rounds_can_rematch_at_the_global_models_widths(trained):
    clients, models = trained

    def train(node, message):
        if WIDTHS not in message.content["config"]:
            return trained_replies(trained)[node - 10].content
        model = global_model(message.content)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(0.01 * (node - 9))
        return train_reply(model, 10)

    strategy = FusekitStrategy("pfnm", {"width_ratio": 2.0}, later_rounds="rematch",
                               arch=clients[0].checkpoint.arch, fraction_evaluate=0)
    result = strategy.start(Federation(train), train_reply(models[0], 1)["arrays"],
                            num_rounds=3)
    widths = [result.train_metrics_clientapp[r]["pfnm.fused-widths"] for r in (1, 2, 3)]
    assert widths == [[64], [64], [64]]
    fusion, params = strategy.round_fusion()
    assert fusion.name == "pfnm" and params == {"width": [64]}
    with pytest.raises(ParameterError, match="later_rounds: expected one of"):
        FusekitStrategy("pfnm", later_rounds="pfnm")


@pytest.fixture(scope="module")
def trained_bn(digits):
    """Three BatchNorm MLP clients (64-16-16-10) from their own initial weights, non-iid."""
    config = SimulationConfig(clients=3, partition="dirichlet", alpha=0.5, arch="mlp:16,16",
                              batchnorm=True, train=TrainConfig(epochs=2))
    return with_modules(simulate_clients(digits, config))


def calibrating_federation(trained, digits, statistics=None, targets=None, **options):
    """Nodes 10-12 reply their trained model (with, when ``targets(node, inputs)`` gives
    them, its statistics on those inputs), and to a statistics query
    ``statistics(node, message, inputs)`` (default: ``statistics_reply`` on the node's
    training inputs)."""
    clients, _ = trained
    inputs = {10 + c.index: digits.x_train[c.indices] for c in clients}
    answer = statistics or (lambda node, m, x: statistics_reply(m.content, x))
    own = None if targets is None else {node: targets(node, x) for node, x in inputs.items()}
    replies = {message.metadata.src_node_id: message.content
               for message in trained_replies(trained, inputs=own, **options)}
    return Federation(lambda node, _: replies[node],
                      lambda node, m: answer(node, m, inputs[node])), inputs


def calibrated_round(trained, digits, statistics):
    """One PFNM round calibrated (one pass) with the answers of ``statistics``: the
    strategy, its Result and each node's inputs."""
    clients, _ = trained
    grid, inputs = calibrating_federation(trained, digits, statistics)
    strategy = FusekitStrategy("pfnm", arch=clients[0].checkpoint.arch, fraction_evaluate=0,
                               calibrate=True)
    result = strategy.start(grid, trained_replies(trained)[0].content["arrays"],
                            num_rounds=1)
    return strategy, result, inputs


def fused_pfnm(trained):
    clients, _ = trained
    result = fusekit.fuse([c.checkpoint for c in clients], method="pfnm")
    return Checkpoint.from_state_dict(result.state_dict, result.metadata)


@pytest.mark.parametrize("rounds", ["one-pass", "layerwise"])
def test_calibration_pools_the_nodes_statistics_into_the_global_model(trained_bn, digits,
                                                                      rounds, caplog):
    """The round's global model is the fusion calibrated with the nodes' statistics: what
    ``calibrate_locally`` gives with the nodes' data at hand (one query round, or one per
    BatchNorm layer); the nodes rebuild it, running statistics included."""
    caplog.set_level(logging.INFO, logger="fusekit")
    clients, _ = trained_bn
    grid, inputs = calibrating_federation(trained_bn, digits)
    strategy = FusekitStrategy("pfnm", arch=clients[0].checkpoint.arch, fraction_evaluate=0,
                               calibrate=True, calibration_rounds=rounds)
    result = strategy.start(grid, trained_replies(trained_bn)[0].content["arrays"],
                            num_rounds=1)
    queries = 1 if rounds == "one-pass" else 2  # two BatchNorm layers
    assert grid.sent == ["train"] * 3 + ["query.statistics"] * 3 * queries
    fused = fused_pfnm(trained_bn)
    expected = calibrate_locally(fused, [inputs[n] for n in sorted(inputs)], rounds=rounds)
    calibrated = assert_same_model(result.arrays, expected.state_dict)
    assert not np.allclose(calibrated["net.1.running_var"], fused.tensor("net.1.running_var"))
    metrics = result.train_metrics_clientapp[1]
    assert metrics["pfnm.calibrated"] == 1 and metrics["pfnm.calibration-nodes"] == 3
    assert metrics["pfnm.calibration-rounds"] == queries
    assert metrics["pfnm.calibration-samples"] == sum(len(x) for x in inputs.values())
    assert json.loads(strategy.global_metadata["fusekit.calibration"])["clients"] == 3
    assert f"calibration {rounds} (at least 32 inputs per node)" in caplog.text
    assert_nodes_rebuild_the_global_model(strategy, result.arrays, digits)


def assert_same_model(arrays, expected):
    """``arrays`` hold ``expected``'s tensors, in its order, to float32 rounding; returns
    them."""
    model = arrays_to_state_dict(arrays)
    assert list(model) == list(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(model[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
    return model


def test_bad_statistics_are_left_out_and_calibration_proceeds_with_the_rest(
        trained_bn, digits, caplog):
    """Too few inputs, a negative variance: each is logged and left out with the reason
    ``fusekit calibrate`` gives; the model is calibrated with the good node's statistics."""

    def answer(node, message, x):
        if node == 10:
            return statistics_reply(message.content, x[:8], min_samples=1)
        content = statistics_reply(message.content, x)
        if node == 11:
            with_negative_variance(content)
        return content

    strategy, result, inputs = calibrated_round(trained_bn, digits, answer)
    reasons = strategy.left_out_statistics
    assert sorted(reasons) == [10, 11]
    assert reasons[10] == ("node 10: statistics over 8 inputs; at least 32 are required "
                           "(moments of a few samples reveal them)")
    assert "variances must be finite and >= 0, found [-1.0]" in reasons[11]
    assert all(f"statistics of node {n} left out: {r}" in caplog.text
               for n, r in reasons.items())
    fused = fused_pfnm(trained_bn)
    good = client_statistics(fused, inputs[12], mode="batch")
    calibrated = arrays_to_state_dict(result.arrays)
    for name, value in fusekit.calibrate(fused, [good]).state_dict.items():
        np.testing.assert_allclose(calibrated[name], value, rtol=1e-6, err_msg=name)
    assert result.train_metrics_clientapp[1]["pfnm.calibration-nodes"] == 1


def with_negative_variance(content):
    statistics = content["statistics"]
    var = statistics["bn_input:net.1.var"].numpy().copy()
    var[0] = -1.0
    statistics["bn_input:net.1.var"] = Array(var)


def test_without_usable_statistics_the_round_keeps_the_uncalibrated_fusion(trained_bn, digits,
                                                                           caplog):
    """An error, statistics of another model, of the other mode: nothing to pool; the
    round's global model is the fusion, and the failure is logged as an error."""
    clients, models = trained_bn
    other = Checkpoint.from_state_dict({k: v.numpy() for k, v in models[0].state_dict().items()},
                                       {"fusekit.arch": json.dumps(clients[0].checkpoint.arch)})

    def answer(node, message, x):
        if node == 10:
            return Error(code=3, reason="No query function registered with name 'statistics'")
        if node == 11:
            return statistics_content(client_statistics(other, x, mode="batch"))
        return statistics_content(client_statistics(query_checkpoint(message.content)[0], x))

    strategy, result, _ = calibrated_round(trained_bn, digits, answer)
    reasons = strategy.left_out_statistics
    assert "No query function registered" in reasons[10]
    assert "computed for model" in reasons[11]
    assert reasons[12] == "node 12: statistics in eval mode; the query asked for batch"
    assert "calibration failed: round 1 of 1 (statistics): no client sent usable statistics" in caplog.text
    for name, value in fused_pfnm(trained_bn).state_dict().items():
        np.testing.assert_array_equal(arrays_to_state_dict(result.arrays)[name], value)
    metrics = result.train_metrics_clientapp[1]
    assert metrics["pfnm.calibrated"] == 0 and "fusekit.calibration" not in (
        strategy.global_metadata)


def test_calibration_settings_and_models_it_leaves_alone(trained, caplog):
    with pytest.raises(ParameterError, match="calibrate: method 'ams' returns an ensemble"):
        FusekitStrategy("ams", calibrate=True)
    with pytest.raises(ParameterError, match="calibration_rounds: expected one of"):
        FusekitStrategy("pfnm", calibrate=True, calibration_rounds="two")
    with pytest.raises(ParameterError, match="calibration_min_samples"):
        FusekitStrategy("pfnm", calibrate=True, calibration_min_samples=0)
    # A model without BatchNorm: no query is sent, the fusion is the global model.
    caplog.set_level(logging.INFO, logger="fusekit")
    grid = Federation(lambda node, _: trained_replies(trained)[node - 10].content)
    strategy = FusekitStrategy("pfnm", fraction_evaluate=0, calibrate=True)
    result = strategy.start(grid, trained_replies(trained)[0].content["arrays"], num_rounds=1)
    assert grid.sent == ["train"] * 3
    assert result.train_metrics_clientapp[1]["pfnm.calibrated"] == 0
    assert "no BatchNorm layer and no REPAIR targets: nothing to calibrate" in caplog.text


@pytest.fixture(scope="module")
def trained_plain(digits):
    """Three MLP clients without BatchNorm, two hidden layers, from their own initial
    weights on non-iid digits."""
    config = SimulationConfig(clients=3, partition="dirichlet", alpha=0.5, arch="mlp:16,16",
                              train=TrainConfig(epochs=2))
    return with_modules(simulate_clients(digits, config))


@pytest.mark.parametrize("rounds", ["one-pass", "layerwise"])
def test_repair_targets_from_the_train_replies_calibrate_a_model_without_batchnorm(
        trained_plain, digits, rounds, caplog):
    """Each node's train reply carries its statistics of its own model: with them the
    strategy calibrates every hidden layer of a plain MLP (REPAIR), as
    ``calibrate_locally(..., clients=...)`` does with the nodes' data at hand."""
    caplog.set_level(logging.INFO, logger="fusekit")
    clients, _ = trained_plain
    grid, inputs = calibrating_federation(trained_plain, digits, targets=lambda node, x: x)
    strategy = FusekitStrategy("pfnm", fraction_evaluate=0, calibrate=True,
                               calibration_rounds=rounds)
    result = strategy.start(grid, trained_replies(trained_plain)[0].content["arrays"],
                            num_rounds=1)
    queries = 1 if rounds == "one-pass" else 2  # two hidden layers
    assert grid.sent == ["train"] * 3 + ["query.statistics"] * 3 * queries
    fused = fused_pfnm(trained_plain)
    expected = calibrate_locally(fused, [inputs[n] for n in sorted(inputs)],
                                 clients=[c.checkpoint for c in clients], rounds=rounds)
    calibrated = assert_same_model(result.arrays, expected.state_dict)
    assert not np.allclose(calibrated["net.0.weight"], fused.tensor("net.0.weight"))
    metrics = result.train_metrics_clientapp[1]
    assert metrics["pfnm.calibrated"] == 1 and metrics["pfnm.calibration-repair"] == 1
    assert metrics["pfnm.calibration-paired"] == 1  # each neuron read on its nodes' data
    assert metrics["pfnm.calibration-rounds"] == queries
    assert json.loads(strategy.global_metadata["fusekit.calibration"])["repair"] is True
    assert "REPAIR targets of every layer without BatchNorm" in caplog.text
    assert strategy.left_out_targets == {}


def test_statistics_over_other_inputs_than_the_targets_are_pooled(trained_plain, digits,
                                                                  caplog):
    """Node 10 answers the query over 40 of its inputs, not those of its targets: REPAIR
    cannot read each fused neuron on its matched nodes' data, and pools the nodes'
    statistics (``paired=False``), as logged."""
    caplog.set_level(logging.INFO, logger="fusekit")

    def answer(node, message, x):
        return statistics_reply(message.content, x[:40] if node == 10 else x)

    clients, _ = trained_plain
    grid, inputs = calibrating_federation(trained_plain, digits, answer, targets=lambda n, x: x)
    strategy = FusekitStrategy("pfnm", fraction_evaluate=0, calibrate=True)
    result = strategy.start(grid, trained_replies(trained_plain)[0].content["arrays"],
                            num_rounds=1)
    assert result.train_metrics_clientapp[1]["pfnm.calibration-paired"] == 0
    assert "REPAIR targets of every layer without BatchNorm (pooled)" in caplog.text
    fused = fused_pfnm(trained_plain)
    nodes = sorted(inputs)
    stats = [client_statistics(fused, inputs[n][:40] if n == 10 else inputs[n], mode="batch")
             for n in nodes]
    targets = [client_statistics(c.checkpoint, inputs[10 + c.index]) for c in clients]
    expected = fusekit.calibrate(fused, stats, targets=targets, paired=False)
    assert_same_model(result.arrays, expected.state_dict)


def test_without_every_nodes_targets_layers_without_batchnorm_are_left_as_they_are(
        trained_plain, digits, caplog):
    """A node that sent no statistics of its own model, one that sent them over too few
    inputs: each logged in one line; the plain MLP is not calibrated (no query)."""

    def targets(node, x):
        return {10: None, 11: x[:8]}.get(node, x)

    with pytest.raises(DataError, match="N >= 32"):  # the node refuses by default
        train_reply(trained_plain[1][1], 8, statistics_inputs=digits.x_train[:8])
    caplog.set_level(logging.INFO, logger="fusekit")
    grid, _ = calibrating_federation(trained_plain, digits, targets=targets, min_samples=1)
    strategy = FusekitStrategy("pfnm", fraction_evaluate=0, calibrate=True)
    result = strategy.start(grid, trained_replies(trained_plain)[0].content["arrays"],
                            num_rounds=1)
    reasons = strategy.left_out_targets
    assert sorted(reasons) == [10, 11]
    assert "node 10: no statistics of its own model in its train reply" in reasons[10]
    assert "node 11: statistics over 8 inputs; at least 32 are required" in reasons[11]
    assert all(f"REPAIR targets of node {n} unusable: {r}" in caplog.text
               for n, r in reasons.items())
    assert "REPAIR targets from 1 of 3 fused nodes" in caplog.text
    assert grid.sent == ["train"] * 3
    assert result.train_metrics_clientapp[1]["pfnm.calibrated"] == 0
    for name, value in fused_pfnm(trained_plain).state_dict().items():
        np.testing.assert_array_equal(arrays_to_state_dict(result.arrays)[name], value)


def test_targets_with_input_moments_the_model_has_not_are_left_out(trained_plain, digits):
    """Input moments of a point the model has not (its first layer's only, of its input
    dimension), checked before their values: that node's targets are unusable."""
    clients, _ = trained_plain
    inputs = {10 + c.index: digits.x_train[c.indices] for c in clients}
    replies = trained_replies(trained_plain, inputs=inputs)
    extra = replies[2].content["statistics"]
    extra["input:zzz.count"] = Array(np.array([1000.0]))
    extra["input:zzz.mean"] = Array(np.zeros(3))
    extra["input:zzz.cov"] = Array(np.eye(3))
    fused = fusekit.fuse([c.checkpoint for c in clients], method="pfnm")
    fused_replies = {r.metadata.src_node_id: (
        reply_checkpoint(r.content, f"node {r.metadata.src_node_id}"), r.content)
        for r in replies}
    strategy = FusekitStrategy("pfnm", calibrate=True)
    assert strategy.repair_targets(1, fused, fused_replies) == []
    assert sorted(strategy.left_out_targets) == [12]
    assert ("node 12: point 'input:zzz': not an input point of the model; expected "
            "'input:net.0'") in strategy.left_out_targets[12]


def test_statistics_reply_refuses_too_few_inputs_and_other_messages(trained_bn, digits):
    fused = fused_pfnm(trained_bn)
    content = statistics_query(fused.state_dict(), fused.metadata, [24, 24], "batch")
    with pytest.raises(DataError, match="N >= 32"):
        statistics_reply(content, digits.x_train[:31])
    with pytest.raises(CheckpointError, match="statistics query: expected"):
        statistics_reply(RecordDict({"config": ConfigRecord()}), digits.x_train)
    sent = statistics_reply(content, torch.as_tensor(digits.x_train[:40]))
    assert sorted(sent) == ["fusekit-stats", "statistics"]  # nothing but the aggregates
    assert all(a.numpy().shape == (24,) for a in sent["statistics"].values())
