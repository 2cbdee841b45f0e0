"""The file-based protocol through the CLI: every server-side step prints the next round's
commands, following them reproduces the library's ``align_locally``, and a step that
cannot change the model says why and writes nothing."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import numpy as np
import pytest
from test_service import admin, service  # noqa: F401
from test_service_rounds import TakingPart
from typer.testing import CliRunner

import fusekit
from conftest import mlp, write
from fusekit._cli.app import app
from fusekit.client import Client
from fusekit.core import metadata as meta
from fusekit.core.checkpoint import load_checkpoint, save_checkpoint
from fusekit.core.cross_stats import load_refit_statistics, save_refit_statistics
from fusekit.core.metadata import normalization
from fusekit.core.model_spec import fused_spec
from fusekit.core.neurons import client_layers
from fusekit.methods.calibration import assignments_json, read_assignments
from fusekit.toolkit.data import load_dataset
from fusekit.toolkit.local import align_locally

runner = CliRunner()


def _run(*args) -> dict:
    result = runner.invoke(app, [*map(str, args), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _refused(*args) -> str:
    result = runner.invoke(app, list(map(str, args)))
    assert result.exit_code == 2, result.output
    assert len(result.stderr.strip().splitlines()) == 1
    return result.stderr


def _clients(tmp_path: Path, batchnorm: bool, widths=(6, 8, 7, 3), n: int = 2):
    """Plain torch MLPs from independent initialisations, each with its own data file."""
    models, data = [], []
    for i in range(n):
        models.append(write(tmp_path / f"c{i}.safetensors",
                            mlp(widths, batchnorm=batchnorm, seed=i), num_samples=80))
        x = np.random.default_rng(i).normal(i / 2, 1 + i / 4, (80, widths[0]))
        data.append(tmp_path / f"client{i}.npz")
        np.savez(data[-1], x_train=x.astype(np.float32), y_train=np.zeros(80, np.int64),
                 x_test=x[:5].astype(np.float32), y_test=np.zeros(5, np.int64))
    return models, data


def _follow(step: dict, data: list[Path], own: list[Path]) -> dict:
    """Run what a step printed: client k's line on its data, then the server's line."""
    def words(line: str, k: int | None) -> list[str]:
        text = line.replace("DATA.npz", str(data[k])) if k is not None else line
        for i, path in enumerate(own):
            text = text.replace(f"CLIENT{i}.safetensors", str(path))
        assert text.startswith("fusekit ")
        return shlex.split(text)[1:]

    for k, line in enumerate(step["clients"]):
        _run(*words(line, k))
    return _run(*words(step["then"], None))


def _cli_layerwise_protocol(tmp_path: Path, own: list[Path], data: list[Path], method: str,
                            first: tuple[str, ...] = ("--layers", "0")) -> tuple[Path, list]:
    """align_locally's protocol through the CLI: each client's targets (statistics of its
    own model; ``first`` "--input-moments": with its first layer's input moments), the
    first calibration round (``first``), then every round the previous step printed.
    Returns the final model and the rounds each step announced."""
    fused = tmp_path / "fused.safetensors"
    _run("fuse", *own, "-m", method, "-o", fused)
    targets, stats = [], []
    moments = "--input-moments" in first
    for k, (model, path) in enumerate(zip(own, data, strict=True)):
        targets += ["--targets", _run("stats", model, "--data-path", path, "-o",
                                      tmp_path / f"c{k}.own.safetensors",
                                      *(["--input-moments"] if moments else []))["output"]]
        if not moments:
            stats.append(_run("stats", fused, "--data-path", path, "-o",
                              tmp_path / f"c{k}.stats.safetensors")["output"])
    step = _run("calibrate", fused, *stats, *targets, "--paired",
                *(() if moments else first), "-o", tmp_path / "calibrated.safetensors")
    seen = []
    while step["next"]["then"] is not None:
        seen.append(step["next"]["round"].split(" of ")[0])
        step = _follow(step["next"], data, own)
    assert step["next"]["round"].startswith("nothing: every round is done")
    return Path(step["output"]), seen


def test_following_the_printed_commands_reproduces_align_locally(tmp_path):
    own, data = _clients(tmp_path, batchnorm=True)
    final, seen = _cli_layerwise_protocol(tmp_path, own, data, "ot")
    assert seen == ["calibration round 2", f"{tmp_path / 'calibrated-2.safetensors'} is "
                    "calibrated; alignment round 1", "refit round 1", "refit round 2",
                    "refit round 3"]
    assert final == tmp_path / "refit-3.safetensors"
    inputs = [load_dataset(path=path).x_train for path in data]
    fused = tmp_path / "fused.safetensors"
    expected = align_locally(fused, [load_checkpoint(p) for p in own], inputs).state_dict
    final = load_checkpoint(final)
    for name, value in expected.items():
        np.testing.assert_allclose(final.tensor(name), value, rtol=1e-6, atol=1e-7)


def test_flower_alignment_gives_the_model_the_cli_protocol_gives(tmp_path, monkeypatch):
    """The same clients as Flower nodes (real Messages through the Grid stand-in of
    test_flower; targets and input moments in their train replies): FusekitStrategy's
    layer-by-layer calibration, alignment and refit rounds end with the model the CLI's
    printed commands give (its first layer derived from the input moments too)."""
    pytest.importorskip("flwr", reason="needs the [flower] extra")
    from flwr.app import RecordDict
    from flwr.supercore.task_identity import TaskIdentity
    from test_flower import Federation

    for field in ("_run_id", "_task_id"):  # messages stamped as in a ServerApp
        monkeypatch.setattr(TaskIdentity, field, 1)
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)

    from fusekit.flower import FusekitStrategy, kept_model, statistics_reply, train_reply
    from fusekit.flower.records import arrays_to_state_dict

    own, data = _clients(tmp_path, batchnorm=True, n=3)
    inputs = {10 + k: load_dataset(path=path).x_train for k, path in enumerate(data)}
    states = {node: RecordDict() for node in inputs}
    replies = {node: train_reply(fusekit.load_fused(own[node - 10], "cpu"), len(x),
                                 statistics_inputs=x, input_moments=True,
                                 keep_in=states[node]) for node, x in inputs.items()}
    grid = Federation(lambda node, _: replies[node], lambda node, m: statistics_reply(
        m.content, inputs[node], own_model=kept_model(states[node])))
    strategy = FusekitStrategy("pfnm", fraction_evaluate=0, calibrate=True,
                               calibration_rounds="layerwise", alignment_rounds=1)
    result = strategy.start(grid, replies[10]["arrays"], num_rounds=1)
    final, _ = _cli_layerwise_protocol(tmp_path, own, data, "pfnm", ("--input-moments",))
    flower, cli = arrays_to_state_dict(result.arrays), load_checkpoint(final)
    assert sorted(flower) == sorted(cli.tensors)
    for name, value in flower.items():
        np.testing.assert_allclose(value, cli.tensor(name), rtol=1e-5, atol=1e-6, err_msg=name)


def test_the_refit_rounds_start_from_the_aligned_model_as_written(tmp_path):
    own, data = _clients(tmp_path, batchnorm=True)
    fused = tmp_path / "fused.safetensors"
    _run("fuse", *own, "-m", "rebasin", "-o", fused)
    cross = [_run("stats", fused, "--against", model, "--data-path", path, "-o",
                  tmp_path / f"x{k}.safetensors")["output"]
             for k, (model, path) in enumerate(zip(own, data, strict=True))]
    result = runner.invoke(app, ["align", str(fused), *map(str, own),
                                 *(w for c in cross for w in ("--cross-stats", c)),
                                 "-o", str(tmp_path / "aligned.safetensors")])
    assert result.exit_code == 0, result.output
    text = " ".join(result.stdout.split())
    assert ("refit round 1 of 3 refits layer '0' of " in text
            and "(it starts from the aligned model as written, not calibrated" in text)
    assert f"fusekit refit {tmp_path / 'aligned.safetensors'} {own[0]} {own[1]}" in text
    assert "calibrate it next" not in text


def test_calibrating_a_model_it_cannot_change_is_refused_and_writes_nothing(tmp_path):
    own, data = _clients(tmp_path, batchnorm=False)
    fused, out = tmp_path / "fused.safetensors", tmp_path / "out.safetensors"
    _run("fuse", *own, "-m", "ot", "-o", fused)
    stats = _run("stats", fused, "--data-path", data[0], "-o", tmp_path / "s.safetensors")
    error = _refused("calibrate", fused, stats["output"], "-o", out)
    assert "nothing to calibrate: it has no BatchNorm, and without targets" in error
    targets = _run("stats", own[0], "--data-path", data[0], "-o", tmp_path / "t.safetensors")
    error = _refused("calibrate", fused, stats["output"], "--targets", targets["output"],
                     "--layers", "0,nope", "-o", out)
    assert f"'nope' is not a hidden layer of {fused} (expected some of ['0', '2'])" in error
    assert not out.exists()


def test_a_layer_calibration_cannot_change_is_named(tmp_path):
    own, data = _clients(tmp_path, batchnorm=True)
    fused = tmp_path / "fused.safetensors"
    _run("fuse", *own, "-m", "ot", "-o", fused)
    stats = _run("stats", fused, "--data-path", data[0], "-o", tmp_path / "s.safetensors")
    error = _refused("calibrate", fused, stats["output"], "--layers", "6", "-o",
                     tmp_path / "out.safetensors")
    assert "'6' is not a hidden layer" in error  # the output layer: calibration keeps it
    assert not (tmp_path / "out.safetensors").exists()


@pytest.mark.parametrize("against", [False, True])
def test_statistics_of_a_model_without_hidden_layer_are_refused(tmp_path, against):
    own, data = _clients(tmp_path, batchnorm=False, widths=(6, 3))
    fused, out = tmp_path / "fused.safetensors", tmp_path / "s.safetensors"
    _run("fuse", *own, "-m", "ot", "-o", fused)
    error = _refused("stats", fused, *(["--against", own[0]] if against else []),
                     "--data-path", data[0], "-o", out)
    assert "no hidden layer, so nothing to calibrate or align; no statistics written" in error
    assert not out.exists()


@pytest.mark.parametrize("batchnorm", [False, True])
def test_batch_mode_statistics_of_a_model_without_batchnorm_say_they_are_eval_mode(
        tmp_path, batchnorm):
    own, data = _clients(tmp_path, batchnorm=batchnorm)
    fused, out = tmp_path / "fused.safetensors", tmp_path / "s.safetensors"
    _run("fuse", *own, "-m", "ot", "-o", fused)
    result = runner.invoke(app, ["stats", str(fused), "--mode", "batch", "--data-path",
                                 str(data[0]), "-o", str(out)])
    assert result.exit_code == 0, result.output
    note = "no BatchNorm, so --mode batch computes what --mode eval does"
    if batchnorm:
        assert note not in result.stderr
    else:
        assert note in " ".join(result.stderr.split())
        assert result.stderr.count("WARNING") == 1  # one note (rich wraps it to the width)
    assert out.exists()


def test_aligning_a_model_without_hidden_layer_is_refused_and_writes_nothing(tmp_path):
    own, data = _clients(tmp_path, batchnorm=False, widths=(6, 3))
    fused, out = tmp_path / "fused.safetensors", tmp_path / "aligned.safetensors"
    _run("fuse", *own, "-m", "ot", "-o", fused)
    error = _refused("align", fused, *own, "--cross-stats", tmp_path / "x0.safetensors",
                     "--cross-stats", tmp_path / "x1.safetensors", "-o", out)
    assert f"{fused}: no hidden layer, so nothing to align" in error
    assert not out.exists()


def _aligned_with_refit_statistics(tmp_path: Path) -> tuple[Path, list[Path], list[str]]:
    """An aligned fusion of plain torch MLPs and each client's refit statistics of its
    first layer."""
    own, data = _clients(tmp_path, batchnorm=False)
    fused, aligned = tmp_path / "fused.safetensors", tmp_path / "aligned.safetensors"
    _run("fuse", *own, "-m", "ot", "-o", fused)
    cross = [_run("stats", fused, "--against", model, "--data-path", path, "-o",
                  tmp_path / f"x{k}.safetensors")["output"]
             for k, (model, path) in enumerate(zip(own, data, strict=True))]
    _run("align", fused, *own, *(w for c in cross for w in ("--cross-stats", c)), "-o", aligned)
    refit = [_run("stats", aligned, "--against", model, "--layer", "0", "--data-path", path,
                  "-o", tmp_path / f"r{k}.safetensors")["output"]
             for k, (model, path) in enumerate(zip(own, data, strict=True))]
    return aligned, own, refit


def test_a_refit_that_cannot_change_the_layer_is_refused_and_writes_nothing(tmp_path):
    aligned, own, refit = _aligned_with_refit_statistics(tmp_path)
    out = tmp_path / "refit.safetensors"
    flags = [w for r in refit for w in ("--refit-stats", r)]
    checkpoint = load_checkpoint(aligned)
    spec = fused_spec(checkpoint)
    assignments = read_assignments(checkpoint, spec)
    group = spec.writes[0]

    # No client neuron matched into layer 0 (same tensors, so the same model hash).
    unmatched = tmp_path / "unmatched.safetensors"
    none = [[np.full_like(a, -1) if g == group else a for g, a in enumerate(client)]
            for client in assignments]
    save_checkpoint(unmatched, checkpoint.state_dict(),
                    {**checkpoint.metadata, meta.ASSIGNMENTS: assignments_json(none)})
    error = _refused("refit", unmatched, *own, *flags, "-o", out)
    assert (f"{unmatched}: nothing to refit: no neuron of the given client(s) is matched "
            "into layer '0'") in error

    # Statistics saying each client's pre-activations are what layer 0 already computes.
    layer = client_layers(checkpoint, spec)[0]
    theta = np.hstack([layer.weight.reshape(layer.out_features, -1), layer.bias[:, None]])
    inputs = json.loads(checkpoint.metadata[meta.INPUTS])  # the assignments' client order
    exact = []
    for k, path in enumerate(refit):
        stats = load_refit_statistics(path)
        stats.cross = theta[assignments[inputs.index(stats.model)][group]] @ stats.gram
        exact.append(save_refit_statistics(tmp_path / f"exact{k}.safetensors", stats))
    error = _refused("refit", aligned, *own, *(w for e in exact for w in ("--refit-stats", e)),
                     "-o", out)
    assert (f"{aligned}: nothing to refit: layer '0' already computes the pre-activations "
            "its refit statistics ask of it") in error

    # The refit written, its statistics (of the aligned model) do not apply to it again.
    _run("refit", aligned, *own, *flags, "-o", out)
    again = tmp_path / "again.safetensors"
    error = _refused("refit", out, *own, *flags, "-o", again)
    assert "computed against fused model" in error
    assert not again.exists()


def _cli_protocol(tmp_path: Path, own: list[Path], data: list[Path], method: str) -> Path:
    """The documented protocol through the CLI: fuse, one-shot calibration (batch-mode
    statistics), then every round the previous step printed; returns the final model."""
    tmp_path.mkdir()
    fused = tmp_path / "fused.safetensors"
    _run("fuse", *own, "-m", method, "-o", fused)
    stats = [_run("stats", fused, "--mode", "batch", "--data-path", path, "-o",
                  tmp_path / f"c{k}.stats.safetensors")["output"]
             for k, path in enumerate(data)]
    step = _run("calibrate", fused, *stats, "-o", tmp_path / "calibrated.safetensors")
    while step["next"]["then"] is not None:
        step = _follow(step["next"], data, own)
    return Path(step["output"])


def test_a_service_align_job_gives_the_model_the_cli_protocol_gives(
        service, admin, tmp_path):  # noqa: F811
    """Clients the service never trained, each with its own data file: an align job (one
    batch-mode calibration round, an alignment round, a refit round per layer) run by
    ``Client.take_part`` ends with the model the CLI's printed commands give."""
    own, data = _clients(tmp_path, batchnorm=True, n=3)
    names = [f"clinic-{k}" for k in range(3)]
    job = admin.create_job("ot", names, auto_run=True, calibrate=True, protocol="align")
    for name, path in zip(names, own, strict=True):
        with Client(service.url, job["tokens"][name]) as client:
            client.submit(job["id"], name, path)
    assert admin.wait(job["id"], timeout=120, every=0.1)["state"] == "calibrating"
    inputs = [load_dataset(path=path).x_train for path in data]  # as the CLI reads them
    for thread in [TakingPart(service, job, name, model, x, tmp_path / name)
                   for name, model, x in zip(names, own, inputs, strict=True)]:
        thread.finish()
    assert admin.status(job["id"])["state"] == "succeeded"
    result = load_checkpoint(admin.result(job["id"], tmp_path / "service.safetensors"))
    cli = load_checkpoint(_cli_protocol(tmp_path / "cli", own, data, "ot"))
    assert sorted(result.tensors) == sorted(cli.tensors)
    for name in cli.tensors:
        np.testing.assert_allclose(result.tensor(name), cli.tensor(name), rtol=1e-6,
                                   atol=1e-7, err_msg=name)


def test_contribute_normalize_gives_the_model_stats_normalize_gives(
        service, admin, tmp_path):  # noqa: F811
    """Clients whose models expect normalised inputs but record none take part in a
    calibrating job, one through ``Client.take_part(normalization=...)``, one through
    ``fusekit contribute --normalize``: the result is the model ``fusekit stats
    --normalize`` and ``calibrate`` give on the same data files."""
    own, data = _clients(tmp_path, batchnorm=True)
    names = ["clinic-0", "clinic-1"]
    job = admin.create_job("ot", names, auto_run=True, calibrate=True)
    for name, path in zip(names, own, strict=True):
        with Client(service.url, job["tokens"][name]) as client:
            client.submit(job["id"], name, path)
    assert admin.wait(job["id"], timeout=120, every=0.1)["state"] == "calibrating"
    thread = TakingPart(service, job, names[0], own[0], load_dataset(path=data[0]).x_train,
                        tmp_path / names[0], normalization=normalization([0.5], [2.0]))
    took = runner.invoke(app, list(map(str, (
        "contribute", service.url, own[1], "--job", job["id"], "--client", names[1],
        "--token", job["tokens"][names[1]], "--data-path", data[1], "--normalize", "0.5,2",
        "--work-dir", tmp_path / names[1], "--timeout", "120"))))
    thread.finish()
    assert took.exit_code == 0 and "succeeded" in took.stdout, took.output
    result = load_checkpoint(admin.result(job["id"], tmp_path / "service.safetensors"))
    fused = admin.fused(job["id"], tmp_path / "fused.safetensors")
    stats = [_run("stats", fused, "--mode", "batch", "--normalize", "0.5,2", "--data-path",
                  path, "-o", tmp_path / f"c{k}.stats.safetensors")["output"]
             for k, path in enumerate(data)]
    cli = load_checkpoint(_run("calibrate", fused, *stats, "-o",
                               tmp_path / "cli.safetensors")["output"])
    raw = fusekit.load_checkpoint(fused)
    assert any(not np.allclose(cli.tensor(n), raw.tensor(n)) for n in cli.tensors)
    for name in cli.tensors:
        np.testing.assert_allclose(result.tensor(name), cli.tensor(name), rtol=1e-6,
                                   atol=1e-7, err_msg=name)
