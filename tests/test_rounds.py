"""Multi-round simulation (fusekit.toolkit.rounds) and `fusekit simulate --rounds`."""

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import fusekit
from fusekit._cli.app import app
from fusekit.core.errors import ParameterError
from fusekit.toolkit.data import load_dataset
from fusekit.toolkit.rounds import RoundsConfig, fuse_round, round_method, run_rounds
from fusekit.toolkit.simulate import SimulationConfig, simulate_clients
from fusekit.toolkit.train import FedNLRConfig, TrainConfig

DATA = load_dataset("digits")
SGD = TrainConfig(epochs=1, batch_size=32, lr=0.05, optimizer="sgd")
PAN = {"mode": "multiplicative", "amplitude": 0.1, "period": 1.0}


def sim(**changes) -> SimulationConfig:
    base = SimulationConfig(clients=4, alpha=0.5, arch="mlp:16", shared_init=True, train=SGD)
    return replace(base, **changes)


def tensors(checkpoint):
    return {name: checkpoint.tensor(name) for name in checkpoint.tensors}


def test_rounds_are_deterministic_for_a_seed_and_sample_clients():
    config = RoundsConfig(rounds=3, clients_per_round=2, simulation=sim())
    first, again = run_rounds(DATA, config), run_rounds(DATA, config)
    assert [r.clients for r in first.rounds] == [r.clients for r in again.rounds]
    assert [r.accuracy for r in first.rounds] == [r.accuracy for r in again.rounds]
    for name, value in tensors(first.global_checkpoint).items():
        np.testing.assert_array_equal(value, again.global_checkpoint.tensor(name))
    assert all(len(r.clients) == 2 and len(set(r.clients)) == 2 for r in first.rounds)
    other = run_rounds(DATA, replace(config, simulation=sim(seed=1)))
    assert ([r.clients for r in other.rounds] != [r.clients for r in first.rounds]
            or other.rounds[-1].accuracy != first.rounds[-1].accuracy)
    assert all(0 <= r.accuracy <= 1 and r.drift > 0 for r in first.rounds)


@pytest.mark.parametrize("changes", [
    {"pan": PAN},
    {"train": replace(SGD, fednlr=FedNLRConfig())},
], ids=["pans", "fednlr"])
def test_round_one_equals_simulated_shared_init_clients_fused(changes):
    # One round with every client is what PANs and FedNLR did before rounds existed.
    config = sim(**changes)
    clients = simulate_clients(DATA, config)
    expected = fusekit.fuse([c.checkpoint for c in clients], "avg")
    result = run_rounds(DATA, RoundsConfig(rounds=1, simulation=config))
    for name, value in expected.state_dict.items():
        np.testing.assert_array_equal(result.global_checkpoint.tensor(name), value, name)
    if "pan" in changes:
        assert result.global_checkpoint.arch["pan"] == PAN


def test_fuse_round_is_fusekit_fuse_on_in_memory_checkpoints():
    clients = [c.checkpoint for c in simulate_clients(DATA, sim())]
    fused = fuse_round(clients, "avg")
    reference = fusekit.fuse(clients, "avg")
    assert fused.metadata == reference.metadata
    for name, value in reference.state_dict.items():
        np.testing.assert_array_equal(fused.tensor(name), value)


def test_one_shot_methods_fuse_the_first_round_then_average():
    assert [round_method("pfnm", r) for r in (1, 2, 3)] == ["pfnm", "avg", "avg"]
    assert [round_method("fed2", r) for r in (1, 2)] == ["fed2", "fed2"]
    result = run_rounds(DATA, RoundsConfig(rounds=2, method="pfnm", simulation=sim()))
    assert [r.method for r in result.rounds] == ["pfnm", "avg"]
    fed2 = sim(arch="mlp:16,10", fed2={"groups": 5, "depth": 2})
    result = run_rounds(DATA, RoundsConfig(rounds=2, method="fed2", simulation=fed2))
    assert result.global_checkpoint.arch["fed2"]["groups"] == 5
    assert [r.method for r in result.rounds] == ["fed2", "fed2"]


def test_settings_that_cannot_work_are_refused_before_training():
    with pytest.raises(ParameterError, match="ensemble"):
        RoundsConfig(rounds=2, method="ams", simulation=sim())
    with pytest.raises(ParameterError, match="clients_per_round"):
        RoundsConfig(rounds=2, clients_per_round=5, simulation=sim())
    with pytest.raises(ParameterError, match="Fed²"):
        run_rounds(DATA, RoundsConfig(rounds=1, method="fed2", simulation=sim()))
    with pytest.raises(ParameterError, match="position-aware"):
        run_rounds(DATA, RoundsConfig(rounds=1, method="pfnm", simulation=sim(pan=PAN)))
    with pytest.raises(ParameterError, match="one global model"):
        run_rounds(DATA, RoundsConfig(rounds=1, simulation=sim(arch=["mlp:8", "mlp:16"] * 2)))


def test_cli_rounds_write_global_model_and_log(tmp_path):
    out = tmp_path / "run"
    args = ["simulate", "-o", str(out), "--rounds", "2", "--method", "fed2", "--fed2",
            "--fed2-groups", "5", "--arch", "mlp:16,10", "--clients", "4", "--epochs", "1",
            "--clients-per-round", "3", "--device", "cpu", "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    log = json.loads((out / "rounds.json").read_text())
    assert json.loads(result.stdout) == log
    assert [r["round"] for r in log["rounds"]] == [1, 2]
    assert all(len(r["clients"]) == 3 for r in log["rounds"])
    assert all(0 <= r["dislocated"] <= 1 for r in log["rounds"])  # the table's word
    model = fusekit.load_fused(out / "global.safetensors", device="cpu")
    assert model(torch.zeros(2, 64)).shape == (2, 10)
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 2 and "exists" in again.output


@pytest.mark.parametrize("args, needle", [
    (["--method", "pfnm"], "only with --rounds"),
    (["--rounds", "2", "--method", "ams"], "ensemble"),
    (["--rounds", "1", "--method", "fed2"], "Fed²"),
])
def test_cli_rounds_errors(tmp_path, args, needle):
    result = CliRunner().invoke(app, ["simulate", "-o", str(tmp_path / "x"), "--clients", "2",
                                      "--epochs", "1", "--device", "cpu", *args])
    assert result.exit_code == 2 and needle in result.output
    assert not (tmp_path / "x" / "global.safetensors").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_rounds_train_and_evaluate_on_cuda():
    config = RoundsConfig(rounds=2, simulation=sim(fed2={"groups": 5, "depth": 2},
                                                   arch="mlp:16,10"), method="fed2")
    on_gpu = run_rounds(DATA, config, device="cuda")
    on_cpu = run_rounds(DATA, config, device="cpu")
    assert [r.clients for r in on_gpu.rounds] == [r.clients for r in on_cpu.rounds]
    assert abs(on_gpu.rounds[-1].accuracy - on_cpu.rounds[-1].accuracy) < 0.05


def test_benchmark_script_runs_a_tiny_grid(tmp_path):
    from bench_rounds import main

    json_out, plot = tmp_path / "rounds.json", tmp_path / "rounds.png"
    assert main(["--rounds", "1", "--seeds", "1", "--epochs", "1", "--no-write",
                 "--json-out", str(json_out), "--plot", str(plot)]) == 0
    runs = json.loads(json_out.read_text())["runs"]
    assert sorted({r["method"] for r in runs}) == ["fed2", "fedavg", "fednlr", "pans"]
    assert all(len(r["accuracy"]) == 1 for r in runs) and plot.stat().st_size > 0
    assert all("dislocated" in r for r in runs)


def test_benchmark_renders_files_from_before_the_rename():
    from bench_rounds import curves

    runs = [{"alpha": 0.5, "method": "fedavg", "misaligned": [0.25]},
            {"alpha": 0.5, "method": "fedavg", "dislocated": [0.5]}]
    assert curves({"runs": runs}, "dislocated")[(0.5, "fedavg")].tolist() == [[0.25], [0.5]]


def test_neuron_dislocation_counts_dislocated_neurons():
    from fusekit.core.checkpoint import Checkpoint
    from fusekit.core.spec import infer_spec, permute
    from fusekit.toolkit.rounds import neuron_dislocation

    start = simulate_clients(DATA, sim(clients=2, arch="mlp:16,8"))[0].checkpoint
    state = start.state_dict()
    swapped = permute(state, infer_spec(state), [np.r_[1, 0, 2:16], None])
    same, moved = Checkpoint.from_state_dict(state), Checkpoint.from_state_dict(swapped)
    assert neuron_dislocation([same], start) == 0
    assert neuron_dislocation([same, moved], start) == pytest.approx(2 / 48)
