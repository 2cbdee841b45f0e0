"""The round protocol (ALGORITHMS.md §12): calibrate, then align, then refit every layer
from input to output, as a plan of rounds and one step per round.

A plan (:func:`plan`) is a list of :class:`Round`: what each round asks every taking part
client for (statistics of the round's model in a mode, for some layers; nothing new, the
first layer derived from the input moments the targets carry; cross statistics of the
round's model and the client's own; refit statistics of one layer). :func:`advance` is
what the server does with one round's replies: the next model, and who takes part next.

The drivers only move bytes: the service (files over HTTP, :mod:`fusekit.service.rounds`),
the Flower strategy (query Messages, :mod:`fusekit.flower.strategy`) and the local driver
(every client's data at hand, :mod:`fusekit.toolkit.local`) each ask
the taking part clients for what the round asks, collect the replies that pass their
screening, and call :func:`advance` when the round ends (every participant answered, or
the driver stops waiting). One rule for a client that did not answer, in every kind of
round: the round proceeds with those that did (a calibration pools their statistics; an
alignment re-fuses them, and only they take part from then on; a refit fits each fused
neuron to the answering clients' neurons matched into it, a neuron none of them was
matched into keeping its weights). A round that asks for something cannot proceed
without any usable reply, nor an alignment round with fewer than the state's
``min_fused``.

Torch-free: the steps are :func:`fusekit.calibrate`, :func:`fusekit.align` and
:func:`fusekit.refit`; the forward passes that compute the replies live in the toolkit.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from fusekit import calibration
from fusekit.core.checkpoint import Checkpoint, load_checkpoint
from fusekit.core.cross_stats import DEFAULT_RIDGE
from fusekit.core.errors import ParameterError, StatisticsError
from fusekit.core.model_spec import fused_spec
from fusekit.core.stats import DEFAULT_MIN_SAMPLES, Statistics, load_statistics
from fusekit.core.transformer import TransformerSpec
from fusekit.methods.base import FusionResult
from fusekit.methods.calibration import calibration_layers

STATISTICS, DERIVED, CROSS, REFIT = "statistics", "derived", "cross", "refit"
#: How calibration asks for statistics: one round with every BatchNorm normalised by the
#: client's batch statistics (approximate), or one round per calibrated layer, input to
#: output, each on the model calibrated so far (exact).
CALIBRATIONS = ("one-pass", "layerwise")
#: The one-pass round's mode: each BatchNorm normalised with the batch's statistics, so
#: that one round calibrates every layer (a transformer has no BatchNorm: eval).
ONE_PASS_MODE = "batch"
#: What each kind of round's step reports under (``FusionResult.report``).
REPORTS = {STATISTICS: "calibration", DERIVED: "calibration", CROSS: "alignment",
           REFIT: "refit"}


@dataclass(frozen=True)
class Round:
    """One round: what it asks each taking part client for.

    Attributes:
        kind: ``statistics``, ``derived`` (asks nothing), ``cross`` or ``refit``.
        layers: the layers a calibration round calibrates (None: every one).
        mode: the mode of the statistics a calibration round asks for (``batch``, ``eval``).
        layer: the layer a refit round refits.
    """

    kind: str
    layers: tuple[str, ...] | None = None
    mode: str | None = None
    layer: str | None = None

    @property
    def asks(self) -> bool:
        """Whether the clients send anything (a derived round needs no reply)."""
        return self.kind != DERIVED

    @property
    def calibrates(self) -> bool:
        return self.kind in (STATISTICS, DERIVED)

    def as_dict(self) -> dict[str, Any]:
        """The round as JSON (the service's plan records it so)."""
        if self.calibrates:
            return {"kind": self.kind, "layers": None if self.layers is None
                    else list(self.layers), "mode": self.mode}
        return {"kind": self.kind, **({"layer": self.layer} if self.kind == REFIT else {})}

    @classmethod
    def from_dict(cls, record: Mapping[str, Any]) -> Round:
        layers = record.get("layers")
        return cls(record["kind"], None if layers is None else tuple(layers),
                   record.get("mode"), record.get("layer"))


def calibration_rounds(spec, calibration: str = "one-pass", *, repair: bool = False,
                       derive_first: bool = False, layers: Collection[str] | None = None,
                       order: Sequence[str] | None = None) -> list[Round]:
    """The rounds that calibrate a fused model of ``spec``: none when no layer needs it.

    Args:
        calibration: ``one-pass`` or ``layerwise`` (:data:`CALIBRATIONS`).
        repair: REPAIR's targets will be at hand (every hidden layer is calibrated).
        derive_first: layer by layer, the first layer comes from the input moments the
            targets carry, without a round that asks anything.
        layers: calibrate only these layers (by name: a transformer's points by module);
            default every one.
        order: a transformer's calibrated modules in the order its forward pass reaches
            them, as a client's statistics of it list their points: layer by layer, one
            round each in that order. The spec alone does not give it, so without it a
            transformer calibrates in one pass only.
    """
    if calibration not in CALIBRATIONS:
        raise ParameterError(f"calibration: expected one of {list(CALIBRATIONS)}, found "
                             f"{calibration!r}")
    chosen = None if layers is None else tuple(layers)
    if isinstance(spec, TransformerSpec):  # no BatchNorm; REPAIR of every MLP and LayerNorm
        if calibration == "one-pass":
            return [Round(STATISTICS, chosen, "eval")]
        if order is None:
            raise ParameterError(f"calibration {calibration!r}: a transformer calibrates in "
                                 "one pass (one-pass), or layer by layer in the order its "
                                 "forward pass reaches its points (order)")
        names, first = list(order), None
    else:
        names, first = calibration_layers(spec, repair=repair), spec.layers[0].name
        if not names:
            return []
        if calibration == "one-pass":
            return [Round(STATISTICS, chosen, ONE_PASS_MODE)]
    return [Round(DERIVED if derive_first and name == first else STATISTICS, (name,), "eval")
            for name in names if chosen is None or name in chosen]


def plan(spec, *, calibration: str = "one-pass", repair: bool = False,
         derive_first: bool = False, alignment_rounds: int = 0,
         refit: bool = True) -> list[Round]:
    """The whole protocol for a fused model of ``spec``: its calibration rounds
    (:func:`calibration_rounds`); then ``alignment_rounds`` alignment rounds, the result
    calibrated again between them; then, with ``refit``, one refit round per layer, input
    to output (without: a last calibration)."""
    calibrating = calibration_rounds(spec, calibration, repair=repair,
                                     derive_first=derive_first)
    if alignment_rounds and isinstance(spec, TransformerSpec):
        raise ParameterError("alignment rounds re-match the ReLU units of MLPs, CNNs and "
                             "ResNets and do not cover transformers' heads and streams")
    rounds = list(calibrating)
    for number in range(1, alignment_rounds + 1):
        rounds.append(Round(CROSS))
        if number < alignment_rounds or not refit:
            rounds.extend(calibrating)
    if alignment_rounds and refit:
        rounds.extend(Round(REFIT, layer=layer.name) for layer in spec.layers)
    return rounds


@dataclass
class State:
    """Where a run of the protocol stands.

    Attributes:
        plan: the rounds, in order.
        model: the current round's model (the clients compute their replies of it).
        clients: each client's own model (one of the fusion's inputs), by the driver's key
            (a client's name, a node id, an index).
        participants: who takes part in the current round, in the driver's order.
        targets: REPAIR's targets by key: clients' statistics of their own models.
        index: the current round's index in ``plan`` (``len(plan)``: done).
        result: the last step's result (None before the first).
        history: per round done, who answered, who did not, and the step's report.
        min_fused: the fewest clients an alignment round re-fuses (>= 1).
        paired: REPAIR may read each fused neuron on the data of the clients matched into
            it where every participant's statistics pair with its targets.
    """

    plan: list[Round]
    model: Checkpoint
    clients: Mapping[Hashable, Any]
    participants: list[Hashable]
    targets: Mapping[Hashable, Any] = field(default_factory=dict)
    index: int = 0
    result: FusionResult | None = None
    history: list[dict[str, Any]] = field(default_factory=list)
    min_fused: int = 1
    min_samples: int = DEFAULT_MIN_SAMPLES
    ridge: float = DEFAULT_RIDGE
    paired: bool = True

    @property
    def round(self) -> Round:
        return self.plan[self.index]

    @property
    def done(self) -> bool:
        return self.index >= len(self.plan)

    def where(self) -> str:
        return f"round {self.index + 1} of {len(self.plan)} ({self.round.kind})"


def start(model: Checkpoint | str, rounds: Sequence[Round], clients: Mapping[Hashable, Any],
          **options: Any) -> State:
    """A run of ``rounds`` on ``model`` with every client in ``clients`` taking part."""
    model = model if isinstance(model, Checkpoint) else load_checkpoint(model)
    return State(list(rounds), model, clients, list(clients), **options)


def advance(state: State, replies: Mapping[Hashable, Any]) -> State:
    """The server's step of the current round: the next state, from the usable
    ``replies`` (by key; those of clients not taking part are ignored).

    Raises:
        StatisticsError: no usable reply (an alignment round: fewer than
            ``state.min_fused``), or replies that :func:`fusekit.calibrate` / ``align`` /
            ``refit`` refuse.
    """
    round_ = state.round
    answered = [key for key in state.participants if key in replies]
    if round_.asks and not answered:
        raise StatisticsError(f"{state.where()}: no client sent usable statistics")
    if round_.kind == CROSS and len(answered) < state.min_fused:
        raise StatisticsError(f"{state.where()}: usable cross statistics from "
                              f"{len(answered)} client(s), fewer than the {state.min_fused} "
                              "an alignment re-fuses")
    result = _step(state, round_, answered, replies)
    missing = [key for key in state.participants if key not in answered] if round_.asks else []
    done = {"kind": round_.kind, "answered": answered, "missing": missing,
            REPORTS[round_.kind]: result.report[REPORTS[round_.kind]]}
    model = Checkpoint.from_state_dict(result.state_dict, result.metadata,
                                       source=state.model.label, config=result.config)
    return replace(state, model=model, index=state.index + 1, result=result,
                   participants=answered if round_.kind == CROSS else state.participants,
                   history=[*state.history, done])


def _step(state: State, round_: Round, answered: list[Hashable],
          replies: Mapping[Hashable, Any]) -> FusionResult:
    if round_.calibrates:
        targets = [state.targets[key] for key in state.participants if key in state.targets]
        statistics = [replies[key] for key in answered] if round_.asks else []
        paired = state.paired and bool(targets) and (
            not round_.asks or pairs(state.model, dict(zip(answered, statistics, strict=True)),
                                     {k: state.targets[k] for k in state.participants
                                      if k in state.targets}))
        return calibration.calibrate(state.model, statistics, targets=targets,
                             layers=None if round_.layers is None else list(round_.layers),
                             min_samples=state.min_samples, paired=paired)
    clients = [state.clients[key] for key in answered]
    statistics = [replies[key] for key in answered]
    if round_.kind == CROSS:
        return calibration.align(state.model, clients, statistics, min_samples=state.min_samples)
    return calibration.refit(state.model, clients, statistics, ridge=state.ridge,
                     min_samples=state.min_samples)


def pairs(model: Checkpoint, statistics: Mapping[Hashable, Any],
          targets: Mapping[Hashable, Any]) -> bool:
    """Whether REPAIR can read each fused neuron on its matched clients' data
    (:func:`fusekit.calibrate`'s ``paired``, ALGORITHMS §12): the clients that sent
    statistics of the fused network are those whose targets it has, each pair over the
    same number of inputs (its own data). Otherwise the statistics are pooled over every
    answering client's data."""
    if set(statistics) != set(targets) or isinstance(fused_spec(model), TransformerSpec):
        return False
    return all(_samples(statistics[key]) == _samples(targets[key]) for key in statistics)


def _samples(source: Any) -> int:
    stats = source if isinstance(source, Statistics) else load_statistics(source, min_samples=1)
    return stats.num_samples
