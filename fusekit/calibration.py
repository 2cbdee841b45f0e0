"""``fusekit.calibrate``, ``fusekit.align`` and ``fusekit.refit``: a fused model corrected
with statistics its clients computed on their own data (ALGORITHMS.md §12), the steps of
the round protocol (:mod:`fusekit.protocol`). Files are read and checked here, at the edge;
the math is :mod:`fusekit.methods.calibration`'s and :mod:`fusekit.methods.alignment`'s.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fusekit.api import CheckpointLike, canonical_order
from fusekit.core import metadata as meta
from fusekit.core import neurons
from fusekit.core.checkpoint import Checkpoint, load_checkpoint
from fusekit.core.cross_stats import (
    DEFAULT_RIDGE,
    CrossStatistics,
    RefitStatistics,
    check_cross_statistics,
    check_refit_statistics,
    load_cross_statistics,
    load_refit_statistics,
)
from fusekit.core.errors import (
    CheckpointError,
    IncompatibleModelsError,
    ParameterError,
    StatisticsError,
)
from fusekit.core.metadata import load_json
from fusekit.core.model_spec import client_spec, fused_spec, input_points, model_points
from fusekit.core.stats import (
    DEFAULT_MIN_SAMPLES,
    Statistics,
    calibrated_point,
    check_statistics,
    load_statistics,
    pool,
)
from fusekit.core.transformer import CalibrationPoint, TransformerSpec, calibration_points
from fusekit.methods import alignment, calibration
from fusekit.methods.base import FusionResult, provenance, sample_weights

StatisticsLike = str | os.PathLike[str] | Statistics


def calibrate(
    fused: CheckpointLike,
    statistics: Sequence[StatisticsLike] = (),
    *,
    targets: Sequence[StatisticsLike] = (),
    layers: Sequence[str] | None = None,
    min_samples: int = DEFAULT_MIN_SAMPLES,
    paired: bool = False,
) -> FusionResult:
    """Calibrate a fused model with statistics its clients computed on their own data.

    Args:
        fused: the fused checkpoint (path or :class:`Checkpoint`).
        statistics: each client's statistics of ``fused`` (``fusekit stats FUSED ...``, or
            :func:`fusekit.toolkit.calibration.client_statistics`), pooled exactly. None:
            the first layer alone, derived from the input moments the ``targets`` carry
            (no round), or nothing when ``layers`` is empty.
        targets: clients' statistics of their own models (the fusion's inputs): REPAIR's
            targets for layers without BatchNorm (which are left as they are without);
            with every client's input moments (``client_statistics(...,
            input_moments=True)``, ``fusekit stats --input-moments``), the first layer's
            statistics without a round (ALGORITHMS §12).
        layers: calibrate only these layers (layer-by-layer rounds); default all (without
            ``statistics``: the first layer).
        min_samples: refuse statistics over fewer inputs.
        paired: ``statistics[k]`` and ``targets[k]`` were computed on the same client's
            data: REPAIR then reads each fused neuron's moments on the data of the clients
            matched into it, where its targets were measured, instead of pooling them over
            every client's, and restores the first layer's spread around its own mean
            (ALGORITHMS §12; the default where the rounds run locally).

    Returns:
        A FusionResult holding the calibrated model (same tensors, names and widths) and
        the fused model's metadata plus ``fusekit.calibration``; ``report["calibration"]``.

    Raises:
        StatisticsError: a statistics file that is malformed, of another model, of a
            model that is not one of the fusion's inputs, or over too few samples; input
            moments from some clients only, or of another dimension than the first
            layer's; without statistics of ``fused``, a layer that needs a round, or no
            input moments; ``paired`` statistics over another number of inputs than their
            client's targets.
        ParameterError: ``paired`` without as many targets as statistics, or for a
            transformer.
        CheckpointError: the fused file is unreadable or its calibration metadata malformed.
    """
    checkpoint = fused if isinstance(fused, Checkpoint) else load_checkpoint(fused)
    spec = fused_spec(checkpoint)
    transformer = isinstance(spec, TransformerSpec)
    shapes = {name: info.shape for name, info in checkpoint.tensors.items()}
    where = calibration_points(spec, shapes) if transformer else None
    points = model_points(checkpoint, spec)
    stats = [_statistics(s, checkpoint.content_hash, points, min_samples) for s in statistics]
    if paired and (transformer or not targets or (stats and len(targets) != len(stats))):
        raise ParameterError(
            f"paired: expected as many targets as statistics of a network's fused model "
            f"(one pair per client), found {len(stats)} statistics and {len(targets)} targets"
            + (f" for a transformer ({checkpoint.label})" if transformer else ""))
    if transformer:
        nothing_to_calibrate = layers is not None and not layers
        pooled = {} if nothing_to_calibrate and not stats else pool(stats)
        state_dict = _calibrated_transformer(checkpoint, spec, where, pooled, targets, layers,
                                             min_samples)
        used = stats
    else:
        state_dict, layers, used = _calibrated_network(checkpoint, spec, stats, targets, layers,
                                                       min_samples, paired)
    report = {"clients": len(used), "samples": sum(s.num_samples for s in used),
              "mode": stats[0].mode if stats else ("derived" if used else None),
              "repair": bool(targets), "paired": paired,
              "layers": list(layers) if layers is not None else "all"}
    metadata = dict(checkpoint.metadata)
    metadata[meta.CALIBRATION] = json.dumps(report)
    inputs = [p for p in [checkpoint.path, *statistics, *targets] if isinstance(p, (str, Path))]
    return FusionResult(state_dict=state_dict, method=metadata.get(meta.METHOD, "unknown"),
                        params={}, widths=spec.hidden_widths, report={"calibration": report},
                        metadata=metadata, inputs=[Path(p).absolute() for p in inputs],
                        spec=spec, config=checkpoint.config)


def _calibrated_network(checkpoint: Checkpoint, spec, stats: Sequence[Statistics],
                        targets: Sequence[StatisticsLike], layers: Sequence[str] | None,
                        min_samples: int, paired: bool = False
                        ) -> tuple[dict[str, Any], list[str] | None, list[Statistics]]:
    """BatchNorms restored and REPAIR (ALGORITHMS §12); without statistics of the fused
    model, the first layer alone, from the input moments the targets carry.

    Returns:
        The calibrated tensors, the layers calibrated (None: all) and the statistics used.
    """
    own, chosen = (_target_assignments(checkpoint, spec, targets, min_samples) if targets
                   else ([], []))
    repair = calibration.neuron_targets(spec, own, chosen) if own else None
    calibration.changed_layers(spec, layers, repair=bool(own), label=checkpoint.label)
    used = list(stats)
    if not stats:  # the first layer alone, each client's statistics derived
        stats = _derived_first_layer(checkpoint, spec, own)
        used = own if stats else []
        layers = _derivable_layers(spec, layers, stats[0].points if stats else {},
                                   checkpoint.label)
    pooled = pool(stats) if stats else {}
    if paired and stats:
        pooled.update(calibration.matched_moments(spec, _same_data(stats, own), own, chosen,
                                                  pooled))
        repair = calibration.first_layer_mean_kept(spec, repair, pooled) if repair else None
    state_dict = calibration.calibrated_state_dict(
        checkpoint.state_dict(), spec, pooled,
        norm_targets=calibration.read_norm_targets(checkpoint, spec), targets=repair,
        layers=layers)
    return state_dict, layers, used


def _derived_first_layer(checkpoint: Checkpoint, spec, own: Sequence[Statistics]
                         ) -> list[Statistics]:
    """Per client, the fused first layer's statistics from its input moments (ALGORITHMS
    §12: exact; pooled, those of the union); empty when no client sent any."""
    if not any(s.inputs for s in own) or len(spec.layers) < 2:
        return []
    first = spec.layers[0]
    ((point, fan_in),) = input_points(checkpoint, spec).items()
    for s in own:
        moments = s.inputs.get(point)
        if moments is None:
            raise StatisticsError(
                f"{s.label}: no input moments of the first layer ({point!r}); the first layer "
                "is derived from every client's input moments, or calibrated in a round")
        if moments.mean.shape != (fan_in,):
            raise StatisticsError(
                f"{s.label}: point {point!r}: input moments of dimension "
                f"{moments.mean.shape[0]}; layer {first.name!r} multiplies vectors of {fan_in}")
    weight = checkpoint.tensor(first.weight)
    bias = checkpoint.tensor(first.bias) if first.bias else None
    return [Statistics(checkpoint.content_hash, s.num_samples, "eval", {
        calibrated_point(first): calibration.derived_moments(weight, bias, s.inputs[point])},
        label=f"{s.label} (derived)") for s in own]


def _derivable_layers(spec, layers: Sequence[str] | None, pooled: Mapping[str, Any],
                      label: str) -> list[str]:
    """Without a round: the layers whose statistics were derived (default), refusing any
    other, and at least one unless ``layers`` is empty."""
    available = [layer.name for layer in spec.layers[:-1] if calibrated_point(layer) in pooled]
    if layers is None and not available:
        raise StatisticsError(
            f"{label}: calibration needs each client's statistics of this model, or, for the "
            "first layer alone, --targets carrying input moments (fusekit stats "
            "--input-moments); found neither")
    chosen = available if layers is None else list(layers)
    needing = [name for name in chosen if name not in available]
    if needing:
        raise StatisticsError(
            f"layers: {needing[0]!r} needs statistics of the fused model (a round); without "
            f"them only {available or 'no layer'} can be calibrated, from input moments")
    return chosen


def _calibrated_transformer(checkpoint: Checkpoint, spec: TransformerSpec,
                            where: Sequence[CalibrationPoint], pooled: Mapping[str, Any],
                            targets: Sequence[StatisticsLike], layers: Sequence[str] | None,
                            min_samples: int) -> dict[str, Any]:
    """REPAIR of every MLP's hidden units and every LayerNorm (ALGORITHMS §13), towards the
    clients' statistics of their own models."""
    if not targets:
        raise ParameterError(
            f"targets: {checkpoint.label} is a transformer, which has no BatchNorm to "
            "restore: give each client's statistics of its own model (--targets)")
    modules = [p.module for p in where]
    unknown = sorted(set(layers or ()) - set(modules))
    if unknown:
        raise ParameterError(f"layers: {unknown[:3]} are not calibration points of "
                             f"{checkpoint.label}; expected some of {modules[:4]}...")
    stats, chosen = _target_assignments(checkpoint, spec, targets, min_samples)
    goals = calibration.point_targets(spec, where, stats, chosen)
    return calibration.calibrated_transformer(
        checkpoint.state_dict(), where, pooled, goals, modules=layers)


def _statistics(source: StatisticsLike, model: str, points: Mapping[str, int],
                min_samples: int) -> Statistics:
    return _screened(source, Statistics, check_statistics, load_statistics, model=model,
                     points=points, min_samples=min_samples)


def _screened(source, in_memory: type, check: Callable[..., None], load: Callable[..., Any],
              **checks: Any) -> Any:
    """``source``, statistics of any kind, checked: in memory (an ``in_memory``) by
    ``check``, a file by ``load``, both with ``checks``."""
    if isinstance(source, in_memory):
        check(source, **checks)
        return source
    return load(source, **checks)


def _one_per_client(clients: Sequence[Checkpoint], sources: Sequence[Any],
                    read: Callable[[Any], Any], kind: str, stage: str) -> list[Any]:
    """The statistics ``read`` gives for ``sources`` (each checked, naming one of
    ``clients`` as its model), in the clients' order: exactly one per client.

    Raises:
        StatisticsError: two for one client, or none for one.
    """
    index = {c.content_hash: i for i, c in enumerate(clients)}
    out: list[Any] = [None] * len(clients)
    for source in sources:
        stats = read(source)
        if out[index[stats.model]] is not None:
            raise StatisticsError(f"{stats.label}: a second {kind} file for client "
                                  f"{clients[index[stats.model]].label}")
        out[index[stats.model]] = stats
    missing = [c.label for c, s in zip(clients, out, strict=True) if s is None]
    if missing:
        raise StatisticsError(f"{stage}: no {kind} for client(s) {', '.join(missing[:3])}; "
                              "every client must send one")
    return out


def _same_data(stats: Sequence[Statistics], own: Sequence[Statistics]) -> list[Statistics]:
    """Paired statistics, checked as far as they can be: each pair over as many inputs.

    Raises:
        StatisticsError: a pair over different numbers of inputs (not one client's data).
    """
    for fused_side, own_side in zip(stats, own, strict=True):
        if fused_side.num_samples != own_side.num_samples:
            raise StatisticsError(
                f"{fused_side.label}: paired with {own_side.label}, but computed over "
                f"{fused_side.num_samples} inputs against {own_side.num_samples}; paired "
                "statistics are one client's, on the same data, in the same order")
    return list(stats)


def _target_assignments(checkpoint: Checkpoint, spec, targets: Sequence[StatisticsLike],
                        min_samples: int) -> tuple[list[Statistics], list[Any]]:
    """The clients' statistics of their own models, each with its assignments: the
    fusion's for that client (each file names its model, which must be one of the fusion's
    inputs), or the identity for statistics of the calibrated model itself."""
    assignments = calibration.read_assignments(checkpoint, spec)
    inputs = load_json(checkpoint.metadata.get(meta.INPUTS, "[]"),
                       f"{checkpoint.label}: metadata {meta.INPUTS}")
    stats = [_statistics(s, None, None, min_samples) for s in targets]
    if assignments is None and all(s.model == checkpoint.content_hash for s in stats):
        identity = [np.arange(width) for width in spec.hidden_widths]
        return stats, [identity] * len(stats)
    if assignments is None or not isinstance(inputs, list) or len(inputs) != len(assignments):
        raise CheckpointError(
            f"{checkpoint.label}: REPAIR targets need the fusion's {meta.ASSIGNMENTS} and "
            f"{meta.INPUTS} metadata (a fusion by a method that matches neurons); found none")
    chosen = []
    for s in stats:
        if s.model not in inputs:
            raise StatisticsError(
                f"{s.label}: computed for model {s.model[:16]}..., which is not one of the "
                f"fusion's inputs; targets are the clients' statistics of their own models")
        chosen.append(assignments[inputs.index(s.model)])
    return stats, chosen


CrossStatisticsLike = str | os.PathLike[str] | CrossStatistics


def align(
    reference: CheckpointLike,
    clients: Sequence[CheckpointLike],
    cross_statistics: Sequence[CrossStatisticsLike],
    *,
    min_samples: int = DEFAULT_MIN_SAMPLES,
) -> FusionResult:
    """Re-match every client to a reference by activations and re-fuse (an alignment
    round, ALGORITHMS.md §12).

    Args:
        reference: the fused model the clients ran (best calibrated first: its
            activations are then those of a working network).
        clients: the clients' own models (the fusion's inputs).
        cross_statistics: one per client, its cross statistics of ``reference`` and its own
            model on its own data (``fusekit stats REFERENCE --against OWN_MODEL``, or
            :func:`fusekit.toolkit.alignment.cross_statistics`).
        min_samples: refuse statistics over fewer inputs.

    Returns:
        The re-fused model at the reference's widths, BatchNorms folded (calibrate it
        next), with the fusion's assignments and norm targets; ``report["alignment"]``:
        per client and group the mean correlation of the matched channels.

    Raises:
        StatisticsError: cross statistics that are malformed, against another reference,
            of a model that is none of the clients, two for one client or none for one.
        IncompatibleModelsError: clients whose layers are not the reference's, or a
            transformer.
        ParameterError: a reference without a hidden layer (no neuron to re-match).
    """
    reference = reference if isinstance(reference, Checkpoint) else load_checkpoint(reference)
    reference_spec = fused_spec(reference)
    if isinstance(reference_spec, TransformerSpec):
        raise IncompatibleModelsError(
            f"{reference.label}: a transformer; alignment rounds re-match the ReLU units of "
            "MLPs, CNNs and ResNets and do not cover transformers' heads and streams")
    if len(reference_spec.layers) < 2:
        raise ParameterError(f"{reference.label}: no hidden layer, so nothing to align")
    checkpoints = [c if isinstance(c, Checkpoint) else load_checkpoint(c) for c in clients]
    specs = [client_spec(c, None) for c in checkpoints]
    order = canonical_order(checkpoints, specs)
    checkpoints, specs = [checkpoints[i] for i in order], [specs[i] for i in order]
    for checkpoint, spec in zip(checkpoints, specs, strict=True):
        if [layer.name for layer in spec.layers] != [layer.name for layer in
                                                     reference_spec.layers]:
            raise IncompatibleModelsError(
                f"{checkpoint.label}: its layers are not those of the reference "
                f"{reference.label}")
    cross = _cross_statistics_by_client(reference, reference_spec, checkpoints, specs,
                                        cross_statistics, min_samples)
    weights = sample_weights(checkpoints)
    state_dict, assignments, report = alignment.realign(
        checkpoints, specs, reference_spec, cross, weights)
    report["reference"] = reference.content_hash
    method = reference.metadata.get(meta.METHOD, "unknown")
    result = FusionResult(state_dict=state_dict, method=method, params={},
                          widths=reference_spec.hidden_widths, report={"alignment": report},
                          metadata={key: reference.metadata[key] for key in (meta.SPEC, meta.ARCH)
                                    if key in reference.metadata},
                          assignments=assignments, spec=reference_spec)
    provenance(result, checkpoints)
    result.metadata[meta.PARAMS] = reference.metadata.get(meta.PARAMS, "{}")
    result.metadata[meta.ALIGNMENT] = json.dumps({"reference": reference.content_hash,
                                                  "mean_correlation": report["mean_correlation"]})
    result.metadata[meta.ASSIGNMENTS] = calibration.assignments_json(assignments)
    if any(layer.norm for layer in reference_spec.layers):
        targets = calibration.norm_targets(checkpoints, specs, reference_spec, assignments,
                                           weights)
        result.metadata[meta.NORM_TARGETS] = json.dumps(targets, separators=(",", ":"))
    return result


def _cross_statistics_by_client(reference: Checkpoint, reference_spec: Any,
                                checkpoints: Sequence[Checkpoint], specs: Sequence[Any],
                                sources: Sequence[CrossStatisticsLike],
                                min_samples: int) -> list[CrossStatistics]:
    """Each client's cross statistics (clients' order), checked against the reference and
    that client."""
    checks = {"reference": reference.content_hash, "min_samples": min_samples,
              "models": {c.content_hash: alignment.cross_points(s)
                         for c, s in zip(checkpoints, specs, strict=True)},
              "widths": alignment.cross_points(reference_spec)}
    return _one_per_client(
        checkpoints, sources, lambda source: _screened(
            source, CrossStatistics, check_cross_statistics, load_cross_statistics, **checks),
        "cross statistics", "alignment")


RefitStatisticsLike = str | os.PathLike[str] | RefitStatistics
#: A refit that moves no weight or bias by more than this (relative to the layer's largest
#: value) leaves the layer as it is: float64 rounding, not a change.
REFIT_UNCHANGED = 1e-9


def refit(
    fused: CheckpointLike,
    clients: Sequence[CheckpointLike],
    refit_statistics: Sequence[RefitStatisticsLike],
    *,
    ridge: float = DEFAULT_RIDGE,
    min_samples: int = DEFAULT_MIN_SAMPLES,
) -> FusionResult:
    """Refit one layer of a fused model to the matched clients' pre-activations, by least
    squares from the clients' moments (a refit round, ALGORITHMS.md §12).

    Args:
        fused: the fused model the clients ran (after an alignment round: its
            ``fusekit.assignments`` say which client neuron each fused neuron fits).
        clients: the clients' own models (the fusion's inputs; some of them: a fused
            neuron that none of them was matched into keeps its weights).
        refit_statistics: one per client, all for the same layer (``fusekit stats FUSED
            --against OWN_MODEL --layer NAME``, or
            :func:`fusekit.toolkit.alignment.refit_statistics`).
        ridge: relative ridge towards the layer's current weights (> 0).
        min_samples: refuse statistics over fewer inputs.

    Returns:
        The fused model with that layer refit (BatchNorms folded: the layer now emits the
        clients' pre-activations itself); ``report["refit"]``.

    Raises:
        StatisticsError: statistics that are malformed, of another fused model, of a model
            that is none of the clients, of different layers, two or none for a client.
        CheckpointError: a fused model without ``fusekit.assignments``.
        ParameterError: a ridge that is not > 0; statistics that cannot change the layer
            (no given client matched into it, or pre-activations it already computes).
    """
    if isinstance(ridge, bool) or not isinstance(ridge, (int, float)) or not ridge > 0:
        raise ParameterError(f"ridge: expected a number > 0, found {ridge!r}")
    fused = fused if isinstance(fused, Checkpoint) else load_checkpoint(fused)
    spec = fused_spec(fused)
    assignments = calibration.read_assignments(fused, spec)
    hashes = load_json(fused.metadata.get(meta.INPUTS, "[]"), f"{fused.label}: metadata "
                       f"{meta.INPUTS}")
    if assignments is None or not isinstance(hashes, list) or len(hashes) != len(assignments):
        raise CheckpointError(f"{fused.label}: a refit needs the fusion's {meta.ASSIGNMENTS} "
                              f"and {meta.INPUTS} metadata (run fusekit align first)")
    checkpoints = {c.content_hash: c for c in (
        c if isinstance(c, Checkpoint) else load_checkpoint(c) for c in clients)}
    if not checkpoints or not set(checkpoints) <= set(hashes):
        raise IncompatibleModelsError(f"clients: expected some of the {len(hashes)} models "
                                      f"{fused.label} was fused from, found others")
    ordered = [checkpoints[h] for h in hashes if h in checkpoints]
    specs = [client_spec(c, None) for c in ordered]
    stats = _refit_statistics_by_client(fused, spec, ordered, specs, refit_statistics,
                                        min_samples)
    index = [layer.name for layer in spec.layers].index(stats[0].layer)
    layers = neurons.client_layers(fused, spec)
    group = spec.writes[index]
    rows = [np.arange(spec.layers[index].out_features) if group is None else a[group]
            for h, a in zip(hashes, assignments, strict=True) if h in checkpoints]
    weights = sample_weights(ordered)
    refit_layer = alignment.refit_layer(layers[index], [s.gram for s in stats],
                                        [s.cross for s in stats], rows, weights, ridge)
    _refit_changes(fused.label, stats[0].layer, rows, layers[index], refit_layer)
    layers[index] = refit_layer
    state_dict = neurons.to_state_dict(ordered, spec, layers)
    state_dict.update({name: fused.tensor(name) for name in spec.other})
    done = load_json(fused.metadata.get(meta.REFIT, "{}"), f"{fused.label}: metadata "
                     f"{meta.REFIT}")
    record = {"layers": [*(done.get("layers", []) if isinstance(done, dict) else []),
                         stats[0].layer], "ridge": ridge}
    metadata = {**fused.metadata, meta.REFIT: json.dumps(record)}
    return FusionResult(state_dict=state_dict, method=fused.metadata.get(meta.METHOD, "unknown"),
                        params={}, widths=spec.hidden_widths, report={"refit": record},
                        metadata=metadata, assignments=assignments, spec=spec)


def _refit_changes(label: str, layer: str, rows: Sequence[np.ndarray],
                   prior: neurons.UnitLayer, refit: neurons.UnitLayer) -> None:
    """Refuse a refit that leaves the layer as it is: it would write the model unchanged
    under a record saying the layer was refit."""
    if not any(np.any(np.asarray(r) >= 0) for r in rows):
        raise ParameterError(
            f"{label}: nothing to refit: no neuron of the given client(s) is matched into "
            f"layer {layer!r} ({meta.ASSIGNMENTS}), so their statistics cannot change it")
    before = np.concatenate([prior.weight.ravel(), prior.bias])
    change = np.abs(np.concatenate([refit.weight.ravel(), refit.bias]) - before)
    if np.max(change) <= REFIT_UNCHANGED * np.max(np.abs(before)):
        raise ParameterError(
            f"{label}: nothing to refit: layer {layer!r} already computes the pre-activations "
            "its refit statistics ask of it, so the refit cannot change it")


def _refit_statistics_by_client(fused: Checkpoint, spec: Any, clients: Sequence[Checkpoint],
                                specs: Sequence[Any], sources: Sequence[RefitStatisticsLike],
                                min_samples: int) -> list[RefitStatistics]:
    """Each client's refit statistics (clients' order), checked, all of one layer."""
    models = {c.content_hash: {layer.name: layer.out_features for layer in s.layers}
              for c, s in zip(clients, specs, strict=True)}
    checks = {"reference": fused.content_hash, "models": models,
              "inputs": alignment.layer_inputs(spec), "min_samples": min_samples}
    layers: list[str] = []

    def read(source: RefitStatisticsLike) -> RefitStatistics:
        stats = _screened(source, RefitStatistics, check_refit_statistics,
                          load_refit_statistics, **checks)
        if layers and stats.layer != layers[0]:
            raise StatisticsError(f"{stats.label}: layer {stats.layer!r}; the other files "
                                  "are for another layer (one refit round refits one layer)")
        layers.append(stats.layer)
        return stats

    return _one_per_client(clients, sources, read, "refit statistics", "refit")
