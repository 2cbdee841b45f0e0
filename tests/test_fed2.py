"""Fed²: the grouped structure (Fed² paper §4-5.1) and feature-paired averaging (Eq. 18-19)."""

import json

import numpy as np
import pytest
import torch

import fusekit
from fusekit.core.arch import convnet_arch, mlp_arch, validate_arch
from fusekit.core.checkpoint import Checkpoint
from fusekit.core.errors import IncompatibleModelsError, SpecError
from fusekit.core.fed2 import allocate_classes, group_sizes, layer_masks, validate_fed2
from fusekit.toolkit.data import load_dataset
from fusekit.toolkit.nn import build_model
from fusekit.toolkit.nn.preprocess import attach_normalization
from fusekit.toolkit.simulate import SimulationConfig, simulate_clients
from fusekit.toolkit.train import TrainConfig, train_model


def fed2_mlp(hidden=(6, 5), classes=4, groups=2, depth=3, order=None):
    arch = mlp_arch(8, list(hidden), classes)
    settings = {"groups": groups, "depth": depth}
    if order is not None:
        settings["classes"] = order
    return validate_arch({**arch, "fed2": settings})


def test_group_allocation_hand_computed():
    # 10 classes over 4 groups: contiguous blocks, the first 10 mod 4 = 2 groups larger.
    assert allocate_classes(10, 4) == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    assert allocate_classes(10, 10) == [[k] for k in range(10)]  # one class per group
    assert group_sizes(10, 4) == [3, 3, 2, 2]
    # MLP 8-6-5-4, G=2, depth 3: layer 0 reads the input (dense, grouped output: no mask),
    # layer 1 is group-wise (6 = 3+3 inputs, 5 = 3+2 outputs), logits {0,1} -> group 0.
    masks = layer_masks(fed2_mlp()["fed2"], [6, 5], 4)
    assert masks[0] is None
    np.testing.assert_array_equal(masks[1].astype(int), [
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [0, 0, 0, 1, 1, 1],
        [0, 0, 0, 1, 1, 1]])
    np.testing.assert_array_equal(masks[2].astype(int), [
        [1, 1, 1, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 1, 1], [0, 0, 0, 1, 1]])
    # depth 2: the last hidden layer branches densely off the shared layer below.
    masks = layer_masks(fed2_mlp(depth=2)["fed2"], [6, 5], 4)
    assert masks[:2] == [None, None] and masks[2].shape == (4, 5)


def test_gradients_of_a_class_stay_in_its_group():
    # Gradient redirection (Eq. 16): the loss of class 3 reaches group 1 only.
    model = build_model(fed2_mlp(), seed=0)
    # Own seeded inputs, enough that every ReLU unit is active on some (with 5 draws of the
    # global generator a unit was sometimes dead on all, its gradient 0, by test order).
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    model(x)[:, 3].sum().backward()
    grouped, logits = model.net[2], model.net[4]
    assert (grouped.weight.grad[:3] == 0).all() and (grouped.weight.grad[3:] != 0).any()
    assert (logits.weight.grad[:3] == 0).all()
    assert (logits.weight.grad[3, :3] == 0).all() and (logits.weight.grad[3, 3:] != 0).all()


def test_masked_weights_stay_zero_through_training():
    arch = validate_arch({**convnet_arch((1, 8, 8), [4, 6], 4, hidden=[6]),
                          "fed2": {"groups": 2, "depth": 3}})
    model = build_model(arch, seed=1)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(40, 1, 8, 8)).astype(np.float32), rng.integers(0, 4, 40)
    train_model(model, x, y, TrainConfig(epochs=2, batch_size=8, weight_decay=1e-3), seed=0)
    for layer in (model.net[-3], model.net[-1]):
        assert (layer.weight[layer.mask.expand_as(layer.weight) == 0] == 0).all()
        assert (layer.weight[layer.mask.expand_as(layer.weight) == 1] != 0).all()


def test_invalid_structures_are_refused():
    for bad, needle in [({"groups": 5, "depth": 2}, "1 <= G <= 4"),
                        ({"groups": 2, "depth": 1}, "2 <= depth"),
                        ({"groups": 2, "depth": 4}, "2 <= depth"),
                        ({"groups": 2, "depth": 2, "classes": [[0, 1], [1, 2]]}, "once"),
                        ({"groups": 2, "depth": 2, "size": 1}, "unknown")]:
        with pytest.raises(SpecError, match=needle):
            validate_arch({**mlp_arch(8, [6, 5], 4), "fed2": bad})
    with pytest.raises(SpecError, match="fewer than"):
        validate_arch({**mlp_arch(8, [6, 1], 4), "fed2": {"groups": 2, "depth": 2}})


def random_client(arch, seed, samples):
    model = build_model(arch, seed=seed)
    with torch.no_grad():  # non-zero biases, so that pairing them is checked too
        for p in model.parameters():
            if p.ndim == 1:
                p.normal_()
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    return Checkpoint.from_state_dict(state, {"fusekit.arch": json.dumps(arch),
                                              "fusekit.num_samples": str(samples)})


def test_feature_paired_averaging_equals_numpy_reference():
    # Groups of 3 and 2 neurons (width 5) cannot be paired with their order swapped.
    uneven = [random_client(fed2_mlp(order=order), s, 10)
              for s, order in enumerate([[[0, 1], [2, 3]], [[2, 3], [0, 1]]])]
    with pytest.raises(IncompatibleModelsError, match="different number of neurons"):
        fusekit.fuse(uneven, "fed2")
    arch_6 = fed2_mlp(hidden=(6, 6), order=[[0, 1], [2, 3]])
    swapped_6 = fed2_mlp(hidden=(6, 6), order=[[3, 2], [1, 0]])
    clients = [random_client(arch_6, 0, 10), random_client(swapped_6, 1, 30),
               random_client(arch_6, 2, 20)]
    result = fusekit.fuse(clients, "fed2")
    reference_classes = json.loads(result.metadata["fusekit.arch"])["fed2"]["classes"]
    canonical = [next(c for c in clients if c.content_hash == h)
                 for h in json.loads(result.metadata["fusekit.inputs"])]
    weights = np.array([c.num_samples for c in canonical], dtype=np.float64) / 60
    expected = paired_average_reference(canonical, weights, reference_classes)
    for name, value in expected.items():
        np.testing.assert_allclose(result.state_dict[name], value, rtol=1e-6, atol=1e-6,
                                   err_msg=name)
    # Every client shares one allocation: feature pairing is coordinate averaging (FedAvg).
    same = [random_client(arch_6, s, 10 + s) for s in range(3)]
    fed2, avg = fusekit.fuse(same, "fed2"), fusekit.fuse(same, "avg")
    for name in avg.state_dict:
        np.testing.assert_array_equal(fed2.state_dict[name], avg.state_dict[name])


def paired_average_reference(clients, weights, reference_classes):
    """Eq. 18-19 for the 8-6-6-4 MLP, G=2, depth 3 (groups of 3 neurons), with slices."""
    block = [slice(0, 3), slice(3, 6)]
    total = {n: np.zeros(clients[0].tensors[n].shape) for n in clients[0].tensors}
    for c, w in zip(clients, weights, strict=True):
        own = [set(b) for b in c.arch["fed2"]["classes"]]
        for g, classes in enumerate(reference_classes):
            h = own.index(set(classes))  # the client's group holding the same logits
            rows, src = block[g], block[h]
            total["net.0.weight"][rows] += w * c.tensor("net.0.weight")[src]
            total["net.0.bias"][rows] += w * c.tensor("net.0.bias")[src]
            total["net.2.weight"][rows, rows] += w * c.tensor("net.2.weight")[src, src]
            total["net.2.bias"][rows] += w * c.tensor("net.2.bias")[src]
            total["net.4.weight"][classes, rows] += w * c.tensor("net.4.weight")[classes][:, src]
        total["net.4.bias"] += w * c.tensor("net.4.bias")
    return total


def test_fed2_refuses_plain_clients_and_permuting_methods_refuse_fed2(tmp_path):
    plain = [random_client(mlp_arch(8, [6], 4), s, 10) for s in range(2)]
    with pytest.raises(IncompatibleModelsError, match="Fed² models"):
        fusekit.fuse(plain, "fed2")
    grouped = [random_client(fed2_mlp(), s, 10) for s in range(2)]
    for method in ("pfnm", "ot"):
        with pytest.raises(IncompatibleModelsError, match="Fed²"):
            fusekit.fuse(grouped, method)


def test_simulated_fed2_clients_round_trip_through_load_fused(tmp_path):
    data = load_dataset("digits")
    config = SimulationConfig(clients=3, arch="mlp:20,20", fed2={"groups": 5, "depth": 2},
                              shared_init=True, train=TrainConfig(epochs=1))
    clients = simulate_clients(data, config, out_dir=tmp_path / "clients")
    assert all(c.checkpoint.arch["fed2"]["classes"] == allocate_classes(10, 5) for c in clients)
    saved = fusekit.fuse([c.path for c in clients], "fed2").save(tmp_path / "fused.safetensors")
    model = fusekit.load_fused(saved, device="cpu")
    assert type(model.net[4]).__name__ == "GroupMaskedLinear"  # the decoupled logit layer
    stored = fusekit.load_checkpoint(saved)
    assert stored.arch["fed2"]["groups"] == 5
    assert stored.preprocess == data.normalization  # the clients' inputs, carried
    rebuilt = attach_normalization(build_model(stored.arch), stored.preprocess, "fused")
    rebuilt.load_state_dict({k: torch.from_numpy(stored.tensor(k).copy()) for k in stored.tensors})
    x = torch.from_numpy(data.x_test[:16])
    with torch.no_grad():
        torch.testing.assert_close(model(x), rebuilt(x))
        assert (model.net[4].weight[model.net[4].mask == 0] == 0).all()


@pytest.mark.parametrize("as_json", [False, True])
def test_cli_fuse_fed2(tmp_path, as_json):
    from typer.testing import CliRunner

    from fusekit._cli.app import app
    from fusekit.core.checkpoint import save_checkpoint

    paths = []
    for s in range(2):
        client = random_client(fed2_mlp(hidden=(6, 6)), s, 10 + s)
        paths.append(save_checkpoint(tmp_path / f"c{s}.safetensors", client.state_dict(),
                                     client.metadata))
    out = tmp_path / "fused.safetensors"
    args = ["fuse", *map(str, paths), "--method", "fed2", "--uniform", "-o", str(out)]
    result = CliRunner().invoke(app, args + (["--json"] if as_json else []))
    assert result.exit_code == 0, result.output
    if as_json:
        assert json.loads(result.stdout)["params"] == {"uniform": True}
    expected = [fusekit.load_checkpoint(p) for p in paths]
    mean = (expected[0].tensor("net.0.bias") + expected[1].tensor("net.0.bias")) / 2
    np.testing.assert_allclose(fusekit.load_checkpoint(out).tensor("net.0.bias"), mean,
                               rtol=1e-6)


@pytest.mark.parametrize(("settings", "message"), [
    ([1], "arch.fed2: expected null or an object, found list"),
    ({"y": 2}, "arch.fed2: unknown key(s) ['y']; allowed groups, depth, classes"),
])
def test_fed2_settings_must_be_an_object_of_known_keys(settings, message):
    with pytest.raises(SpecError) as refused:
        validate_fed2(settings, num_classes=10, widths=[10, 10])
    assert str(refused.value) == message
