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
global model's widths). Methods that keep the global model's coordinates (avg, Fed²)
fuse every round.

With ``calibrate=True`` each fused model is calibrated before it becomes the round's
global model (ALGORITHMS.md §12): query rounds, no training, send it to the nodes whose
models were fused; each replies with per-channel statistics of it on its own data
(:func:`fusekit.flower.statistics_reply`) and :func:`fusekit.calibrate` pools them. Where
every fused node's train reply also carried its statistics of its own model
(``train_reply(..., statistics_inputs=...)``) and the fusion recorded which node neurons
went into each fused neuron, those are REPAIR's targets: every hidden layer is calibrated,
those without BatchNorm too, each fused neuron read on the data of the nodes matched into
it (paired REPAIR) when every node answered over the inputs of its targets.

With ``alignment_rounds=N`` the calibrated fusion is then re-matched to the nodes by
activations and refit layer by layer (ALGORITHMS.md §12), in more query rounds: N
alignment rounds (each node sends its cross statistics of the current model and the model
it trained, :func:`fusekit.align` re-fuses; between rounds the result is calibrated), then
one refit round per layer (each node sends the layer's moments, :func:`fusekit.refit`
refits it with the nodes that answered). The rounds are :mod:`fusekit.protocol`'s plan and
steps, which the service and :func:`fusekit.toolkit.local.align_locally` (every
client's data at hand) run too; the strategy only moves the queries and replies.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Result

import fusekit
from fusekit import protocol
from fusekit.core import metadata as meta
from fusekit.core.checkpoint import Checkpoint
from fusekit.core.cross_stats import (
    CrossStatistics,
    RefitStatistics,
    check_cross_statistics,
    check_refit_statistics,
)
from fusekit.core.errors import (
    CheckpointError,
    FusekitError,
    IncompatibleModelsError,
    ParameterError,
    StatisticsError,
)
from fusekit.core.model_spec import (
    SpecLike,
    check_compatible,
    client_spec,
    fused_spec,
    input_points,
)
from fusekit.core.spec import PermutationSpec
from fusekit.core.stats import DEFAULT_MIN_SAMPLES, Statistics, check_statistics, statistic_points
from fusekit.methods import FusionResult
from fusekit.methods.alignment import cross_points, layer_inputs
from fusekit.methods.avg import check_equal_shapes
from fusekit.methods.base import FusionMethod, get_method
from fusekit.methods.params import method_params, validate
from fusekit.toolkit.rounds import ENSEMBLES, EVERY_ROUND, round_method

from .records import (
    CLASS_COUNTS,
    STATISTICS_QUERY,
    STATS_ARRAYS,
    arrays_to_state_dict,
    model_config,
    reply_checkpoint,
    reply_statistics,
    reply_targets,
    state_dict_to_arrays,
    statistics_query,
)

log = logging.getLogger(__name__)
T = TypeVar("T")
#: How a SuperNode words the exception a ClientApp raised, in its error reply's reason:
#: ``<class 'FileNotFoundError'>:<'[Errno 2] No such file or directory: ...'>``.
RAISED = re.compile(r"<class '(?:[\w.]+\.)?(\w+)'>:<'(.*)'>", re.S)

#: What fuses the rounds after a method that rematches neurons has fused one.
LATER_ROUNDS = ("avg", "rematch")
#: How calibration queries the nodes: one round per calibrated layer, each with the layers
#: below already calibrated (exact), or one round with every BatchNorm normalised by the
#: node's batch statistics (approximate): the protocol's calibrations.
CALIBRATION_ROUNDS = protocol.CALIBRATIONS


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
        preprocess: the ``fusekit.preprocess`` of the initial model (``{"mean": [...],
            "std": [...]}``, or a :class:`~fusekit.core.metadata.Normalization`): the
            normalisation it applies to inputs as stored, for server-side evaluation before
            the first round (later rounds use the fused model's, which its nodes record).
        min_fused_replies: the fewest usable replies a round fuses; with fewer the round
            fails and the global model stays as it was.
        later_rounds: after a method that rematches neurons (PFNM, NAFI, OT) has fused a
            round, ``"avg"`` averages the later rounds (as ``fusekit simulate --rounds``);
            ``"rematch"`` fuses them with the method again, PFNM and NAFI at the global
            model's widths (``width`` replaces ``width_ratio``), so the width holds too.
        calibrate: calibrate every fused model with the statistics the nodes whose models
            it fused compute on their own data (query rounds after the fusion; the
            ClientApp answers them with ``statistics_reply``): BatchNorm layers get the
            pooled statistics. Layers without BatchNorm are renormalised to REPAIR's
            targets when every fused node's train reply carried its statistics of its own
            model (``train_reply(..., statistics_inputs=...)``) and the method recorded its
            assignments (PFNM, NAFI, OT, re-basin, avg); else they are left as they are.
        calibration_rounds: ``"one-pass"`` (default: one query round, each BatchNorm
            normalised by the node's batch statistics) or ``"layerwise"`` (one query round
            per calibrated layer, input to output: exact, one network round trip each).
        calibration_min_samples: refuse a node's statistics over fewer inputs (they come
            close to revealing them).
        alignment_rounds: after calibrating (needs ``calibrate=True``), this many alignment
            rounds (0: none, the default): each fused node answers with its cross
            statistics of the current model and the model it trained
            (``statistics_reply(..., own_model=...)``) and :func:`fusekit.align` re-matches
            and re-fuses the nodes whose statistics are usable; between rounds the result
            is calibrated.
        refit: after the last alignment round, refit every layer, input to output, one
            query round each (:func:`fusekit.refit`, ridge 0.1, with the nodes that
            answered); ``False`` calibrates it instead.
        **fedavg: FedAvg's own arguments (``fraction_train``, ``min_train_nodes``,
            ``min_available_nodes``, ``weighted_by_key``, ...).

    Raises:
        UnknownMethodError: ``method`` is not registered.
        ParameterError: ``params`` do not match the method's declaration (names, types,
            choices, bounds), or give a per-client parameter one value per client;
            ``preprocess`` is no normalisation;
            ``min_fused_replies`` is not a positive integer; calibration settings out of
            range, or ``calibrate`` with a method whose result is an ensemble (AMS).
    """

    def __init__(
        self,
        method: str = "pfnm",
        params: Mapping[str, Any] | None = None,
        *,
        spec: SpecLike | None = None,
        arch: Mapping[str, Any] | None = None,
        preprocess: Mapping[str, Any] | meta.Normalization | None = None,
        min_fused_replies: int = 2,
        later_rounds: str = "avg",
        calibrate: bool = False,
        calibration_rounds: str = "one-pass",
        calibration_min_samples: int = DEFAULT_MIN_SAMPLES,
        alignment_rounds: int = 0,
        refit: bool = True,
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
        self._set_calibration(calibrate, calibration_rounds, calibration_min_samples)
        self._set_alignment(alignment_rounds, refit)
        self.initial_metadata = {meta.ARCH: json.dumps(dict(arch))} if arch else {}
        if preprocess is not None:
            self.initial_metadata[meta.PREPROCESS] = _normalization(preprocess).to_json()
        self._begin()

    def _set_calibration(self, calibrate: bool, rounds: str, min_samples: int) -> None:
        if not isinstance(calibrate, bool):
            raise ParameterError(f"calibrate: expected true or false, found {calibrate!r}")
        if calibrate and self.method in ENSEMBLES:
            raise ParameterError(f"calibrate: method {self.method!r} returns an ensemble of "
                                 "the nodes' models, which calibration does not cover")
        if rounds not in CALIBRATION_ROUNDS:
            raise ParameterError(f"calibration_rounds: expected one of "
                                 f"{list(CALIBRATION_ROUNDS)}, found {rounds!r}")
        if isinstance(min_samples, bool) or not (isinstance(min_samples, int)
                                                 and min_samples >= 1):
            raise ParameterError(f"calibration_min_samples: expected an integer >= 1, found "
                                 f"{min_samples!r}")
        self.calibrate = calibrate
        self.calibration_rounds = rounds
        self.calibration_min_samples = min_samples

    def _set_alignment(self, rounds: int, refit: bool) -> None:
        if isinstance(rounds, bool) or not isinstance(rounds, int) or not 0 <= rounds <= 100:
            raise ParameterError(f"alignment_rounds: expected an integer in [0, 100], found "
                                 f"{rounds!r}")
        if rounds and not self.calibrate:
            raise ParameterError("alignment_rounds: needs calibrate=True (an alignment round "
                                 "matches the nodes to the calibrated fusion)")
        if not isinstance(refit, bool):
            raise ParameterError(f"refit: expected true or false, found {refit!r}")
        self.alignment_rounds = rounds
        self.refit = refit

    def _begin(self) -> None:
        """The state of a run that has not fused yet."""
        #: The global model's fusekit metadata (architecture, spec): rebuilds it anywhere.
        self.global_metadata: dict[str, str] = dict(self.initial_metadata)
        #: The last round's fusion, and why replies were left out of it (node id -> reason).
        self.last_fusion: FusionResult | None = None
        self.left_out: dict[int, str] = {}
        #: The nodes' models the last round fused, by node id (as their replies sent them).
        self.fused_models: dict[int, Checkpoint] = {}
        #: How many rounds of this run fused so far (failed rounds do not count).
        self.fused_rounds = 0
        #: Why nodes' statistics were left out of the last calibration (node id -> reason).
        self.left_out_statistics: dict[int, str] = {}
        #: Why nodes' statistics of their own models (REPAIR's targets) were not usable in
        #: the last calibration (node id -> reason).
        self.left_out_targets: dict[int, str] = {}
        #: Why nodes' cross or refit statistics were left out of the last alignment
        #: (node id -> reason).
        self.left_out_alignment: dict[int, str] = {}
        #: The Grid of the round being run (calibration queries the nodes through it).
        self._grid: Grid | None = None
        #: The global model sent to the nodes for the round being run, and the messages.
        self._sent: ArrayRecord | None = None
        self._train_messages: list[Message] = []
        self._timeout = 3600.0

    @property
    def method(self) -> str:
        return self.fusion.name

    def summary(self) -> None:
        super().summary()
        log.info("fusekit: method %s, parameters %s, at least %d replies per round, "
                 "calibration %s%s", self.method, self.params, self.min_fused_replies,
                 f"{self.calibration_rounds} (at least {self.calibration_min_samples} inputs "
                 "per node)" if self.calibrate else "off",
                 f", {self.alignment_rounds} alignment round(s)"
                 f"{' and refit rounds' if self.refit else ''}" if self.alignment_rounds
                 else "")

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
        self._timeout = timeout
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
        self._grid = grid  # aggregate_train, which calibrates, is not given it
        self._sent = arrays  # the global model the nodes train: its architecture wins ties
        # Kept: pushing them gives them the ids the SuperLink's answers for stopped nodes name.
        self._train_messages = list(super().configure_train(
            server_round, arrays, self._with_global_model(config), grid))
        return self._train_messages

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
            aggregate of the clients' metrics plus, named by the round's method (``avg``
            on the rounds it averages), ``<method>.fused-widths`` (hidden widths, input to
            output), ``<method>.fuse-time-s``, ``<method>.fused-replies`` and
            ``<method>.left-out-replies``.

        Raises:
            FusekitError: the configured parameters do not suit the models.
        """
        replies = list(replies)
        fusion, params = self.round_fusion()
        asked = sent_to(self._train_messages)
        usable, self.left_out = self.usable_replies(replies, fusion, asked)
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
        log.info("round %d: %s fused %d models in %.2f s, hidden widths %s", server_round,
                 fusion.name, len(usable), elapsed, result.widths)
        calibration = {}
        fused_nodes = [node for node in (reply_node(reply, asked) for reply in replies)
                       if node not in self.left_out]
        fused_replies = dict(zip(fused_nodes, usable, strict=True))
        self.fused_models = {node: checkpoint for node, (checkpoint, _) in fused_replies.items()}
        if self.calibrate:
            targets = self.repair_targets(server_round, result, fused_replies)
            result, calibration = self.calibrated(server_round, result, fused_nodes, targets)
        self.last_fusion, self.global_metadata = result, dict(result.metadata)
        self.fused_rounds += 1
        metrics = self._round_metrics(fusion.name, usable, result, elapsed)
        metrics.update({f"{fusion.name}.{key}": value for key, value in calibration.items()})
        return state_dict_to_arrays(result.state_dict), metrics

    def _round_metrics(self, method: str, usable: list[tuple[Checkpoint, RecordDict]],
                       result: FusionResult, elapsed: float) -> MetricRecord:
        """FedAvg's aggregate of the clients' metrics plus the fusion's own, named by the
        round's ``method``."""
        metrics = self.train_metrics_aggr_fn([content for _, content in usable],
                                             self.weighted_by_key)
        metrics.pop(CLASS_COUNTS, None)  # an average of class counts means nothing
        metrics.update({
            f"{method}.fused-widths": [int(w) for w in result.widths],
            f"{method}.fuse-time-s": elapsed,
            f"{method}.fused-replies": len(usable),
            f"{method}.left-out-replies": len(self.left_out),
        })
        return metrics

    def repair_targets(self, server_round: int, fused: FusionResult,
                       replies: Mapping[int, tuple[Checkpoint, RecordDict]]
                       ) -> list[Statistics]:
        """REPAIR's targets: the fused nodes' statistics of their own models (``replies``:
        each fused node's model and train reply), each screened against that node's model
        (content hash, points and widths, counts, finite non-negative variances, at least
        ``calibration_min_samples`` inputs).

        All or none: empty when no node sent any, when the fusion recorded no assignments
        (no client neuron maps to a fused one: Fed²), or when any fused node's are
        missing or unusable (each such node logged in one line and kept in
        ``self.left_out_targets``; a fused neuron matched only to its neurons would have
        no target). Layers without BatchNorm are then left as they are.
        """
        self.left_out_targets = {}
        if not any(STATS_ARRAYS in content.array_records for _, content in replies.values()):
            return []
        if meta.ASSIGNMENTS not in fused.metadata:
            log.info("round %d: the %s fusion recorded no assignments of the nodes' neurons: "
                     "their statistics of their own models (REPAIR's targets) are not used",
                     server_round, fused.method)
            return []
        targets: dict[int, Statistics] = {}
        for node, (checkpoint, content) in replies.items():
            try:
                own = reply_targets(content, f"node {node}")
                if own is None:
                    raise StatisticsError(
                        f"node {node}: no statistics of its own model in its train reply "
                        "(train_reply(..., statistics_inputs=...))")
                spec = client_spec(checkpoint, self.spec)
                check_statistics(own, model=checkpoint.content_hash,
                                 points=statistic_points(spec),
                                 min_samples=self.calibration_min_samples,
                                 inputs=input_points(checkpoint, spec))
                targets[node] = own
            except FusekitError as exc:
                self.left_out_targets[node] = str(exc)
        for node, reason in self.left_out_targets.items():
            log.warning("round %d: REPAIR targets of node %d unusable: %s", server_round, node,
                        reason)
        if self.left_out_targets:
            log.warning("round %d: REPAIR targets from %d of %d fused nodes: layers without "
                        "BatchNorm are left as they are", server_round, len(targets),
                        len(replies))
            return []
        return [targets[node] for node in replies]

    def calibrated(self, server_round: int, fused: FusionResult, nodes: Sequence[int],
                   targets: Sequence[Statistics] = ()) -> tuple[FusionResult, dict[str, Any]]:
        """``fused`` calibrated with the statistics ``nodes`` compute of it on their own data
        and, with ``alignment_rounds``, re-matched to the nodes by activations and refit:
        the rounds of :func:`fusekit.protocol.plan`, each a query round through the round's
        Grid (a layer derived from the nodes' input moments none), each step
        :func:`fusekit.protocol.advance` on the usable replies, as
        :func:`fusekit.toolkit.local.align_locally` steps with the data at hand.

        Calibration (``calibration_rounds``: one pass, or one round per calibrated layer):
        with ``targets`` (:meth:`repair_targets`) every hidden layer, else the BatchNorm
        ones; a model without BatchNorm is returned as it is, without a query, unless there
        are targets. Replies are screened as ``fusekit calibrate``, ``align`` and ``refit``
        screen files (another model, other points or widths, too few inputs, non-finite
        moments, ...); a reply that fails is logged and left out
        (``self.left_out_statistics``, ``self.left_out_alignment``), and the round goes on
        with the others (the protocol's rule): an alignment round re-fuses the nodes that
        answered (at least ``min_fused_replies``), who alone take part from then on; a refit
        round refits with them. A calibration round without any usable reply leaves the
        round's global model the uncalibrated fusion; a later round that cannot go on, the
        calibrated fusion (each logged as an error).

        Returns:
            The model, and the round's metrics: ``calibrated`` (1 or 0),
            ``calibration-rounds`` (query rounds), ``calibration-nodes`` (the nodes whose
            statistics were pooled in the last one), ``calibration-samples``,
            ``calibration-time-s``, ``calibration-repair`` (1 with targets),
            ``calibration-paired`` (1 when REPAIR read every fused neuron on its matched
            nodes' data in every round: :func:`fusekit.protocol.pairs`); with alignment
            rounds ``aligned`` (1 or 0), ``alignment-rounds``, ``refit-rounds``,
            ``alignment-nodes``, ``alignment-correlation`` (the last round's mean matched
            correlation), ``alignment-time-s``.
        """
        if self._grid is None:
            raise ParameterError("calibrate: the strategy queries the nodes through the "
                                 "round's Grid; run it with strategy.start(grid=...)")
        started = time.perf_counter()
        current = Checkpoint.from_state_dict(fused.state_dict, fused.metadata,
                                             source=f"round {server_round}'s fusion")
        spec = fused_spec(current)
        derive = bool(targets) and all(t.inputs for t in targets)
        calibrating = protocol.calibration_rounds(spec, self.calibration_rounds,
                                                  repair=bool(targets), derive_first=derive)
        state = protocol.start(
            current, protocol.plan(spec, calibration=self.calibration_rounds,
                                   repair=bool(targets), derive_first=derive,
                                   alignment_rounds=self.alignment_rounds, refit=self.refit),
            {node: self.fused_models[node] for node in nodes},
            targets=dict(zip(nodes, targets, strict=True)) if targets else {},
            min_fused=self.min_fused_replies, min_samples=self.calibration_min_samples)
        self.left_out_statistics, self.left_out_alignment = {}, {}
        state, error = self._run(server_round, state, len(calibrating))
        if error is not None:
            log.error("round %d: calibration failed: %s; the global model is the "
                      "uncalibrated fusion", server_round, error)
            return fused, {"calibrated": 0, "calibration-rounds": state.index + 1,
                           **({"aligned": 0} if self.alignment_rounds else {})}
        if calibrating:
            result, metrics = self._calibration_done(server_round, fused, state, calibrating,
                                                     time.perf_counter() - started)
        else:
            log.info("round %d: the fused model has no BatchNorm layer and no REPAIR targets: "
                     "nothing to calibrate", server_round)
            result, metrics = fused, {"calibrated": 0, "calibration-rounds": 0}
        if self.alignment_rounds:
            result, alignment = self._aligned(server_round, result, state)
            metrics.update(alignment)
        return result, metrics

    def _run(self, server_round: int, state: protocol.State, until: int
             ) -> tuple[protocol.State, FusekitError | None]:
        """The rounds of ``state`` up to index ``until``: the last state, and why a round
        could not go on (None if every one did)."""
        while state.index < until:
            replies = self._replies(server_round, state) if state.round.asks else {}
            try:
                state = protocol.advance(state, replies)
            except FusekitError as exc:
                return state, exc
        return state, None

    def _replies(self, server_round: int, state: protocol.State) -> dict[int, Any]:
        """The current round's query to its participants: their usable replies by node."""
        round_ = state.round
        if round_.calibrates:
            return self._query_statistics(server_round, state.model, round_.mode,
                                          state.participants)
        number = 1 + sum(r.kind == round_.kind for r in state.plan[:state.index])
        total = sum(r.kind == round_.kind for r in state.plan)
        what = (f"alignment query {number} of {total}" if round_.kind == protocol.CROSS
                else f"refit query {number} of {total} (layer {round_.layer})")
        return self._query_alignment(server_round, state.participants, what, state.model,
                                     state.clients, round_.layer)

    def _calibration_done(self, server_round: int, fused: FusionResult, state: protocol.State,
                          rounds: Sequence[protocol.Round], elapsed: float
                          ) -> tuple[FusionResult, dict[str, Any]]:
        """The calibrated fusion with its record, and the calibration's metrics."""
        result = state.result
        queries = sum(r.asks for r in rounds)
        report = result.report["calibration"]
        report.update(rounds=queries, layers="all")
        result.metadata[meta.CALIBRATION] = json.dumps(report)
        result.widths = fused.widths
        paired = all(done["calibration"]["paired"] for done in state.history)
        log.info("round %d: calibrated with the statistics of %d node(s) over %d inputs "
                 "(%s, %d query round(s)%s) in %.2f s%s", server_round, report["clients"],
                 report["samples"], self.calibration_rounds, queries,
                 ", the first layer from the nodes' input moments" if queries < len(rounds)
                 else "", elapsed,
                 f", REPAIR targets of every layer without BatchNorm "
                 f"({'paired' if paired else 'pooled'})" if report["repair"] else "")
        return result, {"calibrated": 1, "calibration-rounds": queries,
                        "calibration-nodes": report["clients"],
                        "calibration-samples": report["samples"],
                        "calibration-time-s": elapsed,
                        "calibration-repair": int(report["repair"]),
                        "calibration-paired": int(paired)}

    def _query_statistics(self, server_round: int, model: Checkpoint, mode: str,
                          nodes: Sequence[int]) -> dict[int, Statistics]:
        """One calibration query round: ``model`` to ``nodes``, their usable statistics
        back, by node id."""
        spec = fused_spec(model)
        stats, reasons = self._query(
            server_round, nodes, f"statistics query ({mode} mode)",
            statistics_query(model.state_dict(), model.metadata, spec.hidden_widths, mode),
            lambda replies, asked: self.usable_statistics(
                replies, model.content_hash, statistic_points(spec), mode, asked))
        for node, reason in reasons.items():
            log.warning("round %d: statistics of node %d left out: %s", server_round, node,
                        reason)
        self.left_out_statistics.update(reasons)
        return stats

    def _query(self, server_round: int, nodes: Sequence[int], what: str, content: RecordDict,
               screen: Callable[[list[Message], Mapping[str, int]],
                                tuple[dict[int, T], dict[int, str]]]
               ) -> tuple[dict[int, T], dict[int, str]]:
        """One query round: ``content`` to ``nodes``; their replies ``screen``ed, with the
        node each message went to by message id, into the usable ones and the others'
        reasons (a node that stopped, or did not answer within the round's timeout, among
        them), by node id."""
        messages = [Message(content, dst_node_id=node, message_type=STATISTICS_QUERY)
                    for node in nodes]
        log.info("round %d: %s to %d node(s)", server_round, what, len(messages))
        replies = list(self._grid.send_and_receive(messages, timeout=self._timeout))
        usable, reasons = screen(replies, sent_to(messages))
        for node in nodes:
            if node not in usable and node not in reasons:
                reasons[node] = f"no reply within the round's timeout ({self._timeout:g} s)"
        return usable, reasons

    def _aligned(self, server_round: int, calibrated: FusionResult, state: protocol.State
                 ) -> tuple[FusionResult, dict[str, Any]]:
        """The alignment and refit rounds from ``state`` on: the model (``calibrated`` when
        a round cannot go on), and the alignment metrics."""
        started, first = time.perf_counter(), len(state.history)
        state, error = self._run(server_round, state, len(state.plan))
        done = state.history[first:]
        metrics = {"aligned": 0,
                   "alignment-rounds": sum(d["kind"] == protocol.CROSS for d in done),
                   "refit-rounds": sum(d["kind"] == protocol.REFIT for d in done)}
        if error is not None:
            log.error("round %d: alignment stopped: %s; the global model is the calibrated "
                      "fusion", server_round, error)
            return calibrated, metrics
        result = state.result
        correlation = [d["alignment"]["mean_correlation"] for d in done
                       if d["kind"] == protocol.CROSS]
        result.widths = calibrated.widths
        result.metadata[meta.ALIGNMENT] = json.dumps(
            {"rounds": self.alignment_rounds, "refit": self.refit,
             "mean_correlation": correlation})
        metrics.update({"aligned": 1, "alignment-nodes": len(state.participants),
                        "alignment-correlation": correlation[-1],
                        "alignment-time-s": time.perf_counter() - started})
        log.info("round %d: aligned to %d node(s) in %d alignment and %d refit round(s), "
                 "mean matched correlation %.4f, in %.2f s", server_round,
                 len(state.participants), metrics["alignment-rounds"], metrics["refit-rounds"],
                 metrics["alignment-correlation"], metrics["alignment-time-s"])
        return result, metrics

    def _query_alignment(self, server_round: int, nodes: Sequence[int], what: str,
                         model: Checkpoint, models: Mapping[int, Checkpoint],
                         layer: str | None) -> dict[int, CrossStatistics | RefitStatistics]:
        """One alignment (``layer`` None) or refit query round: each node's statistics of
        ``model`` and its own model in ``models``, screened; the others logged and kept in
        ``self.left_out_alignment``."""
        spec = fused_spec(model)
        kind = "cross" if layer is None else "refit"
        content = statistics_query(model.state_dict(), model.metadata, spec.hidden_widths,
                                   "eval", kind, layer)
        stats, reasons = self._query(
            server_round, nodes, what, content,
            lambda replies, asked: screen_replies(
                replies, lambda node, reply: self._node_statistics(
                    node, reply, model, spec, models[node], layer), asked))
        for node, reason in reasons.items():
            log.warning("round %d: %s statistics of node %d left out: %s", server_round, kind,
                        node, reason)
        self.left_out_alignment.update(reasons)
        return stats

    def _node_statistics(self, node: int, content: RecordDict, model: Checkpoint, spec: Any,
                         own: Checkpoint, layer: str | None
                         ) -> CrossStatistics | RefitStatistics:
        """A node's cross (``layer`` None) or refit statistics, checked as ``fusekit align``
        and ``fusekit refit`` check files: against ``model`` and the node's ``own``."""
        own_spec = client_spec(own, self.spec)
        stats = reply_statistics(content, f"node {node}", "cross" if layer is None else "refit")
        if layer is None:
            check_cross_statistics(stats, reference=model.content_hash,
                                   models={own.content_hash: cross_points(own_spec)},
                                   widths=cross_points(spec),
                                   min_samples=self.calibration_min_samples)
            return stats
        check_refit_statistics(
            stats, reference=model.content_hash,
            models={own.content_hash: {item.name: item.out_features for item in own_spec.layers}},
            inputs=layer_inputs(spec), min_samples=self.calibration_min_samples)
        if stats.layer != layer:
            raise StatisticsError(f"node {node}: refit statistics of layer {stats.layer!r}; "
                                  f"the query asked for {layer!r}")
        return stats

    def usable_statistics(self, replies: Iterable[Message], model: str,
                          points: Mapping[str, int], mode: str,
                          asked: Mapping[str, int] | None = None
                          ) -> tuple[dict[int, Statistics], dict[int, str]]:
        """Split statistics replies into those calibration pools (by node id) and the
        others' one-line reasons: an error, malformed records, statistics of another model
        (``model``: its content hash) or other ``points``, in another ``mode``, over fewer
        than ``calibration_min_samples`` inputs, or with values ``fusekit calibrate``
        refuses (negative or non-finite variances, ...). ``asked``: see
        :func:`screen_replies`."""

        def parse(node: int, content: RecordDict) -> Statistics:
            stats = reply_statistics(content, f"node {node}")
            check_statistics(stats, model=model, points=points,
                             min_samples=self.calibration_min_samples)
            if stats.mode != mode:
                raise StatisticsError(f"node {node}: statistics in {stats.mode} mode; the "
                                      f"query asked for {mode}")
            return stats

        return screen_replies(replies, parse, asked)

    def usable_replies(
        self, replies: Iterable[Message], fusion: FusionMethod | None = None,
        asked: Mapping[str, int] | None = None
    ) -> tuple[list[tuple[Checkpoint, RecordDict]], dict[int, str]]:
        """Split replies into (checkpoint, content) pairs ``fusion`` (the strategy's
        method if None) can fuse together, and the others' one-line reasons (those
        ``fusekit fuse`` gives), by node id (:func:`reply_node`)."""
        fusion = fusion or self.fusion

        def parse(node: int, content: RecordDict
                  ) -> tuple[Checkpoint, PermutationSpec, RecordDict]:
            checkpoint = reply_checkpoint(content, f"node {node}", self.weighted_by_key)
            spec = client_spec(checkpoint, self.spec)
            fusion.check_client(checkpoint, spec)
            return checkpoint, spec, content

        usable, reasons = screen_replies(replies, parse, asked)
        if fusion.requires_same_architecture:
            same_shapes = fusion.name in EVERY_ROUND
            reasons.update(_other_architectures(usable, same_shapes,
                                                self._global_architecture(same_shapes)))
        return ([(checkpoint, content) for node, (checkpoint, _, content) in usable.items()
                 if node not in reasons], reasons)

    def _global_architecture(self, same_shapes: bool) -> tuple | None:
        """The architecture of the global model the nodes were sent this round (None when
        unknown: no round configured, or a model fusekit cannot read)."""
        if self._sent is None or len(self._sent) == 0:
            return None
        try:
            checkpoint = self.global_checkpoint(self._sent)
            return _architecture(checkpoint, client_spec(checkpoint, self.spec), same_shapes)
        except FusekitError:
            return None

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


def _normalization(preprocess: Any) -> meta.Normalization:
    """The strategy's ``preprocess`` argument, checked as a checkpoint's metadata is."""
    if isinstance(preprocess, meta.Normalization):
        return preprocess
    if not isinstance(preprocess, Mapping):
        raise ParameterError(f"preprocess: expected {{\"mean\": [...], \"std\": [...]}} or a "
                             f"Normalization, found {preprocess!r}")
    try:
        return meta.parse_preprocess(json.dumps(dict(preprocess)), "preprocess")
    except (CheckpointError, TypeError, ValueError) as exc:
        raise ParameterError(str(exc)) from None


def _architecture(checkpoint: Checkpoint, spec: Any, same_shapes: bool) -> tuple:
    """What replies of one architecture share: structure and tensor names (``same_shapes``:
    every tensor's shape too, for methods that average coordinates)."""
    return (tuple(spec.structure()), tuple(sorted(checkpoint.tensors)),
            tuple(info.shape for _, info in sorted(checkpoint.tensors.items()))
            if same_shapes else ())


def _other_architectures(usable: Mapping[int, tuple[Checkpoint, Any, RecordDict]],
                         same_shapes: bool, current: tuple | None) -> dict[int, str]:
    """Why replies outside the architecture most replies share cannot join it, by node id.
    Ties go to ``current``, the global model's architecture, then to the architecture of the
    lowest node id: never to whichever reply arrived first."""
    if not usable:
        return {}
    shapes = {node: _architecture(checkpoint, spec, same_shapes)
              for node, (checkpoint, spec, _) in usable.items()}
    counts = Counter(shapes.values())
    common = max(counts, key=lambda shape: (counts[shape], shape == current,
                                            -min(n for n, s in shapes.items() if s == shape)))
    reference = min(n for n, shape in shapes.items() if shape == common)
    first, first_spec, _ = usable[reference]
    reasons = {}
    for node, (checkpoint, spec, _) in usable.items():
        try:
            check_compatible([first, checkpoint], [first_spec, spec])
            if same_shapes:
                check_equal_shapes([first, checkpoint])
        except IncompatibleModelsError as exc:
            reasons[node] = str(exc)
    return reasons


def reply_node(reply: Message, asked: Mapping[str, int] | None = None) -> int:
    """The node a reply is from; one the SuperLink sent in a node's stead (the node
    stopped) is that node's: the one its message went to (``asked``: node by message
    id, as pushing the messages set their ids)."""
    node = reply.metadata.src_node_id
    if node == SUPERLINK_NODE_ID:
        node = (asked or {}).get(reply.metadata.reply_to_message_id, node)
    return node


def sent_to(messages: Iterable[Message]) -> dict[str, int]:
    """The node each pushed message went to, by message id."""
    return {m.metadata.message_id: m.metadata.dst_node_id for m in messages}


def screen_replies(replies: Iterable[Message], parse: Callable[[int, RecordDict], T],
                   asked: Mapping[str, int] | None = None
                   ) -> tuple[dict[int, T], dict[int, str]]:
    """Each reply's ``parse(node, content)`` by node id, and for the others the one-line
    reason: the node stopped (the SuperLink's error for a node whose heartbeats ended),
    the ClientApp's error, or the FusekitError ``parse`` raised; by :func:`reply_node`."""
    parsed, reasons = {}, {}
    for reply in replies:
        node = reply_node(reply, asked)
        if reply.has_error():
            reasons[node] = error_reason(reply.error.code, reply.error.reason)
            continue
        try:
            parsed[node] = parse(node, reply.content)
        except FusekitError as exc:
            reasons[node] = str(exc)
    return parsed, reasons


def error_reason(code: int, reason: str) -> str:
    """An error reply's one-line reason: the node stopped (the SuperLink's reply for a node
    whose heartbeats ended), or what the ClientApp raised, as ``Type: message``."""
    if code == ErrorCode.NODE_UNAVAILABLE:
        return f"the node stopped answering (error {code}: {reason})"
    if raised := RAISED.fullmatch(reason.strip()):
        reason = f"{raised[1]}: {raised[2]}"
    return f"the ClientApp failed (error {code}: {' '.join(reason.split())})"


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
