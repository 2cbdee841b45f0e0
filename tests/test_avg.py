import json
import logging

import numpy as np
import pytest
import torch

import fusekit
from conftest import cnn, mlp, write, write_raw
from fusekit.core.checkpoint import load_checkpoint
from fusekit.core.errors import (
    CheckpointError,
    IncompatibleModelsError,
    ParameterError,
    UnknownMethodError,
)


def reference_average(paths):
    """FedAvg in plain numpy, float64: Σ_s N_s θ_s / Σ N, counters take the max; and for
    each tensor the bound on a float32 accumulation's error, S eps32 Σ_s |N_s θ_s| / Σ N
    (0 for counters)."""
    ckpts = [load_checkpoint(p) for p in paths]
    n = np.array([c.num_samples for c in ckpts], dtype=np.float64)
    out, bounds = {}, {}
    for name in ckpts[0].tensors:
        stack = np.stack([c.tensor(name) for c in ckpts])
        if name.endswith("num_batches_tracked"):
            out[name], bounds[name] = stack.max(axis=0), 0.0
        else:
            out[name] = np.tensordot(n / n.sum(), stack.astype(np.float64), axes=1)
            magnitude = np.tensordot(n / n.sum(), np.abs(stack.astype(np.float64)), axes=1)
            bounds[name] = len(ckpts) * np.finfo(np.float32).eps * magnitude
    return out, bounds


def test_average_matches_numpy_reference(mlp_clients):
    """float32 sums: within float32's rounding of the float64 average, and not further."""
    result = fusekit.fuse(mlp_clients, method="avg")
    expected, bounds = reference_average(mlp_clients)
    assert set(result.state_dict) == set(expected)
    for name, value in expected.items():
        assert result.state_dict[name].dtype == load_checkpoint(mlp_clients[0]).tensor(name).dtype
        error = np.abs(result.state_dict[name] - value)
        assert np.all(error <= bounds[name]), (name, float(np.max(error - bounds[name])))
    assert result.state_dict["1.num_batches_tracked"].dtype == np.int64


def test_class_weighted_output_layer(mlp_clients):
    result = fusekit.fuse(mlp_clients, method="avg", class_weighted=True)
    ckpts = [load_checkpoint(p) for p in mlp_clients]
    counts = np.stack([c.class_counts for c in ckpts])
    shares = counts / counts.sum(axis=0)
    for name in ("3.weight", "3.bias"):
        stack = np.stack([c.tensor(name) for c in ckpts]).astype(np.float64)
        expected = np.stack([shares[:, k] @ stack[:, k].reshape(len(ckpts), -1)
                             for k in range(3)]).reshape(stack.shape[1:])
        np.testing.assert_allclose(result.state_dict[name], expected, rtol=1e-6)
    # hidden layers are still sample-weighted
    expected, bounds = reference_average(mlp_clients)
    assert np.all(np.abs(result.state_dict["0.weight"] - expected["0.weight"])
                  <= bounds["0.weight"])


def test_class_weighted_needs_class_counts(tmp_path):
    paths = [write(tmp_path / f"{i}.safetensors", mlp(seed=i), num_samples=3) for i in range(2)]
    with pytest.raises(ParameterError, match=r"needs fusekit\.class_counts.*0\.safetensors"):
        fusekit.fuse(paths, class_weighted=True)


def test_uniform_weights_with_a_warning(tmp_path, caplog):
    paths = [write(tmp_path / f"{i}.safetensors", mlp(seed=i)) for i in range(2)]
    with caplog.at_level(logging.WARNING):
        result = fusekit.fuse(paths)
    assert "weighting clients uniformly" in caplog.text
    a, b = (load_checkpoint(p).tensor("0.weight") for p in paths)
    np.testing.assert_allclose(result.state_dict["0.weight"], (a + b) / 2, rtol=1e-6)


def test_order_of_inputs_does_not_change_the_result(mlp_clients):
    a = fusekit.fuse(mlp_clients).state_dict
    b = fusekit.fuse(mlp_clients[::-1]).state_dict
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])


def test_fusing_identical_models_is_the_identity(tmp_path):
    model = cnn()
    paths = [write(tmp_path / f"{i}.safetensors", model, num_samples=i + 1) for i in range(3)]
    fused = fusekit.fuse(paths).state_dict
    for name, tensor in model.state_dict().items():
        np.testing.assert_allclose(fused[name], tensor.numpy(), rtol=1e-6)


@pytest.mark.parametrize("make", [lambda s: mlp(batchnorm=True, seed=s), lambda s: cnn(seed=s)])
def test_fused_checkpoint_loads_into_the_same_module_class(tmp_path, make):
    paths = [write(tmp_path / f"{i}.safetensors", make(i), num_samples=5) for i in range(3)]
    out = fusekit.fuse(paths).save(tmp_path / "fused.safetensors")
    import safetensors.torch

    model = make(99)
    model.load_state_dict(safetensors.torch.load_file(out), strict=True)
    x = torch.randn(2, 6) if isinstance(model[0], torch.nn.Linear) else torch.randn(2, 1, 8, 8)
    assert torch.isfinite(model(x)).all()


def test_mismatched_shapes(tmp_path):
    a = write(tmp_path / "a.safetensors", mlp(widths=(6, 5, 3)))
    b = write(tmp_path / "b.safetensors", mlp(widths=(6, 7, 3)))
    with pytest.raises(IncompatibleModelsError,
                       match=r"tensor '0\.bias' has shape \(5,\) in .*a\.safetensors but \(7,\) "
                             r"in .*b\.safetensors; 'avg' needs equal shapes"):
        fusekit.fuse([a, b], method="avg")


def test_architectures_that_cannot_be_fused(tmp_path):
    a = write(tmp_path / "a.safetensors", mlp(widths=(6, 5, 3)))
    b = write(tmp_path / "b.safetensors", mlp(widths=(6, 5, 5, 3)))
    with pytest.raises(IncompatibleModelsError,
                       match=r"cannot be fused: .*a\.safetensors has 2 layers, "
                             r".*b\.safetensors has 3"):
        fusekit.fuse([a, b])
    c = write(tmp_path / "c.safetensors", mlp(widths=(6, 5, 4)))
    with pytest.raises(IncompatibleModelsError, match=r"has 3 outputs where .*c\.safetensors "
                                                      r"has 4 outputs"):
        fusekit.fuse([a, c])


def test_tensor_missing_in_one_client(tmp_path):
    sd = mlp().state_dict()
    a = write(tmp_path / "a.safetensors", sd)
    b = write(tmp_path / "b.safetensors", {**sd, "temperature": torch.ones(1)})
    with pytest.raises(IncompatibleModelsError,
                       match=r"tensor 'temperature' is in .*b\.safetensors "
                             r"but missing from .*a\.safetensors"):
        fusekit.fuse([a, b])


def test_unknown_method_lists_valid_ones(mlp_clients):
    with pytest.raises(UnknownMethodError, match=r"unknown fusion method 'fedprox'; choose one of: "
                                                 r".*avg"):
        fusekit.fuse(mlp_clients, method="fedprox")


def test_unknown_parameter(mlp_clients):
    with pytest.raises(ParameterError, match=r"method 'avg' does not take parameter\(s\) sigma; "
                                             r"it takes: class_weighted"):
        fusekit.fuse(mlp_clients, method="avg", sigma=1.0)


def test_no_inputs():
    with pytest.raises(ParameterError, match="expected at least one checkpoint"):
        fusekit.fuse([])


def test_fused_metadata_describes_the_model(mlp_clients):
    result = fusekit.fuse(mlp_clients)
    spec = json.loads(result.metadata["fusekit.spec"])
    assert [layer["name"] for layer in spec["layers"]] == ["0", "3"]
    assert result.widths == [5]


def never_or_always_mapped(monkeypatch, mapped: bool) -> None:
    """Pieces read into buffers, or every piece mapped (odd offsets, page-straddling)."""
    from fusekit.core import checkpoint
    from fusekit.methods import avg

    for module in (checkpoint, avg):
        monkeypatch.setattr(module, "MAP_MIN_BYTES", 4 if mapped else 1 << 40)


@pytest.mark.parametrize("mapped", [False, True])
def test_streamed_average_reads_tensors_in_pieces(mlp_clients, monkeypatch, mapped):
    """Tensors larger than a piece are averaged piece by piece, as the reference does,
    whether the pieces are read into buffers or viewed in the files' mapped pages."""
    from fusekit.methods import avg

    never_or_always_mapped(monkeypatch, mapped)
    monkeypatch.setattr(avg, "PIECE_BYTES", 256)
    monkeypatch.setattr(avg, "SUM_BLOCK", 7)
    result = fusekit.fuse(mlp_clients, method="avg")
    ckpts = [load_checkpoint(p) for p in mlp_clients]
    weights = np.array([c.num_samples for c in ckpts], dtype=np.float64)
    order = np.argsort([c.sample_hash for c in ckpts])  # the sums' order: canonical
    for name in ckpts[0].tensors:  # bit for bit what whole tensors give
        arrays = [ckpts[i].tensor(name) for i in order]
        if name.endswith(("num_batches_tracked", "running_var")):  # whole, checked tensors
            whole = avg.average_tensor(arrays, weights[order] / weights.sum(), name)
        else:
            whole = np.empty(arrays[0].size, dtype=arrays[0].dtype)
            avg.weighted_sum([a.reshape(-1) for a in arrays], weights[order] / weights.sum(),
                             whole, np.empty((2, whole.size), avg.accumulator(whole.dtype)))
        np.testing.assert_array_equal(result.state_dict[name].reshape(-1), whole.reshape(-1),
                                      err_msg=name)


@pytest.mark.parametrize("mapped", [False, True])
def test_a_non_finite_value_met_while_streaming_is_named(tmp_path, monkeypatch, mapped):
    from fusekit.methods import avg

    never_or_always_mapped(monkeypatch, mapped)
    monkeypatch.setattr(avg, "PIECE_BYTES", 256)
    states = [{k: v.numpy().copy() for k, v in mlp(seed=s).state_dict().items()} for s in range(3)]
    states[2]["0.weight"].flat[-1] = np.inf
    paths = [write_raw(tmp_path / f"c{s}.safetensors", state) for s, state in enumerate(states)]
    with pytest.raises(CheckpointError, match=r"c2\.safetensors: tensor '0\.weight' has 1 "
                                              r"non-finite value"):
        fusekit.fuse(paths, method="avg")


@pytest.mark.parametrize("mapped", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_avg_hashes_each_input_from_the_values_it_averages(tmp_path, monkeypatch, dtype,
                                                          mapped):
    """avg reads every file once: the inputs' content hashes are fed with the values it
    averages, and are those the files' own hashing pass gives (pieces, 0-d counters,
    variances, BF16, a tensor held before the fusion)."""
    import safetensors.torch

    from fusekit.core.checkpoint import Checkpoint
    from fusekit.methods import avg

    paths = []
    for seed in range(3):  # plain torch models, written by safetensors itself
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(9, 40), torch.nn.BatchNorm1d(40),
                                    torch.nn.ReLU(), torch.nn.Linear(40, 4)).to(dtype)
        model(torch.randn(16, 9, dtype=dtype))  # running statistics and a counter
        paths.append(tmp_path / f"c{seed}.safetensors")
        safetensors.torch.save_file(model.state_dict(), paths[-1])
    expected = sorted(load_checkpoint(p).content_hash for p in paths)
    monkeypatch.setattr(avg, "PIECE_BYTES", 256)  # several pieces per tensor
    monkeypatch.setattr(avg, "SMALL_HASH_BYTES", 128)  # on the hashing threads
    never_or_always_mapped(monkeypatch, mapped)
    reads = []
    pieces = Checkpoint.pieces
    monkeypatch.setattr(Checkpoint, "pieces", lambda self, name, *args, **kwargs: (
        reads.append((self.label, name)), pieces(self, name, *args, **kwargs))[1])
    clients = [load_checkpoint(p) for p in paths]
    clients[1].tensor("0.weight")  # held before the fusion: hashed as held
    result = fusekit.fuse(clients, method="avg")
    assert sorted(json.loads(result.metadata["fusekit.inputs"])) == expected
    assert sorted(c.content_hash for c in clients) == expected
    streamed = [name for name in clients[0].tensors
                if not name.endswith(("num_batches_tracked", "running_var"))]
    assert sorted(reads) == sorted((str(p), name) for p in paths for name in streamed)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_weighted_addition_by_blocks_is_the_whole_one(dtype, monkeypatch):
    """ot's running sums add each client by blocks: the same values as one product and sum
    over the whole tensor, bit for bit, whatever the block size."""
    from fusekit.methods import avg

    rng = np.random.default_rng(0)
    for block, shape in [(1 << 15, (3, 70_001)), (7, (5, 3, 3)), (64, (64,))]:
        monkeypatch.setattr(avg, "SUM_BLOCK", block)
        total = rng.standard_normal(shape)
        array = rng.standard_normal(shape).astype(dtype)
        weight = np.float64(0.3) / 7
        expected = total + weight * array
        avg.add_weighted(total, weight, array)
        np.testing.assert_array_equal(total, expected)
