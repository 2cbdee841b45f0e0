"""fusekit.core.neurons: BatchNorm folding, unit form, incoming-weight mapping, write-back."""

import numpy as np
import pytest
import torch
from torch import nn

from fusekit.core import neurons
from fusekit.core.checkpoint import Checkpoint
from fusekit.core.errors import IncompatibleModelsError
from fusekit.core.spec import infer_spec, permute


class Net(nn.Module):
    def __init__(self, *layers):
        super().__init__()
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


def cnn(c1=4, c2=6, seed=0):
    torch.manual_seed(seed)
    model = Net(nn.Conv2d(1, c1, 3, padding=1), nn.BatchNorm2d(c1), nn.ReLU(), nn.MaxPool2d(2),
                nn.Conv2d(c1, c2, 3, padding=1, bias=False), nn.BatchNorm2d(c2), nn.ReLU(),
                nn.MaxPool2d(2), nn.Flatten(), nn.Linear(c2 * 4, 5))
    randomize_batchnorm(model)
    return model.eval()


def randomize_batchnorm(model):
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (nn.BatchNorm1d, nn.BatchNorm2d)):
                module.weight.uniform_(0.5, 1.5)
                module.bias.normal_(0, 0.3)
                module.running_mean.normal_(0, 0.3)
                module.running_var.uniform_(0.5, 2.0)


def as_checkpoint(model):
    return Checkpoint.from_state_dict({k: v.detach().numpy().copy()
                                       for k, v in model.state_dict().items()})


def outputs(model, state_dict, x):
    model.load_state_dict({k: torch.as_tensor(np.array(v)) for k, v in state_dict.items()})
    with torch.no_grad():
        return model.eval()(x).numpy()


def test_folding_then_identity_batchnorm_keeps_the_function():
    model = cnn()
    ckpt = as_checkpoint(model)
    spec = infer_spec(ckpt.state_dict())
    layers = neurons.client_layers(ckpt, spec)
    assert [layer.weight.shape for layer in layers] == [(4, 1, 9), (6, 4, 9), (5, 6, 4)]
    state = neurons.to_state_dict([ckpt], spec, layers)
    assert set(state) == set(ckpt.tensors)
    np.testing.assert_array_equal(state["net.1.running_mean"], 0)
    np.testing.assert_array_equal(state["net.5.weight"], 1)
    x = torch.randn(7, 1, 8, 8)
    expected = outputs(cnn(), ckpt.state_dict(), x)
    np.testing.assert_allclose(outputs(cnn(), state, x), expected, rtol=1e-4, atol=1e-5)


def test_map_incoming_scatters_units_and_marks_the_unobserved():
    weight = np.arange(2 * 3 * 4, dtype=float).reshape(2, 3, 4)
    mapped, observed = neurons.map_incoming(weight, np.array([4, 0, 2]), 5)
    assert mapped.shape == (2, 5, 4)
    np.testing.assert_array_equal(mapped[:, 4], weight[:, 0])
    np.testing.assert_array_equal(mapped[:, 0], weight[:, 1])
    np.testing.assert_array_equal(mapped[:, [1, 3]], 0)
    np.testing.assert_array_equal(observed, [True, False, True, False, True])


def test_neuron_vectors_follow_a_permutation_of_the_layer_below():
    model = cnn()
    ckpt = as_checkpoint(model)
    spec = infer_spec(ckpt.state_dict())
    perm = np.array([2, 0, 3, 1])
    permuted = Checkpoint.from_state_dict(permute(ckpt.state_dict(), spec, [perm, None]))
    original = neurons.client_layers(ckpt, spec)
    shuffled = neurons.client_layers(permuted, spec)
    # The permuted client's neuron k sits where the original's perm[k] sits globally.
    vec_a, obs_a, layout = neurons.neuron_vectors(original[1], None, 4, original[2])
    vec_b, obs_b, _ = neurons.neuron_vectors(shuffled[1], perm, 4, shuffled[2])
    np.testing.assert_allclose(vec_a, vec_b)
    assert obs_a.all() and obs_b.all()
    assert layout.size == 4 * 9 + 1 + 5 * 4
    incoming, bias, outgoing = layout.split(vec_a)
    np.testing.assert_allclose(incoming, original[1].weight)
    np.testing.assert_allclose(bias, original[1].bias)
    np.testing.assert_allclose(outgoing, original[2].weight)


def test_block_variances_are_per_block_means_over_observed_entries():
    rng = np.random.default_rng(0)
    layout = neurons.VectorLayout(n_in=3, block_in=1, n_out=2, block_out=1)
    a = rng.normal(0, 1, (50, layout.size))
    b = rng.normal(0, 1, (50, layout.size)) * 3
    obs_b = np.array([True, False, True, True, True, True])
    b[:, ~obs_b] = 0.0
    unit = neurons.block_variances([a, b], [np.ones(6, bool), obs_b], layout)
    both = np.vstack([a, b])
    expected_in = np.mean([both[:, 0].var(), a[:, 1].var(), both[:, 2].var()])
    assert unit[0] == pytest.approx(expected_in)
    assert unit[3] == pytest.approx(both[:, 3].var())
    assert unit[4] == pytest.approx(np.mean([both[:, 4].var(), both[:, 5].var()]))


def test_position_aware_checkpoints_are_refused_with_a_pointer_to_avg():
    ckpt = Checkpoint.from_state_dict({
        "net.0.weight": np.ones((3, 2), np.float32), "net.0.bias": np.zeros(3, np.float32),
        "net.2.encoding": np.ones(3, np.float32),
        "net.3.weight": np.ones((2, 3), np.float32), "net.3.bias": np.zeros(2, np.float32)})
    spec = infer_spec(ckpt.state_dict())
    with pytest.raises(IncompatibleModelsError, match=r"position-aware.*avg"):
        neurons.refuse_position_aware([ckpt], [spec], "pfnm")


def test_batchnorm_folded_in_float32_is_the_float64_fold_to_float32_precision():
    """Folding into float32 (ot) rounds the scale and each scaled weight: within float32's
    eps of the float64 fold, relative, the same bias; a layer without a BatchNorm is not
    widened, and float64 weights stay float64."""
    model = cnn(seed=3)
    checkpoint = Checkpoint.from_state_dict(
        {k: v.numpy() for k, v in model.state_dict().items()})
    spec = infer_spec({k: v.shape for k, v in model.state_dict().items()})
    wide = neurons.client_layers(checkpoint, spec)
    narrow = neurons.client_layers(checkpoint, spec, dtype=np.float32)
    for layer, w64, w32 in zip(spec.layers, wide, narrow, strict=True):
        assert w64.weight.dtype == np.float64 and w32.weight.dtype == np.float32, layer.name
        np.testing.assert_array_equal(w32.bias, w64.bias)
        # two roundings (the scale, the product), each at most half of eps32 relative
        bound = 1.001 * np.finfo(np.float32).eps * np.abs(w64.weight)
        assert np.all(np.abs(w32.weight - w64.weight) <= bound), layer.name
        if layer.norm is None:  # as stored
            np.testing.assert_array_equal(w32.weight, w64.weight)
    double = Checkpoint.from_state_dict({k: v.double().numpy()
                                         for k, v in model.state_dict().items()})
    assert all(layer.weight.dtype == np.float64
               for layer in neurons.client_layers(double, spec, dtype=np.float32))


def test_layers_held_in_their_stored_dtype_write_the_same_tensors():
    """A method may cast each finished layer as it goes (as_stored): the written model is
    the one the float64 layers give, bit for bit, overflow to Inf included."""
    ckpt = as_checkpoint(cnn())
    spec = infer_spec(ckpt.state_dict())
    rng = np.random.default_rng(0)
    layers = [neurons.UnitLayer(rng.normal(0, 1, layer.weight.shape) / 3, layer.bias)
              for layer in neurons.client_layers(ckpt, spec)]
    layers[1].weight[0, 0, 0] = 1e300  # beyond float32: Inf in both
    stored = [neurons.as_stored(layer, neurons.stored_dtype(ckpt, spec.layers[i]))
              for i, layer in enumerate(layers)]
    assert all(layer.weight.dtype == np.float32 for layer in stored)
    expected = neurons.to_state_dict([ckpt], spec, layers)
    found = neurons.to_state_dict([ckpt], spec, stored)
    assert set(found) == set(expected)
    for name, array in expected.items():
        assert found[name].dtype == array.dtype
        np.testing.assert_array_equal(found[name], array)
    assert np.isinf(found["net.4.weight"]).any()
