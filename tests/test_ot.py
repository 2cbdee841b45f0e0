"""OT fusion (ALGORITHMS.md §5) against a direct POT computation, and its properties."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

import fusekit
from conftest import _with_random_stats, mlp, numpy_state
from fusekit.core.checkpoint import Checkpoint, load_checkpoint
from fusekit.core.errors import DataError, IncompatibleModelsError, ParameterError
from fusekit.core.spec import infer_spec, permute
from fusekit.methods.ot import transport_plan
from fusekit.toolkit.activations import ActivationInputs, load_activation_inputs
from fusekit.toolkit.nn import build_model, convnet_arch


def cnn(channels=(4, 6), hidden=8, seed=0) -> nn.Module:
    """fusekit ConvNet on 1x8x8 images (conv-BN-ReLU-pool blocks), random BN statistics;
    carries its architecture in ``.arch`` (needed to rebuild a conv model)."""
    torch.manual_seed(seed)
    return _with_random_stats(build_model(convnet_arch((1, 8, 8), channels, 3, hidden=[hidden]),
                                          seed=seed))


def save(path, model_or_state, num_samples, arch=None):
    state = model_or_state if isinstance(model_or_state, dict) else numpy_state(model_or_state)
    arch = arch if arch is not None else getattr(model_or_state, "arch", None)
    metadata = {"fusekit.num_samples": str(num_samples)}
    if arch is not None:
        metadata["fusekit.arch"] = json.dumps(arch)
    return fusekit.save_checkpoint(path, state, metadata)


# ---- a direct implementation of §5 on torch modules, with POT's exact EMD everywhere ----


def folded_layers(model: nn.Sequential) -> list[tuple[np.ndarray, np.ndarray]]:
    """(W (out, in_units, positions), b) per Linear/Conv2d, BatchNorm folded in."""
    mods = list(getattr(model, "steps", None) or getattr(model, "net", model))
    layers, channels_below = [], None
    for i, m in enumerate(mods):
        if not isinstance(m, (nn.Linear, nn.Conv2d)):
            continue
        w = m.weight.detach().double().numpy()
        b = m.bias.detach().double().numpy()
        following = mods[i + 1] if i + 1 < len(mods) else None
        if isinstance(following, nn.modules.batchnorm._BatchNorm):
            scale = (following.weight.detach().double().numpy()
                     / np.sqrt(following.running_var.double().numpy() + following.eps))
            w = w * scale.reshape(-1, *[1] * (w.ndim - 1))
            b = scale * (b - following.running_mean.double().numpy()) \
                + following.bias.detach().double().numpy()
        if w.ndim == 4:
            w = w.reshape(w.shape[0], w.shape[1], -1)
            channels_below = w.shape[0]
        elif channels_below is not None:  # first linear after the flatten
            w = w.reshape(w.shape[0], channels_below, -1)
            channels_below = None
        else:
            w = w[:, :, None]
        layers.append((w, b))
    return layers


def reference_ot(models, weights, anchor, activations=None):
    """§5 steps 1-5, plainly: returns the fused (W, b) per layer."""
    import ot as pot  # here, not at collection: POT costs every pytest worker a second

    clients = [folded_layers(m) for m in models]
    n_layers = len(clients[0])
    aligned = [[None] * n_layers for _ in models]
    for s, layers in enumerate(clients):
        t_hat = None
        for li, (w, b) in enumerate(layers):
            if t_hat is not None:  # step 1, per kernel position / spatial block
                w = np.stack([w[:, :, p] @ t_hat for p in range(w.shape[2])], axis=2)
            if s == anchor or li == n_layers - 1:
                aligned[s][li] = (w, b)
                t_hat = None if s == anchor else t_hat
                continue
            wa, ba = clients[anchor][li]
            if activations is None:
                mine = np.hstack([w.reshape(len(w), -1), b[:, None]])
                theirs = np.hstack([wa.reshape(len(wa), -1), ba[:, None]])
            else:
                mine, theirs = activations[s][li].T, activations[anchor][li].T
            cost = ((mine[:, None, :] - theirs[None, :, :]) ** 2).sum(-1)
            plan = pot.emd(np.full(len(mine), 1 / len(mine)),
                           np.full(len(theirs), 1 / len(theirs)), cost)
            beta = plan.sum(axis=0)
            t_hat = plan / beta
            aligned[s][li] = (np.einsum("ig,iup->gup", t_hat, w), t_hat.T @ b)
    return [(sum(a * aligned[s][li][0] for s, a in enumerate(weights)),
             sum(a * aligned[s][li][1] for s, a in enumerate(weights)))
            for li in range(n_layers)]


def mlp_preactivations(model: nn.Sequential, x: np.ndarray) -> list[np.ndarray]:
    h, out = x, []
    layers = folded_layers(model)
    for w, b in layers[:-1]:
        z = h @ w[:, :, 0].T + b
        out.append(z)
        h = np.maximum(z, 0)
    return out


def fused_layers(result) -> list[tuple[np.ndarray, np.ndarray]]:
    """The fused model's (W, b) per layer in the same form (its BatchNorms are identities)."""
    module = fusekit.load_fused(Checkpoint.from_state_dict(result.state_dict, result.metadata),
                                "cpu")
    return folded_layers(module)


def outputs(model, x):
    with torch.no_grad():
        return model(torch.as_tensor(x, dtype=torch.float32)).double().numpy()


# ---- properties ----

def permuted(model: nn.Module, seed: int) -> dict[str, np.ndarray]:
    state = numpy_state(model)
    spec = infer_spec(state)
    rng = np.random.default_rng(seed)
    return permute(state, spec, [rng.permutation(w) for w in spec.hidden_widths])


@pytest.mark.parametrize("activations", [False, True])
@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_permuted_copies_give_back_the_original_function(tmp_path, kind, activations):
    model = mlp(widths=(6, 9, 7, 3), batchnorm=True, seed=1) if kind == "mlp" else cnn(seed=1)
    shape = (6,) if kind == "mlp" else (1, 8, 8)
    arch = getattr(model, "arch", None)
    paths = [save(tmp_path / "original.safetensors", model, 10)]
    for seed in range(2):
        paths.append(save(tmp_path / f"perm{seed}.safetensors", permuted(model, seed), 5, arch))
    x = np.random.default_rng(0).normal(size=(64, *shape)).astype(np.float32)
    params = {"activations": ActivationInputs(x)} if activations else {}
    result = fusekit.fuse(paths, method="ot", **params)
    fused = fusekit.load_fused(
        result.save(tmp_path / "fused.safetensors"), "cpu")
    np.testing.assert_allclose(outputs(fused, x), outputs(model, x), rtol=1e-5, atol=1e-5)
    assert all(r["transport"] == ["assignment"] for r in result.report["layers"])
    if not activations:  # permuted copies align at zero weight cost
        assert all(c < 1e-9 for r in result.report["layers"] for c in r["mean_cost"])


def _clients(tmp_path, models, counts):
    return [save(tmp_path / f"c{i}.safetensors", m, n)
            for i, (m, n) in enumerate(zip(models, counts, strict=True))]


@pytest.mark.parametrize("widths", [[(6, 5, 4, 3), (6, 5, 4, 3)],   # equal: C++ assignment
                                    [(6, 7, 4, 3), (6, 5, 6, 3)],   # unequal: POT emd
                                    [(6, 5, 4, 3), (6, 8, 4, 3), (6, 5, 2, 3)]])
def test_mlp_matches_direct_pot_computation(tmp_path, widths):
    models = [mlp(widths=w, batchnorm=True, seed=10 + i) for i, w in enumerate(widths)]
    counts = [7, 30, 11][:len(models)]
    result = fusekit.fuse(_clients(tmp_path, models, counts), method="ot")
    anchor = int(np.argmax(counts))
    expected = reference_ot(models, np.array(counts) / sum(counts), anchor)
    got = fused_layers(result)
    assert result.widths == list(widths[anchor][1:-1])
    for (w, b), (ew, eb) in zip(got, expected, strict=True):
        np.testing.assert_allclose(w, ew, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(b, eb, rtol=1e-5, atol=1e-6)
    for li, report in enumerate(result.report["layers"]):
        expected_kinds = {"assignment" if w[li + 1] == widths[anchor][li + 1] else "emd"
                          for i, w in enumerate(widths) if i != anchor}
        assert set(report["transport"]) == expected_kinds


def test_cnn_matches_direct_pot_computation(tmp_path):
    """Per kernel position for the convs, per spatial block at the flatten."""
    models = [cnn(channels=(4, 6), hidden=8, seed=3), cnn(channels=(5, 3), hidden=6, seed=4)]
    result = fusekit.fuse(_clients(tmp_path, models, [3, 9]), method="ot")
    expected = reference_ot(models, np.array([3, 9]) / 12, anchor=1)
    assert result.widths == [5, 3, 6]
    for (w, b), (ew, eb) in zip(fused_layers(result), expected, strict=True):
        np.testing.assert_allclose(w, ew, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(b, eb, rtol=1e-5, atol=1e-6)
    assert {k for r in result.report["layers"] for k in r["transport"]} == {"emd"}


def test_activation_cost_matches_direct_pot_computation(tmp_path):
    models = [mlp(widths=(6, 7, 5, 3), batchnorm=True, seed=20),
              mlp(widths=(6, 7, 4, 3), batchnorm=True, seed=21)]
    x = np.random.default_rng(1).normal(size=(40, 6))
    result = fusekit.fuse(_clients(tmp_path, models, [9, 4]), method="ot",
                          activations=ActivationInputs(x))
    acts = [mlp_preactivations(m, x.astype(np.float32).astype(np.float64)) for m in models]
    expected = reference_ot(models, np.array([9, 4]) / 13, anchor=0, activations=acts)
    for (w, b), (ew, eb) in zip(fused_layers(result), expected, strict=True):
        np.testing.assert_allclose(w, ew, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(b, eb, rtol=1e-5, atol=1e-5)
    assert result.report["cost"] == "activations"
    weights_only = fusekit.fuse([Checkpoint.from_state_dict(numpy_state(m)) for m in models],
                                method="ot")
    assert weights_only.report["cost"] == "weights"


def test_transport_plan_marginals_and_kinds():
    import ot as pot

    rng = np.random.default_rng(0)
    for n, m in [(5, 5), (4, 7), (8, 3)]:
        cost = rng.random((n, m))
        plan, kind = transport_plan(cost)
        assert kind == ("assignment" if n == m else "emd")
        np.testing.assert_allclose(plan.sum(1), 1 / n)
        np.testing.assert_allclose(plan.sum(0), 1 / m)
        reference = pot.emd(np.full(n, 1 / n), np.full(m, 1 / m), cost)
        assert (plan * cost).sum() == pytest.approx((reference * cost).sum(), rel=1e-12)


# ---- anchor, data, refusals ----

def test_anchor_default_and_selection(tmp_path):
    models = [mlp(widths=(6, 5, 3), seed=0), mlp(widths=(6, 7, 3), seed=1)]
    paths = _clients(tmp_path, models, [5, 8])
    assert fusekit.fuse(paths, method="ot").widths == [7]
    by_name = fusekit.fuse(paths, method="ot", anchor="c0.safetensors")
    assert by_name.widths == [5] and by_name.report["anchor"] == str(paths[0])
    digest = load_checkpoint(paths[0]).content_hash[:12]
    assert fusekit.fuse(paths, method="ot", anchor=digest).widths == [5]
    with pytest.raises(ParameterError, match=r"anchor 'nope' matches no client"):
        fusekit.fuse(paths, method="ot", anchor="nope")


def test_identical_clients_are_the_identity(tmp_path):
    model = cnn(seed=5)
    paths = _clients(tmp_path, [model, model, model], [1, 2, 3])
    fused = fusekit.load_fused(fusekit.fuse(paths, method="ot").save(tmp_path / "f.safetensors"),
                               "cpu")
    x = np.random.default_rng(2).normal(size=(16, 1, 8, 8))
    np.testing.assert_allclose(outputs(fused, x), outputs(model, x), rtol=1e-5, atol=1e-5)


def test_refuses_position_aware_neurons(tmp_path):
    from fusekit.toolkit.nn import build_model, mlp_arch

    arch = mlp_arch(6, [5], 3, pan={"mode": "multiplicative", "amplitude": 0.1, "period": 1})
    sd = build_model(arch, seed=0).state_dict()
    ckpts = [Checkpoint.from_state_dict(sd, {"fusekit.arch": json.dumps(arch)})] * 2
    with pytest.raises(IncompatibleModelsError, match="position-aware"):
        fusekit.fuse(ckpts, method="ot")


def test_activation_inputs_formats(tmp_path):
    x = np.arange(60, dtype=np.float64).reshape(10, 6)
    np.save(tmp_path / "x.npy", x)
    np.savez(tmp_path / "x.npz", x=x)
    np.savez(tmp_path / "train.npz", x_train=x, y_train=np.zeros(10, int))
    np.savez(tmp_path / "other.npz", inputs=x)
    for name in ("x.npy", "x.npz", "train.npz"):
        loaded = load_activation_inputs(str(tmp_path / name), samples=100)
        assert loaded.dtype == np.float32
        np.testing.assert_array_equal(loaded, x)
    subset = load_activation_inputs(x, samples=4, seed=3)
    assert subset.shape == (4, 6) and len({tuple(r) for r in subset}) == 4
    assert set(map(tuple, subset)) <= set(map(tuple, x.astype(np.float32)))
    assert load_activation_inputs("digits", samples=5).shape == (5, 1, 8, 8)
    with pytest.raises(DataError, match=r"expected an array named 'x' or 'x_train'"):
        load_activation_inputs(str(tmp_path / "other.npz"), samples=5)
    with pytest.raises(DataError, match="does not exist"):
        load_activation_inputs(str(tmp_path / "missing.npy"), samples=5)
    with pytest.raises(DataError, match=r"neither a \.npy/\.npz file nor a data set name"):
        load_activation_inputs("no-such-data", samples=5)
    with pytest.raises(DataError, match=r"shape \(N, \.\.\.\)"):
        load_activation_inputs(np.zeros(3), samples=5)


def test_activation_inputs_that_do_not_fit_are_refused(tmp_path):
    models = [mlp(widths=(6, 5, 3), seed=s) for s in range(2)]
    clients = _clients(tmp_path, models, [1, 1])
    with pytest.raises(DataError, match=r"inputs of shape \(8, 4\) do not fit"):
        fusekit.fuse(clients, method="ot", activations=ActivationInputs(np.zeros((8, 4))))
    wanted = r"activations: expected a callable, or None, found ndarray of shape \(8, 6\)"
    with pytest.raises(ParameterError, match=wanted):
        fusekit.fuse(clients, method="ot", activations=np.zeros((8, 6)))


def test_provider_output_is_checked_against_the_widths(tmp_path):
    models = [mlp(widths=(6, 5, 3), seed=s) for s in range(2)]
    with pytest.raises(DataError, match=r"expected one \(samples, J\) array per hidden layer"):
        fusekit.fuse(_clients(tmp_path, models, [1, 1]), method="ot",
                     activations=lambda checkpoint, spec: [np.zeros((4, 3))])


def _npy_claiming_too_much(path):
    np.save(path, np.zeros((4, 6), np.float32))
    data = path.read_bytes().replace(b"(4, 6)", b"(999999999999, 6)".ljust(6))
    path.write_bytes(data)


@pytest.mark.parametrize(("make", "message"), [
    (lambda p: np.savez(p, x=np.array([{"a": 1}], dtype=object)), "holds Python objects"),
    (lambda p: p.write_bytes(b"PK\x03\x04 not a zip"), r"not a readable \.npz file"),
    (lambda p: p.mkdir(), "is a directory"),
    (_npy_claiming_too_much, r"header claims 23999999999976 bytes .* the file holds \d+$"),
])
def test_hostile_activation_files_are_refused_naming_the_file(tmp_path, make, message):
    suffix = ".npy" if make is _npy_claiming_too_much else ".npz"
    path = tmp_path / f"bad{suffix}"
    make(path)
    with pytest.raises(DataError, match=message) as info:
        load_activation_inputs(path, samples=5)
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_cli_fuse_ot(tmp_path):
    from typer.testing import CliRunner

    from fusekit._cli.app import app

    models = [mlp(widths=(6, 5, 3), seed=0), mlp(widths=(6, 7, 3), seed=1)]
    paths = _clients(tmp_path, models, [5, 8])
    np.save(tmp_path / "inputs.npy", np.random.default_rng(0).normal(size=(30, 6)))
    out = tmp_path / "ot.safetensors"
    result = CliRunner().invoke(app, [
        "fuse", *map(str, paths), "--method", "ot", "--anchor", "c0.safetensors",
        "--activations", str(tmp_path / "inputs.npy"), "--activation-samples", "20",
        "-o", str(out), "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["widths"] == [5] and payload["report"]["cost"] == "activations"
    assert payload["params"]["activations"]["samples"] == 20
