"""fusekit.toolkit.train: local training, determinism, FedNLR learning rates (paper Eq. 14-17)."""

import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from fusekit.core.errors import ParameterError
from fusekit.toolkit.data import synthetic
from fusekit.toolkit.nn import build_model, convnet_arch, mlp_arch
from fusekit.toolkit.train import (
    FedNLRConfig,
    Optimizer,
    TrainConfig,
    mean_activations,
    neuron_learning_rates,
    resolve_device,
    train_model,
)

DATA = synthetic(samples=300, features=6, classes=3, seed=0)


def _train(arch, config, seed=0):
    model = build_model(arch, seed=seed)
    result = train_model(model, DATA.x_train, DATA.y_train, config, seed=seed)
    return model, result


@pytest.mark.parametrize("optimizer, lr", [("adam", 1e-2), ("sgd", 5e-2)])
def test_training_reduces_loss(optimizer, lr):
    _, result = _train(mlp_arch(6, [16, 8], 3), TrainConfig(epochs=8, lr=lr, optimizer=optimizer))
    assert result.epoch_losses[-1] < 0.7 * result.epoch_losses[0]


def test_training_is_deterministic_for_a_seed():
    config = TrainConfig(epochs=2, batch_size=16)
    a, _ = _train(mlp_arch(6, [10], 3, batchnorm=True), config)
    b, _ = _train(mlp_arch(6, [10], 3, batchnorm=True), config)
    c, _ = _train(mlp_arch(6, [10], 3, batchnorm=True), config, seed=1)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["net.0.weight"], sc["net.0.weight"])


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_dropout_training_is_deterministic_for_a_seed_whatever_drew_before(device):
    # dropout draws from torch's global generator: a VGG's clients used to differ with
    # whatever had drawn from it before their training
    arch = {"type": "vgg", "name": "tiny", "batchnorm": True, "config": [4, "M"],
            "hidden": [8], "in_channels": 1, "out_features": 3}
    images = DATA.x_train[:64, :4].reshape(-1, 1, 2, 2)

    def trained(seed):
        model = build_model(arch, seed=0)
        train_model(model, images, DATA.y_train[:64], TrainConfig(epochs=2, batch_size=16),
                    seed=seed, device=device)
        return model.state_dict()

    first = trained(0)
    torch.rand(7, device=device)  # the caller draws from the global generator in between
    state = torch.get_rng_state() if device == "cpu" else torch.cuda.get_rng_state()
    second = trained(0)
    after = torch.get_rng_state() if device == "cpu" else torch.cuda.get_rng_state()
    assert torch.equal(after, state)  # and training leaves it as it was
    for name in first:
        if device == "cpu":
            assert torch.equal(first[name], second[name]), name
        else:  # CUDA adds atomically in arrival order: equal to rounding, but for what Adam
            # steps on a gradient that is zero up to rounding (a conv's bias before its
            # BatchNorm, and the running mean that follows it); dropout is in the classifier
            atol = 1e-6 if name.startswith("classifier") else 1e-2
            assert torch.allclose(first[name].float(), second[name].float(), atol=atol), name
    other = trained(1)
    assert not torch.equal(first["classifier.0.weight"], other["classifier.0.weight"])


def test_convnet_with_pans_trains_and_keeps_encodings():
    images = DATA.x_train[:, :4].reshape(-1, 1, 2, 2)
    model = build_model(convnet_arch((1, 2, 2), [4], 3, pan={"mode": "multiplicative"}), seed=0)
    before = model.state_dict()["net.3.encoding"].clone()
    result = train_model(model, images, DATA.y_train, TrainConfig(epochs=3, lr=1e-2))
    assert result.epoch_losses[-1] < result.epoch_losses[0]
    assert torch.equal(model.state_dict()["net.3.encoding"], before)


def test_fednlr_rates_hand_computed():
    # l = 1 of L = 2, M = 3 neurons: mu = 2 + 1*1/2 + 0.5 ln 3; T = (3 - 1) / ln mu.
    h = np.array([1.0, 2.0, 3.0])
    config = FedNLRConfig(mu0=2.0, c1=1.0, c2=0.5)
    mu = 2.5 + 0.5 * math.log(3)
    t = 2.0 / math.log(mu)
    p = np.exp(h / t) / np.exp(h / t).sum()
    expected = 0.1 * 3 * p
    rates = neuron_learning_rates(h, 0.1, 1, 2, config)
    np.testing.assert_allclose(rates, expected, rtol=1e-12)
    assert rates.max() / rates.min() == pytest.approx(mu)
    assert rates.mean() == pytest.approx(0.1)
    np.testing.assert_allclose(neuron_learning_rates(np.ones(4), 0.1, 1, 2, config), 0.1)


def test_mean_activations_are_post_relu_means_and_logits():
    model = build_model(mlp_arch(6, [5], 3), seed=0).eval()
    x = torch.as_tensor(DATA.x_train[:50])
    hidden, logits = mean_activations(model, x, batch_size=7)
    with torch.no_grad():
        h = torch.relu(model.net[0](x))
        np.testing.assert_allclose(hidden, h.double().mean(0).numpy(), rtol=1e-6)
        np.testing.assert_allclose(logits, model(x).double().mean(0).numpy(), rtol=1e-5, atol=1e-7)


def test_fednlr_step_scales_each_neurons_update():
    # One SGD step without momentum: the update of row m of layer 1 is eta_m * grad.
    arch = mlp_arch(6, [5], 3)
    config = TrainConfig(
        epochs=1, batch_size=1000, lr=0.1, optimizer="sgd", momentum=0.0, fednlr=FedNLRConfig()
    )
    start = build_model(arch, seed=0)
    reference = build_model(arch, seed=0)
    x, y = torch.as_tensor(DATA.x_train), torch.as_tensor(DATA.y_train)
    torch.nn.functional.cross_entropy(reference(x), y).backward()
    result = train_model(start, DATA.x_train, DATA.y_train, config, seed=0)
    rates = result.neuron_learning_rates
    with torch.no_grad():
        delta = reference.net[0].weight - start.net[0].weight
        expected = (
            torch.as_tensor(rates[0], dtype=torch.float32)[:, None] * reference.net[0].weight.grad
        )
        torch.testing.assert_close(delta, expected, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("config", [
    TrainConfig(lr=0.01, weight_decay=0.1), TrainConfig(lr=0.05, optimizer="sgd"),
    TrainConfig(lr=0.05, optimizer="sgd", momentum=0.0, weight_decay=0.01)],
    ids=["adam", "sgd", "sgd-no-momentum"])
@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_steps_are_torch_optims_bit_for_bit(config, device):
    # The layer left out of the forward pass has no gradient: both leave it as it is. On
    # CUDA both take torch's multi-tensor kernels, on the CPU its per-tensor ones.
    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3),
                                   torch.nn.Linear(3, 3)).to(device)

    ours, theirs = model(), model()
    optimizer = Optimizer(ours.parameters(), config.optimizer, config.lr, config.weight_decay,
                          config.momentum)
    reference = (torch.optim.Adam(theirs.parameters(), lr=config.lr,
                                  weight_decay=config.weight_decay)
                 if config.optimizer == "adam" else
                 torch.optim.SGD(theirs.parameters(), lr=config.lr, momentum=config.momentum,
                                 weight_decay=config.weight_decay))
    x, y = (torch.as_tensor(a[:64], device=device) for a in (DATA.x_train, DATA.y_train))
    for batch in torch.arange(64).split(16):
        for net, step in ((ours, optimizer), (theirs, reference)):
            step.zero_grad()
            torch.nn.functional.cross_entropy(net[:3](x[batch]), y[batch]).backward()
            step.step()
    for (name, a), b in zip(ours.state_dict().items(), theirs.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert torch.equal(ours[3].weight, model()[3].weight)


def test_training_does_not_import_torch_dynamo():
    # A torch.optim optimizer imports it (1.6 s of CPU), which every process that trains
    # would pay: each Flower ClientApp message that trains is one.
    code = ("import sys, numpy as np\n"
            "from fusekit.toolkit.nn import build_model, mlp_arch\n"
            "from fusekit.toolkit.train import TrainConfig, train_model\n"
            "x, y = np.ones((8, 4), np.float32), np.arange(8) % 2\n"
            "for optimizer in ('adam', 'sgd'):\n"
            "    train_model(build_model(mlp_arch(4, [3], 2)), x, y,\n"
            "                TrainConfig(epochs=1, optimizer=optimizer))\n"
            "print('torch._dynamo' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)
    assert done.stdout.strip() == "False", done.stderr


def test_config_errors():
    with pytest.raises(ParameterError, match="sgd"):
        TrainConfig(fednlr=FedNLRConfig())
    with pytest.raises(ParameterError, match="momentum >= 0"):
        TrainConfig(optimizer="sgd", momentum=-0.5)
    with pytest.raises(ParameterError, match="weight_decay >= 0"):
        TrainConfig(weight_decay=-1e-4)
    with pytest.raises(ParameterError, match="optimizer"):
        TrainConfig(optimizer="lbfgs")
    with pytest.raises(ParameterError, match="mu0"):
        FedNLRConfig(mu0=0.5)
    with pytest.raises(ParameterError, match="device"):
        resolve_device("tpu")
    assert resolve_device("cpu").type == "cpu"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_training_on_cuda():
    model = build_model(mlp_arch(6, [8], 3), seed=0)
    result = train_model(model, DATA.x_train, DATA.y_train, TrainConfig(epochs=2), device="cuda")
    assert next(model.parameters()).is_cuda and len(result.epoch_losses) == 2
