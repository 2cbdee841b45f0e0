"""Local client training: plain, with PANs (a property of the model, see fusekit.toolkit.nn), and
with FedNLR neuron-wise learning rates.

Training is deterministic for a seed: the data order comes from a seeded torch.Generator,
and the draws of dropout layers from torch's global generator, seeded from the same seed
inside a fork of the global random state (so neither what ran before nor the training
changes the other's draws). Models are initialised by ``build_model(arch, seed=...)``.
Bitwise for a given number of CPU threads: a model above
:data:`SINGLE_THREAD_MAX_PARAMETERS` trains on the caller's thread count, and other counts
sum in other orders (a VGG-11 at 1/4 width: weights 2e-3 apart after one epoch). On CUDA,
kernels that sum with atomic additions (an adaptive pooling that widens, cuDNN's weight
gradients) add in the order the threads arrive: the same draws, weights equal to rounding,
except where Adam steps on a gradient that is zero up to rounding (a convolution's bias
before its BatchNorm: 2e-3 apart after eight steps on an H200, with no effect on the output
of the BatchNorm in training, and its running mean with it).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.optim.adam import adam
from torch.optim.sgd import sgd

from fusekit.core.errors import DataError, ParameterError

logger = logging.getLogger(__name__)

OPTIMIZERS = ("adam", "sgd")


@dataclass(frozen=True)
class FedNLRConfig:
    """FedNLR hyper-parameters (FedNLR paper Eq. 17): the ratio between the largest and
    the smallest learning rate of layer l is mu_l = mu0 + c1 * l / L + c2 * ln(M_l).

    The paper gives no default values; these keep mu_l between about 2 and 6 for layers of
    10..1000 neurons, the range its Fig. 3 temperatures imply.
    """

    mu0: float = 2.0
    c1: float = 1.0
    c2: float = 0.5

    def __post_init__(self) -> None:
        if self.mu0 <= 1 or self.c1 < 0 or self.c2 < 0:
            raise ParameterError(
                f"fednlr: expected mu0 > 1 and c1, c2 >= 0 (so every ratio mu_l > 1), found "
                f"mu0={self.mu0}, c1={self.c1}, c2={self.c2}"
            )


@dataclass(frozen=True)
class TrainConfig:
    """Local training settings.

    Attributes:
        epochs: passes over the client's data (>= 1).
        batch_size: mini-batch size (>= 1).
        lr: base learning rate eta.
        optimizer: ``adam`` or ``sgd``.
        momentum: SGD momentum.
        weight_decay: L2 penalty of the optimizer.
        fednlr: FedNLR settings, or None for one learning rate per layer. Needs ``sgd``:
            Adam divides out any per-neuron gradient scale.
    """

    epochs: int = 20
    batch_size: int = 32
    lr: float = 3e-3
    optimizer: str = "adam"
    momentum: float = 0.9
    weight_decay: float = 0.0
    fednlr: FedNLRConfig | None = None

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ParameterError(
                f"optimizer: expected one of {list(OPTIMIZERS)}, found {self.optimizer!r}"
            )
        if self.epochs < 1 or self.batch_size < 1 or not self.lr > 0:
            raise ParameterError(
                f"training: expected epochs >= 1, batch_size >= 1, lr > 0; found "
                f"{self.epochs}, {self.batch_size}, {self.lr}"
            )
        if not (self.momentum >= 0 and self.weight_decay >= 0):
            raise ParameterError(
                f"training: expected momentum >= 0 and weight_decay >= 0; found "
                f"{self.momentum}, {self.weight_decay}"
            )
        if self.fednlr is not None and self.optimizer != "sgd":
            raise ParameterError(
                "fednlr: neuron-wise learning rates need optimizer 'sgd' (Adam normalises "
                f"gradients per coordinate and would cancel them); found {self.optimizer!r}"
            )


@dataclass
class TrainResult:
    """Mean training loss of every epoch, and the FedNLR rates when used."""

    epoch_losses: list[float] = field(default_factory=list)
    neuron_learning_rates: list[np.ndarray] | None = None


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """``auto`` -> cuda when available, else cpu; ``cuda`` without a GPU is an error.

    Raises:
        ParameterError: unknown device string or cuda requested without CUDA.
    """
    text = str(device)
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if text.startswith("cuda") and not torch.cuda.is_available():
        raise ParameterError("device: 'cuda' requested but torch sees no CUDA device")
    if not (text == "cpu" or text.startswith("cuda")):
        raise ParameterError(f"device: expected auto, cpu or cuda[:N], found {text!r}")
    return torch.device(text)


def train_model(
    model: nn.Module,
    x: np.ndarray,
    y: np.ndarray,
    config: TrainConfig,
    *,
    seed: int = 0,
    device: str | torch.device = "cpu",
    on_epoch: Callable[[int, float], None] | None = None,
) -> TrainResult:
    """Train ``model`` in place with cross-entropy on (x, y).

    Args:
        model: a fusekit module (``build_model``); moved to ``device`` and left there.
        x: float32 (N, ...) inputs.
        y: int64 (N,) labels.
        config: training settings.
        seed: seeds the mini-batch order and the draws of dropout layers.
        device: torch device (use :func:`resolve_device` for ``auto``).
        on_epoch: called with (epoch index, mean loss) after every epoch.

    Returns:
        TrainResult with per-epoch mean losses (and FedNLR rates when used).

    Raises:
        DataError: empty data or mismatched lengths.
    """
    if len(x) == 0 or len(x) != len(y):
        raise DataError(
            f"training data: expected N > 0 inputs and N labels, found {len(x)} and {len(y)}"
        )
    device = torch.device(device)
    model.to(device)
    inputs = torch.as_tensor(np.asarray(x, dtype=np.float32)).to(device)
    targets = torch.as_tensor(np.asarray(y, dtype=np.int64)).to(device)
    result = TrainResult()
    grad_scales: list[tuple[torch.Tensor, torch.Tensor]] = []
    if config.fednlr is not None:
        means = mean_activations(model, inputs, batch_size=max(256, config.batch_size))
        rates = [
            neuron_learning_rates(m, config.lr, index + 1, len(means), config.fednlr)
            for index, m in enumerate(means)
        ]
        result.neuron_learning_rates = rates
        grad_scales = _neuron_gradient_scales(model, [r / config.lr for r in rates], device)
    optimizer = Optimizer(model.parameters(), config.optimizer, config.lr,
                          config.weight_decay, config.momentum)
    generator = torch.Generator().manual_seed(seed)
    model.train()
    with _cpu_threads_for(model, device), _seeded_global_rng(seed, device):
        _run_epochs(
            model, inputs, targets, config, optimizer, grad_scales, generator, result, on_epoch
        )
    model.eval()
    return result


def _run_epochs(
    model: nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    config: TrainConfig,
    optimizer: Optimizer,
    grad_scales: list[tuple[torch.Tensor, torch.Tensor]],
    generator: torch.Generator,
    result: TrainResult,
    on_epoch: Callable[[int, float], None] | None,
) -> None:
    loss_fn = nn.CrossEntropyLoss()
    n = len(targets)
    device = inputs.device
    for epoch in range(config.epochs):
        order = torch.randperm(n, generator=generator).to(device)
        total, seen = 0.0, 0
        for start in range(0, n, config.batch_size):
            batch = order[start : start + config.batch_size]
            if len(batch) == 1 and n > 1 and _has_batchnorm(model):
                continue  # BatchNorm cannot normalise a single sample in training mode
            optimizer.zero_grad()
            loss = loss_fn(model(inputs[batch]), targets[batch])
            loss.backward()
            for grad_owner, scale in grad_scales:
                grad_owner.grad.mul_(scale)
            optimizer.step()
            total += float(loss.detach()) * len(batch)
            seen += len(batch)
        mean_loss = total / max(seen, 1)
        result.epoch_losses.append(mean_loss)
        if on_epoch is not None:
            on_epoch(epoch, mean_loss)


@contextlib.contextmanager
def _seeded_global_rng(seed: int, device: torch.device) -> Iterator[None]:
    """torch's global generator (CPU, and ``device``'s when CUDA) seeded from ``seed`` for
    the duration, the caller's state restored after: dropout draws from it, so without
    this two trainings with the same seed differ with whatever drew from it before."""
    cuda = device.type == "cuda"
    with torch.random.fork_rng(devices=[device] if cuda else []):
        torch.default_generator.manual_seed(seed)
        if cuda:
            with torch.cuda.device(device):
                torch.cuda.manual_seed(seed)
        yield


# Below this many parameters a CPU training step is a few microseconds of arithmetic, and
# splitting it over threads costs more than it saves (10x slower on a loaded 2-core box).
SINGLE_THREAD_MAX_PARAMETERS = 1_000_000


@contextlib.contextmanager
def _cpu_threads_for(model: nn.Module, device: torch.device) -> Iterator[None]:
    n_params = sum(p.numel() for p in model.parameters())
    if device.type != "cpu" or n_params > SINGLE_THREAD_MAX_PARAMETERS:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def weighted_layers(model: nn.Module) -> list[nn.Module]:
    """Linear/Conv2d layers of ``model.net`` in order (the FedNLR layers l = 1..L)."""
    return [m for m in model.net if isinstance(m, (nn.Linear, nn.Conv2d))]


def mean_activations(
    model: nn.Module, inputs: torch.Tensor, *, batch_size: int = 1024
) -> list[np.ndarray]:
    """Mean activation h̄_{l,m} of every neuron over ``inputs`` (FedNLR Eq. 14).

    Hidden layers: the output of the ReLU that follows the layer (averaged over the
    spatial positions of a conv channel). Output layer: the logits.

    Returns:
        One float64 array of shape (M_l,) per weighted layer, in layer order.
    """
    net = model.net
    points: list[nn.Module] = []
    layers = weighted_layers(model)
    modules = list(net)
    for layer in layers[:-1]:
        position = modules.index(layer)
        relu = next(m for m in modules[position:] if isinstance(m, nn.ReLU))
        points.append(relu)
    points.append(layers[-1])
    sums: list[torch.Tensor | None] = [None] * len(points)

    def hook_for(i: int) -> Callable[..., None]:
        def hook(_module: nn.Module, _inp: object, out: torch.Tensor) -> None:
            per_neuron = out.double().sum(dim=0)
            if per_neuron.ndim > 1:
                per_neuron = per_neuron.flatten(1).mean(dim=1)
            sums[i] = per_neuron if sums[i] is None else sums[i] + per_neuron

        return hook

    handles = [p.register_forward_hook(hook_for(i)) for i, p in enumerate(points)]
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            for start in range(0, len(inputs), batch_size):
                model(inputs[start : start + batch_size])
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return [(s / len(inputs)).cpu().numpy() for s in sums]  # type: ignore[union-attr]


def neuron_learning_rates(
    mean_activation: Sequence[float] | np.ndarray,
    base_lr: float,
    layer_index: int,
    n_layers: int,
    config: FedNLRConfig,
) -> np.ndarray:
    """FedNLR learning rates of one layer's neurons (paper Eq. 15-17).

    mu_l = mu0 + c1 * l / L + c2 * ln(M_l);  T_l = (h̄_max - h̄_min) / ln(mu_l);
    p_m = softmax(h̄ / T_l)_m;  eta_m = eta * M_l * p_m / sum_i p_i.
    The rates average to eta and max/min = mu_l. When all h̄ are equal (T_l = 0) every
    neuron gets eta.

    Args:
        mean_activation: (M_l,) mean activations h̄_{l,m}.
        base_lr: eta.
        layer_index: l, 1-based.
        n_layers: L, the number of weighted layers.
        config: mu0, c1, c2.

    Returns:
        float64 (M_l,) learning rates.
    """
    h = np.asarray(mean_activation, dtype=np.float64)
    width = h.size
    mu = config.mu0 + config.c1 * layer_index / n_layers + config.c2 * math.log(width)
    spread = float(h.max() - h.min())
    if spread <= 0:
        return np.full(width, float(base_lr))
    temperature = spread / math.log(mu)
    logits = h / temperature
    p = np.exp(logits - logits.max())
    p /= p.sum()
    return base_lr * width * p / p.sum()


def _neuron_gradient_scales(
    model: nn.Module, scales: list[np.ndarray], device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # With SGD (momentum or not, no decoupled decay) multiplying a parameter's gradient by
    # s is exactly a learning rate of s * eta for it. A neuron's parameters are its weight
    # row / output channel, its bias and its BatchNorm scale and shift.
    modules = list(model.net)
    out = []
    for layer, scale in zip(weighted_layers(model), scales, strict=True):
        s = torch.as_tensor(scale, dtype=torch.float32, device=device)
        out.append((layer.weight, s.reshape(-1, *([1] * (layer.weight.ndim - 1)))))
        if layer.bias is not None:
            out.append((layer.bias, s))
        following = modules[modules.index(layer) + 1] if layer is not modules[-1] else None
        if isinstance(following, (nn.BatchNorm1d, nn.BatchNorm2d)):
            out += [(following.weight, s), (following.bias, s)]
    return out


class Optimizer:
    """``torch.optim.Adam`` (``kind`` "adam") or ``SGD`` ("sgd") with the learning rate,
    weight decay and momentum given (their other settings at torch's defaults), stepped
    through the functional forms their ``step`` calls (``torch.optim.adam.adam``,
    ``torch.optim.sgd.sgd``), with the state they keep: the same updates, bit for bit. An
    ``Optimizer`` object of torch's imports torch._dynamo when it is made and at its first
    step, about 1.6 s of CPU, which a process that trains one small model pays in full:
    each Flower ClientApp message that trains is such a process, and so is a service
    worker or a command that distils."""

    def __init__(self, params: Iterable[torch.Tensor], kind: str, lr: float,
                 weight_decay: float = 0.0, momentum: float = 0.0):
        self.params = list(params)
        self.kind, self.lr, self.weight_decay, self.momentum = kind, lr, weight_decay, momentum
        # Per parameter, as torch keeps it: Adam's step count and moments, SGD's momentum.
        self.state: dict[torch.Tensor, Any] = {}

    def zero_grad(self) -> None:
        for param in self.params:
            param.grad = None

    @torch.no_grad()
    def step(self) -> None:
        # As torch does, a parameter without a gradient is left alone, state and all.
        params = [p for p in self.params if p.grad is not None]
        grads = [p.grad for p in params]
        if self.kind == "adam":
            for param in params:
                if param not in self.state:
                    self.state[param] = _adam_state(param)
            steps, means, squares = ([self.state[p][i] for p in params] for i in range(3))
            adam(params, grads, means, squares, [], steps, amsgrad=False, beta1=0.9,
                 beta2=0.999, lr=self.lr, weight_decay=self.weight_decay, eps=1e-8,
                 maximize=False)
            return
        buffers = [self.state.get(p) for p in params]
        sgd(params, grads, buffers, weight_decay=self.weight_decay, momentum=self.momentum,
            lr=self.lr, dampening=0.0, nesterov=False, maximize=False)
        if self.momentum != 0:
            self.state.update(zip(params, buffers, strict=True))


def _adam_state(param: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A parameter's Adam state as ``torch.optim.Adam`` starts it: step count 0 (a float64
    tensor where that is torch's default type, else float32), zero first and second
    moments."""
    wide = torch.get_default_dtype() == torch.float64
    return (torch.tensor(0.0, dtype=torch.float64 if wide else torch.float32),
            torch.zeros_like(param, memory_format=torch.preserve_format),
            torch.zeros_like(param, memory_format=torch.preserve_format))


def _has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
