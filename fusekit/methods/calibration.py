"""Calibration of a fused model from its clients' statistics (ALGORITHMS.md §12).

Numpy only: the forward passes that compute statistics run in :mod:`fusekit.toolkit`.

- A BatchNorm layer is restored as a real BatchNorm: running mean and variance are the
  pooled statistics of its input (torch's eval-mode convention: the unbiased variance),
  its affine the matched clients' (|gamma|, beta) recorded at fusion
  (``fusekit.norm_targets``), or, for a model whose BatchNorms were not folded (avg), its
  own affine.
- A layer without BatchNorm, given the clients' statistics of their own models, gets
  REPAIR's correction: each fused neuron's pre-activation is rescaled and shifted to the
  mean and standard deviation of the client neurons matched into it (sample-weighted);
  with paired statistics (each client's of the fused model and of its own model), the
  fused neuron's moments are read on the same clients' data (:func:`matched_moments`) and
  the first layer keeps its own mean (:func:`first_layer_mean_kept`).
- The first layer's statistics follow exactly from its input moments (:func:`derived_moments`),
  which clients may send with their own models' statistics: no round for that layer.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection, Mapping, Sequence

import numpy as np

from fusekit.core import metadata as meta
from fusekit.core.checkpoint import Checkpoint
from fusekit.core.errors import CheckpointError, ParameterError, StatisticsError
from fusekit.core.spec import Layer
from fusekit.core.stats import (
    InputMoments,
    Moments,
    Statistics,
    bn_input_point,
    calibrated_point,
    preactivation_point,
)
from fusekit.core.transformer import CalibrationPoint, TransformerSpec

log = logging.getLogger(__name__)

#: A fused neuron whose pooled standard deviation is below this keeps its scale (REPAIR).
MIN_STD = 1e-8

Target = tuple[np.ndarray, np.ndarray]  # (mean, std) per fused neuron, NaN where unknown


def matched_average(values: Sequence[np.ndarray], assignments: Sequence[np.ndarray],
                    weights: Sequence[float], width: int) -> np.ndarray:
    """Per fused neuron, the weighted average of the client values matched into it.

    Args:
        values: per client, (J_s,) one value per client neuron.
        assignments: per client, (J_s,) the fused neuron of each client neuron (-1: none).
        weights: per client, its weight (sample share).
        width: the number of fused neurons.

    Returns:
        (width,) float64; NaN for a fused neuron no client neuron went into.
    """
    total, mass = np.zeros(width), np.zeros(width)
    for value, assigned, weight in zip(values, assignments, weights, strict=True):
        assigned = np.asarray(assigned, np.int64)
        keep = assigned >= 0
        np.add.at(total, assigned[keep], weight * np.asarray(value, np.float64)[keep])
        np.add.at(mass, assigned[keep], weight)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(mass > 0, total / np.where(mass > 0, mass, 1.0), np.nan)


def assignments_json(assignments: Sequence[Sequence[np.ndarray]]) -> str:
    """``fusekit.assignments``: per client, per group, the fused index of each neuron."""
    return json.dumps([[np.asarray(a).astype(int).tolist() for a in client]
                       for client in assignments], separators=(",", ":"))


def norm_targets(checkpoints: Sequence[Checkpoint], specs: Sequence, fused_spec,
                 assignments: Sequence[Sequence[np.ndarray]],
                 weights: Sequence[float]) -> dict[str, dict[str, list[float]]]:
    """Per BatchNorm of the fused model, (|gamma|, beta) of the client neurons matched into
    each fused neuron: the standard deviation and mean each client's BatchNorm gives its
    neurons, which calibration restores (a neuron no client went into gets (1, 0)).

    Args:
        checkpoints, specs: the clients, canonical order.
        fused_spec: the fused model's spec (its widths).
        assignments: per client and group, as :attr:`FusionResult.assignments`.
        weights: per client, its sample share.
    """
    out = {}
    for index, layer in enumerate(fused_spec.layers[:-1]):
        if layer.norm is None:
            continue
        group = fused_spec.writes[index]
        scales, shifts = [], []
        for checkpoint, spec in zip(checkpoints, specs, strict=True):
            norm = spec.layers[index].norm
            width = spec.layers[index].out_features
            scales.append(np.abs(checkpoint.tensor(norm.weight)) if norm.weight
                          else np.ones(width))
            shifts.append(checkpoint.tensor(norm.bias) if norm.bias else np.zeros(width))
        chosen = [a[group] for a in assignments]
        scale = matched_average(scales, chosen, weights, layer.out_features)
        shift = matched_average(shifts, chosen, weights, layer.out_features)
        out[layer.norm.prefix] = {"weight": np.nan_to_num(scale, nan=1.0).tolist(),
                                  "bias": np.nan_to_num(shift, nan=0.0).tolist()}
    return out


def read_norm_targets(checkpoint: Checkpoint, spec) -> dict[str, Target] | None:
    """The ``fusekit.norm_targets`` of a fused checkpoint as (bias, weight) arrays per
    BatchNorm prefix, checked against its spec; None when absent.

    Raises:
        CheckpointError: malformed, or widths that do not match the model.
    """
    raw = checkpoint.metadata.get(meta.NORM_TARGETS)
    if raw is None:
        return None
    value = meta.parse_json_object(raw, meta.NORM_TARGETS, checkpoint.label)
    widths = {layer.norm.prefix: layer.out_features for layer in spec.layers[:-1] if layer.norm}
    out = {}
    for prefix, width in widths.items():
        entry = value.get(prefix)
        try:
            mean = np.asarray(entry["bias"], np.float64)
            std = np.asarray(entry["weight"], np.float64)
        except (TypeError, KeyError, ValueError):
            mean = std = np.empty(0)
        if mean.shape != (width,) or std.shape != (width,) or not (
                np.isfinite(mean).all() and np.isfinite(std).all()):
            raise CheckpointError(
                f"{checkpoint.label}: metadata {meta.NORM_TARGETS}[{prefix!r}]: expected finite "
                f"\"weight\" and \"bias\" lists of {width} numbers")
        out[prefix] = (mean, std)
    return out


def read_assignments(checkpoint: Checkpoint, spec,
                     client_widths: Sequence[Sequence[int]] | None = None) -> list | None:
    """The ``fusekit.assignments`` of a fused checkpoint, checked: per client and group an
    int array of fused indices in [-1, width). None when absent.

    Raises:
        CheckpointError: malformed, or indices outside the fused widths.
    """
    raw = checkpoint.metadata.get(meta.ASSIGNMENTS)
    if raw is None:
        return None
    value = meta.load_json(raw, f"{checkpoint.label}: metadata {meta.ASSIGNMENTS}")
    widths = spec.hidden_widths
    try:
        out = [[np.asarray(group, dtype=np.int64) for group in client] for client in value]
        ok = all(len(client) == len(widths) and all(
            a.ndim == 1 and a.size and a.min() >= -1 and a.max() < w
            for a, w in zip(client, widths, strict=True)) for client in out)
    except (TypeError, ValueError, OverflowError):
        ok = False
    if not ok:
        raise CheckpointError(
            f"{checkpoint.label}: metadata {meta.ASSIGNMENTS}: expected per client one list "
            f"of fused indices per group, within the widths {widths}")
    return out


def neuron_targets(spec, client_stats: Sequence[Statistics],
                   assignments: Sequence[Sequence[np.ndarray]]) -> dict[str, Target]:
    """REPAIR's targets: per hidden layer of the fused model, the mean and standard
    deviation of the client neurons matched into each fused neuron, weighted by the
    clients' sample counts (ALGORITHMS §12).

    Args:
        spec: the fused model's spec.
        client_stats: each client's statistics of its own model.
        assignments: for each of those clients, per group, its neurons' fused indices.

    Raises:
        StatisticsError: a client's statistics do not fit its assignments.
    """
    out = {}
    for index, layer in enumerate(spec.layers[:-1]):
        point = preactivation_point(layer.name)
        chosen = [a[spec.writes[index]] for a in assignments]
        out[point] = point_target(point, client_stats, chosen, layer.out_features)
    return out


def point_target(point: str, client_stats: Sequence[Statistics],
                 chosen: Sequence[np.ndarray], width: int) -> Target:
    """REPAIR's target of one point: per fused channel, the mean and standard deviation of
    the client channels matched into it (``chosen``: per client, the fused channel of each
    of its channels), weighted by the clients' sample counts.

    Raises:
        StatisticsError: a client's statistics do not fit its assignments.
    """
    moments = [s.points.get(point) for s in client_stats]
    for stats, m, assigned in zip(client_stats, moments, chosen, strict=True):
        if m is None or m.mean.shape != assigned.shape:
            raise StatisticsError(
                f"{stats.label}: point {point!r} has {None if m is None else m.mean.size} "
                f"channels; the fusion matched {assigned.size} neurons of that client")
    weights = [s.num_samples for s in client_stats]
    return (matched_average([m.mean for m in moments], chosen, weights, width),
            matched_average([m.std for m in moments], chosen, weights, width))


def matched_moments(spec, fused_stats: Sequence[Statistics], client_stats: Sequence[Statistics],
                    assignments: Sequence[Sequence[np.ndarray]],
                    pooled: Mapping[str, Moments]) -> dict[str, Moments]:
    """REPAIR's measured side on the data its targets were measured on (paired statistics,
    ALGORITHMS §12): per layer without BatchNorm, each fused neuron's mean and standard
    deviation on the data of the clients whose neurons were matched into it, averaged with
    the weights :func:`point_target` gives its targets.

    A target is a client neuron's moments on that client's own data; the pooled moments
    are the fused neuron's on the union of every client's data. Where clients' data differ,
    the two differ by more than what averaging did (a neuron of a client that saw three
    classes varies less on its data than on all ten), and rescaling by their ratio
    distorts neurons averaging did not shrink. Read on the same data, the ratio is what
    averaging changed.

    Args:
        spec: the fused model's spec.
        fused_stats: per client, its statistics of the fused model, in the order of
            ``client_stats`` (the same client's data).
        client_stats: each client's statistics of its own model (the targets).
        assignments: for each of those clients, per group, its neurons' fused indices.
        pooled: the pooled statistics of the fused model (their counts are kept; a fused
            neuron no client neuron went into keeps its pooled moments).

    Returns:
        Per pre-activation point of a layer without BatchNorm that the statistics hold,
        the matched moments.
    """
    weights = [s.num_samples for s in client_stats]
    out = {}
    for index, layer in enumerate(spec.layers[:-1]):
        point = preactivation_point(layer.name)
        if layer.norm is not None or point not in fused_stats[0].points:
            continue
        chosen = [a[spec.writes[index]] for a in assignments]
        at_matched = [(s.points[point], np.maximum(a, 0))  # -1: ignored by matched_average
                      for s, a in zip(fused_stats, chosen, strict=True)]
        mean = matched_average([m.mean[a] for m, a in at_matched], chosen, weights,
                               layer.out_features)
        std = matched_average([m.std[a] for m, a in at_matched], chosen, weights,
                              layer.out_features)
        whole = pooled[point]
        out[point] = Moments(whole.count, np.where(np.isnan(mean), whole.mean, mean),
                             np.where(np.isnan(std), whole.var, np.square(std)))
    return out


def first_layer_mean_kept(spec, targets: Mapping[str, Target],
                          measured: Mapping[str, Moments]) -> dict[str, Target]:
    """REPAIR's targets with the first layer's means replaced by the fused neurons' own
    (``measured``, e.g. :func:`matched_moments`; ALGORITHMS §12): a fused first-layer neuron
    is a weighted average of the matched neurons, affine functions of the same inputs, so on
    any data its mean is already the average of theirs; averaging shrank its spread only.
    Deeper layers, whose inputs the fusion changed, keep their targets' means."""
    point = preactivation_point(spec.layers[0].name)
    if point not in targets or point not in measured or spec.layers[0].norm is not None:
        return dict(targets)
    mean, std = targets[point]
    return {**targets, point: (np.where(np.isnan(mean), mean, measured[point].mean), std)}


def derived_moments(weight: np.ndarray, bias: np.ndarray | None,
                    inputs: InputMoments) -> Moments:
    """A layer's pre-activation moments from the moments of its input vectors, exactly:
    mean = W μ + b, var = diag(W Σ Wᵀ) (ALGORITHMS §12).

    Args:
        weight: (out, d) for a Linear, (out, C, kh, kw) for a Conv2d (d = C·kh·kw, the order
            of torch's ``unfold`` patches).
        bias: (out,) or None.
        inputs: count, mean (d,) and population covariance (d, d) of the input vectors
            (a conv's zero-padded patches at every output position).

    Returns:
        Per output channel the count (one per input vector), mean and population variance,
        as a round of statistics over the same inputs computes them.

    Raises:
        StatisticsError: ``inputs`` of another dimension than the layer's fan-in.
    """
    matrix = np.asarray(weight, np.float64).reshape(weight.shape[0], -1)
    if matrix.shape[1] != inputs.mean.shape[0]:
        raise StatisticsError(
            f"input moments of dimension {inputs.mean.shape[0]}; the layer multiplies "
            f"vectors of {matrix.shape[1]}")
    mean = matrix @ inputs.mean + (0.0 if bias is None else np.asarray(bias, np.float64))
    var = np.einsum("ij,jk,ik->i", matrix, inputs.cov, matrix)
    return Moments(np.full(matrix.shape[0], float(inputs.count)), mean, np.maximum(var, 0.0))


def calibration_layers(spec, *, repair: bool) -> list[str]:
    """The layers calibration changes, input to output: those with a BatchNorm, and with
    REPAIR's targets every other hidden layer too."""
    return [layer.name for layer in spec.layers[:-1] if layer.norm is not None or repair]


def changed_layers(spec, layers: Sequence[str] | None, *, repair: bool,
                   label: str) -> list[str]:
    """The hidden layers calibration changes, input to output: those with a BatchNorm, and
    with REPAIR's targets every other one too; only ``layers`` when given.

    Raises:
        ParameterError: ``layers`` naming a layer that is not a hidden layer of the model or
            that calibration cannot change; none to change at all (a model without
            BatchNorm and without targets: calibrating it would write the model unchanged);
            an empty ``layers`` asks for no change and is returned as it is.
    """
    if layers is not None and not layers:
        return []
    hidden = list(spec.layers[:-1])
    changing = calibration_layers(spec, repair=repair)
    why = ("it has no BatchNorm, and without targets (the clients' statistics of their own "
           "models: fusekit stats OWN_MODEL, calibrate --targets) REPAIR has nothing to "
           "restore")
    for name in layers or ():
        if name not in changing:
            known = [layer.name for layer in hidden]
            raise ParameterError(
                f"layers: {name!r} is not a hidden layer of {label} (expected some of "
                f"{known})" if name not in known else
                f"layers: calibration cannot change layer {name!r} of {label}: {why}")
    if not changing:
        raise ParameterError(f"{label}: nothing to calibrate: "
                             + (why if hidden else "it has no hidden layer"))
    return changing if layers is None else [name for name in changing if name in layers]


def calibrated_state_dict(state_dict: Mapping[str, np.ndarray], spec,
                          pooled: Mapping[str, Moments], *,
                          norm_targets: Mapping[str, Target] | None = None,
                          targets: Mapping[str, Target] | None = None,
                          layers: Sequence[str] | None = None) -> dict[str, np.ndarray]:
    """The fused model with BatchNorms restored and REPAIR applied (module docstring).

    Args:
        state_dict: the fused model's tensors (not modified).
        spec: its spec.
        pooled: pooled statistics of the fused model (:func:`fusekit.core.stats.pool`).
        norm_targets: per BatchNorm prefix (mean, std) to restore (None: the model's own
            affine).
        targets: REPAIR's targets per pre-activation point (:func:`neuron_targets`); None:
            layers without BatchNorm are left as they are.
        layers: calibrate only these layers (by name; layer-by-layer rounds), else all.

    Returns:
        A new state_dict, same names, shapes and dtypes.
    """
    out = dict(state_dict)
    chosen = None if layers is None else set(layers)
    for layer in spec.layers[:-1]:
        if chosen is not None and layer.name not in chosen:
            continue
        if layer.norm is not None:
            _restore_norm(out, layer, pooled[calibrated_point(layer)],
                          None if norm_targets is None else norm_targets[layer.norm.prefix])
        elif targets is not None:
            _repair(out, layer, pooled[calibrated_point(layer)],
                    targets[preactivation_point(layer.name)])
    return out


def _restore_norm(out: dict[str, np.ndarray], layer: Layer, moments: Moments,
                  target: Target | None) -> None:
    norm = layer.norm
    dtype = out[norm.running_mean].dtype
    out[norm.running_mean] = moments.mean.astype(dtype)
    out[norm.running_var] = moments.unbiased_var.astype(dtype)
    if target is None:
        return
    mean, std = target
    if norm.weight is None or norm.bias is None:
        log.warning("%s: a BatchNorm without affine parameters keeps unit scale", norm.prefix)
        return
    out[norm.weight] = np.where(np.isnan(std), out[norm.weight], std).astype(dtype)
    out[norm.bias] = np.where(np.isnan(mean), out[norm.bias], mean).astype(dtype)


def _repair(out: dict[str, np.ndarray], layer: Layer, moments: Moments, target: Target) -> None:
    if layer.bias is None:
        log.warning("%s: no bias to shift; REPAIR skipped for this layer", layer.name)
        return
    out[layer.weight], out[layer.bias] = repair_affine(out[layer.weight], out[layer.bias], 0,
                                                       moments, target)


def repair_affine(weight: np.ndarray, bias: np.ndarray, axis: int, moments: Moments,
                  target: Target) -> tuple[np.ndarray, np.ndarray]:
    """REPAIR on the channels that ``weight`` (along ``axis``) and ``bias`` write:
    W <- a W, b <- a (b - mean) + target mean, a = target std / std, per channel; a channel
    without a target or with a vanishing std keeps its scale. Same dtypes."""
    mean, std = target
    known = ~np.isnan(mean) & (moments.std > MIN_STD)
    scale = np.where(known, std / np.where(known, moments.std, 1.0), 1.0)
    shift = np.where(known, mean - scale * moments.mean, 0.0)
    shape = [1] * weight.ndim
    shape[axis] = -1
    scaled = (weight.astype(np.float64) * scale.reshape(shape)).astype(weight.dtype)
    return scaled, (bias.astype(np.float64) * scale + shift).astype(bias.dtype)


# -- transformers ------------------------------------------------------------------------
# Calibration of a fused transformer from its clients' statistics (ALGORITHMS.md §13,
# "Calibration"). Numpy only: the forward passes run in :mod:`fusekit.toolkit`.
#
# A transformer has no BatchNorm whose running statistics could be restored, so every point
# is calibrated REPAIR's way (§12), towards the clients' statistics of their own models,
# mapped through the fusion's assignments:
#
# - an MLP's hidden units (``mlp_hidden``): the rows and bias of the MLP's input layer, so
#   that each fused unit's pre-activation has the mean and standard deviation of the client
#   units matched into it;
# - a LayerNorm (``layernorm``): its γ and β, so that each output channel of the fused
#   LayerNorm has the mean and standard deviation of the client channels matched into it
#   (the residual stream's assignments: every LayerNorm sits on the stream).


def point_targets(spec: TransformerSpec, points: Sequence[CalibrationPoint],
                  client_stats: Sequence[Statistics],
                  assignments: Sequence[Sequence[np.ndarray]]) -> dict[str, Target]:
    """Per point, the sample-weighted mean and standard deviation of the client channels
    matched into each fused channel.

    Args:
        spec: the fused model's groups.
        points: its calibration points (:func:`fusekit.core.transformer.calibration_points`).
        client_stats: each client's statistics of its own model.
        assignments: for each of those clients, per group of ``spec.hidden_widths`` (the
            stream, each MLP), the fused unit of each of its units.

    Raises:
        StatisticsError: a client's statistics do not fit its assignments.
    """
    hidden = [g.name for g in spec.groups if g.kind in ("stream", "mlp")]
    out = {}
    for point in points:
        chosen = [a[hidden.index(point.group)] for a in assignments]
        out[point.point] = point_target(point.point, client_stats, chosen, point.size)
    return out


def calibrated_transformer(state_dict: Mapping[str, np.ndarray],
                           points: Sequence[CalibrationPoint], pooled: Mapping[str, Moments],
                           targets: Mapping[str, Target], *,
                           modules: Collection[str] | None = None) -> dict[str, np.ndarray]:
    """The fused model with every point (or those of ``modules``) rescaled and shifted to
    its target: W <- a W, b <- a (b − μ̂) + m, a = t / σ̂ per channel, with (μ̂, σ̂) the
    pooled statistics of the fused model and (m, t) the target. A new dict, same names,
    shapes and dtypes."""
    out = dict(state_dict)
    for point in points:
        if modules is not None and point.module not in modules:
            continue
        weight = point.weight.tensor
        out[weight], out[point.bias] = repair_affine(
            out[weight], out[point.bias], point.weight.axis, pooled[point.point],
            targets[point.point])
    return out
