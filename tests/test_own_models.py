"""fusekit on models it did not train, with the user's own arrays (tests/foreign.py): every
front door feeds the model the inputs its author trained it on."""

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import foreign as own
import fusekit
from fusekit._cli.app import app
from fusekit.core.errors import CheckpointError
from fusekit.toolkit.data import load_dataset
from fusekit.toolkit.evaluate import evaluate_checkpoints

runner = CliRunner()
REBUILDABLE = ("mlp", "bn_mlp", "resnet20")


def cli_scores(*args) -> dict[str, float]:
    result = runner.invoke(app, ["evaluate", *map(str, args), "--json", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    return {s["name"]: s["accuracy"] for s in json.loads(result.stdout)["scores"]}


def test_npz_data_is_used_as_stored(foreign):
    family = foreign("mlp")
    data = load_dataset(path=family.data)
    np.testing.assert_array_equal(data.x_train, family.arrays.x_train)
    np.testing.assert_array_equal(data.x_test, family.arrays.x_test)


@pytest.mark.parametrize("kind", REBUILDABLE)
def test_evaluate_reports_torchs_accuracy_to_the_sample(foreign, kind):
    family = foreign(kind)
    scores = cli_scores(*family.files, "--data-path", family.data)
    for path, model in zip(family.files, family.models, strict=True):
        assert scores[path.name] == family.accuracy(model)


@pytest.mark.parametrize("kind", REBUILDABLE)
def test_python_api_evaluates_like_torch(foreign, kind):
    family = foreign(kind)
    report = evaluate_checkpoints(family.files, load_dataset(path=family.data), device="cpu")
    assert [s.accuracy for s in report.clients] == [family.accuracy(m) for m in family.models]
    for path, model in zip(family.files, family.models, strict=True):
        assert family.accuracy(fusekit.load_fused(path, "cpu")) == family.accuracy(model)


@pytest.mark.parametrize(("kind", "method"), [("mlp", "ot"), ("bn_mlp", "rebasin"),
                                              ("resnet20", "rebasin")])
def test_fused_models_evaluate_like_torch(foreign, tmp_path, kind, method):
    """The fused file scored by fusekit equals its tensors in the author's own module."""
    family = foreign(kind)
    out = fused(family, method, tmp_path)
    in_torch = family.accuracy(own.load_into(kind, out))
    assert family.accuracy(fusekit.load_fused(out, "cpu")) == in_torch
    assert cli_scores(out, "--data-path", family.data)["fused.safetensors"] == in_torch


def test_a_model_fusekit_cannot_rebuild_is_refused_in_one_line(foreign, tmp_path):
    """Custom module names fuse (the spec is inferred), but a CNN's padding and pooling are
    not in its tensors: evaluate says so instead of guessing."""
    family = foreign("cnn")
    out = fused(family, "ot", tmp_path)
    assert family.accuracy(own.load_into("cnn", out)) > 0.5
    result = runner.invoke(app, ["evaluate", str(out), "--data-path", str(family.data)])
    assert result.exit_code == 2
    assert "fused.safetensors" in result.stderr and "fusekit.arch" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def fused(family, method, folder):
    out = folder / "fused.safetensors"
    result = runner.invoke(app, ["fuse", *map(str, family.files), "--method", method, "-o",
                                 str(out)])
    assert result.exit_code == 0, result.output
    return out


def test_normalize_says_what_a_model_expects_once(foreign, tmp_path):
    """A model that expects normalised inputs, given data as stored: --normalize on evaluate;
    fused with --normalize, the fused model records it and needs nothing more."""
    family = foreign("mlp")
    stored = own.Arrays(2 * family.arrays.x_train + 1, family.arrays.y_train,
                        2 * family.arrays.x_test + 1, family.arrays.y_test
                        ).save(tmp_path / "stored.npz")  # the model sees (x - 1) / 2
    scores = cli_scores(*family.files, "--data-path", stored, "--normalize", "1,2")
    assert [scores[p.name] for p in family.files] == [family.accuracy(m) for m in family.models]
    out = tmp_path / "fused.safetensors"
    result = runner.invoke(app, ["fuse", *map(str, family.files), "--method", "ot",
                                 "--normalize", "1,2", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert fusekit.load_checkpoint(out).preprocess.mean == (1.0,)
    assert cli_scores(out, "--data-path", stored)["fused.safetensors"] == family.accuracy(
        own.load_into("mlp", out))
    refused = runner.invoke(app, ["evaluate", str(out), "--data-path", str(stored),
                                  "--normalize", "0,1"])
    assert refused.exit_code == 2
    assert "fused.safetensors" in refused.stderr and "--normalize" in refused.stderr


def test_clients_expecting_different_inputs_are_refused_naming_both(foreign, tmp_path):
    family = foreign("mlp")
    first = fusekit.load_checkpoint(family.files[0])
    second = tmp_path / "scaled.safetensors"
    fusekit.save_checkpoint(second, fusekit.load_checkpoint(family.files[1]).state_dict(),
                            {"fusekit.preprocess": '{"mean": [0.5], "std": [0.25]}'})
    result = runner.invoke(app, ["fuse", str(first.path), str(second), "-m", "ot",
                                 "-o", str(tmp_path / "fused.safetensors")])
    assert result.exit_code == 2
    line = result.stderr.strip()
    assert len(line.splitlines()) == 1
    assert first.path.name in line and second.name in line and "fusekit.preprocess" in line


@pytest.mark.parametrize("raw", ['{"mean": [0.5]}', '{"mean": [0.5], "std": [0]}',
                                 '{"mean": ["a"], "std": [1]}', '[0.5, 1]'])
def test_malformed_preprocess_metadata_is_refused_at_load(foreign, tmp_path, raw):
    path = tmp_path / "bad.safetensors"
    fusekit.save_checkpoint(path, fusekit.load_checkpoint(foreign("mlp").files[0]).state_dict(),
                            {"fusekit.preprocess": raw})
    with pytest.raises(CheckpointError, match="bad.safetensors.*fusekit.pre"):
        fusekit.load_checkpoint(path)


def test_stats_run_the_model_on_the_arrays_as_stored(foreign, tmp_path):
    """A client's statistics of a fused BatchNorm MLP on its own .npz are those of the same
    arrays through the Python API (no loader standardisation in between)."""
    from fusekit.core.stats import load_statistics
    from fusekit.toolkit.calibration import client_statistics

    family = foreign("bn_mlp")
    out = fused(family, "rebasin", tmp_path)
    stats = tmp_path / "s0.safetensors"
    result = runner.invoke(app, ["stats", str(out), "--data-path", str(family.client_data[0]),
                                 "-o", str(stats)])
    assert result.exit_code == 0, result.output
    x = np.load(family.client_data[0])["x_train"]
    want = client_statistics(out, x)
    got = load_statistics(stats)
    for point, moments in want.points.items():
        np.testing.assert_allclose(got.points[point].mean, moments.mean, rtol=1e-6, atol=1e-6)


def test_fusekits_own_models_record_what_they_were_trained_on(tmp_path):
    """simulate records the data set's normalisation; evaluate applies it to the data as
    stored, so it scores what the model scores on the inputs it trained on."""
    from fusekit.toolkit.data import digits
    from fusekit.toolkit.simulate import SimulationConfig, simulate_clients
    from fusekit.toolkit.train import TrainConfig

    data = digits()
    assert data.x_train.max() == 16.0  # pixel values as stored
    client = simulate_clients(data, SimulationConfig(clients=2, partition="iid",
                                                     train=TrainConfig(epochs=2)),
                              out_dir=tmp_path)[0]
    checkpoint = fusekit.load_checkpoint(client.path)
    assert checkpoint.preprocess == data.normalization
    model = fusekit.load_fused(checkpoint, "cpu")
    model._forward_pre_hooks.clear()  # the bare network, fed normalised inputs by hand
    mean, std = data.normalization.mean[0], data.normalization.std[0]
    by_hand = own.accuracy(model, ((data.x_test - mean) / std).astype(np.float32), data.y_test)
    report = evaluate_checkpoints([client.path], data, device="cpu")
    assert report.scores[0].accuracy == by_hand > 0.5


def test_flower_nodes_send_and_receive_the_models_preprocessing():
    """A node's reply says what its model applies; the fused global model it gets back
    applies the same, so nodes feed both the data as stored."""
    from flwr.app import RecordDict

    from fusekit.core.arch import parse_arch_string
    from fusekit.flower import global_model, train_reply
    from fusekit.flower.records import model_config, reply_checkpoint, state_dict_to_arrays
    from fusekit.toolkit.data import digits
    from fusekit.toolkit.nn.preprocess import model_normalization
    from fusekit.toolkit.simulate import fresh_model

    data = digits()
    arch = parse_arch_string("mlp:16", input_shape=data.input_shape, num_classes=10)
    replies = [reply_checkpoint(train_reply(fresh_model(arch, data, seed=s), 10 + s),
                                f"node {s}") for s in range(2)]
    assert [r.preprocess for r in replies] == [data.normalization] * 2
    result = fusekit.fuse(replies, "avg")
    model = global_model(RecordDict({"arrays": state_dict_to_arrays(result.state_dict),
                                     "config": model_config(result.metadata, result.widths)}))
    assert model_normalization(model) == data.normalization
    bare = fusekit.load_fused(fusekit.Checkpoint.from_state_dict(
        result.state_dict, {"fusekit.arch": json.dumps(arch)}), "cpu")
    mean, std = data.normalization.mean[0], data.normalization.std[0]
    x = data.x_test[:50]
    with torch.inference_mode():
        np.testing.assert_allclose(model(torch.from_numpy(x)).numpy(),
                                   bare(torch.from_numpy((x - mean) / std)).numpy(), atol=1e-5)
