"""Alignment rounds (ALGORITHMS.md §12): cross statistics of a reference and a client's
own model, activation matching to the reference, re-fusion, and the checks on untrusted
cross statistics."""

from __future__ import annotations

import json

import numpy as np
import pytest
import safetensors.numpy
import torch
from rich.console import Console
from typer.testing import CliRunner

import fusekit
from conftest import mlp, numpy_state, write
from fusekit._cli.app import app
from fusekit._cli.demo import demo_table
from fusekit.core.arch import named_arch
from fusekit.core.checkpoint import Checkpoint, load_checkpoint
from fusekit.core.cross_stats import (
    FIELDS,
    CrossMoments,
    combine_cross,
    load_cross_statistics,
    save_cross_statistics,
    save_refit_statistics,
)
from fusekit.core.errors import StatisticsError
from fusekit.core.model_spec import fused_spec
from fusekit.core.spec import infer_spec, permute
from fusekit.methods.alignment import group_correlations, match_to_reference
from fusekit.toolkit.alignment import cross_statistics, refit_statistics
from fusekit.toolkit.demo import DemoConfig, run_demo
from fusekit.toolkit.local import align_locally, calibrate_locally
from fusekit.toolkit.nn import build_model

runner = CliRunner()
RESNET = named_arch("resnet20", 10, in_channels=1)


def _model(kind: str) -> tuple[Checkpoint, np.ndarray]:
    """A small model with random BatchNorm statistics and inputs it accepts."""
    rng = np.random.default_rng(0)
    if kind == "mlp":
        state = numpy_state(mlp((6, 8, 7, 3), batchnorm=True, seed=0))
        return (Checkpoint.from_state_dict(state, {"fusekit.num_samples": "64"}),
                rng.normal(size=(64, 6)).astype(np.float32))
    state = numpy_state(build_model(RESNET, seed=0))
    return (Checkpoint.from_state_dict(state, {"fusekit.num_samples": "64",
                                               "fusekit.arch": json.dumps(RESNET)}),
            rng.normal(size=(64, 1, 8, 8)).astype(np.float32))


def _permuted(model: Checkpoint, seed: int) -> tuple[Checkpoint, list[np.ndarray]]:
    spec = infer_spec({k: v.shape for k, v in model.tensors.items()})
    rng = np.random.default_rng(seed)
    perms = [rng.permutation(w) for w in spec.hidden_widths]
    return (Checkpoint.from_state_dict(permute(model.state_dict(), spec, perms),
                                       {**model.metadata, "fusekit.num_samples": str(50 + seed)}),
            perms)


def _outputs(checkpoint: Checkpoint, x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return fusekit.load_fused(checkpoint, "cpu")(torch.from_numpy(x)).numpy()


def _one_pass(x: np.ndarray, y: np.ndarray) -> CrossMoments:
    dx, dy = x - x.mean(0), y - y.mean(0)
    return CrossMoments(np.array([float(len(x))]), x.mean(0), x.var(0), y.mean(0), y.var(0),
                        dx.T @ dy / len(x))


def test_combined_cross_moments_are_those_of_one_pass_over_the_union():
    rng = np.random.default_rng(3)
    x = rng.normal(5.0, 2.0, size=(90, 3))
    y = np.c_[x[:, :1] * 3 + rng.normal(size=(90, 1)), rng.normal(-4.0, 1.0, size=(90, 1))]
    parts = [_one_pass(x[a:b], y[a:b]) for a, b in ((0, 7), (7, 50), (50, 90))]
    combined, whole = combine_cross(parts), _one_pass(x, y)
    for name in FIELDS:
        np.testing.assert_allclose(getattr(combined, name), getattr(whole, name), rtol=1e-12,
                                   atol=1e-12, err_msg=name)


@pytest.mark.parametrize("kind", ["mlp", "resnet"])
def test_cross_statistics_against_a_permuted_copy_give_back_the_permutation(kind):
    model, x = _model(kind)
    copy, perms = _permuted(model, seed=1)
    cross = cross_statistics(model, copy, x, batch_size=24)  # several batches: Chan's update
    assert cross.reference == model.content_hash and cross.model == copy.content_hash
    spec = fused_spec(model)
    assigned, correlation = match_to_reference(group_correlations(spec, cross))
    for group, perm in enumerate(perms):
        np.testing.assert_array_equal(assigned[group], perm)
    # a copy correlates 1 with itself in every writing layer (a residual stream's are
    # averaged), less a constant channel's 0
    assert np.all(np.array(correlation) <= 1 + 1e-9) and np.all(np.array(correlation) > 0.9)


@pytest.mark.parametrize("kind", ["mlp", "resnet"])
def test_aligning_permuted_copies_gives_back_the_same_function(kind):
    model, x = _model(kind)
    clients = [model] + [_permuted(model, seed)[0] for seed in (1, 2)]
    cross = [cross_statistics(model, c, x) for c in clients]
    result = fusekit.align(model, clients, cross)
    aligned = Checkpoint.from_state_dict(result.state_dict, result.metadata)
    np.testing.assert_allclose(_outputs(aligned, x), _outputs(model, x), rtol=1e-4, atol=1e-4)
    assert result.widths == infer_spec({k: v.shape for k, v in model.tensors.items()}).hidden_widths
    # every matched channel correlates 1 with itself, but a channel constant on these
    # inputs counts 0 (two such in the ResNet's stage 3)
    assert 0.99 < result.report["alignment"]["mean_correlation"] <= 1
    assert json.loads(result.metadata["fusekit.alignment"])["reference"] == model.content_hash
    assert "fusekit.assignments" in result.metadata and "fusekit.norm_targets" in result.metadata


def test_align_locally_leaves_a_matched_family_as_calibration_does():
    model, x = _model("mlp")
    alone = fusekit.fuse([model], "rebasin")  # the model, BatchNorms calibrated on x
    model = Checkpoint.from_state_dict(
        calibrate_locally(Checkpoint.from_state_dict(alone.state_dict, alone.metadata), [x],
                          rounds="layerwise").state_dict, {"fusekit.num_samples": "64"})
    clients = [model] + [_permuted(model, seed)[0] for seed in (1, 2)]
    fused = fusekit.fuse(clients, "rebasin")  # permuted copies: matched exactly
    fused = Checkpoint.from_state_dict(fused.state_dict, fused.metadata)
    result = align_locally(fused, clients, [x] * 3, alignment_rounds=2, refit=False)
    assert result.widths == infer_spec({k: v.shape for k, v in model.tensors.items()}
                                       ).hidden_widths
    assert [r["mean_correlation"] for r in result.report["alignment"]] == [1.0, 1.0]
    assert json.loads(result.metadata["fusekit.alignment"])["rounds"] == 2
    calibrated = calibrate_locally(fused, [x] * 3, clients=clients)
    np.testing.assert_allclose(
        _outputs(Checkpoint.from_state_dict(result.state_dict, result.metadata), x),
        _outputs(Checkpoint.from_state_dict(calibrated.state_dict, calibrated.metadata), x),
        rtol=1e-5, atol=1e-5)


def test_refit_rounds_on_a_permuted_family_give_back_the_function():
    model, x = _model("mlp")  # (ResNet-20: 22 rounds, in bench_calibration.py)
    clients = [model] + [_permuted(model, seed)[0] for seed in (1, 2)]
    fused = fusekit.fuse(clients, "avg")  # the copies averaged unmatched: another function
    fused = Checkpoint.from_state_dict(fused.state_dict, fused.metadata)
    result = align_locally(fused, clients, [x] * 3, rounds="one-pass", min_samples=16)
    assert json.loads(result.metadata["fusekit.refit"])["layers"] == [
        layer.name for layer in fused_spec(model).layers]
    refit = Checkpoint.from_state_dict(result.state_dict, result.metadata)
    np.testing.assert_allclose(_outputs(refit, x), _outputs(model, x), rtol=1e-3, atol=1e-3)


def test_refit_statistics_are_the_moments_of_the_layer_inputs_and_outputs():
    model, x = _model("mlp")
    copy, perms = _permuted(model, seed=1)
    stats = refit_statistics(model, copy, x, "0", batch_size=24)
    rows = np.hstack([x, np.ones((len(x), 1))]).astype(np.float64)
    np.testing.assert_allclose(stats.gram, rows.T @ rows / len(x), rtol=1e-6, atol=1e-9)
    t = {k: copy.tensor(k).astype(np.float64) for k in copy.tensors}  # Linear, BatchNorm
    own = ((x @ t["0.weight"].T + t["0.bias"] - t["1.running_mean"])
           / np.sqrt(t["1.running_var"] + 1e-5) * t["1.weight"] + t["1.bias"])
    np.testing.assert_allclose(stats.cross, own.T @ rows / len(x), rtol=1e-5, atol=1e-7)
    assert stats.count == 64 and stats.layer == "0"


def _refit_case(tmp_path):
    model, x = _model("mlp")
    copy, _ = _permuted(model, seed=1)
    fused = fusekit.align(model, [copy], [cross_statistics(model, copy, x)])
    fused = Checkpoint.from_state_dict(fused.state_dict, fused.metadata)
    return fused, copy, refit_statistics(fused, copy, x, "3")


def test_bad_refit_statistics_are_refused_in_one_line(tmp_path):
    fused, copy, stats = _refit_case(tmp_path)
    path = save_refit_statistics(tmp_path / "r.safetensors", stats)
    fusekit.refit(fused, [copy], [path])  # the good file passes
    broken = [("gram", lambda g: g + np.triu(np.ones_like(g), 1), "not the moments of any"),
              ("gram", lambda g: g * 2.0, "not the moments of any"),
              ("cross", lambda c: c[:-1], "expected gram"),
              ("cross", lambda c: c * 1e150, "cross up to .* expected at most 1e\\+24")]
    for field, change, message in broken:
        bad = save_refit_statistics(tmp_path / f"{field}.safetensors", type(stats)(
            **{**vars(stats), field: change(getattr(stats, field))}), force=True)
        with pytest.raises(StatisticsError, match=message) as info:
            fusekit.refit(fused, [copy], [bad])
        assert str(bad) in str(info.value) and "\n" not in str(info.value)
    few = type(stats)(**{**vars(stats), "count": 64, "num_samples": 64,
                         "gram": np.eye(70), "cross": np.zeros((7, 70))})
    few.layer = "3"
    with pytest.raises(StatisticsError, match="expected gram"):
        fusekit.refit(fused, [copy], [few])
    other, _ = _permuted(copy, seed=3)
    cases = [([copy], [type(stats)(**{**vars(stats), "reference": "0" * 64})],
              "computed against fused model"),
             ([copy], [type(stats)(**{**vars(stats), "layer": "9"})], "not a layer"),
             ([copy], [type(stats)(**{**vars(stats), "num_samples": 8, "count": 8})],
              "over 8 inputs"),
             ([copy], [type(stats)(**{**vars(stats), "num_samples": 10**30,
                                      "count": 10**30})], "expected at most 2\\*\\*53"),
             ([copy], [path, path], "a second refit statistics file"),
             ([other], [path], "the 1 models"),
             ([copy], [write(tmp_path / "m.safetensors", mlp())], "not a refit statistics")]
    for clients, sources, message in cases:
        with pytest.raises((StatisticsError, ValueError), match=message):
            fusekit.refit(fused, clients, sources)
    with pytest.raises(ValueError, match="ridge: expected a number > 0"):
        fusekit.refit(fused, [copy], [path], ridge=0)


def _tampered(tmp_path, cross, field, value):
    point = next(iter(cross.points))
    arrays = {f"{p}.{f}": np.array(getattr(m, f)) for p, m in cross.points.items()
              for f in FIELDS}
    arrays[f"{point}.{field}"].flat[0] = value
    path = tmp_path / "bad.safetensors"
    safetensors.numpy.save_file(arrays, path, {"fusekit.cross_stats": json.dumps(
        {"format": "fusekit.cross_stats/1", "reference": cross.reference, "model": cross.model,
         "num_samples": cross.num_samples, "mode": "eval"})})
    return path


@pytest.mark.parametrize(("field", "value", "message"), [
    ("count", 65, "multiple of the 64 inputs"),
    ("count", 0, "positive count"),
    ("covariance", np.nan, "non-finite value"),
    ("own_var", -1.0, "variances must be >= 0"),
    ("covariance", 1e6, "Cauchy-Schwarz"),
    ("own_mean", 1e150, "own_mean up to 1e\\+150; expected at most 1e\\+12"),
    ("count", 64 * 2.0**900, "at most 2\\*\\*53"),
    ("reference_var", 1e300, "reference_var up to"),
])
def test_bad_cross_statistics_are_refused_in_one_line_naming_the_file(tmp_path, field, value,
                                                                      message):
    model, x = _model("mlp")
    copy, _ = _permuted(model, seed=1)
    path = _tampered(tmp_path, cross_statistics(model, copy, x), field, value)
    with pytest.raises(StatisticsError, match=message) as info:
        fusekit.align(model, [copy], [path])
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_cross_statistics_for_another_reference_client_or_too_few_samples_are_refused(tmp_path):
    model, x = _model("mlp")
    copy, _ = _permuted(model, seed=1)
    other, _ = _permuted(model, seed=2)
    good = save_cross_statistics(tmp_path / "good.safetensors", cross_statistics(model, copy, x))
    back = load_cross_statistics(good, reference=model.content_hash)
    assert back.num_samples == 64 and set(back.points) == set(cross_statistics(
        model, copy, x).points)
    cases = [
        (copy, [copy], [cross_statistics(other, copy, x)], "computed against reference"),
        (model, [other], [good], "none of the 1 client model"),
        (model, [copy, other], [good], "no cross statistics for client"),
        (model, [copy], [good, good], "a second cross statistics file"),
        (model, [copy], [cross_statistics(model, copy, x[:8], min_samples=8)],
         "over 8 inputs; at least 32"),
        (model, [copy], [write(tmp_path / "m.safetensors", mlp())], "not a cross statistics"),
    ]
    for reference, clients, cross, message in cases:
        with pytest.raises(StatisticsError, match=message):
            fusekit.align(reference, clients, cross)
    wide = cross_statistics(model, copy, x)
    point = next(iter(wide.points))
    wide.points[point].covariance = wide.points[point].covariance[:, :-1]
    with pytest.raises(StatisticsError, match="expected count"):
        fusekit.align(model, [copy], [wide])
    with pytest.raises(ValueError, match=r"N >= 32"):
        cross_statistics(model, copy, x[:8])


def test_cli_stats_against_and_align(tmp_path):
    paths = [write(tmp_path / f"c{i}.safetensors", mlp((6, 8, 3), batchnorm=True, seed=i),
                   num_samples=80) for i in range(2)]
    fused = tmp_path / "fused.safetensors"
    assert runner.invoke(app, ["fuse", *map(str, paths), "-m", "pfnm", "--width-ratio", "1.5",
                               "-o", str(fused)]).exit_code == 0
    cross = []
    for i, own in enumerate(paths):
        data = tmp_path / f"d{i}.npz"
        rng = np.random.default_rng(i)
        np.savez(data, x_train=rng.normal(size=(80, 6)).astype(np.float32),
                 y_train=np.zeros(80, np.int64), x_test=np.zeros((5, 6), np.float32),
                 y_test=np.zeros(5, np.int64))
        cross.append(tmp_path / f"x{i}.safetensors")
        result = runner.invoke(app, ["stats", str(fused), "--against", str(own),
                                     "--data-path", str(data), "-o", str(cross[-1])])
        assert result.exit_code == 0, result.output
    out = tmp_path / "aligned.safetensors"
    result = runner.invoke(app, ["align", str(fused), *map(str, paths),
                                 *[a for c in cross for a in ("--cross-stats", str(c))],
                                 "-o", str(out), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["clients"] == 2
    expected = fusekit.align(fused, paths, cross).state_dict
    aligned = load_checkpoint(out)
    assert [aligned.tensor(k).shape for k in expected] == [v.shape for v in expected.values()]
    for name, value in expected.items():
        np.testing.assert_array_equal(aligned.tensor(name), value)
    refit_stats = []
    for i, own in enumerate(paths):
        refit_stats.append(tmp_path / f"r{i}.safetensors")
        result = runner.invoke(app, ["stats", str(out), "--against", str(own), "--layer", "0",
                                     "--data-path", str(tmp_path / f"d{i}.npz"),
                                     "-o", str(refit_stats[-1])])
        assert result.exit_code == 0, result.output
    refit = tmp_path / "refit.safetensors"
    result = runner.invoke(app, ["refit", str(out), *map(str, paths),
                                 *[a for r in refit_stats for a in ("--refit-stats", str(r))],
                                 "-o", str(refit), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["layers"] == ["0"]
    expected = fusekit.refit(out, paths, refit_stats).state_dict
    for name, value in expected.items():
        np.testing.assert_array_equal(load_checkpoint(refit).tensor(name), value)
    bad = runner.invoke(app, ["align", str(fused), *map(str, paths), "--cross-stats",
                              str(paths[0]), "-o", str(tmp_path / "y.safetensors")])
    assert bad.exit_code == 2 and "not a cross statistics file" in bad.stderr
    assert not (tmp_path / "y.safetensors").exists()


def test_demo_align_scores_the_aligned_and_refit_models_beside_the_others(tmp_path):
    args = ["demo", "--clients", "3", "--epochs", "1", "--arch", "mlp:16", "-m", "ot", "-m",
            "ams", "--device", "cpu", "--align", "--out", str(tmp_path)]
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    runs = {run["method"]: run for run in json.loads(result.stdout)["methods"]}
    assert runs["ams"]["aligned"] is None and runs["ot"]["calibrated"] is None
    assert 0 <= runs["ot"]["aligned"]["accuracy"] <= 1
    aligned = load_checkpoint(tmp_path / "fused-ot-aligned.safetensors")
    assert json.loads(aligned.metadata["fusekit.alignment"])["refit"] is True
    assert fused_spec(aligned).hidden_widths == runs["ot"]["widths"]
    report = run_demo(DemoConfig(clients=3, epochs=1, arch="mlp:16", methods=["ot", "ams"],
                                 device="cpu", calibrate=True, align=True))
    console = Console(width=200, record=True)
    console.print(demo_table(report))
    lines = console.export_text().splitlines()
    header = next(line for line in lines if "accuracy" in line)
    assert "calibrated" in header and "aligned + refit" in header
    ot = next(run for run in report.methods if run.method == "ot")
    row = next(line for line in lines if line.split("│")[0].strip() == "ot")
    assert [f"{s.accuracy:.2%}" in row for s in (ot.score, ot.calibrated, ot.aligned)] == [
        True] * 3
    ams = next(line for line in lines if line.split("│")[0].strip() == "ams")
    assert ams.count(" - ") == 2


def test_simulate_rounds_align_each_fused_model(tmp_path):
    result = runner.invoke(app, [
        "simulate", "-o", str(tmp_path / "sim"), "--rounds", "1", "--method", "ot", "--align",
        "--clients", "3", "--epochs", "1", "--arch", "mlp:16", "--partition", "iid",
        "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    log = json.loads(result.stdout)["rounds"][0]
    assert 0 <= log["uncalibrated_accuracy"] <= 1 and 0 <= log["accuracy"] <= 1
    alignment = json.loads(load_checkpoint(tmp_path / "sim" / "global.safetensors")
                           .metadata["fusekit.alignment"])
    assert alignment["rounds"] == 1 and alignment["refit"] is True
    bad = runner.invoke(app, ["simulate", "-o", str(tmp_path / "x"), "--align"])
    assert bad.exit_code == 2 and "only with --rounds" in bad.stderr
