"""FusekitStrategy's alignment and refit rounds (``alignment_rounds``) and the ClientApp's
answers to them, on real Flower Messages through a Grid stand-in (no network): the global
model is what ``align_locally`` gives with the nodes' data at hand; bad replies are left
out with their reason."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

pytest.importorskip("flwr", reason="needs the [flower] extra")

import test_flower
from flwr.app import Error, RecordDict
from test_flower import STOPPED, Federation, assert_same_model, with_modules

import fusekit
from fusekit import protocol
from fusekit.core.checkpoint import Checkpoint
from fusekit.core.errors import ParameterError
from fusekit.core.model_spec import fused_spec
from fusekit.flower import FusekitStrategy, kept_model, statistics_reply, train_reply
from fusekit.flower.records import query_checkpoint, statistics_query
from fusekit.toolkit.alignment import cross_statistics, refit_statistics
from fusekit.toolkit.calibration import client_statistics
from fusekit.toolkit.local import align_locally, calibrate_locally, refit_locally
from fusekit.toolkit.simulate import SimulationConfig, simulate_clients
from fusekit.toolkit.train import TrainConfig

# test_flower's fixtures: its digits, BatchNorm and plain MLP clients, its ServerApp
# identity.
digits, trained_bn = test_flower.digits, test_flower.trained_bn
trained_plain = test_flower.trained_plain
serverapp_identity = test_flower.serverapp_identity


class Nodes:
    """Nodes 10-12: each trains (its client's model), keeps it in its own state and answers
    every statistics query with ``statistics_reply(..., own_model=kept_model(state))`` on
    its training inputs, unless ``answer(node, message, inputs, state)`` is given."""

    def __init__(self, trained, digits, answer=None):
        clients, models = trained
        self.inputs = {10 + c.index: digits.x_train[c.indices] for c in clients}
        self.states = {node: RecordDict() for node in self.inputs}
        self.replies = {
            10 + c.index: train_reply(model, len(c.indices),
                                      c.checkpoint.class_counts.astype(int).tolist(),
                                      statistics_inputs=self.inputs[10 + c.index],
                                      input_moments=True, keep_in=self.states[10 + c.index])
            for c, model in zip(clients, models, strict=True)}
        self.answer = answer or (lambda node, m, x, state: statistics_reply(
            m.content, x, own_model=kept_model(state)))
        self.grid = Federation(lambda node, _: self.replies[node],
                               lambda node, m: self.answer(node, m, self.inputs[node],
                                                           self.states[node]))

    def run(self, **options):
        strategy = FusekitStrategy("pfnm", fraction_evaluate=0, calibrate=True,
                                   calibration_rounds="layerwise", **options)
        result = strategy.start(self.grid, self.replies[10]["arrays"], num_rounds=1)
        return strategy, result


def assert_the_calibrated_fusion(result, nodes, clients):
    """The round's global model is the fusion calibrated (layer by layer, the first layer
    from the input moments), not aligned."""
    metrics = result.train_metrics_clientapp[1]
    assert metrics["pfnm.aligned"] == 0 and metrics["pfnm.calibrated"] == 1
    inputs = [nodes.inputs[n] for n in sorted(nodes.inputs)]
    expected = calibrate_locally(fused_pfnm(clients), inputs,
                                 clients=[c.checkpoint for c in clients], input_moments=True)
    assert_same_model(result.arrays, expected.state_dict)


def fused_pfnm(clients):
    result = fusekit.fuse([c.checkpoint for c in clients], method="pfnm")
    return Checkpoint.from_state_dict(result.state_dict, result.metadata)


@pytest.mark.parametrize("refit", [True, False])
def test_alignment_and_refit_rounds_give_what_align_locally_gives(trained_bn, digits, refit,
                                                                  caplog):
    """Calibration layer by layer (the first layer from the input moments the train replies
    carry: no query), one alignment round, then a refit round per layer (or a calibration):
    the global model equals ``align_locally``'s on the same nodes' models and data."""
    caplog.set_level(logging.INFO, logger="fusekit")
    clients, _ = trained_bn
    nodes = Nodes(trained_bn, digits)
    strategy, result = nodes.run(alignment_rounds=1, refit=refit)
    inputs = [nodes.inputs[n] for n in sorted(nodes.inputs)]
    expected = align_locally(fused_pfnm(clients), [c.checkpoint for c in clients], inputs,
                             refit=refit)
    assert_same_model(result.arrays, expected.state_dict)
    # Calibration: 1 query (layer 2; layer 1 derived); an alignment query; then 3 refit
    # queries (two hidden layers and the output) or a calibration (1 query again).
    queries = 1 + 1 + (3 if refit else 1)
    assert nodes.grid.sent == ["train"] * 3 + ["query.statistics"] * 3 * queries
    metrics = result.train_metrics_clientapp[1]
    assert metrics["pfnm.aligned"] == 1 and metrics["pfnm.alignment-rounds"] == 1
    assert metrics["pfnm.refit-rounds"] == (3 if refit else 0)
    assert metrics["pfnm.alignment-nodes"] == 3
    correlation = expected.report["alignment"][0]["mean_correlation"]
    assert metrics["pfnm.alignment-correlation"] == pytest.approx(correlation)
    alignment = json.loads(strategy.global_metadata["fusekit.alignment"])
    assert alignment["rounds"] == 1 and alignment["refit"] is refit
    assert "the first layer from the nodes' input moments" in caplog.text
    assert strategy.left_out_alignment == {}


def test_a_bad_cross_statistics_reply_is_left_out_and_the_others_are_aligned(
        trained_bn, digits, caplog):
    """Node 10's ClientApp fails the alignment query; nodes 11 and 12 are aligned and refit
    (the global model is ``align_locally``'s with their models and data)."""
    caplog.set_level(logging.INFO, logger="fusekit")

    def answer(node, message, x, state):
        if node == 10 and message.content["config"]["fusekit-stats-kind"] != "channels":
            return Error(code=3, reason="no own model kept")
        return statistics_reply(message.content, x, own_model=kept_model(state))

    clients, _ = trained_bn
    nodes = Nodes(trained_bn, digits, answer)
    strategy, result = nodes.run(alignment_rounds=1)
    assert list(strategy.left_out_alignment) == [10]
    assert "no own model kept" in strategy.left_out_alignment[10]
    assert "cross statistics of node 10 left out: the ClientApp failed" in caplog.text
    assert result.train_metrics_clientapp[1]["pfnm.alignment-nodes"] == 2
    # What align_locally gives from the same calibrated fusion with nodes 11 and 12.
    inputs = [nodes.inputs[n] for n in sorted(nodes.inputs)]
    calibrated = calibrate_locally(fused_pfnm(clients), inputs,
                                   clients=[c.checkpoint for c in clients])
    reference = Checkpoint.from_state_dict(calibrated.state_dict, calibrated.metadata)
    others = [c.checkpoint for c in clients[1:]]
    aligned = fusekit.align(reference, others, [cross_statistics(reference, c, x)
                                                for c, x in zip(others, inputs[1:], strict=True)])
    expected = refit_locally(Checkpoint.from_state_dict(aligned.state_dict, aligned.metadata),
                             others, inputs[1:])
    assert_same_model(result.arrays, expected.state_dict)


def test_a_refit_round_goes_on_with_the_nodes_that_answered(trained_bn, digits, caplog):
    """Node 11 answers the first refit query with statistics of another layer: it is left
    out of that round, which refits with nodes 10 and 12 (the protocol's rule for a node
    that did not answer, as the service's); it takes part in the next refit rounds again.
    The global model is what the protocol gives with the data at hand and the same
    replies."""
    caplog.set_level(logging.INFO, logger="fusekit")
    clients, _ = trained_bn

    def answer(node, message, x, state):
        config = message.content["config"]
        if node == 11 and config.get("fusekit-refit-layer") == "net.0":
            content = RecordDict(message.content)
            content["config"] = type(config)({**config, "fusekit-refit-layer": "net.3"})
            return statistics_reply(content, x, own_model=kept_model(state))
        return statistics_reply(message.content, x, own_model=kept_model(state))

    nodes = Nodes(trained_bn, digits, answer)
    strategy, result = nodes.run(alignment_rounds=1)
    assert list(strategy.left_out_alignment) == [11]
    assert "the query asked for 'net.0'" in strategy.left_out_alignment[11]
    metrics = result.train_metrics_clientapp[1]
    assert metrics["pfnm.aligned"] == 1 and metrics["pfnm.refit-rounds"] == 3
    assert metrics["pfnm.alignment-nodes"] == 3
    # The same rounds with every node's data at hand, node 11 silent in the first refit.
    inputs = [nodes.inputs[n] for n in sorted(nodes.inputs)]
    expected = refit_without(fused_pfnm(clients), [c.checkpoint for c in clients], inputs, 1)
    assert_same_model(result.arrays, expected.state_dict())


def test_nodes_that_stop_are_named_and_the_rounds_go_on(trained_bn, digits, caplog):
    """Node 12 stops while training and node 11 during the first refit query: the
    SuperLink answers for each (its error comes from the SuperLink, not the node). Each is
    named by its own node id as having stopped; the round fuses nodes 10 and 11, and the
    refit rounds go on with node 10 alone (node 11 is asked again and has stopped)."""
    caplog.set_level(logging.INFO, logger="fusekit")

    def answer(node, message, x, state):
        if node == 11 and message.content["config"]["fusekit-stats-kind"] == "refit":
            return STOPPED
        return statistics_reply(message.content, x, own_model=kept_model(state))

    clients, _ = trained_bn
    nodes = Nodes(trained_bn, digits, answer)
    train = nodes.grid.handlers["train"]
    nodes.grid.handlers["train"] = lambda node, m: STOPPED if node == 12 else train(node, m)
    strategy, result = nodes.run(alignment_rounds=1)
    stopped = "the node stopped answering (error 5: Error: Node Unavailable"
    assert list(strategy.left_out) == [12] and strategy.left_out[12].startswith(stopped)
    assert list(strategy.left_out_alignment) == [11]
    assert strategy.left_out_alignment[11].startswith(stopped)
    assert f"refit statistics of node 11 left out: {stopped}" in caplog.text
    metrics = result.train_metrics_clientapp[1]
    assert metrics["pfnm.fused-replies"] == 2 and metrics["pfnm.alignment-nodes"] == 2
    assert metrics["pfnm.refit-rounds"] == 3
    # The protocol's rounds with nodes 10 and 11's models and data, node 11 silent from
    # the first refit round on.
    inputs = [nodes.inputs[n] for n in (10, 11)]
    models = [c.checkpoint for c in clients[:2]]
    expected = protocol_with_nodes_killed(fused_pfnm(clients[:2]), models, inputs,
                                          {protocol.REFIT: 1}, input_moments=True)
    assert_same_model(result.arrays, expected.model.state_dict())


def protocol_with_nodes_killed(fused, models, inputs, killed, input_moments=False,
                               misses_first=None):
    """The strategy's rounds (:func:`fusekit.protocol.plan`: REPAIR layer by layer, the
    first layer from the input moments with ``input_moments``, one alignment round, a
    refit round per layer) with every node's data at hand, each node's REPAIR targets
    those its train reply carries; ``killed``: kind of round -> the node (index) that
    answers no round from the first of that kind on; ``misses_first``: kind of round ->
    the node that misses the first round of that kind and answers the others. The last
    state."""
    targets = {k: client_statistics(m, x, input_moments=input_moments)
               for k, (m, x) in enumerate(zip(models, inputs, strict=True))}
    plan = protocol.plan(fused_spec(fused), calibration="layerwise",
                         repair=True, derive_first=input_moments, alignment_rounds=1)
    state = protocol.start(fused, plan, dict(enumerate(models)), targets=targets,
                           min_fused=2)
    dead, seen = set(), set()
    while not state.done:
        round_ = state.round
        dead |= {node for kind, node in killed.items() if kind == round_.kind}
        silent = dead | {node for kind, node in (misses_first or {}).items()
                         if kind == round_.kind and kind not in seen}
        seen.add(round_.kind)
        state = protocol.advance(state, {key: local_reply(state, key, inputs[key])
                                         for key in state.participants if key not in silent}
                                 if round_.asks else {})
    return state


def local_reply(state, key, x):
    """What node ``key`` answers the query of ``state``'s round, on its inputs ``x``."""
    round_, model = state.round, state.model
    if round_.calibrates:
        return client_statistics(model, x, mode=round_.mode)
    if round_.kind == protocol.CROSS:
        return cross_statistics(model, state.clients[key], x)
    return refit_statistics(model, state.clients[key], x, round_.layer)


def refit_without(fused, models, inputs, silent):
    """The fusion calibrated, aligned and refit with every client's data at hand, client
    ``silent`` missing the first refit round; checks that its absence changes that round."""
    calibrated = calibrate_locally(fused, inputs, clients=models)
    reference = Checkpoint.from_state_dict(calibrated.state_dict, calibrated.metadata)
    aligned = fusekit.align(reference, models, [cross_statistics(reference, c, x)
                                                for c, x in zip(models, inputs, strict=True)])
    current = Checkpoint.from_state_dict(aligned.state_dict, aligned.metadata)
    layers = [layer.name for layer in fused_spec(current).layers]
    everyone = range(len(models))

    def refit(model, answering, layer):
        refit = fusekit.refit(model, [models[i] for i in answering],
                              [refit_statistics(model, models[i], inputs[i], layer)
                               for i in answering])
        return Checkpoint.from_state_dict(refit.state_dict, refit.metadata)

    expected = refit(current, [i for i in everyone if i != silent], layers[0])
    assert not np.allclose(expected.tensor(f"{layers[0]}.weight"),
                           refit(current, everyone, layers[0]).tensor(f"{layers[0]}.weight"))
    for layer in layers[1:]:
        expected = refit(expected, everyone, layer)
    return expected


def test_alignment_settings_and_queries_a_node_cannot_answer(trained_bn, digits):
    with pytest.raises(ParameterError, match="alignment_rounds: needs calibrate=True"):
        FusekitStrategy("pfnm", alignment_rounds=1)
    with pytest.raises(ParameterError, match=r"alignment_rounds: expected an integer in"):
        FusekitStrategy("pfnm", calibrate=True, alignment_rounds=-1)
    with pytest.raises(ParameterError, match="refit: expected true or false"):
        FusekitStrategy("pfnm", calibrate=True, alignment_rounds=1, refit="yes")
    clients, _ = trained_bn
    fused = fused_pfnm(clients)
    query = statistics_query(fused.state_dict(), fused.metadata, [24, 24], "eval", "cross")
    with pytest.raises(ParameterError, match="own_model: the query asks for cross statistics"):
        statistics_reply(query, digits.x_train)
    assert kept_model(RecordDict()) is None


def test_too_few_usable_cross_statistics_keep_the_calibrated_fusion(trained_bn, digits,
                                                                    caplog):
    """Nodes 10 and 11 answer the alignment query with calibration's statistics: one usable
    reply is fewer than the two a fusion needs; no refit query is sent and the round's
    global model is the calibrated fusion."""

    def answer(node, message, x, state):
        if node in (10, 11) and message.content["config"]["fusekit-stats-kind"] == "cross":
            return statistics_reply(statistics_query(
                **query_arguments(message.content), kind="channels"), x)
        return statistics_reply(message.content, x, own_model=kept_model(state))

    clients, _ = trained_bn
    nodes = Nodes(trained_bn, digits, answer)
    strategy, result = nodes.run(alignment_rounds=1)
    assert sorted(strategy.left_out_alignment) == [10, 11]
    assert "expected an ArrayRecord 'cross-statistics'" in strategy.left_out_alignment[10]
    assert ("alignment stopped: round 3 of 6 (cross): usable cross statistics from 1 "
            "client(s), fewer than the 2 an alignment re-fuses") in caplog.text
    assert nodes.grid.sent == ["train"] * 3 + ["query.statistics"] * 3 * 2
    assert_the_calibrated_fusion(result, nodes, clients)


def query_arguments(content):
    """``statistics_query``'s arguments that rebuild the query ``content`` is."""
    query = query_checkpoint(content)
    return {"state_dict": query.model.state_dict(), "metadata": query.model.metadata,
            "widths": list(content["config"]["fusekit-widths"]), "mode": query.mode}


@pytest.fixture(scope="module")
def trained_conv(digits):
    """Three small ConvNets (two conv layers, a linear layer) from their own initial
    weights, non-iid."""
    config = SimulationConfig(clients=3, partition="dirichlet", alpha=0.5, arch="conv:4,8/16",
                              train=TrainConfig(epochs=1))
    return with_modules(simulate_clients(digits, config))


def test_a_convnet_is_aligned_and_refit_as_align_locally_does(trained_conv, digits):
    """Conv layers: the cross statistics count every position, the refit moments are over
    the fused model's patches, the first conv's input moments over zero-padded patches."""
    clients, _ = trained_conv
    nodes = Nodes(trained_conv, digits)
    _, result = nodes.run(alignment_rounds=1)
    inputs = [nodes.inputs[n] for n in sorted(nodes.inputs)]
    expected = align_locally(fused_pfnm(clients), [c.checkpoint for c in clients], inputs)
    assert_same_model(result.arrays, expected.state_dict)
    metrics = result.train_metrics_clientapp[1]
    # REPAIR on the 3 hidden layers, the first from the input moments: 2 queries; then an
    # alignment query and 4 refit queries.
    assert metrics["pfnm.calibration-rounds"] == 2 and metrics["pfnm.refit-rounds"] == 4


def test_the_first_layer_from_input_moments_and_paired_repair_as_calibrate_locally(
        trained_plain, digits, caplog):
    """A plain MLP, layer by layer: the first hidden layer from the nodes' input moments
    (no query), the second from a query round, both with paired REPAIR: what
    ``calibrate_locally(..., input_moments=True)`` gives."""
    caplog.set_level(logging.INFO, logger="fusekit")
    clients, _ = trained_plain
    nodes = Nodes(trained_plain, digits)
    _, result = nodes.run()
    assert nodes.grid.sent == ["train"] * 3 + ["query.statistics"] * 3
    inputs = [nodes.inputs[n] for n in sorted(nodes.inputs)]
    expected = calibrate_locally(fused_pfnm(clients), inputs,
                                 clients=[c.checkpoint for c in clients], input_moments=True)
    assert_same_model(result.arrays, expected.state_dict)
    metrics = result.train_metrics_clientapp[1]
    assert metrics["pfnm.calibration-rounds"] == 1 and metrics["pfnm.calibration-paired"] == 1
    assert "REPAIR targets of every layer without BatchNorm (paired)" in caplog.text
