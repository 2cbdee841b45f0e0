"""fusekit.toolkit.simulate and `fusekit simulate`: checkpoints, metadata, determinism, PANs."""

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import fusekit
from fusekit._cli.app import app
from fusekit.core.checkpoint import load_checkpoint
from fusekit.core.errors import OutputError, ParameterError, SpecError
from fusekit.core.metadata import SIMULATION
from fusekit.toolkit.data import synthetic
from fusekit.toolkit.evaluate import evaluate_checkpoints
from fusekit.toolkit.nn import load_model, pan_buffer_names
from fusekit.toolkit.simulate import SimulationConfig, simulate_clients
from fusekit.toolkit.train import FedNLRConfig, TrainConfig

DATA = synthetic(samples=400, features=8, classes=4, seed=0)
FAST = TrainConfig(epochs=2, batch_size=32, lr=1e-2)


def _config(**changes):
    base = {"clients": 3, "arch": "mlp:12", "train": FAST, "min_samples": 5}
    return SimulationConfig(**{**base, **changes})


def test_writes_one_checkpoint_per_client_with_metadata(tmp_path):
    clients = simulate_clients(DATA, _config(), out_dir=tmp_path)
    paths = sorted(tmp_path.glob("*.safetensors"))
    assert [p.name for p in paths] == [f"client_0{i}.safetensors" for i in range(3)]
    total = np.zeros(DATA.num_classes)
    for client, path in zip(clients, paths, strict=True):
        ckpt = load_checkpoint(path)
        assert ckpt.num_samples == len(client.indices)
        counts = np.bincount(DATA.y_train[client.indices], minlength=DATA.num_classes)
        np.testing.assert_array_equal(ckpt.class_counts, counts)
        total += ckpt.class_counts
        assert ckpt.arch["hidden"] == [12] and ckpt.arch["pan"] is None
        assert json.loads(ckpt.metadata[SIMULATION])["partition"] == "dirichlet"
        model = load_model(path)
        assert model(torch.as_tensor(DATA.x_test[:2])).shape == (2, 4)
    np.testing.assert_array_equal(total, np.bincount(DATA.y_train))


def test_same_seed_same_checkpoints_other_seed_differs():
    def hashes(seed):
        return [c.checkpoint.content_hash for c in simulate_clients(DATA, _config(seed=seed))]

    assert hashes(1) == hashes(1)
    assert hashes(1) != hashes(2)


def test_shared_init_starts_clients_from_the_same_weights():
    one_step = TrainConfig(epochs=1, batch_size=10_000, lr=1e-9, optimizer="sgd", momentum=0.0)
    shared = simulate_clients(DATA, _config(shared_init=True, train=one_step))
    own = simulate_clients(DATA, _config(train=one_step))
    w = [c.checkpoint.tensor("net.0.weight") for c in shared]
    assert np.allclose(w[0], w[1], atol=1e-6)
    v = [c.checkpoint.tensor("net.0.weight") for c in own]
    assert not np.allclose(v[0], v[1], atol=1e-2)


def test_pan_encodings_present_and_detected(tmp_path):
    pan = {"mode": "additive", "amplitude": 0.2, "period": 1.0}
    simulate_clients(DATA, _config(pan=pan, arch="mlp:12,6"), out_dir=tmp_path)
    ckpt = load_checkpoint(tmp_path / "client_00.safetensors")
    assert ckpt.arch["pan"] == pan
    assert pan_buffer_names(ckpt.state_dict()) == ["net.2.encoding", "net.5.encoding"]
    j = np.arange(12)
    np.testing.assert_allclose(
        ckpt.tensor("net.2.encoding"), 0.2 * np.sin(2 * np.pi * j / 12), atol=1e-6
    )
    spec = fusekit.infer_spec({k: v.shape for k, v in ckpt.state_dict().items()})
    assert spec.hidden_widths == [12, 6]
    assert set(spec.other) >= {"net.2.encoding", "net.5.encoding"}


def test_heterogeneous_architectures_per_client():
    clients = simulate_clients(DATA, _config(arch=["mlp:12", "mlp:20", "mlp:8,8"]))
    assert [c.checkpoint.arch["hidden"] for c in clients] == [[12], [20], [8, 8]]
    with pytest.raises(ParameterError, match="one per client"):
        simulate_clients(DATA, _config(arch=["mlp:12", "mlp:20"]))


def test_bad_settings_fail_before_training(tmp_path):
    with pytest.raises(SpecError, match="--arch"):
        simulate_clients(DATA, _config(arch="transformer"))
    simulate_clients(DATA, _config(), out_dir=tmp_path)
    with pytest.raises(OutputError, match="--force"):
        simulate_clients(DATA, _config(), out_dir=tmp_path)
    simulate_clients(DATA, _config(), out_dir=tmp_path, force=True)


def test_simulate_fuse_evaluate_end_to_end(tmp_path):
    clients = simulate_clients(DATA, _config(clients=4), out_dir=tmp_path / "c")
    paths = [c.path for c in clients]
    fused = fusekit.fuse(paths, method="avg").save(tmp_path / "avg.safetensors")
    report = evaluate_checkpoints([*paths, fused], DATA, device="cpu")
    kinds = [s.kind for s in report.scores]
    assert kinds == ["client"] * 4 + ["fused", "ensemble", "ensemble"]
    assert report.scores[4].method == "avg"
    assert all(0.0 <= s.accuracy <= 1.0 and np.isfinite(s.loss) for s in report.scores)
    assert report.scores[-1].accuracy > 1.5 / DATA.num_classes  # ensemble beats chance


def test_cli_simulate(tmp_path, small_synthetic_args):
    out = tmp_path / "ckpts"
    args = [
        "simulate",
        *small_synthetic_args,
        "--clients",
        "3",
        "--partition",
        "labels",
        "--min-classes",
        "1",
        "--max-classes",
        "2",
        "--arch",
        "mlp:8",
        "--epochs",
        "1",
        "--seed",
        "3",
        "--pan",
        "multiplicative",
        "--out",
        str(out),
        "--json",
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["clients"]
    assert len(rows) == 3 and all(1 <= r["classes"] <= 2 for r in rows)
    assert load_checkpoint(out / "client_01.safetensors").arch["pan"]["mode"] == "multiplicative"
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 2 and "--force" in again.output
    bad = CliRunner().invoke(app, ["simulate", "--out", str(tmp_path / "x"), "--arch", "mlp:a"])
    assert bad.exit_code == 2 and "--arch" in bad.output


def test_cli_fednlr_needs_sgd(tmp_path):
    result = CliRunner().invoke(
        app, ["simulate", "--out", str(tmp_path), "--fednlr", "--optimizer", "adam"]
    )
    assert result.exit_code == 2 and "sgd" in result.output


def test_convnet_clients_fuse_and_evaluate(tmp_path):
    from fusekit.toolkit.data import digits

    images = digits()
    config = SimulationConfig(
        clients=2, arch="conv:4,6/8", train=TrainConfig(epochs=1), min_samples=5
    )
    clients = simulate_clients(images, config, out_dir=tmp_path)
    arch = clients[0].checkpoint.arch
    assert arch["type"] == "convnet" and arch["channels"] == [4, 6] and arch["hidden"] == [8]
    fused = fusekit.fuse([c.path for c in clients], method="avg").save(tmp_path / "f.safetensors")
    report = evaluate_checkpoints([c.path for c in clients] + [fused], images, device="cpu")
    assert [s.kind for s in report.scores] == ["client", "client", "fused", "ensemble", "ensemble"]


def test_fednlr_clients_get_neuron_wise_rates():
    config = _config(
        shared_init=True,
        arch="mlp:12,6",
        train=TrainConfig(epochs=1, optimizer="sgd", lr=0.05, fednlr=FedNLRConfig()),
    )
    clients = simulate_clients(DATA, config)
    rates = clients[0].training.neuron_learning_rates
    assert [r.shape for r in rates] == [(12,), (6,), (4,)]
    for index, r in enumerate(rates, start=1):
        assert r.mean() == pytest.approx(0.05)
        mu = 2.0 + index / 3 + 0.5 * np.log(r.size)
        assert r.max() / r.min() == pytest.approx(mu)


def test_cli_fed2_clients(tmp_path):
    out = tmp_path / "ckpts"
    args = ["simulate", "--clients", "2", "--arch", "conv:4,6/6", "--fed2", "--fed2-groups", "2",
            "--fed2-depth", "3", "--epochs", "1", "--device", "cpu", "--out", str(out), "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    arch = load_checkpoint(out / "client_00.safetensors").arch
    assert arch["fed2"] == {"groups": 2, "depth": 3, "classes": [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]}
    bad = CliRunner().invoke(app, [*args[:-3], "--fed2-groups", "11", "--out", str(tmp_path / "x")])
    assert bad.exit_code == 2 and "fed2.groups" in bad.output
