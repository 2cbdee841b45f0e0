"""Multi-round federated simulation: local training from the global model, then fusion.

Round r (1-based) of R:

1. sample ``clients_per_round`` of the S clients (seeded per round);
2. each sampled client trains the current global model on its own data (plain, with PANs,
   FedNLR neuron-wise rates or a Fed² structure: all are properties of the model and the
   training settings, see :mod:`fusekit.toolkit.train`);
3. :func:`fuse_round` fuses the updates with ``fusekit.fuse`` into the next global model;
   with ``calibrate``, the sampled clients then calibrate it with statistics of their own
   data, layer by layer (ALGORITHMS §12); with ``align``, they calibrate it, run an
   alignment round and a refit round per layer;
4. the global model is evaluated on the test split.

:func:`fuse_round` is the whole server-side step (in-memory checkpoints in, one checkpoint
out); a federated framework's strategy calls it the same way. One-shot methods that
rematch neurons (pfnm, nafi, ot) fuse the first round, when clients come from the same
initial model but have drifted apart; later rounds start every client from that one
global model, so their coordinates agree and :func:`round_method` averages them (avg). AMS
returns an ensemble, not one model a client could train, and is refused for R > 1.

Seeds: the partition and the initial global model come from ``simulation.seed`` (the
initial model is the one :func:`~fusekit.toolkit.simulate.simulate_clients` gives every
client with ``shared_init``); round r's client sample and each client's mini-batch order
from seeds derived from it (round 1 uses simulate's), so a configuration always gives the
same rounds, and one round with every client equals simulating shared-init clients and
fusing them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from fusekit.api import fuse
from fusekit.core import metadata as meta
from fusekit.core import progress
from fusekit.core.checkpoint import Checkpoint, is_integer_buffer
from fusekit.core.errors import ParameterError
from fusekit.core.model_spec import client_spec
from fusekit.core.stats import DEFAULT_MIN_SAMPLES
from fusekit.engine.matching import solve_assignment, sqeuclidean_cost
from fusekit.methods import METHODS, get_method
from fusekit.toolkit.data import Dataset, partition
from fusekit.toolkit.simulate import (
    SimulationConfig,
    client_archs,
    client_checkpoint,
    derive_seed,
)

logger = logging.getLogger(__name__)

#: Methods that keep the global model's coordinates and can fuse every round.
EVERY_ROUND = ("avg", "fed2")
#: Methods whose result is an ensemble of the clients, not one trainable model.
ENSEMBLES = ("ams",)


@dataclass(frozen=True)
class RoundsConfig:
    """A multi-round simulation.

    Attributes:
        rounds: number of rounds R (>= 1).
        method: fusion method of every round (``avg``, ``fed2``) or of the first round
            (one-shot methods, see :func:`round_method`).
        params: the method's parameters, passed to ``fusekit.fuse``.
        clients_per_round: clients sampled each round; None = all S.
        simulation: data split, architecture (PANs, Fed²), local training and seed; every
            client starts each round from the global model.
        calibrate: calibrate each fused model with the sampled clients' statistics of
            their own data (fusions that record assignments; others are left as they are).
        align: calibrate each such fused model, then run one alignment round and a refit
            round per layer with the sampled clients' data
            (:func:`fusekit.toolkit.local.align_locally`); ``calibrate`` adds nothing.
    """

    rounds: int = 10
    method: str = "avg"
    params: Mapping[str, Any] = field(default_factory=dict)
    clients_per_round: int | None = None
    simulation: SimulationConfig = field(default_factory=SimulationConfig)
    calibrate: bool = False
    align: bool = False

    def __post_init__(self) -> None:
        if self.rounds < 1:
            raise ParameterError(f"rounds: expected R >= 1, found {self.rounds}")
        get_method(self.method)  # UnknownMethodError for a bad name
        k, s = self.clients_per_round, self.simulation.clients
        if k is not None and not 1 <= k <= s:
            raise ParameterError(
                f"clients_per_round: expected 1..{s} (the number of clients), found {k}"
            )
        if self.method in ENSEMBLES and self.rounds > 1:
            raise ParameterError(
                f"method {self.method!r} returns an ensemble of the clients, which clients "
                "cannot train in a next round; use it with rounds=1"
            )


@dataclass
class RoundLog:
    """What one round did.

    Attributes:
        round: r, 1-based.
        method: the fusion method of this round.
        clients: indices of the sampled clients.
        accuracy, loss: of the global model on the test split after fusion.
        train_loss: mean final-epoch training loss of the sampled clients.
        drift: mean over sampled clients of ||θ_s − θ̄|| / ||θ̄|| (θ̄ the plain mean of the
            updates; weights and biases only): how far local training pulled clients apart.
        dislocated: fraction of the clients' hidden neurons that local training moved
            closer to another neuron of the round's starting model than to their own
            (:func:`neuron_dislocation`): the dislocation PANs and Fed² guard against.
        widths: hidden widths of the global model.
        time_s: wall time of the round.
        uncalibrated_accuracy: with calibration (or alignment), the fused model's accuracy
            before it.
    """

    round: int
    method: str
    clients: list[int]
    accuracy: float
    loss: float
    train_loss: float
    drift: float
    dislocated: float
    widths: list[int]
    time_s: float
    uncalibrated_accuracy: float | None = None


@dataclass
class RoundsResult:
    """The final global model and one log entry per round."""

    global_checkpoint: Checkpoint
    rounds: list[RoundLog]

    def as_dict(self) -> dict[str, Any]:
        return {"rounds": [asdict(r) for r in self.rounds]}


def round_method(method: str, round_index: int) -> str:
    """The method that fuses round ``round_index`` (1-based): ``method`` on round 1 and on
    every round for the methods in :data:`EVERY_ROUND`; avg on later rounds otherwise."""
    return method if round_index == 1 or method in EVERY_ROUND else "avg"


def fuse_round(
    updates: Sequence[Checkpoint], method: str, params: Mapping[str, Any] | None = None
) -> Checkpoint:
    """The server step of a round: fuse the clients' updated models into the next global
    model with ``fusekit.fuse``.

    Args:
        updates: the clients' models after local training (with ``fusekit.num_samples``
            for sample weighting and ``fusekit.arch`` to rebuild them).
        method: a registered fusion method.
        params: its parameters.

    Returns:
        The fused model as an in-memory checkpoint with the method's metadata.

    Raises:
        FusekitError: whatever ``fusekit.fuse`` raises for these inputs.
    """
    result = fuse(list(updates), method, **dict(params or {}))
    return Checkpoint.from_state_dict(result.state_dict, result.metadata)


def calibrate_round(fused: Checkpoint, updates: Sequence[Checkpoint],
                    client_inputs: Sequence[np.ndarray], *, align: bool = False) -> Checkpoint:
    """Calibrate a round's fused model layer by layer with the clients' statistics of their
    own data (of the fused model, and of their updates: REPAIR's targets); with ``align``,
    then one alignment round and a refit round per layer (``align_locally``)."""
    from fusekit.toolkit.local import align_locally, calibrate_locally

    min_samples = min(DEFAULT_MIN_SAMPLES, *(len(x) for x in client_inputs))
    result = (align_locally(fused, updates, client_inputs, min_samples=min_samples) if align
              else calibrate_locally(fused, client_inputs, clients=updates,
                                     min_samples=min_samples))
    return Checkpoint.from_state_dict(result.state_dict, result.metadata)


def initial_global(dataset: Dataset, simulation: SimulationConfig) -> Checkpoint:
    """The round-1 global model: the architecture initialised from ``simulation.seed``.

    Raises:
        ParameterError, SpecError: no single valid architecture for every client.
    """
    from fusekit.toolkit.nn.modules import build_model

    archs = client_archs(simulation, dataset)
    if any(arch != archs[0] for arch in archs):
        raise ParameterError(
            "arch: rounds start every client from one global model; expected one "
            "architecture for all clients, found several"
        )
    model = build_model(archs[0], seed=simulation.seed)  # as simulate's shared_init
    return client_checkpoint(model, dataset, None)


def run_rounds(
    dataset: Dataset,
    config: RoundsConfig,
    *,
    device: str = "cpu",
    initial: Checkpoint | None = None,
) -> RoundsResult:
    """Run R rounds of local training and fusion.

    Args:
        dataset: its train split is partitioned over the clients; its test split scores
            the global model after every round.
        config: rounds, method and simulation settings.
        device: ``auto``, ``cpu`` or ``cuda`` for local training and evaluation.
        initial: the round-1 global model; None = :func:`initial_global`.

    Returns:
        The final global model and the per-round logs.

    Raises:
        ParameterError, SpecError: invalid settings; FusekitError from fusion.
    """
    from fusekit.toolkit.evaluate import Evaluator

    sim = config.simulation
    _check_method_fits(config)
    evaluator = Evaluator(dataset, device)
    parts = partition(dataset.y_train, sim.clients, sim.partition, alpha=sim.alpha,
                      min_classes=sim.min_classes, max_classes=sim.max_classes,
                      min_samples=sim.min_samples, seed=sim.seed)
    current = initial if initial is not None else initial_global(dataset, sim)
    per_round = config.clients_per_round or sim.clients
    logs = []
    for r in range(1, config.rounds + 1):
        start = time.perf_counter()
        chosen = sample_clients(sim, r, per_round)
        trained = [train_local(current, dataset, parts[i], sim, seed=_order_seed(sim, r, i),
                               device=str(evaluator.device)) for i in chosen]
        updates, losses = [u for u, _ in trained], [loss for _, loss in trained]
        method = round_method(config.method, r)
        dislocated = neuron_dislocation(updates, current)
        current = fuse_round(updates, method, config.params if method == config.method else {})
        before = None
        if (config.calibrate or config.align) and meta.ASSIGNMENTS in current.metadata:
            before = evaluator.score(evaluator.logits(current)[1], "", "fused").accuracy
            current = calibrate_round(current, updates, [dataset.x_train[parts[i]]
                                                         for i in chosen], align=config.align)
        _, logits = evaluator.logits(current)
        score = evaluator.score(logits, f"round {r}", "fused", method)
        log = RoundLog(r, method, chosen, score.accuracy, score.loss, float(np.mean(losses)),
                       client_drift(updates), dislocated, _widths(current),
                       time.perf_counter() - start, before)
        logger.debug("round %d/%d (%s): accuracy %.4f, drift %.4f", r, config.rounds, method,
                    log.accuracy, log.drift)
        logs.append(log)
        progress.advance(f"rounds (accuracy {log.accuracy:.4f})", r, config.rounds)
    return RoundsResult(current, logs)


def sample_clients(simulation: SimulationConfig, round_index: int, count: int) -> list[int]:
    """The sorted indices of the ``count`` clients of round ``round_index`` (seeded)."""
    rng = np.random.default_rng(derive_seed(simulation.seed, "sample", round_index))
    return sorted(int(i) for i in rng.choice(simulation.clients, size=count, replace=False))


def train_local(
    global_model: Checkpoint,
    dataset: Dataset,
    indices: np.ndarray,
    simulation: SimulationConfig,
    *,
    seed: int,
    device: str = "cpu",
) -> tuple[Checkpoint, float]:
    """One client's local update: the global model trained on the client's samples.

    Returns:
        (the updated model with the client's sample and class counts, its final-epoch loss).
    """
    from fusekit.toolkit.nn.modules import load_model
    from fusekit.toolkit.train import train_model

    model = load_model(global_model, device).train()
    result = train_model(model, dataset.x_train[indices], dataset.y_train[indices],
                         simulation.train, seed=seed, device=device)
    return client_checkpoint(model, dataset, indices), result.epoch_losses[-1]


def _order_seed(simulation: SimulationConfig, round_index: int, client: int) -> int:
    # Round 1 uses simulate_clients' seeds, so one round equals simulating shared-init
    # clients and fusing them.
    index = (round_index - 1) * simulation.clients + client
    return derive_seed(simulation.seed, "order", index)


def client_drift(updates: Sequence[Checkpoint]) -> float:
    """Mean over clients of ||θ_s − θ̄|| / ||θ̄|| over the float tensors they share
    (θ̄ the plain mean); 0 for one client."""
    names = [n for n in updates[0].tensors if not is_integer_buffer(n)
             and not n.endswith((".running_mean", ".running_var", ".encoding"))]
    flat = np.stack([np.concatenate([u.tensor(n).ravel() for n in names]).astype(np.float64)
                     for u in updates])
    mean = flat.mean(axis=0)
    return float(np.linalg.norm(flat - mean, axis=1).mean() / max(np.linalg.norm(mean), 1e-12))


def neuron_dislocation(updates: Sequence[Checkpoint], start: Checkpoint) -> float:
    """Fraction of hidden neurons, over all clients and hidden layers, whose optimal
    one-to-one match to the neurons of ``start`` (the model the clients trained from) is
    not themselves; a neuron is its incoming weights and bias, matched by squared distance
    with the assignment solver. 0 means coordinate averaging pairs every neuron with its
    counterpart.
    """
    spec = client_spec(start, None)
    moved = total = 0
    for layer in spec.layers[:-1]:
        before = _neuron_rows(start, layer.weight, layer.bias)
        for update in updates:
            _, match = solve_assignment(sqeuclidean_cost(
                _neuron_rows(update, layer.weight, layer.bias), before))
            moved += int((match != np.arange(len(match))).sum())
            total += len(match)
    return moved / max(total, 1)


def _neuron_rows(checkpoint: Checkpoint, weight: str, bias: str | None) -> np.ndarray:
    rows = checkpoint.tensor(weight).reshape(checkpoint.tensors[weight].shape[0], -1)
    parts = [rows] if bias is None else [rows, checkpoint.tensor(bias)[:, None]]
    return np.concatenate(parts, axis=1).astype(np.float64)


def _widths(checkpoint: Checkpoint) -> list[int]:
    from fusekit.core.arch import hidden_widths

    return hidden_widths(checkpoint.arch) if checkpoint.arch else []


def _check_method_fits(config: RoundsConfig) -> None:
    """Refuse, before any training, a method the clients' structure rules out."""
    sim = config.simulation
    cls = METHODS[config.method]
    if cls.client_structure == "fed2" and sim.fed2 is None:
        raise ParameterError(
            f"method {config.method!r} fuses Fed² models; give the Fed² structure "
            "(--fed2 / SimulationConfig.fed2)"
        )
    if cls.permutes_neurons and (sim.pan is not None or sim.fed2 is not None):
        kind = "position-aware neurons" if sim.pan is not None else "a Fed² structure"
        raise ParameterError(
            f"method {config.method!r} permutes neurons, which breaks {kind}; use "
            f"{'avg' if sim.pan is not None else 'fed2'}"
        )


__all__ = [
    "ENSEMBLES",
    "EVERY_ROUND",
    "RoundLog",
    "RoundsConfig",
    "RoundsResult",
    "client_drift",
    "fuse_round",
    "initial_global",
    "neuron_dislocation",
    "round_method",
    "run_rounds",
    "sample_clients",
    "train_local",
]
