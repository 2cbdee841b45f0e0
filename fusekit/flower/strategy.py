"""``FusekitStrategy``: Flower's FedAvg whose aggregation is ``fusekit.fuse``.

Node sampling, configuration records, client-metric aggregation and the round loop
(``strategy.start``) are FedAvg's; only the step that turns the clients' models into the
global model changes. Each round is one call to :func:`fusekit.fuse` on the round's replies,
so a Flower round and a ``fusekit fuse`` run on the same models give the same model.

Rounds follow ``fusekit simulate --rounds`` (:func:`fusekit.toolkit.rounds.round_method`):
a method that rematches neurons (PFNM, NAFI, OT) fuses the first round that fuses; the
nodes then train that global model, whose neurons already correspond, and later rounds
average them (avg) at the fused width, which therefore stays as the first fusion set it;
with ``later_rounds="rematch"`` they fuse with the method again (PFNM and NAFI at the
global model's widths). Methods that keep the global model's coordinates (avg, Fed²) fuse every round.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Result

import fusekit
from fusekit.api import SpecLike, check_compatible, client_spec
from fusekit.core import metadata as meta
from fusekit.core.checkpoint import Checkpoint
from fusekit.core.errors import (
    CheckpointError,
    FusekitError,
    IncompatibleModelsError,
    ParameterError,
)
from fusekit.core.spec import PermutationSpec
from fusekit.methods import FusionResult
from fusekit.methods.avg import check_equal_shapes
from fusekit.methods.base import FusionMethod, get_method
from fusekit.methods.params import method_params, validate
from fusekit.toolkit.rounds import ENSEMBLES, EVERY_ROUND, round_method

from .records import (
    CLASS_COUNTS,
    arrays_to_state_dict,
    model_config,
    reply_checkpoint,
    state_dict_to_arrays,
)

log = logging.getLogger(__name__)

#: What fuses the rounds after a method that rematches neurons has fused one.
LATER_ROUNDS = ("avg", "rematch")


class FusekitStrategy(FedAvg):
    """One-shot model fusion (PFNM, NAFI, OT, AMS, Fed², averaging) as a Flower strategy.

    Args:
        method: a name from ``fusekit.METHODS``.
        params: the method's parameters (those of ``fusekit fuse --help``), e.g.
            ``{"width": 150}`` for PFNM; checked against the method's
            declaration when the strategy is built.
        spec: a permutation spec for models whose structure fusekit cannot infer.
        arch: the ``fusekit.arch`` of the initial model, for server-side evaluation before
            the first round (later rounds use the fused architecture).
        min_fused_replies: the fewest usable replies a round fuses; with fewer the round
            fails and the global model stays as it was.
        later_rounds: after a method that rematches neurons (PFNM, NAFI, OT) has fused a
            round, ``"avg"`` averages the later rounds (as ``fusekit simulate --rounds``);
            ``"rematch"`` fuses them with the method again, PFNM and NAFI at the global
            model's widths (``width`` replaces ``width_ratio``), so the width holds too.
        **fedavg: FedAvg's own arguments (``fraction_train``, ``min_train_nodes``,
            ``min_available_nodes``, ``weighted_by_key``, ...).

    Raises:
        UnknownMethodError: ``method`` is not registered.
        ParameterError: ``params`` do not match the method's declaration (names, types,
            choices, bounds), or give a per-client parameter one value per client; or
            ``min_fused_replies`` is not a positive integer.
    """

    def __init__(
        self,
        method: str = "pfnm",
        params: Mapping[str, Any] | None = None,
        *,
        spec: SpecLike | None = None,
        arch: Mapping[str, Any] | None = None,
        min_fused_replies: int = 2,
        later_rounds: str = "avg",
        **fedavg: Any,
    ) -> None:
        super().__init__(**fedavg)
        # A bad method or parameter fails now, not after the nodes have trained.
        self.fusion = get_method(method)
        self.params = dict(params or {})
        check_params(self.fusion, self.params)
        if isinstance(min_fused_replies, bool) or not (
                isinstance(min_fused_replies, int) and min_fused_replies >= 1):
            raise ParameterError(f"min_fused_replies: expected an integer >= 1, found "
                                 f"{min_fused_replies!r}")
        self.spec = spec
        self.min_fused_replies = min_fused_replies
        if later_rounds not in LATER_ROUNDS:
            raise ParameterError(f"later_rounds: expected one of {list(LATER_ROUNDS)}, found "
                                 f"{later_rounds!r}")
        self.later_rounds = later_rounds
        self.initial_metadata = {meta.ARCH: json.dumps(dict(arch))} if arch else {}
        self._begin()

    def _begin(self) -> None:
        """The state of a run that has not fused yet."""
        #: The global model's fusekit metadata (architecture, spec): rebuilds it anywhere.
        self.global_metadata: dict[str, str] = dict(self.initial_metadata)
        #: The last round's fusion, and why replies were left out of it (node id -> reason).
        self.last_fusion: FusionResult | None = None
        self.left_out: dict[int, str] = {}
        #: How many rounds of this run fused so far (failed rounds do not count).
        self.fused_rounds = 0

    @property
    def method(self) -> str:
        return self.fusion.name

    def summary(self) -> None:
        super().summary()
        log.info("fusekit: method %s, parameters %s, at least %d replies per round",
                 self.method, self.params, self.min_fused_replies)

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3,
              timeout: float = 3600, train_config: ConfigRecord | None = None,
              evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
              ) -> Result:
        """FedAvg's round loop. Afterwards ``result.arrays`` holds the global model even
        when no round fused (Flower's loop fills it only after a round that did): then it
        is ``initial_arrays``, the global model the nodes were sent.

        Raises:
            ParameterError: more than one round of a method whose result is an ensemble
                (AMS), which nodes cannot train.
        """
        if self.method in ENSEMBLES and num_rounds > 1:
            raise ParameterError(
                f"num_rounds: method {self.method!r} returns an ensemble of the nodes' "
                f"models, which nodes cannot train in a next round; expected 1, found "
                f"{num_rounds}")
        self._begin()  # a strategy started again starts from initial_arrays
        result = super().start(grid, initial_arrays, num_rounds, timeout, train_config,
                               evaluate_config, evaluate_fn)
        if len(result.arrays) == 0:
            log.warning("no round fused: the global model is the initial one")
            result.arrays = initial_arrays
        return result

    def round_fusion(self) -> tuple[FusionMethod, dict[str, Any]]:
        """The method and parameters of the next fusion: the strategy's own for its first
        fusion and for methods that fuse every round; after a method that rematches
        neurons, avg without parameters (:func:`fusekit.toolkit.rounds.round_method`) or,
        with ``later_rounds="rematch"``, the method at the global model's widths."""
        name = round_method(self.method, self.fused_rounds + 1)
        if name == self.method:
            return self.fusion, self.params
        if self.later_rounds == "rematch":
            return self.fusion, self._at_global_widths()
        return get_method(name), {}

    def _at_global_widths(self) -> dict[str, Any]:
        """The method's parameters with ``width`` set to the global model's hidden widths,
        for methods that take one (PFNM, NAFI); as they are for the others (OT)."""
        if "width" not in {spec.name for spec in method_params(self.fusion)}:
            return self.params
        params = {k: v for k, v in self.params.items() if k not in ("width", "width_ratio")}
        return {**params, "width": [int(w) for w in self.last_fusion.widths]}

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        return super().configure_train(server_round, arrays, self._with_global_model(config),
                                       grid)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        return super().configure_evaluate(server_round, arrays,
                                          self._with_global_model(config), grid)

    def _with_global_model(self, config: ConfigRecord) -> ConfigRecord:
        """``config`` plus what rebuilds the fused global model (nothing before a fusion)."""
        if self.last_fusion is None:
            return config
        return ConfigRecord({**config, **model_config(self.global_metadata,
                                                      self.last_fusion.widths)})

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Fuse the replies' models with ``fusekit.fuse``.

        The round's method is :meth:`round_fusion`'s (the strategy's own, or on the rounds
        after a method that rematches neurons avg, or the method again with
        ``later_rounds="rematch"``). Replies that carry an error or
        models that method cannot fuse are logged and left out (``self.left_out`` keeps the
        reasons). With fewer than ``min_fused_replies`` left the round fails:
        ``(None, None)``, and the global model stays as it was.

        Returns:
            The fused ArrayRecord (tensor names kept) and a MetricRecord with FedAvg's
            aggregate of the clients' metrics plus ``<method>.fused-widths`` (hidden widths,
            input to output), ``<method>.fuse-time-s``, ``<method>.fused-replies`` and
            ``<method>.left-out-replies``.

        Raises:
            FusekitError: the configured parameters do not suit the models.
        """
        replies = list(replies)
        fusion, params = self.round_fusion()
        usable, self.left_out = self.usable_replies(replies, fusion)
        for node, reason in self.left_out.items():
            log.warning("round %d: reply of node %d left out: %s", server_round, node, reason)
        if len(usable) < self.min_fused_replies:
            log.error("round %d: %d usable replies of %d, fewer than %d; round failed, the "
                      "global model is unchanged", server_round, len(usable), len(replies),
                      self.min_fused_replies)
            return None, None
        log.info("round %d: fusing %d models with %s", server_round, len(usable), fusion.name)
        start = time.perf_counter()
        result = fusekit.fuse([checkpoint for checkpoint, _ in usable], method=fusion.name,
                              spec=self.spec, **params)
        elapsed = time.perf_counter() - start
        self.last_fusion, self.global_metadata = result, dict(result.metadata)
        self.fused_rounds += 1
        log.info("round %d: %s fused %d models in %.2f s, hidden widths %s", server_round,
                 fusion.name, len(usable), elapsed, result.widths)
        return state_dict_to_arrays(result.state_dict), self._round_metrics(usable, result,
                                                                            elapsed)

    def _round_metrics(self, usable: list[tuple[Checkpoint, RecordDict]],
                       result: FusionResult, elapsed: float) -> MetricRecord:
        """FedAvg's aggregate of the clients' metrics plus the fusion's own."""
        metrics = self.train_metrics_aggr_fn([content for _, content in usable],
                                             self.weighted_by_key)
        metrics.pop(CLASS_COUNTS, None)  # an average of class counts means nothing
        metrics.update({
            f"{self.method}.fused-widths": [int(w) for w in result.widths],
            f"{self.method}.fuse-time-s": elapsed,
            f"{self.method}.fused-replies": len(usable),
            f"{self.method}.left-out-replies": len(self.left_out),
        })
        return metrics

    def usable_replies(
        self, replies: Iterable[Message], fusion: FusionMethod | None = None
    ) -> tuple[list[tuple[Checkpoint, RecordDict]], dict[int, str]]:
        """Split replies into (checkpoint, content) pairs ``fusion`` (the strategy's
        method if None) can fuse together, and the others' one-line reasons (those
        ``fusekit fuse`` gives), by node id."""
        fusion = fusion or self.fusion
        usable, reasons = {}, {}
        for reply in replies:
            node = reply.metadata.src_node_id
            if reply.has_error():
                reasons[node] = (f"the ClientApp failed (error {reply.error.code}: "
                                 f"{reply.error.reason})")
                continue
            try:
                checkpoint = reply_checkpoint(reply.content, f"node {node}",
                                              self.weighted_by_key)
                spec = client_spec(checkpoint, self.spec)
                fusion.check_client(checkpoint, spec)
            except FusekitError as exc:
                reasons[node] = str(exc)
                continue
            usable[node] = (checkpoint, spec, reply.content)
        if fusion.requires_same_architecture:
            reasons.update(self._other_architectures(usable, fusion.name in EVERY_ROUND))
        return ([(checkpoint, content) for node, (checkpoint, _, content) in usable.items()
                 if node not in reasons], reasons)

    @staticmethod
    def _other_architectures(
        usable: dict[int, tuple[Checkpoint, PermutationSpec, RecordDict]], same_shapes: bool
    ) -> dict[int, str]:
        """Why replies outside the most common architecture cannot join it, by node id;
        ``same_shapes``: every tensor's shape too (for methods that average coordinates)."""
        if not usable:
            return {}
        shapes = {node: (tuple(spec.structure()), tuple(sorted(checkpoint.tensors)),
                         tuple(info.shape for _, info in sorted(checkpoint.tensors.items()))
                         if same_shapes else ())
                  for node, (checkpoint, spec, _) in usable.items()}
        common = Counter(shapes.values()).most_common(1)[0][0]
        first, first_spec, _ = usable[next(n for n, shape in shapes.items() if shape == common)]
        reasons = {}
        for node, (checkpoint, spec, _) in usable.items():
            try:
                check_compatible([first, checkpoint], [first_spec, spec])
                if same_shapes:
                    check_equal_shapes([first, checkpoint])
            except IncompatibleModelsError as exc:
                reasons[node] = str(exc)
        return reasons

    def global_checkpoint(self, arrays: ArrayRecord) -> Checkpoint:
        """The global model (``result.arrays``) as a fusekit checkpoint, with its (fused)
        architecture.

        Raises:
            CheckpointError: ``arrays`` is empty.
        """
        if len(arrays) == 0:
            raise CheckpointError(
                "global model: the ArrayRecord is empty; expected the global model's tensors "
                "(strategy.start(...).arrays holds them after any run)")
        return Checkpoint.from_state_dict(arrays_to_state_dict(arrays), self.global_metadata,
                                          source="global model")

    def evaluate_fn(self, dataset: Any, device: str = "cpu"
                    ) -> Callable[[int, ArrayRecord], MetricRecord]:
        """Server-side evaluation for ``strategy.start(evaluate_fn=...)``: the global model,
        rebuilt with its fused widths as ``fusekit.load_fused`` does, scored on
        ``dataset``'s test split (a :class:`fusekit.toolkit.data.Dataset`).

        The MetricRecord holds ``accuracy``, ``loss`` and ``hidden-widths``.
        """
        from fusekit.toolkit.evaluate import Evaluator

        evaluator = Evaluator(dataset, device)

        def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
            checkpoint, logits = evaluator.logits(self.global_checkpoint(arrays))
            score = evaluator.score(logits, f"round {server_round}", "fused", self.method)
            widths = [int(w) for w in (self.last_fusion.widths if self.last_fusion else
                                       client_spec(checkpoint, self.spec).hidden_widths)]
            log.info("round %d: global model accuracy %.4f (hidden widths %s)",
                     server_round, score.accuracy, widths)
            return MetricRecord({"accuracy": score.accuracy, "loss": score.loss,
                                 "hidden-widths": widths})

        return evaluate


def check_params(fusion: FusionMethod, params: Mapping[str, Any]) -> None:
    """``params`` against the method's declaration, as ``fusekit.fuse`` checks them; a
    per-client parameter takes one value here, since which nodes reply, and in what order,
    changes from round to round."""
    declared = method_params(fusion)
    validate(fusion.name, declared, dict(params))
    for spec in declared:
        value = params.get(spec.name)
        if spec.per_client and isinstance(value, Sequence) and not isinstance(value, str):
            raise ParameterError(
                f"{spec.name}: expected one value for every node of a federation, found "
                f"{len(value)} values {list(value)!r:.80}"
            )
