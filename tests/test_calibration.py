"""Calibration from client statistics: pooling, validation, BatchNorm restoration, REPAIR,
the CLI and strict loading (ALGORITHMS.md §12)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import safetensors.numpy
import torch
from torch import nn
from typer.testing import CliRunner

import fusekit
from conftest import mlp, numpy_state, write
from fusekit._cli.app import app
from fusekit.core.arch import named_arch
from fusekit.core.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from fusekit.core.errors import ParameterError, StatisticsError
from fusekit.core.model_spec import fused_spec
from fusekit.core.spec import permute
from fusekit.core.stats import (
    InputMoments,
    Moments,
    Statistics,
    calibrated_point,
    check_statistics,
    combine_inputs,
    input_point,
    load_statistics,
    pool,
    save_statistics,
    statistic_points,
    statistics_description,
    statistics_tensors,
)
from fusekit.methods.calibration import (
    derived_moments,
    matched_moments,
    neuron_targets,
    read_assignments,
)
from fusekit.toolkit.calibration import _InputAccumulator, client_statistics
from fusekit.toolkit.local import calibrate_locally
from fusekit.toolkit.nn import build_model

runner = CliRunner()


def _inputs(n, features=6, seed=0):
    return np.random.default_rng(seed).normal(size=(n, features)).astype(np.float32)


def _clients(batchnorm, n=3, widths=(6, 8, 7, 3)):
    return [Checkpoint.from_state_dict(numpy_state(mlp(widths, batchnorm=batchnorm, seed=s)),
                                       {"fusekit.num_samples": str(100 + 10 * s)})
            for s in range(n)]


def _fused(clients, method="pfnm", **params):
    result = fusekit.fuse(clients, method, **params)
    return Checkpoint.from_state_dict(result.state_dict, result.metadata)


def _outputs(checkpoint, x):
    with torch.no_grad():
        return fusekit.load_fused(checkpoint, "cpu")(torch.from_numpy(x)).numpy()


def test_pooled_statistics_equal_one_pass_over_the_union():
    fused = _fused(_clients(batchnorm=True))
    parts = [_inputs(n, seed=i) * (i + 1) + i for i, n in enumerate((40, 70, 55))]
    pooled = pool([client_statistics(fused, x, batch_size=16) for x in parts])
    union = client_statistics(fused, np.concatenate(parts), batch_size=1000)
    assert set(pooled) == set(union.points) == set(statistic_points(fused_spec(fused)))
    for point, moments in union.points.items():
        for field in ("count", "mean", "var"):
            np.testing.assert_allclose(getattr(pooled[point], field), getattr(moments, field),
                                       rtol=1e-10, atol=1e-12)


def test_statistics_files_round_trip_and_name_their_model(tmp_path):
    fused = _fused(_clients(batchnorm=True))
    stats = client_statistics(fused, _inputs(64))
    path = save_statistics(tmp_path / "s.safetensors", stats)
    back = load_statistics(path, model=fused.content_hash,
                           points=statistic_points(fused_spec(fused)))
    assert back.model == fused.content_hash and back.num_samples == 64
    for point, moments in stats.points.items():
        np.testing.assert_array_equal(back.points[point].var, moments.var)


def _tampered(stats, point, field, value):
    moments = stats.points[point]
    changed = {f: getattr(moments, f).copy() for f in ("count", "mean", "var")}
    changed[field][0] = value
    return Statistics(stats.model, stats.num_samples, stats.mode,
                      {**stats.points, point: Moments(**changed)})


@pytest.mark.parametrize(("field", "value", "message"), [
    ("count", 0, "positive counts"),
    ("count", 65, "multiples of the 64 inputs"),
    ("var", -1.0, "variances must be finite and >= 0"),
    ("var", np.inf, "non-finite value"),
    ("mean", np.nan, "non-finite value"),
])
def test_bad_statistics_are_refused_naming_the_file(tmp_path, field, value, message):
    fused = _fused(_clients(batchnorm=True))
    stats = client_statistics(fused, _inputs(64))
    point = next(iter(stats.points))
    bad = _tampered(stats, point, field, value)
    path = tmp_path / "bad.safetensors"
    arrays = {f"{p}.{f}": getattr(m, f) for p, m in bad.points.items()
              for f in ("count", "mean", "var")}
    safetensors.numpy.save_file(arrays, path, {"fusekit.stats": json.dumps(
        {"format": "fusekit.stats/1", "model": stats.model, "num_samples": 64,
         "mode": "eval"})})
    with pytest.raises(StatisticsError, match=message) as info:
        fusekit.calibrate(fused, [path])
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_statistics_of_another_model_too_few_samples_or_wrong_shape_are_refused(tmp_path):
    clients = _clients(batchnorm=True)
    fused = _fused(clients)
    other = client_statistics(clients[0], _inputs(64))
    path = save_statistics(tmp_path / "other.safetensors", other)
    with pytest.raises(StatisticsError, match="computed for model"):
        fusekit.calibrate(fused, [path])
    with pytest.raises(ValueError, match=r"N >= 32 \(min_samples\)"):
        client_statistics(fused, _inputs(8))  # refused where the data is, too
    few = save_statistics(tmp_path / "few.safetensors",
                          client_statistics(fused, _inputs(8), min_samples=8))
    with pytest.raises(StatisticsError, match="over 8 inputs; at least 32"):
        fusekit.calibrate(fused, [few])
    fusekit.calibrate(fused, [few], min_samples=8)  # configurable
    with pytest.raises(StatisticsError, match="not a statistics file"):
        fusekit.calibrate(fused, [write(tmp_path / "model.safetensors", mlp())])
    wider = _fused(clients, width_ratio=2.0)
    stats = client_statistics(wider, _inputs(64))
    stats.model = fused.content_hash
    with pytest.raises(StatisticsError, match=r"expected count, mean and var of shape \(\d+,\)"):
        fusekit.calibrate(fused, [stats])


def _recomputed_batchnorm(fused: Checkpoint, x: np.ndarray) -> nn.Module:
    """The reference: torch itself recomputes every BatchNorm's running statistics on
    ``x``, input to output, after giving it the affine recorded at fusion."""
    model = fusekit.load_fused(fused, "cpu")
    targets = json.loads(fused.metadata["fusekit.norm_targets"])
    norms = [m for m in model.modules() if isinstance(m, nn.BatchNorm1d)]
    names = {id(m): n for n, m in model.named_modules()}
    for norm in norms:
        with torch.no_grad():
            norm.weight.copy_(torch.tensor(targets[names[id(norm)]]["weight"]))
            norm.bias.copy_(torch.tensor(targets[names[id(norm)]]["bias"]))
        norm.reset_running_stats()
        norm.momentum = None
        norm.train()
        with torch.no_grad():
            model(torch.from_numpy(x))
        norm.eval()
    return model


def test_layerwise_calibration_equals_batchnorm_recomputed_on_the_union():
    fused = _fused(_clients(batchnorm=True))
    parts = [_inputs(n, seed=i) for i, n in enumerate((60, 90))]
    calibrated = calibrate_locally(fused, parts, rounds="layerwise")
    assert calibrated.report["calibration"]["rounds"] == 2
    mine = _outputs(Checkpoint.from_state_dict(calibrated.state_dict, calibrated.metadata),
                    _inputs(50, seed=9))
    reference = _recomputed_batchnorm(fused, np.concatenate(parts))
    with torch.no_grad():
        expected = reference(torch.from_numpy(_inputs(50, seed=9))).numpy()
    np.testing.assert_allclose(mine, expected, rtol=1e-4, atol=1e-4)
    before = _outputs(fused, _inputs(50, seed=9))
    assert not np.allclose(before, expected, atol=1e-2)  # calibration changed the model


def test_one_pass_differs_from_layerwise_and_stays_close():
    fused = _fused(_clients(batchnorm=True))
    parts = [_inputs(60, seed=1) + 1.0, _inputs(90, seed=2) - 1.0]
    layerwise = calibrate_locally(fused, parts, rounds="layerwise")
    one_pass = calibrate_locally(fused, parts, rounds="one-pass")
    assert one_pass.report["calibration"]["rounds"] == 1
    names = [n for n in layerwise.state_dict if n.endswith("running_var")]
    # The first BatchNorm sees the same inputs either way; deeper ones differ (§12).
    np.testing.assert_allclose(one_pass.state_dict[names[0]], layerwise.state_dict[names[0]],
                               rtol=1e-5)
    assert not np.allclose(one_pass.state_dict[names[-1]], layerwise.state_dict[names[-1]],
                           rtol=1e-6)


def _repair_case(clients, parts, method="ot"):
    """A fusion of ``clients``, each client's statistics of its own model on its part, and
    REPAIR's targets and the assignments in that order."""
    fused = _fused(clients, method)
    spec = fused_spec(fused)
    own = [client_statistics(c, x) for c, x in zip(clients, parts, strict=True)]
    inputs = json.loads(fused.metadata["fusekit.inputs"])
    assignments = read_assignments(fused, spec)
    chosen = [assignments[inputs.index(s.model)] for s in own]
    return fused, spec, own, chosen, neuron_targets(spec, own, chosen)


def test_repair_gives_each_fused_neuron_its_matched_clients_moments_on_their_data():
    """Layer by layer with paired statistics (calibrate_locally): on the data of the clients
    matched into it, each calibrated fused neuron has its targets' deviation, and its
    targets' mean in the deeper layers; a first-layer neuron keeps its own mean (averaging
    affine functions of the same inputs does not move it), which is not its target's."""
    clients = _clients(batchnorm=False)
    parts = [_inputs(80, seed=s) + s for s in range(len(clients))]  # non-iid
    fused, spec, own, chosen, targets = _repair_case(clients, parts)
    before = [client_statistics(fused, x) for x in parts]
    own_mean = matched_moments(spec, before, own, chosen, pool(before))
    calibrated = calibrate_locally(fused, parts, clients=clients)
    assert calibrated.report["calibration"]["paired"] is True
    result = Checkpoint.from_state_dict(calibrated.state_dict, calibrated.metadata)
    per_client = [client_statistics(result, x) for x in parts]
    after = matched_moments(spec, per_client, own, chosen, pool(per_client))
    first = f"preactivation:{spec.layers[0].name}"
    assert set(after) == set(targets) and len(targets) == 2
    for point, (mean, std) in targets.items():
        kept = own_mean[point].mean if point == first else mean
        np.testing.assert_allclose(after[point].mean, kept, atol=1e-4)
        np.testing.assert_allclose(after[point].std, std, rtol=1e-4, atol=1e-5)
    assert not np.allclose(own_mean[first].mean, targets[first][0], atol=1e-2)
    np.testing.assert_array_equal(calibrated.state_dict["2.weight"] != 0,
                                  fused.tensor("2.weight") != 0)


def test_unpaired_repair_gives_the_pooled_moments_the_targets():
    """Without pairs (statistics from some clients, in any order), the fused neuron's
    moments pooled over the union go to the targets (exact for the first layer)."""
    clients = _clients(batchnorm=False)
    parts = [_inputs(80, seed=s) for s in range(len(clients))]
    fused, spec, own, _, targets = _repair_case(clients, parts)
    first = spec.layers[0].name
    stats = [client_statistics(fused, x) for x in reversed(parts)]
    calibrated = fusekit.calibrate(fused, stats, targets=own, layers=[first])
    assert calibrated.report["calibration"]["paired"] is False
    result = Checkpoint.from_state_dict(calibrated.state_dict, calibrated.metadata)
    after = pool([client_statistics(result, x) for x in parts])
    mean, std = targets[f"preactivation:{first}"]
    np.testing.assert_allclose(after[f"preactivation:{first}"].mean, mean, atol=1e-4)
    np.testing.assert_allclose(after[f"preactivation:{first}"].std, std, rtol=1e-4, atol=1e-5)


def test_paired_repair_leaves_a_model_averaging_did_not_change_alone_on_non_iid_data():
    """Two clients that are permuted copies of one network, on data that differ: the fusion
    is that network, nothing was averaged, and paired REPAIR leaves its function as it is;
    pooled over the union, each neuron's spread includes the gap between the clients' data
    and REPAIR shrank every neuron towards the narrower per-client spread."""
    base = Checkpoint.from_state_dict(numpy_state(mlp((6, 8, 7, 3), seed=0)),
                                      {"fusekit.num_samples": "80"})
    spec = fused_spec(base)
    perms = [np.random.default_rng(1).permutation(w) for w in spec.hidden_widths]
    copy = Checkpoint.from_state_dict(permute(base.state_dict(), spec, perms),
                                      {"fusekit.num_samples": "80"})
    parts = [_inputs(80, seed=1) + 2.0, _inputs(80, seed=2) - 2.0]
    fused = _fused([base, copy], "rebasin")
    x = _inputs(50, seed=9)
    np.testing.assert_allclose(_outputs(fused, x), _outputs(base, x), rtol=1e-5, atol=1e-5)
    paired = calibrate_locally(fused, parts, clients=[base, copy])
    np.testing.assert_allclose(_outputs(Checkpoint.from_state_dict(paired.state_dict,
                                                                   paired.metadata), x),
                               _outputs(base, x), rtol=1e-4, atol=1e-4)
    own = [client_statistics(c, p) for c, p in zip([base, copy], parts, strict=True)]
    stats = [client_statistics(fused, p) for p in parts]
    first = spec.layers[0].name
    pooled = fusekit.calibrate(fused, stats, targets=own, layers=[first])
    assert not np.allclose(pooled.state_dict["0.weight"], fused.tensor("0.weight"), rtol=1e-2)


def test_paired_statistics_must_come_in_pairs_over_the_same_inputs():
    clients = _clients(batchnorm=False)
    parts = [_inputs(80 + 8 * s, seed=s) for s in range(len(clients))]
    fused, _, own, _, _ = _repair_case(clients, parts)
    stats = [client_statistics(fused, x) for x in parts]
    with pytest.raises(ParameterError, match="found 2 statistics and 3 targets"):
        fusekit.calibrate(fused, stats[:2], targets=own, paired=True)
    with pytest.raises(StatisticsError, match="computed over 88 inputs against 80"):
        fusekit.calibrate(fused, [stats[1], stats[0], stats[2]], targets=own, paired=True)


def test_repair_needs_the_fusion_assignments(tmp_path):
    clients = _clients(batchnorm=False)
    fused = _fused(clients, "ot")
    bare = Checkpoint.from_state_dict(fused.state_dict(), {
        k: v for k, v in fused.metadata.items() if k != "fusekit.assignments"})
    parts = [_inputs(64, seed=s) for s in range(3)]
    with pytest.raises(ValueError, match="fusekit.assignments"):
        fusekit.calibrate(bare, [client_statistics(bare, x) for x in parts],
                          targets=[client_statistics(c, x) for c, x in zip(clients, parts)])


def test_cli_round_trip(tmp_path):
    paths = [write(tmp_path / f"c{i}.safetensors", mlp((6, 8, 3), batchnorm=True, seed=i),
                   num_samples=80) for i in range(2)]
    fused = tmp_path / "fused.safetensors"
    assert runner.invoke(app, ["fuse", *map(str, paths), "-m", "rebasin", "-o", str(fused)]
                         ).exit_code == 0
    stats = []
    for i in range(2):
        data = tmp_path / f"d{i}.npz"
        np.savez(data, x_train=_inputs(80, seed=i), y_train=np.zeros(80, np.int64),
                 x_test=_inputs(5), y_test=np.zeros(5, np.int64))
        stats.append(tmp_path / f"s{i}.safetensors")
        result = runner.invoke(app, ["stats", str(fused), "--data-path", str(data),
                                     "-o", str(stats[-1])])
        assert result.exit_code == 0, result.output
    out = tmp_path / "calibrated.safetensors"
    result = runner.invoke(app, ["calibrate", str(fused), *map(str, stats), "-o", str(out),
                                 "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["samples"] == 160
    calibrated = load_checkpoint(out)
    assert json.loads(calibrated.metadata["fusekit.calibration"])["clients"] == 2
    expected = fusekit.calibrate(fused, stats).state_dict
    for name, value in expected.items():
        np.testing.assert_array_equal(calibrated.tensor(name), value)
    few = runner.invoke(app, ["stats", str(fused), "--data-path", str(data), "-o",
                              str(tmp_path / "x.safetensors"), "--min-samples", "81"])
    assert few.exit_code == 2 and "N >= 81 (--min-samples)" in few.stderr
    bad = runner.invoke(app, ["calibrate", str(fused), str(paths[0]), "-o",
                              str(tmp_path / "x.safetensors")])
    assert bad.exit_code == 2 and "not a statistics file" in bad.stderr
    assert not (tmp_path / "x.safetensors").exists()


def test_cli_paired_repair_equals_the_api_and_refuses_unequal_pairs(tmp_path):
    clients = _clients(batchnorm=False, n=2)
    parts = [_inputs(64, seed=1) + 1.0, _inputs(72, seed=2) - 1.0]
    fused, *_ = _repair_case(clients, parts)
    fused_path = save_checkpoint(tmp_path / "fused.safetensors", fused.state_dict(),
                                 fused.metadata)
    stats, own = [], []
    for i, (client, x) in enumerate(zip(clients, parts, strict=True)):
        stats.append(save_statistics(tmp_path / f"s{i}.safetensors",
                                     client_statistics(fused_path, x)))
        own.append(save_statistics(tmp_path / f"t{i}.safetensors",
                                   client_statistics(client, x)))
    out = tmp_path / "calibrated.safetensors"
    targets = [arg for path in own for arg in ("--targets", str(path))]
    result = runner.invoke(app, ["calibrate", str(fused_path), *map(str, stats), *targets,
                                 "--paired", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "REPAIR targets, paired" in " ".join(result.stdout.split())
    expected = fusekit.calibrate(fused_path, stats, targets=own, paired=True).state_dict
    unpaired = fusekit.calibrate(fused_path, stats, targets=own).state_dict
    calibrated = load_checkpoint(out)
    assert not np.allclose(expected["0.weight"], unpaired["0.weight"])
    for name, value in expected.items():
        np.testing.assert_array_equal(calibrated.tensor(name), value)
    swapped = runner.invoke(app, ["calibrate", str(fused_path), *map(str, stats[::-1]),
                                  *targets, "--paired", "-o", str(tmp_path / "x.safetensors")])
    assert swapped.exit_code == 2 and "computed over 72 inputs against 64" in swapped.stderr
    assert not (tmp_path / "x.safetensors").exists()


def test_calibrated_resnet_loads_strictly_into_the_torchvision_module():
    arch = named_arch("resnet20", 10, in_channels=1)
    clients = [Checkpoint.from_state_dict(numpy_state(build_model(arch, seed=s)),
                                          {"fusekit.num_samples": "64"}) for s in range(2)]
    fused = _fused(clients, "rebasin")
    parts = [np.random.default_rng(s).normal(size=(40, 1, 8, 8)).astype(np.float32)
             for s in range(2)]
    calibrated = calibrate_locally(fused, parts, rounds="one-pass", min_samples=16)
    module = build_model(arch)
    module.load_state_dict({k: torch.from_numpy(np.array(v))
                            for k, v in calibrated.state_dict.items()}, strict=True)
    loaded = fusekit.load_fused(Checkpoint.from_state_dict(calibrated.state_dict,
                                                           calibrated.metadata), "cpu")
    x = torch.from_numpy(parts[0])
    with torch.no_grad():
        np.testing.assert_allclose(loaded(x).numpy(), module.eval()(x).numpy(), rtol=1e-5,
                                   atol=1e-5)


def test_simulate_rounds_calibrate_each_fused_model(tmp_path):
    result = runner.invoke(app, [
        "simulate", "-o", str(tmp_path / "sim"), "--rounds", "1", "--method", "ot",
        "--calibrate", "--clients", "3", "--epochs", "1", "--batchnorm", "--arch", "mlp:16,16",
        "--partition", "iid", "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    log = json.loads(result.stdout)["rounds"][0]
    assert 0 <= log["uncalibrated_accuracy"] <= 1 and 0 <= log["accuracy"] <= 1
    calibration = json.loads(load_checkpoint(tmp_path / "sim" / "global.safetensors")
                             .metadata["fusekit.calibration"])
    assert calibration["clients"] == 3 and calibration["rounds"] == 2
    bad = runner.invoke(app, ["simulate", "-o", str(tmp_path / "x"), "--calibrate"])
    assert bad.exit_code == 2 and "only with --rounds" in bad.stderr


def test_demo_calibrate_scores_the_calibrated_models():
    from fusekit.toolkit.demo import DemoConfig, run_demo

    report = run_demo(DemoConfig(clients=3, epochs=1, arch="mlp:16,16", batchnorm=True,
                                 methods=["ot", "ams"], device="cpu", calibrate=True))
    runs = {run.method: run for run in report.methods}
    assert runs["ot"].calibrated is not None and runs["ams"].calibrated is None
    assert not report.failed


def test_inspect_cuts_long_metadata(tmp_path):
    paths = [write(tmp_path / f"c{i}.safetensors", mlp((6, 200, 3), seed=i), num_samples=9)
             for i in range(2)]
    fused = fusekit.fuse(paths, "rebasin").save(tmp_path / "fused.safetensors")
    result = runner.invoke(app, ["inspect", str(fused)])
    assert result.exit_code == 0, result.output
    assert "characters; --json shows all" in result.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_statistics_on_cuda_equal_cpu():
    fused = _fused(_clients(batchnorm=True))
    x = _inputs(100)
    on_gpu, on_cpu = client_statistics(fused, x, device="cuda"), client_statistics(fused, x)
    for point, moments in on_cpu.points.items():
        np.testing.assert_allclose(on_gpu.points[point].var, moments.var, rtol=1e-4, atol=1e-6)



def test_one_pass_calibration_records_its_round_like_layerwise():
    fused = _fused(_clients(batchnorm=True))
    parts = [_inputs(40, seed=i) for i in range(3)]
    one_pass = calibrate_locally(fused, parts, rounds="one-pass")
    assert json.loads(one_pass.metadata["fusekit.calibration"])["rounds"] == 1
    layerwise = calibrate_locally(fused, parts)
    assert json.loads(layerwise.metadata["fusekit.calibration"])["rounds"] == 2


def test_local_calibration_runs_no_pass_when_no_layer_needs_one(monkeypatch):
    plain = _fused(_clients(batchnorm=False))  # no BatchNorm and no targets: nothing to do
    passes = []
    monkeypatch.setattr("fusekit.toolkit.calibration.client_statistics",
                        lambda *args, **kwargs: passes.append(args))
    unchanged = calibrate_locally(plain, [_inputs(40, seed=i) for i in range(3)])
    assert passes == [] and unchanged.report["calibration"]["rounds"] == 0
    for name, tensor in plain.state_dict().items():
        np.testing.assert_array_equal(unchanged.state_dict[name], tensor)


def _first_layer_case(kind):
    """Clients, their inputs (from different distributions) and a fused model."""
    if kind == "resnet20":
        arch = named_arch("resnet20", 10, in_channels=1)
        clients = [Checkpoint.from_state_dict(numpy_state(build_model(arch, seed=s)),
                                              {"fusekit.num_samples": str(48 + 8 * s)})
                   for s in range(3)]
        parts = [np.random.default_rng(s).normal(s, 1 + s, size=(48 + 8 * s, 1, 8, 8))
                 .astype(np.float32) for s in range(3)]
        return clients, parts, _fused(clients, "rebasin")
    clients = _clients(batchnorm=kind == "mlp_bn")
    parts = [_inputs(n, seed=i) * (i + 1) + i for i, n in enumerate((40, 70, 55))]
    return clients, parts, _fused(clients)


@pytest.mark.parametrize("kind", ["mlp_bn", "mlp", "resnet20"])
def test_first_layer_derived_from_input_moments_equals_a_round(kind):
    clients, parts, fused = _first_layer_case(kind)
    targets = [client_statistics(c, x, batch_size=32, input_moments=True, min_samples=16)
               for c, x in zip(clients, parts, strict=True)]
    spec = fused_spec(fused)
    first = spec.layers[0]
    round_stats = [client_statistics(fused, x, batch_size=32, min_samples=16) for x in parts]
    inputs = combine_inputs([t.inputs[input_point(first.name)] for t in targets])
    derived = derived_moments(fused.tensor(first.weight),
                              fused.tensor(first.bias) if first.bias else None, inputs)
    pooled = pool(round_stats)[calibrated_point(first)]
    for field in ("count", "mean", "var"):  # the round runs the model in float32
        np.testing.assert_allclose(getattr(derived, field), getattr(pooled, field),
                                   rtol=1e-5, atol=1e-6)
    without_round = fusekit.calibrate(fused, [], targets=targets, min_samples=16)
    with_round = fusekit.calibrate(fused, round_stats, targets=targets, layers=[first.name],
                                   min_samples=16)
    assert without_round.report["calibration"]["layers"] == [first.name]
    assert without_round.report["calibration"]["mode"] == "derived"
    changed = [name for name, value in fused.state_dict().items()
               if not np.array_equal(without_round.state_dict[name], value)]
    assert changed and set(changed) <= set(first.tensors)
    for name, value in with_round.state_dict.items():
        np.testing.assert_allclose(without_round.state_dict[name], value, rtol=1e-5, atol=1e-6)


def test_input_moments_of_a_strided_dilated_padded_conv_give_its_output_moments():
    torch.manual_seed(0)  # float64 throughout: exact up to rounding
    conv = nn.Conv2d(3, 5, kernel_size=(3, 2), stride=(2, 1), padding=(1, 2),
                     dilation=(1, 2)).double()
    x = torch.randn(37, 3, 9, 7, dtype=torch.float64) * torch.tensor(
        [1.0, 3.0, 0.5], dtype=torch.float64).reshape(1, 3, 1, 1) + 2
    accumulator = _InputAccumulator(conv, "conv")
    for batch in x.split(10):
        accumulator.add(batch)
    derived = derived_moments(conv.weight.detach().numpy(), conv.bias.detach().numpy(),
                              accumulator.moments())
    with torch.no_grad():
        out = conv(x).double().transpose(0, 1).reshape(5, -1).numpy()
    np.testing.assert_allclose(derived.count, out.shape[1])
    np.testing.assert_allclose(derived.mean, out.mean(1), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(derived.var, out.var(1), rtol=1e-10, atol=1e-12)


def test_local_calibration_with_input_moments_saves_the_first_round():
    clients, parts, fused = _first_layer_case("mlp_bn")
    rounds = calibrate_locally(fused, parts, clients=clients, min_samples=16)
    derived = calibrate_locally(fused, parts, clients=clients, min_samples=16,
                                input_moments=True)
    assert (derived.report["calibration"]["rounds"]
            == rounds.report["calibration"]["rounds"] - 1)
    for name, value in rounds.state_dict.items():
        np.testing.assert_allclose(derived.state_dict[name], value, rtol=1e-5, atol=1e-6)


def _with_inputs(stats, **fields):
    (point, moments), = stats.inputs.items()
    changed = {f: fields.get(f, getattr(moments, f)) for f in ("count", "mean", "cov")}
    return dataclasses.replace(stats, inputs={point: InputMoments(**changed)})


@pytest.mark.parametrize("change, message", [
    (lambda m: {"cov": m.cov[:-1]}, r"expected count \(1,\), mean \(d,\) and cov \(d, d\)"),
    (lambda m: {"mean": np.where(np.arange(m.mean.size) == 0, np.nan, m.mean)},
     "must be finite|non-finite value"),  # the file: refused as it is read
    (lambda m: {"cov": m.cov + np.triu(np.ones_like(m.cov), 1)}, "not symmetric"),
    (lambda m: {"cov": m.cov - 2 * np.abs(m.cov).max() * np.eye(len(m.cov))},
     "not positive semi-definite"),
    (lambda m: {"count": m.count + 1}, "multiple of the 40 inputs"),
    (lambda m: {"count": np.float64(0)}, "above the dimension 6"),
])
def test_bad_input_moments_are_refused_naming_the_file(tmp_path, change, message):
    stats = client_statistics(_clients(batchnorm=True)[0], _inputs(40), input_moments=True)
    bad = _with_inputs(stats, **change(next(iter(stats.inputs.values()))))
    path = tmp_path / "bad.safetensors"
    safetensors.numpy.save_file(statistics_tensors(bad), path,
                                {"fusekit.stats": statistics_description(bad)})
    with pytest.raises(StatisticsError, match=message) as error:
        load_statistics(path)
    assert str(path) in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(StatisticsError, match=message):
        check_statistics(bad)  # in memory (a Flower reply) as well


def test_input_moments_from_some_clients_or_for_deeper_layers_are_refused():
    clients, parts, fused = _first_layer_case("mlp_bn")
    targets = [client_statistics(c, x, input_moments=i > 0, min_samples=16)
               for i, (c, x) in enumerate(zip(clients, parts, strict=True))]
    with pytest.raises(StatisticsError, match="no input moments of the first layer"):
        fusekit.calibrate(fused, [], targets=targets, min_samples=16)
    targets[0] = client_statistics(clients[0], parts[0], input_moments=True, min_samples=16)
    second = fused_spec(fused).layers[1].name
    with pytest.raises(StatisticsError, match=f"'{second}' needs statistics of the fused"):
        fusekit.calibrate(fused, [], targets=targets, layers=[second], min_samples=16)
    with pytest.raises(StatisticsError, match="found neither"):
        fusekit.calibrate(fused, [], min_samples=16)
    with pytest.raises(ValueError, match="6 input vectors of dimension 6"):
        client_statistics(clients[0], parts[0][:6], input_moments=True, min_samples=1)


def test_cli_calibrates_the_first_layer_without_a_round(tmp_path):
    clients, parts, _ = _first_layer_case("mlp_bn")
    paths = [write(tmp_path / f"c{i}.safetensors", c.state_dict(), num_samples=len(x))
             for i, (c, x) in enumerate(zip(clients, parts, strict=True))]
    fused = tmp_path / "fused.safetensors"
    assert runner.invoke(app, ["fuse", *map(str, paths), "-m", "pfnm", "-o", str(fused)]
                         ).exit_code == 0
    targets = []
    for i, (path, x) in enumerate(zip(paths, parts, strict=True)):
        data = tmp_path / f"d{i}.npz"
        np.savez(data, x_train=x, y_train=np.zeros(len(x), np.int64), x_test=x[:5],
                 y_test=np.zeros(5, np.int64))
        targets += ["--targets", str(tmp_path / f"t{i}.safetensors")]
        result = runner.invoke(app, ["stats", str(path), "--data-path", str(data),
                                     "--input-moments", "-o", targets[-1]])
        assert result.exit_code == 0, result.output
    out = tmp_path / "calibrated.safetensors"
    result = runner.invoke(app, ["calibrate", str(fused), *targets, "-o", str(out), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["mode"] == "derived"
    expected = fusekit.calibrate(fused, targets=targets[1::2]).state_dict
    for name, value in expected.items():
        np.testing.assert_array_equal(load_checkpoint(out).tensor(name), value)
    none = runner.invoke(app, ["calibrate", str(fused), "-o", str(tmp_path / "x.safetensors")])
    assert none.exit_code == 2 and "found neither" in none.stderr
