"""PFNM and NAFI: the matching engine and the two methods end to end (ALGORITHMS.md §2-4)."""

import json

import numpy as np
import pytest
import torch
from test_neurons import Net, cnn, outputs, randomize_batchnorm
from torch import nn

import fusekit
from fusekit.core.checkpoint import Checkpoint
from fusekit.core.errors import IncompatibleModelsError, ParameterError
from fusekit.core.spec import infer_spec, permute
from fusekit.engine import matching, reference
from fusekit.methods import bayesian
from fusekit.methods.bayesian import MatchingBackend, match_neurons

NUMPY = bayesian.get_backend("numpy")


def generative_clients(n_clients, *, pool=150, take=100, dim=40, weight_std=0.1,
                       noise_std=0.02, seed=0):
    rng = np.random.default_rng(seed)
    atoms = rng.normal(0, weight_std, (pool, dim))
    vectors, labels = [], []
    for _ in range(n_clients):
        ids = rng.choice(pool, take, replace=False)
        vectors.append(atoms[ids] + rng.normal(0, noise_std, (take, dim)))
        labels.append(ids)
    return vectors, labels


def mlp(widths=(6, 5), n_in=4, n_out=3, seed=0):
    torch.manual_seed(seed)
    layers, prev = [], n_in
    for w in widths:
        layers += [nn.Linear(prev, w), nn.ReLU()]
        prev = w
    return Net(*layers, nn.Linear(prev, n_out)).eval()


def to_ckpt(state, metadata=None):
    return Checkpoint.from_state_dict({k: np.asarray(v, np.float64) for k, v in state.items()},
                                      metadata)


def permuted_copies(model, n_copies, noise=1e-7, seed=0):
    rng = np.random.default_rng(seed)
    state = {k: v.detach().numpy().astype(np.float64) for k, v in model.state_dict().items()}
    spec = infer_spec(state)
    copies = []
    for _ in range(n_copies):
        perms = [rng.permutation(w) for w in spec.hidden_widths]
        shuffled = permute(state, spec, perms)
        copies.append(to_ckpt({k: v + noise * rng.standard_normal(v.shape)
                               if not k.endswith("num_batches_tracked") else v
                               for k, v in shuffled.items()}))
    return state, copies


# Near-exact copies: observation noise far below the weight variance, a broad prior.
COPY_PARAMS = dict(sigma=1e-6, sigma0=1.0)


@pytest.mark.parametrize("method", ["pfnm", "nafi"])
def test_permuted_copies_of_a_two_hidden_layer_mlp_fuse_back(method):
    model = mlp(widths=(7, 5))
    state, copies = permuted_copies(model, 4)
    result = fusekit.fuse(copies, method=method, **COPY_PARAMS)
    assert result.widths == [7, 5]
    x = torch.randn(20, 4)
    np.testing.assert_allclose(outputs(mlp(widths=(7, 5)), result.state_dict, x),
                               outputs(mlp(widths=(7, 5)), state, x), rtol=1e-5, atol=1e-5)
    for layer in result.report["layers"]:
        assert all(c["matched"] == c["width"] and c["new"] == 0 for c in layer["clients"])


def test_permuted_copies_of_a_cnn_with_batchnorm_fuse_back_to_the_same_module():
    model = cnn(c1=6, c2=8)
    state, copies = permuted_copies(model, 3)
    result = fusekit.fuse(copies, method="pfnm", **COPY_PARAMS)
    assert result.widths == [6, 8]
    x = torch.randn(9, 1, 8, 8)
    np.testing.assert_allclose(outputs(cnn(6, 8), result.state_dict, x),
                               outputs(cnn(6, 8), state, x), rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(result.state_dict["net.5.running_mean"], 0)


def test_generative_pool_is_recovered_with_high_purity():
    vectors, labels = generative_clients(5, dim=100)
    # ALGORITHMS §3, first regime: sigma^2 = sigma0^2 = the weight variance (0.1^2), 25x
    # the noise variance (0.02^2). (sigma^2 = the noise variance itself makes a true match
    # cost about as much as a new neuron: PFNM's cost has no log-determinant terms.)
    result = match_neurons(vectors, [1 / 0.1**2] * 5, sigma0_2=0.1**2, sweeps=2,
                           backend=NUMPY, true_labels=labels)
    assert abs(result.width - 150) <= 0.05 * 150
    assert result.report["purity"] >= 0.95
    assert len(result.report["objective"]) == 1 + result.report["sweeps_run"]
    assert result.report["sweeps_run"] <= 2


def test_generative_pool_with_relative_default_units():
    """Defaults of the methods: sigma = sigma0 = 1 x the per-coordinate variance."""
    vectors, labels = generative_clients(4, seed=1)
    unit = np.vstack(vectors).var(0).mean()
    result = match_neurons(vectors, [1 / unit] * 4, sigma0_2=unit, sweeps=1, backend=NUMPY,
                           true_labels=labels)
    assert abs(result.width - 150) <= 0.05 * 150
    assert result.report["purity"] >= 0.95


class Recording:
    """The C++ kernels, recording every cost matrix the engine asks for."""

    def __init__(self):
        self.calls = []

    def pfnm(self, *args, **kwargs):
        cost = matching.pfnm_cost(*args, **kwargs)
        self.calls.append(("pfnm", [np.array(a) for a in args], dict(kwargs), cost))
        return cost

    def nafi(self, *args, **kwargs):
        cost = matching.nafi_cost(*args, **kwargs)
        self.calls.append(("nafi", [np.array(a) for a in args], dict(kwargs), cost))
        return cost


@pytest.mark.parametrize("lam", [None, 0.3])
def test_cost_matrices_follow_the_formulas_and_the_current_posteriors(lam):
    """Every cost matrix equals §3-4 evaluated on the posterior of the other clients."""
    vectors, _ = generative_clients(3, pool=12, take=8, dim=6, noise_std=0.05)
    recorder = Recording()
    backend = MatchingBackend("rec", recorder.pfnm, recorder.nafi, matching.solve_assignment)
    sigma0_2 = 0.02
    precisions = [np.full(6, 1 / 0.01), np.full(6, 1 / 0.02), np.r_[np.zeros(2), np.full(4, 50.0)]]
    result = match_neurons(vectors, precisions, sigma0_2=sigma0_2, mu0=0.01, gamma0=2.0,
                           sweeps=2, lam=lam, backend=backend)
    assert len(recorder.calls) == 2 + 2 * 3
    for kind, (local, s, sums, prec, counts), kwargs, cost in recorder.calls:
        assert kind == ("pfnm" if lam is None else "nafi")
        client = next(i for i, v in enumerate(vectors) if v.shape == local.shape
                      and np.array_equal(v, local))
        # The globals hold the OTHER clients only: 1 <= n_i <= S - 1, prior included.
        assert (counts >= 1).all() and counts.max() <= 2
        assert np.all(prec >= 1 / sigma0_2 - 1e-9)
        np.testing.assert_array_equal(s, precisions[client])
        assert kwargs["n_clients"] == 3 and kwargs["gamma0"] == 2.0
        # The entries, recomputed one by one from the formulas of ALGORITHMS.md §3-4.
        means = sums / prec
        n_global, n_local = means.shape[0], local.shape[0]
        assert cost.shape == (n_global + n_local, n_local)
        numpy_kernel = reference.pfnm_cost if lam is None else reference.nafi_cost
        np.testing.assert_allclose(cost, numpy_kernel(local, s, sums, prec, counts, **kwargs),
                                   rtol=1e-10, atol=1e-10)
        for i in range(n_global):
            for j in range(n_local):
                a = s * prec[i] / (s + prec[i])
                value = np.sum(a * (local[j] - means[i]) ** 2)
                value += 2 * np.log((3 - counts[i]) / counts[i])
                if lam is not None:
                    r = (prec[i] + s) / prec[i]
                    value += lam * 0.5 * np.sum(r - 1 - np.log(r)
                                                + s**2 * (local[j] - means[i]) ** 2 / (prec[i] + s))
                assert cost[i, j] == pytest.approx(value, rel=1e-10, abs=1e-10)
        for k in range(n_local):
            for j in range(n_local):
                value = np.sum(s / (1 + s * sigma0_2) * (local[j] - 0.01) ** 2)
                value += 2 * np.log((k + 1) * 3 / 2.0)
                if lam is not None:
                    p0 = 1 / sigma0_2
                    r = (p0 + s) / p0
                    value += lam * 0.5 * np.sum(r - 1 - np.log(r)
                                                + s**2 * (local[j] - 0.01) ** 2 / (p0 + s))
                assert cost[n_global + k, j] == pytest.approx(value, rel=1e-10, abs=1e-10)
    # The final posterior is Eq. 4 over the final assignment.
    for g in range(result.width):
        members = [(c, j) for c, rows in enumerate(result.assignments)
                   for j in np.flatnonzero(rows == g)]
        num = 0.01 / sigma0_2 + sum(precisions[c] * vectors[c][j] for c, j in members)
        den = 1 / sigma0_2 + sum(precisions[c] for c, _ in members)
        np.testing.assert_allclose(result.means[g], num / den, rtol=1e-12)


def test_nafi_with_lambda_zero_gives_pfnm_exactly():
    vectors, _ = generative_clients(4, pool=40, take=25, dim=10, noise_std=0.06, seed=3)
    precisions = [1 / 0.06**2] * 4
    pfnm = match_neurons(vectors, precisions, sigma0_2=0.01, sweeps=3, seed=7, backend=NUMPY)
    nafi = match_neurons(vectors, precisions, sigma0_2=0.01, sweeps=3, seed=7, lam=0.0,
                         backend=NUMPY)
    for a, b in zip(pfnm.assignments, nafi.assignments, strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(pfnm.means, nafi.means)
    assert pfnm.report["objective"] == nafi.report["objective"]


def heterogeneous_clients():
    """Clients of widths 64, 100 and 150 on one 784-input... (scaled down: 20-input) MLP."""
    clients = []
    for i, width in enumerate((64, 100, 150)):
        model = mlp(widths=(width,), n_in=20, n_out=4, seed=i)
        state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
        counts = [10 + i, 20, 30 - i, 5 + 3 * i]
        clients.append(to_ckpt(state, {"fusekit.num_samples": str(sum(counts)),
                                       "fusekit.class_counts": str(counts)}))
    return clients


def test_heterogeneous_widths_fuse_into_one_loadable_model():
    clients = heterogeneous_clients()
    result = fusekit.fuse(clients, method="nafi", sweeps=2)
    (width,) = result.widths
    assert width >= 150
    assert result.report["class_share"] is True
    layer = result.report["layers"][0]
    assert [c["width"] for c in layer["clients"]] == [150, 100, 64]  # canonical: widest first
    assert all(c["matched"] + c["new"] == c["width"] for c in layer["clients"])
    assert len(layer["objective"]) == 1 + layer["sweeps_run"] <= 3
    assert layer["time_cost_s"] >= 0 and layer["time_assignment_s"] >= 0
    model = mlp(widths=(width,), n_in=20, n_out=4)
    out = outputs(model, result.state_dict, torch.randn(3, 20))
    assert out.shape == (3, 4) and np.isfinite(out).all()


def test_same_seed_same_result_and_input_order_does_not_matter():
    clients = heterogeneous_clients()
    a = fusekit.fuse(clients, method="pfnm", seed=3, sweeps=2)
    b = fusekit.fuse(clients[::-1], method="pfnm", seed=3, sweeps=2)
    c = fusekit.fuse([clients[1], clients[0], clients[2]], method="pfnm", seed=3, sweeps=2)
    for other in (b, c):
        assert other.widths == a.widths
        for name in a.state_dict:
            np.testing.assert_array_equal(a.state_dict[name], other.state_dict[name])


def test_width_cap_is_respected():
    vectors, _ = generative_clients(3, pool=60, take=30, dim=8, noise_std=0.05, seed=2)
    capped = match_neurons(vectors, [1 / 0.05**2] * 3, sigma0_2=0.01, sweeps=1,
                           max_width=35, backend=NUMPY)
    assert 30 <= capped.width <= 35
    with pytest.raises(ParameterError, match="max_width"):
        match_neurons(vectors, [1.0] * 3, max_width=10, backend=NUMPY)


def test_pan_checkpoints_are_refused():
    model = mlp(widths=(5,))
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    state["net.2.encoding"] = np.ones(5, np.float32)
    clients = [to_ckpt(state), to_ckpt(state)]
    for method in ("pfnm", "nafi"):
        with pytest.raises(IncompatibleModelsError, match="avg"):
            fusekit.fuse(clients, method=method)


def test_bad_parameters_name_the_argument():
    clients = heterogeneous_clients()
    with pytest.raises(ParameterError, match="sigma"):
        fusekit.fuse(clients, method="pfnm", sigma=[1.0, 2.0])
    with pytest.raises(ParameterError, match="variance_units"):
        fusekit.fuse(clients, method="pfnm", variance_units="weird")
    with pytest.raises(ParameterError, match="lam"):
        fusekit.fuse(clients, method="pfnm", lam=0.1)


@pytest.mark.parametrize("lam", [None, 0.05])
def test_core_and_numpy_backends_agree(lam):
    vectors, labels = generative_clients(4, pool=50, take=30, dim=20, seed=4)
    kwargs = dict(sigma0_2=0.01, sweeps=2, seed=1, lam=lam, true_labels=labels)
    core = match_neurons(vectors, [100.0] * 4, backend="core", **kwargs)
    numpy = match_neurons(vectors, [100.0] * 4, backend="numpy", **kwargs)
    for a, b in zip(core.assignments, numpy.assignments, strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(core.means, numpy.means, rtol=1e-12)
    assert core.report["backend"] == "core" and numpy.report["backend"] == "numpy"


def test_cli_flags_reach_the_method_and_file_order_does_not_matter(mlp_clients, tmp_path):
    from typer.testing import CliRunner

    from fusekit._cli.app import app
    from fusekit.core.checkpoint import load_checkpoint

    runner = CliRunner()
    outs = []
    for i, files in enumerate((mlp_clients, mlp_clients[::-1])):
        out = tmp_path / f"fused{i}.safetensors"
        result = runner.invoke(app, ["fuse", *map(str, files), "-m", "nafi", "-o", str(out),
                                     "--sigma", "0.5", "--lambda", "0.1", "--sweeps", "2",
                                     "--seed", "4", "--no-class-share", "--json"])
        assert result.exit_code == 0, result.output
        outs.append(out)
    payload = json.loads(result.stdout)
    assert payload["params"]["sigma"] == 0.5 and payload["params"]["lam"] == 0.1
    assert payload["params"]["class_share"] is False and payload["params"]["seed"] == 4
    (layer,) = payload["report"]["layers"]
    assert layer["width"] == payload["widths"][0] >= 6
    assert len(layer["objective"]) == 1 + layer["sweeps_run"] and len(layer["clients"]) == 3
    first, second = load_checkpoint(outs[0]), load_checkpoint(outs[1])
    for name in first.tensors:
        np.testing.assert_array_equal(first.tensor(name), second.tensor(name))


def test_sweeps_stop_at_a_fixed_point():
    vectors, labels = generative_clients(5, pool=60, take=40, dim=15, noise_std=0.04, seed=6)
    kwargs = dict(sigma0_2=0.01, seed=3, true_labels=labels)
    result = match_neurons(vectors, [100.0] * 5, sweeps=10, **kwargs)
    assert result.report["sweeps_run"] < 10 and result.report["moves"][-1] == 0
    assert all(m > 0 for m in result.report["moves"][:-1])
    assert len(result.report["objective"]) == 1 + result.report["sweeps_run"]


def test_fusion_benchmark_runs_end_to_end_on_a_tiny_case(tmp_path):
    from bench_fusion import main

    out = tmp_path / "bench.json"
    assert main(["--clients", "2", "--numpy-clients", "2", "--no-cnn", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["method"], r["backend"]) for r in rows} == {
        ("pfnm", "core"), ("pfnm", "numpy"), ("nafi", "core"), ("nafi", "numpy")}
    # Two clients of 100 pool neurons each cover between 100 and 150 of them.
    assert all(100 <= r["widths"][0] <= 150 and r["purity"] == 1.0 for r in rows)
    assert len({r["widths"][0] for r in rows}) == 1


@pytest.mark.parametrize("method", ["pfnm", "nafi"])
def test_fused_checkpoint_carries_its_widths_and_loads_into_the_module_class(method, tmp_path):
    from fusekit.core.arch import convnet_arch
    from fusekit.toolkit.nn.modules import build_model, load_model

    clients = []
    for seed, channels in enumerate(((4, 6), (5, 6), (4, 7))):
        arch = convnet_arch((1, 8, 8), channels, 10)
        model = build_model(arch, seed=seed)
        randomize_batchnorm(model)
        state = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
        clients.append(Checkpoint.from_state_dict(
            state, {"fusekit.arch": json.dumps(arch), "fusekit.num_samples": "50"}))
    result = fusekit.fuse(clients, method=method, sweeps=2)
    arch = json.loads(result.metadata["fusekit.arch"])
    assert arch["channels"] == result.widths and min(result.widths) >= 5
    path = result.save(tmp_path / "fused.safetensors")
    model = load_model(path)
    with torch.no_grad():
        out = model(torch.randn(2, 1, 8, 8)).numpy()
    assert out.shape == (2, 10) and np.isfinite(out).all()


def test_per_client_sigma_follows_the_order_of_the_inputs():
    clients = heterogeneous_clients()
    sigmas = [0.5, 1.0, 2.0][: len(clients)]
    forward = fusekit.fuse(clients, method="pfnm", sigma=sigmas)
    backward = fusekit.fuse(clients[::-1], method="pfnm", sigma=sigmas[::-1])
    for name, value in forward.state_dict.items():
        np.testing.assert_array_equal(value, backward.state_dict[name])
    wanted = "sigma: expected a finite number > 0, or one such number per client"
    with pytest.raises(ParameterError, match=wanted):
        fusekit.fuse(clients, method="pfnm", sigma="12")
