"""fusekit.load_fused: every method's output (and any client) loads back as a torch module."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from test_ams import reference_selection

import fusekit
from conftest import mlp, write
from fusekit.core.checkpoint import load_checkpoint, save_checkpoint
from fusekit.core.errors import CheckpointError
from fusekit.methods import METHODS
from fusekit.toolkit.nn import build_model, convnet_arch, load_model, mlp_arch
from fusekit.toolkit.nn.ams import AMSModel

CLASSES = 4
IMAGE = (1, 4, 4)


def randomise_batchnorm(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    generator = torch.Generator().manual_seed(seed)
    for module in model.modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            n = module.num_features
            module.running_mean.copy_(torch.randn(n, generator=generator))
            module.running_var.copy_(torch.rand(n, generator=generator) + 0.5)
            module.weight.data.copy_(torch.rand(n, generator=generator) + 0.5)
            module.bias.data.copy_(torch.randn(n, generator=generator))
    return model.eval()


def arch_of(kind: str, depth: int = 2) -> dict:
    if kind == "mlp":
        return mlp_arch(16, [7] * depth, CLASSES, batchnorm=True)
    return convnet_arch(IMAGE, [3, 5], CLASSES, hidden=[6])


def write_client(path, arch, seed, num_samples=10, head_scale=1.0):
    model = randomise_batchnorm(build_model(arch, seed=seed), seed)
    with torch.no_grad():
        model.net[-1].weight.mul_(head_scale)
    return save_checkpoint(path, model.state_dict(), {
        "fusekit.arch": json.dumps(arch), "fusekit.num_samples": str(num_samples)})


def outputs(model: torch.nn.Module, x: torch.Tensor) -> np.ndarray:
    with torch.no_grad():
        return model(x).double().numpy()


@pytest.mark.parametrize("kind", ["mlp", "convnet"])
@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_round_trips(tmp_path, method, kind):
    arch = arch_of(kind)
    if METHODS[method].client_structure == "fed2":  # Fed² clients: 2 groups, last 2 layers
        arch = {**arch, "fed2": {"groups": 2, "depth": 2}}
    paths = [write_client(tmp_path / f"c{i}.safetensors", arch, seed=i, num_samples=10 + i)
             for i in range(3)]
    # The round trip of the file distill writes, not its training: a few student updates.
    params = {"steps": 3} if method == "distill" else {}
    saved = fusekit.fuse(paths, method=method, **params).save(tmp_path / "fused.safetensors")
    model = fusekit.load_fused(saved, device="cpu")
    assert not model.training
    stored = load_checkpoint(saved)
    loaded = model.state_dict()
    assert set(loaded) == set(stored.tensors), "module tensor names = checkpoint tensor names"
    for name in stored.tensors:
        np.testing.assert_array_equal(loaded[name].numpy(), stored.tensor(name), err_msg=name)
    x = torch.randn(9, *IMAGE)
    logits = outputs(model, x)
    assert logits.shape == (9, CLASSES) and np.isfinite(logits).all()
    assert isinstance(model, AMSModel) == (method == "ams")


@pytest.mark.parametrize("method", ["avg", "ams", "ot"])
@pytest.mark.parametrize("kind", ["mlp", "convnet"])
def test_fusing_copies_of_one_client_gives_back_its_function(tmp_path, method, kind):
    client = write_client(tmp_path / "c.safetensors", arch_of(kind), seed=3)
    copies = [load_checkpoint(client) for _ in range(3)]
    saved = fusekit.fuse(copies, method=method).save(tmp_path / "fused.safetensors")
    x = torch.randn(20, *IMAGE)
    np.testing.assert_allclose(outputs(fusekit.load_fused(saved, "cpu"), x),
                               outputs(load_model(client), x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("mode", "k"), [("top1", None), ("topk", 2), ("topk", 4), ("full", None)])
def test_ams_across_architectures_matches_reference(tmp_path, mode, k):
    """MLPs of depth 1 to 5 and a CNN, the same 4 outputs; one client twice (exact ties),
    confident enough (scaled head) to be chosen often."""
    archs = [arch_of("mlp", depth) for depth in range(1, 6)] + [arch_of("convnet")]
    paths = [write_client(tmp_path / f"c{i}.safetensors", a, seed=i)
             for i, a in enumerate(archs)]
    for name in ("twin_a", "twin_b"):
        paths.append(write_client(tmp_path / f"{name}.safetensors", arch_of("mlp", 2), seed=9,
                                  head_scale=3.0))
    result = fusekit.fuse(paths, method="ams", mode=mode, k=k)
    saved = result.save(tmp_path / "ams.safetensors")
    model = fusekit.load_fused(saved, device="cpu")
    assert isinstance(model, AMSModel) and model.k == result.params["k"]
    order = [load_checkpoint(p).content_hash for p in paths]
    inputs = json.loads(load_checkpoint(saved).metadata["fusekit.inputs"])
    clients = [load_model(paths[order.index(h)]) for h in inputs]
    x = torch.randn(200, *IMAGE)
    separate = np.stack([outputs(c, x) for c in clients])
    with torch.no_grad():
        fused, chosen = model.select(x)
    ref_fused, ref_chosen = reference_selection(separate, model.k)
    np.testing.assert_allclose(fused.numpy(), ref_fused, rtol=1e-5, atol=1e-5)
    if model.k < len(clients):
        np.testing.assert_array_equal(chosen.numpy(), ref_chosen)
    twins = [i for i, h in enumerate(inputs) if inputs.count(h) == 2]
    assert len(twins) == 2
    if mode == "top1":  # exact tie between the twins: the lower index always wins
        assert (chosen[0] != twins[1]).all() and (chosen[0] == twins[0]).any()


def test_clients_without_arch_load_from_their_spec(tmp_path):
    """Checkpoints from outside fusekit (no fusekit.arch) load as ReLU MLPs."""
    clients = [mlp(widths=(6, 5, 4, 3), batchnorm=True, seed=s) for s in range(2)]
    paths = [write(tmp_path / f"c{i}.safetensors", m, num_samples=4) for i, m in enumerate(clients)]
    x = torch.randn(7, 6)
    np.testing.assert_allclose(outputs(fusekit.load_fused(paths[0], "cpu"), x),
                               outputs(clients[0], x), rtol=1e-5, atol=1e-6)
    same = fusekit.fuse([paths[0], paths[0]], method="avg").save(tmp_path / "avg.safetensors")
    np.testing.assert_allclose(outputs(fusekit.load_fused(same, "cpu"), x),
                               outputs(clients[0], x), rtol=1e-5, atol=1e-6)
    shallow = write(tmp_path / "shallow.safetensors", mlp(widths=(6, 3), seed=5), num_samples=4)
    ams = fusekit.fuse([*paths, shallow], method="ams", mode="full")
    model = fusekit.load_fused(ams.save(tmp_path / "ams.safetensors"), "cpu")
    expected = sum(outputs(m, x) for m in [*clients, mlp(widths=(6, 3), seed=5)])
    np.testing.assert_allclose(outputs(model, x), expected, rtol=1e-5, atol=1e-5)


def test_convolutional_model_without_arch_is_refused(tmp_path):
    from conftest import cnn

    path = write(tmp_path / "cnn.safetensors", cnn(), num_samples=4)
    with pytest.raises(CheckpointError, match=r"convolutional model needs fusekit\.arch"):
        fusekit.load_fused(path, "cpu")


def test_malformed_ams_artefact_is_refused(tmp_path):
    client = write_client(tmp_path / "c.safetensors", arch_of("mlp"), seed=0)
    result = fusekit.fuse([client, client], method="ams")
    result.state_dict["stray.weight"] = np.zeros(3, dtype=np.float32)
    with pytest.raises(CheckpointError, match=r"stray\.weight.*belong to no AMS sub-model"):
        fusekit.load_fused(result.save(tmp_path / "bad.safetensors"), "cpu")
    result = fusekit.fuse([client, client], method="ams")
    del result.state_dict["models.1.net.0.weight"]
    with pytest.raises(CheckpointError, match=r"models\.1\..*missing \['net\.0\.weight'\]"):
        fusekit.load_fused(result.save(tmp_path / "missing.safetensors"), "cpu")


def test_import_fusekit_does_not_import_torch():
    code = ("import sys, fusekit; assert 'torch' not in sys.modules; "
            "assert callable(fusekit.load_fused); assert 'torch' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_load_on_gpu_matches_cpu(tmp_path):
    archs = [arch_of("mlp", 2), arch_of("mlp", 2), arch_of("convnet")]
    paths = [write_client(tmp_path / f"c{i}.safetensors", a, seed=i) for i, a in enumerate(archs)]
    saved = fusekit.fuse(paths, method="ams", mode="topk", k=2).save(tmp_path / "a.safetensors")
    x = torch.randn(64, *IMAGE)
    cpu = fusekit.load_fused(saved, "cpu")
    gpu = fusekit.load_fused(saved, "cuda")
    with torch.no_grad():
        np.testing.assert_allclose(gpu(x.cuda()).cpu().numpy(), cpu(x).numpy(),
                                   rtol=1e-4, atol=1e-4)
