"""Cost matrices on a device: the toolkit's torch kernels against the C++ core, the engine's
choice of where a matrix is computed, and whole fusions on CUDA against the CPU's.

The kernels' math is checked on CPU tensors everywhere; the `gpu` tests run them on CUDA
and are skipped without it."""

from __future__ import annotations

import json
import subprocess
import sys
from functools import partial

import numpy as np
import pytest
import torch

import fusekit
from conftest import cnn, mlp, write
from fusekit.core.errors import ParameterError
from fusekit.engine import matching, offload
from fusekit.engine.offload import (
    AUTO_MIN_FLOPS,
    AUTO_START_FLOPS,
    Accelerator,
    accelerator_for,
    on_device,
)
from fusekit.toolkit import costs

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def posterior_case(rng, *, j_local=12, j_global=20, p=9, scalar=True, lam=0.0):
    """Arguments of the posterior cost (core order) for a client whose first five neurons
    sit on globals (cancelling entries), with per-coordinate or scalar precisions."""
    w = rng.normal(size=(j_local, p))
    if scalar:
        s, precisions = np.full(p, 2.0), np.full((j_global, p), 5.0)
    else:
        s, precisions = rng.uniform(0.1, 3.0, p), rng.uniform(1.0, 6.0, (j_global, p))
        s[min(2, p - 1)] = 0.0  # an unobserved coordinate
    means = np.vstack([w[:5] + 1e-9, rng.normal(size=(j_global - 5, p))])
    counts = rng.integers(1, 4, j_global).astype(np.float64)
    return (w, s, means * precisions, precisions, counts, rng.normal(size=p) * 0.1,
            rng.uniform(0.5, 2.0, p), 5.0, 1.3, lam)


def core_posterior(w, s, sums, precisions, counts, mu0, sigma0_2, n_clients, gamma0, lam):
    return matching.nafi_cost(w, s, sums, precisions, counts, n_clients=int(n_clients),
                              mu0=mu0, sigma0_2=sigma0_2, gamma0=gamma0, lam=lam)


def assert_same_costs(got, want):
    """Equal to rounding, entries that cancel (near 0) included, relative to each entry's
    own terms rather than to the matrix's largest."""
    assert got.dtype == np.float64 and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12 * np.abs(want).max(initial=0))
    small = np.abs(want) < 1e-6
    np.testing.assert_allclose(got[small], want[small], rtol=1e-6, atol=1e-20)


# -- the math, on CPU tensors --------------------------------------------------------------

def test_torch_sqeuclidean_equals_the_core_near_equal_rows_included():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(30, 17)) * 40.0
    b = np.vstack([a[:10] + 1e-7, rng.normal(size=(20, 17))])  # 10 pairs cancel
    a.flags.writeable = False  # read-only, as a memory-mapped checkpoint's arrays
    got = costs.sqeuclidean_cost(a, b, device="cpu")
    assert_same_costs(got, matching.sqeuclidean_cost(a, b))
    assert (got >= 0).all() and got[np.arange(10), np.arange(10)].max() < 1e-12


@pytest.mark.parametrize("scalar", [True, False], ids=["scalar-precision", "per-coordinate"])
@pytest.mark.parametrize("lam", [0.0, 0.01], ids=["pfnm", "nafi"])
def test_torch_posterior_cost_equals_the_core(scalar, lam):
    args = posterior_case(np.random.default_rng(1), scalar=scalar, lam=lam)
    assert_same_costs(costs.posterior_cost(*args, device="cpu"), core_posterior(*args))


@pytest.mark.parametrize(("n", "m", "p"), [(0, 4, 3), (4, 0, 3), (3, 4, 0)])
def test_torch_sqeuclidean_on_empty_shapes(n, m, p):
    a, b = np.ones((n, p)), np.zeros((m, p))
    assert_same_costs(costs.sqeuclidean_cost(a, b, device="cpu"), matching.sqeuclidean_cost(a, b))


def test_torch_inner_products_equal_numpys():
    rng = np.random.default_rng(5)
    pairs = [(rng.normal(size=(7, p)), rng.normal(size=(9, p))) for p in (3, 11, 1)]
    got = costs.inner_products(pairs, device="cpu")
    want = matching.inner_products(pairs)
    assert_same_costs(got, want)
    np.testing.assert_allclose(want, sum(a @ b.T for a, b in pairs), rtol=0, atol=0)


def test_torch_posterior_cost_without_globals_gives_the_new_neuron_slots():
    w, s, sums, precisions, counts, *rest = posterior_case(np.random.default_rng(2))
    args = (w, s, sums[:0], precisions[:0], counts[:0], *rest)
    got = costs.posterior_cost(*args, device="cpu")
    assert got.shape == (12, 12)
    assert_same_costs(got, core_posterior(*args))


# -- where a matrix is computed ------------------------------------------------------------

@pytest.fixture
def torch_kernels_on_the_cpu():
    """The toolkit's torch kernels, bound to the CPU, standing in for a CUDA device: every
    matrix a fusion sends to "the device" is computed by them."""
    saved = list(offload._factory)
    asked = []

    def factory(device):
        asked.append(device)
        return Accelerator("cpu", *(partial(kernel, device="cpu") for kernel in (
            costs.sqeuclidean_cost, costs.posterior_cost, costs.inner_products)))

    offload.set_accelerator(factory)
    yield asked
    offload._factory[:] = saved


def test_cpu_never_asks_for_the_device_and_auto_only_for_large_problems(
        torch_kernels_on_the_cpu, monkeypatch):
    assert accelerator_for(1e18) is None  # outside any block: the C++ core
    with on_device("cpu") as placement:
        assert accelerator_for(1e18) is None
    assert placement.summary()["matrices_on_cpu"] == 1 and not torch_kernels_on_the_cpu
    monkeypatch.setattr(offload, "_driver_loaded", lambda: True)
    with on_device("auto") as placement:
        assert accelerator_for(AUTO_MIN_FLOPS / 2) is None  # never worth a transfer
        large = AUTO_START_FLOPS / 4  # large problems: the first ones wait on the CPU
        assert [accelerator_for(large) for _ in range(3)] == [None] * 3
        assert torch_kernels_on_the_cpu == []  # until they add up to the device's start
        assert accelerator_for(large).device == "cpu"  # (the torch kernels stand in)
        assert accelerator_for(AUTO_MIN_FLOPS).device == "cpu"  # now every large one
        assert accelerator_for(AUTO_MIN_FLOPS / 2) is None
    assert placement.summary() == {"device": "auto", "ran_on": "cpu",
                                   "matrices_on_device": 2, "matrices_on_cpu": 5}
    monkeypatch.setattr(offload, "_driver_loaded", lambda: False)
    with on_device("auto"):
        assert accelerator_for(1e18) is None  # no NVIDIA driver: torch is not consulted
    assert torch_kernels_on_the_cpu == ["auto"]


def test_a_bad_device_is_refused_before_any_work():
    with pytest.raises(ParameterError, match=r"device: expected auto, cpu or cuda\[:N\], "
                                             r"found 'gpu'"), on_device("gpu"):
        pass


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_cuda_without_a_device_is_refused_on_entry(tmp_path):
    paths = [write(tmp_path / f"c{i}.safetensors", mlp(seed=i)) for i in range(2)]
    with pytest.raises(ParameterError, match="device: 'cuda' requested but torch sees no CUDA"):
        fusekit.fuse(paths, "pfnm", device="cuda")


def test_auto_without_a_gpu_never_imports_torch(tmp_path):
    """The CPU path is the one without an accelerator: a default fusion through the front
    door on a machine without an NVIDIA driver leaves torch unloaded."""
    if offload._driver_loaded():
        pytest.skip("this machine has an NVIDIA driver")
    paths = [write(tmp_path / f"c{i}.safetensors", mlp((64, 48, 10), seed=i)) for i in range(3)]
    code = ("import sys, fusekit; r = fusekit.fuse(sys.argv[1:], 'pfnm'); "
            "print(r.report['cost_matrices']['ran_on'], 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, *map(str, paths)], capture_output=True,
                         text=True, timeout=120, check=True)
    assert out.stdout.split() == ["cpu", "False"]


def test_the_command_line_takes_device(tmp_path):
    from typer.testing import CliRunner

    from fusekit._cli.app import app

    paths = [str(write(tmp_path / f"c{i}.safetensors", mlp(seed=i))) for i in range(2)]
    out = tmp_path / "fused.safetensors"
    result = CliRunner().invoke(app, ["fuse", *paths, "-m", "ot", "--device", "cpu", "-o",
                                      str(out), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["params"]["device"] == "cpu"
    assert summary["report"]["cost_matrices"]["ran_on"] == "cpu"
    refused = CliRunner().invoke(app, ["fuse", *paths, "-m", "pfnm", "--device", "gpu", "-o",
                                       str(tmp_path / "other.safetensors")])
    assert refused.exit_code == 2
    assert "device: expected auto, cpu or cuda[:N], found 'gpu'" in refused.output
    assert not (tmp_path / "other.safetensors").exists()


def plain_torch_clients(tmp_path, kind):
    """Clients fusekit did not train: plain torch MLPs or ConvNets, random inits."""
    make = {"mlp": lambda s: mlp((20, 16, 12, 4), seed=s),
            "cnn": lambda s: cnn((6, 8), hidden=10, seed=s)}[kind]
    return [write(tmp_path / f"{kind}{s}.safetensors", make(s), num_samples=50 + s)
            for s in range(3)]


def assert_same_fusion(got, want):
    assert got.widths == want.widths
    assert got.state_dict.keys() == want.state_dict.keys()
    for name, array in want.state_dict.items():
        np.testing.assert_allclose(got.state_dict[name], array, rtol=1e-5, atol=1e-6,
                                   err_msg=name)


@pytest.mark.parametrize("method", ["pfnm", "nafi", "ot", "rebasin"])
@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_a_fusion_through_the_device_kernels_equals_the_cpu_one(
        tmp_path, torch_kernels_on_the_cpu, method, kind):
    paths = plain_torch_clients(tmp_path, kind)
    on_cpu = fusekit.fuse(paths, method, device="cpu")
    through = fusekit.fuse(paths, method, device="cuda")
    assert_same_fusion(through, on_cpu)
    assert through.params["device"] == "cuda" and on_cpu.params["device"] == "cpu"
    placed = through.report["cost_matrices"]
    assert placed["matrices_on_device"] > 0 and placed["matrices_on_cpu"] == 0
    assert on_cpu.report["cost_matrices"]["matrices_on_device"] == 0


def tiny_berts(tmp_path, n_clients=2):
    """Hugging Face BERT folders fusekit did not train (random weights)."""
    transformers = pytest.importorskip("transformers", reason="the [hf] extra is not installed")
    folders = []
    for seed in range(n_clients):
        torch.manual_seed(seed)
        config = transformers.BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2,
                                         num_attention_heads=4, intermediate_size=24,
                                         max_position_embeddings=16, num_labels=3)
        model = transformers.BertForSequenceClassification(config).eval()
        model.save_pretrained(tmp_path / f"bert{seed}")
        folders.append(tmp_path / f"bert{seed}")
    return folders


@pytest.mark.parametrize("method", ["pfnm", "ot", "rebasin"])
def test_a_transformer_fusion_through_the_device_kernels_equals_the_cpu_one(
        tmp_path, torch_kernels_on_the_cpu, method):
    folders = tiny_berts(tmp_path)
    through = fusekit.fuse(folders, method, device="cuda")
    assert_same_fusion(through, fusekit.fuse(folders, method, device="cpu"))
    assert through.report["cost_matrices"]["matrices_on_device"] > 0


# -- on CUDA ---------------------------------------------------------------------------------

@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("scalar", [True, False], ids=["scalar-precision", "per-coordinate"])
@pytest.mark.parametrize("lam", [0.0, 0.01], ids=["pfnm", "nafi"])
def test_cuda_posterior_cost_equals_the_core(scalar, lam):
    args = posterior_case(np.random.default_rng(3), j_local=300, j_global=450, p=700,
                          scalar=scalar, lam=lam)
    assert_same_costs(costs.posterior_cost(*args, device="cuda"), core_posterior(*args))


@pytest.mark.gpu
@CUDA
def test_cuda_sqeuclidean_equals_the_core():
    rng = np.random.default_rng(4)
    a = rng.normal(size=(500, 1200))
    b = np.vstack([a[:100] + 1e-7, rng.normal(size=(400, 1200))])
    assert_same_costs(costs.sqeuclidean_cost(a, b, device="cuda"), matching.sqeuclidean_cost(a, b))


@pytest.mark.gpu
@CUDA
def test_auto_sends_large_problems_to_cuda():
    with on_device("auto") as placement:
        assert accelerator_for(AUTO_MIN_FLOPS / 2) is None
        assert accelerator_for(AUTO_START_FLOPS).device.startswith("cuda")
        assert accelerator_for(AUTO_MIN_FLOPS).device.startswith("cuda")
    assert placement.summary()["ran_on"].startswith("cuda")


@pytest.mark.gpu
@CUDA
def test_cuda_inner_products_equal_numpys():
    rng = np.random.default_rng(6)
    pairs = [(rng.normal(size=(300, p)), rng.normal(size=(300, p))) for p in (500, 1000, 7)]
    assert_same_costs(costs.inner_products(pairs, device="cuda"), matching.inner_products(pairs))


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("method", ["pfnm", "nafi", "ot", "rebasin"])
@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_a_fusion_on_cuda_equals_the_cpu_one(tmp_path, method, kind):
    paths = plain_torch_clients(tmp_path, kind)
    on_cpu = fusekit.fuse(paths, method, device="cpu")
    on_cuda = fusekit.fuse(paths, method, device="cuda")
    assert_same_fusion(on_cuda, on_cpu)
    placed = on_cuda.report["cost_matrices"]
    assert placed["ran_on"].startswith("cuda") and placed["matrices_on_device"] > 0


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("method", ["pfnm", "ot", "rebasin"])
def test_a_residual_network_fused_on_cuda_equals_the_cpu_one(tmp_path, method):
    from fusekit.core.arch import named_arch
    from fusekit.toolkit.nn import build_model

    arch = named_arch("resnet20", 10)
    paths = [write(tmp_path / f"r{s}.safetensors", build_model(arch, seed=s), num_samples=9 + s)
             for s in range(2)]
    assert_same_fusion(fusekit.fuse(paths, method, device="cuda"),
                       fusekit.fuse(paths, method, device="cpu"))
