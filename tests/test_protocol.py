"""fusekit.protocol: the plan of rounds every driver runs, and its rule for a client that
does not answer (the round goes on with those that did)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

import fusekit
from conftest import mlp, numpy_state
from fusekit import protocol
from fusekit.core.checkpoint import Checkpoint
from fusekit.core.errors import ParameterError, StatisticsError
from fusekit.core.model_spec import fused_spec
from fusekit.core.spec import infer_spec, permute
from fusekit.core.transformer import TransformerSpec
from fusekit.protocol import CROSS, DERIVED, REFIT, STATISTICS, Round
from fusekit.toolkit.alignment import cross_statistics, refit_statistics
from fusekit.toolkit.local import run_locally


def _family() -> tuple[list[Checkpoint], np.ndarray]:
    """A BatchNorm MLP and two permuted copies (one function), and inputs."""
    state = numpy_state(mlp((6, 8, 7, 3), batchnorm=True, seed=0))
    model = Checkpoint.from_state_dict(state, {"fusekit.num_samples": "64"})
    spec = infer_spec({k: v.shape for k, v in model.tensors.items()})
    copies = []
    for seed in (1, 2):
        rng = np.random.default_rng(seed)
        perms = [rng.permutation(w) for w in spec.hidden_widths]
        copies.append(Checkpoint.from_state_dict(permute(state, spec, perms),
                                                 {"fusekit.num_samples": str(50 + seed)}))
    return [model, *copies], np.random.default_rng(0).normal(size=(64, 6)).astype(np.float32)


def _outputs(checkpoint: Checkpoint, x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return fusekit.load_fused(checkpoint, "cpu")(torch.from_numpy(x)).numpy()


def test_the_plan_of_each_protocol():
    clients, _ = _family()
    spec = fused_spec(clients[0])
    first, second, out = (layer.name for layer in spec.layers)
    assert protocol.plan(spec) == [Round(STATISTICS, None, "batch")]
    layerwise = [Round(DERIVED, (first,), "eval"), Round(STATISTICS, (second,), "eval")]
    assert protocol.plan(spec, calibration="layerwise", derive_first=True) == layerwise
    refits = [Round(REFIT, layer=name) for name in (first, second, out)]
    assert protocol.plan(spec, calibration="layerwise", derive_first=True,
                         alignment_rounds=2) == [*layerwise, Round(CROSS), *layerwise,
                                                 Round(CROSS), *refits]
    assert protocol.plan(spec, alignment_rounds=1, refit=False) == [
        Round(STATISTICS, None, "batch"), Round(CROSS), Round(STATISTICS, None, "batch")]
    for round_ in [*layerwise, Round(CROSS), *refits]:  # as the service's jobs record them
        assert Round.from_dict(round_.as_dict()) == round_
    plain = infer_spec({k: v.shape for k, v in numpy_state(mlp((6, 8, 3))).items()})
    assert protocol.plan(plain) == []  # no BatchNorm, no REPAIR targets: nothing to do
    assert protocol.plan(plain, repair=True) == [Round(STATISTICS, None, "batch")]
    with pytest.raises(ParameterError, match="calibration: expected one of"):
        protocol.plan(spec, calibration="twice")


def test_calibration_rounds_of_chosen_layers_and_of_a_transformer():
    """calibrate_locally's rounds: only the layers asked for, input to output; a
    transformer's points layer by layer in the order its forward pass reaches them."""
    clients, _ = _family()
    spec = fused_spec(clients[0])
    first, second, _ = (layer.name for layer in spec.layers)
    assert protocol.calibration_rounds(spec, "layerwise", layers=[second, first]) == [
        Round(STATISTICS, (first,), "eval"), Round(STATISTICS, (second,), "eval")]
    assert protocol.calibration_rounds(spec, layers=[second]) == [
        Round(STATISTICS, (second,), "batch")]
    transformer = TransformerSpec("vit", ())
    order = ["vit.layers.0.ln1", "vit.layers.0.mlp.fc1", "vit.ln_f"]
    assert protocol.calibration_rounds(transformer, "layerwise", derive_first=True,
                                       layers=[order[2], order[0]], order=order) == [
        Round(STATISTICS, (order[0],), "eval"), Round(STATISTICS, (order[2],), "eval")]
    assert protocol.calibration_rounds(transformer) == [Round(STATISTICS, None, "eval")]
    with pytest.raises(ParameterError, match="layer by layer in the order its forward pass"):
        protocol.calibration_rounds(transformer, "layerwise")


def test_a_refit_round_goes_on_with_the_clients_that_answered():
    """Client 2 sends nothing in any refit round: each fused neuron is fit to clients 0
    and 1's neurons matched into it, which compute the same function; the refit model
    gives it back, and each round records whom it missed."""
    clients, x = _family()
    fused = fusekit.fuse(clients, "avg")  # the copies averaged unmatched: another function
    fused = Checkpoint.from_state_dict(fused.state_dict, fused.metadata)
    spec = fused_spec(fused)
    state = protocol.start(fused, [Round(CROSS), *(Round(REFIT, layer=layer.name)
                                                   for layer in spec.layers)],
                           dict(enumerate(clients)), min_samples=16)
    state = protocol.advance(state, {k: cross_statistics(state.model, c, x, min_samples=16)
                                     for k, c in enumerate(clients)})
    while not state.done:
        state = protocol.advance(state, {k: refit_statistics(
            state.model, clients[k], x, state.round.layer, min_samples=16) for k in (0, 1)})
    assert [done["missing"] for done in state.history] == [[], [2], [2], [2]]
    assert state.participants == [0, 1, 2]  # a refit round leaves nobody out of the next
    np.testing.assert_allclose(_outputs(state.model, x), _outputs(clients[0], x),
                               rtol=1e-3, atol=1e-3)


def test_a_round_without_enough_usable_replies_cannot_go_on():
    clients, x = _family()
    fused = fusekit.fuse(clients, "avg")
    fused = Checkpoint.from_state_dict(fused.state_dict, fused.metadata)
    state = protocol.start(fused, [Round(STATISTICS, None, "batch"), Round(CROSS)],
                           dict(enumerate(clients)), min_fused=2, min_samples=16)
    with pytest.raises(StatisticsError, match=r"round 1 of 2 \(statistics\): no client sent "
                                              "usable statistics"):
        protocol.advance(state, {})
    state = run_locally(replace(state, plan=state.plan[:1]), [x] * 3)
    state = replace(state, plan=[Round(CROSS)], index=0)
    with pytest.raises(StatisticsError, match="from 1 client.s., fewer than the 2"):
        protocol.advance(state, {0: cross_statistics(state.model, clients[0], x,
                                                     min_samples=16)})
