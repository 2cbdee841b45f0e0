"""Alignment round: re-match every client to a reference by activations, then re-fuse
(ALGORITHMS.md §12). Numpy only: the forward passes run in :mod:`fusekit.toolkit`.

Each client sends the cross statistics (:mod:`fusekit.core.cross_stats`) of the reference
(the fused model) and its own model on its own data. Per permutation group, the Pearson
correlations between the reference's channels and the client's are summed over every
layer writing the group (a residual stream: the stem, every block's last BatchNorm and
every shortcut); one linear assignment maximises the total correlation (activation
matching, Ainsworth et al. 2023 §3.1; the server never needs another client's model).
The clients, mapped into the reference's neuron order (BatchNorm folded), are averaged
over the clients matched into each fused neuron (sample-weighted), at the reference's
widths: a fused neuron no client went into stays zero.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from fusekit.core import neurons
from fusekit.core.checkpoint import Checkpoint
from fusekit.core.cross_stats import CrossStatistics
from fusekit.core.errors import StatisticsError
from fusekit.core.stats import preactivation_point
from fusekit.engine.matching import solve_assignment
from fusekit.methods.avg import average_tensor


def cross_points(spec) -> dict[str, int]:
    """The points a cross statistics file for a model with this spec holds, with widths."""
    return {preactivation_point(layer.name): layer.out_features for layer in spec.layers[:-1]}


def group_correlations(spec, cross: CrossStatistics) -> list[np.ndarray]:
    """Per group of ``spec``, the (R_g, O_g) correlations of the reference's channels with
    the client's, averaged over the group's writing layers (a mean, so that a matched score
    stays a correlation; the assignment is that of the sum)."""
    out: list[np.ndarray | None] = [None] * len(spec.group_names)
    writers = [0] * len(spec.group_names)
    for layer, group in zip(spec.layers, spec.writes, strict=True):
        if group is None:
            continue
        correlation = cross.points[preactivation_point(layer.name)].correlation()
        out[group] = correlation if out[group] is None else out[group] + correlation
        writers[group] += 1
    if any(c is None for c in out):
        raise StatisticsError(f"{cross.label}: a permutation group has no writing layer")
    return [total / count for total, count in zip(out, writers, strict=True)]


def match_to_reference(correlations: Sequence[np.ndarray],
                       solver: Callable[..., tuple] = solve_assignment
                       ) -> tuple[list[np.ndarray], list[float]]:
    """Per group, the reference neuron of each client neuron maximising the total
    correlation (-1 where the reference is narrower), and the group's mean matched
    correlation."""
    assignments, scores = [], []
    for correlation in correlations:
        rows, cols = solver(correlation.T, maximize=True)
        assigned = np.full(correlation.shape[1], -1, np.int64)
        assigned[rows] = cols
        assignments.append(assigned)
        scores.append(float(correlation.T[rows, cols].mean()))
    return assignments, scores


def fuse_matched(checkpoints: Sequence[Checkpoint], specs: Sequence, reference_spec,
                 assignments: Sequence[Sequence[np.ndarray]],
                 weights: np.ndarray) -> list[neurons.UnitLayer]:
    """The clients in the reference's neuron order, averaged (weights ``weights``) over
    the clients matched into each fused neuron, in unit form at the reference's widths.

    A fused neuron computes the weighted mean of what its matched client neurons compute:
    a client's incoming weight from a fused neuron below that it has no neuron in counts
    as 0, not as missing (a feature two clients put into two different fused neurons is
    then read once, not twice).
    """
    totals, masses = None, None
    for checkpoint, spec, assigned, weight in zip(checkpoints, specs, assignments, weights,
                                                  strict=True):
        layers = neurons.client_layers(checkpoint, spec)
        checkpoint.release()
        if totals is None:
            totals = [_zeros(layer, reference_spec, i) for i, layer in enumerate(layers)]
            masses = [np.zeros(t.bias.shape) for t in totals]
        for index, layer in enumerate(layers):
            rows = _indices(assigned, reference_spec.writes[index], layer.out_features)
            cols = _indices(assigned, reference_spec.reads[index], layer.weight.shape[1])
            keep_rows, keep_cols = rows >= 0, cols >= 0
            block = np.ix_(rows[keep_rows], cols[keep_cols])
            totals[index].weight[block] += weight * layer.weight[np.ix_(keep_rows, keep_cols)]
            totals[index].bias[rows[keep_rows]] += weight * layer.bias[keep_rows]
            masses[index][rows[keep_rows]] += weight
    out = []
    for total, mass in zip(totals, masses, strict=True):
        scale = np.where(mass > 0, 1.0 / np.where(mass > 0, mass, 1.0), 0.0)
        out.append(neurons.UnitLayer(total.weight * scale[:, None, None], total.bias * scale))
    return out


def realign(checkpoints: Sequence[Checkpoint], specs: Sequence, reference_spec,
            cross: Sequence[CrossStatistics], weights: np.ndarray
            ) -> tuple[dict[str, np.ndarray], list[list[np.ndarray]], dict[str, Any]]:
    """Match every client to the reference by its cross statistics and re-fuse.

    Args:
        checkpoints, specs: the clients (canonical order).
        reference_spec: the reference's spec (the fused widths).
        cross: per client, its checked cross statistics.
        weights: per client, its sample share.

    Returns:
        (the fused state_dict, BatchNorms folded; per client and group the reference
        neuron of each client neuron; a report: per client and group the mean matched
        correlation, and their mean).
    """
    matched = [match_to_reference(group_correlations(reference_spec, c)) for c in cross]
    assignments = [assigned for assigned, _ in matched]
    layers = fuse_matched(checkpoints, specs, reference_spec, assignments, weights)
    state_dict = neurons.to_state_dict(checkpoints, reference_spec, layers)
    state_dict.update({name: average_tensor([c.tensor(name) for c in checkpoints], weights,
                                            name)
                       for name in reference_spec.other})
    report = {"mean_correlation": round(float(np.mean([np.mean(s) for _, s in matched])), 4),
              "clients": [{"client": c.label, "correlation": [round(v, 4) for v in s]}
                          for c, (_, s) in zip(checkpoints, matched, strict=True)]}
    return state_dict, assignments, report


def _indices(assigned: Sequence[np.ndarray], group: int | None, width: int) -> np.ndarray:
    """A client's units at a layer's output or input, as reference indices (identity at
    the network's input and output)."""
    return np.arange(width) if group is None else np.asarray(assigned[group], np.int64)


def _zeros(layer: neurons.UnitLayer, reference_spec, index: int) -> neurons.UnitLayer:
    reference = reference_spec.layers[index]
    block = layer.weight.shape[2]
    return neurons.UnitLayer(np.zeros((reference.out_features, reference.in_features, block)),
                             np.zeros(reference.out_features))


def layer_inputs(spec) -> dict[str, int]:
    """Per layer, d: the values of one row of its input (a conv's patch: C_in·kh·kw; a
    linear layer's input, a flatten's every position included)."""
    return {layer.name: layer.in_features * (layer.kernel_size[0] * layer.kernel_size[1]
                                             if layer.kind == "conv2d" else layer.input_block)
            for layer in spec.layers}


def refit_layer(prior: neurons.UnitLayer, grams: Sequence[np.ndarray],
                crosses: Sequence[np.ndarray], rows: Sequence[np.ndarray],
                weights: np.ndarray, ridge: float) -> neurons.UnitLayer:
    """Least-squares refit of one fused layer to the matched clients' pre-activations.

    For fused neuron j with matched clients S_j (client s's neuron i_s):
    θ_j = argmin Σ_{s∈S_j} w_s E_s[(θ·u − y_{s,i_s})²] + λ ||θ − θ⁰_j||², u the fused
    model's input to the layer on client s's data (with a trailing 1 for the bias),
    y_{s,i} client s's own pre-activation, λ = ``ridge`` · mean diagonal of Σ w_s G_s.

    Args:
        prior: the layer now (θ⁰), unit form (out, in_units, block) and bias.
        grams: per client, E[u uᵀ] (d+1, d+1), d = in_units · block.
        crosses: per client, E[y uᵀ] (O_s, d+1).
        rows: per client, the fused neuron of each of its neurons (O_s,), -1 for none.
        weights: per client, its sample share.
        ridge: relative ridge λ (> 0).
    """
    theta = np.hstack([prior.weight.reshape(prior.out_features, -1), prior.bias[:, None]])
    members: dict[tuple[int, ...], list[int]] = {}
    for j in range(prior.out_features):
        key = tuple(s for s, r in enumerate(rows) if np.any(np.asarray(r) == j))
        if key:
            members.setdefault(key, []).append(j)
    for key, slots in members.items():
        gram = sum(weights[s] * grams[s] for s in key)
        lam = ridge * float(np.mean(np.diag(gram))) + 1e-12
        rhs = lam * theta[slots].T
        for s in key:
            own = np.full(theta.shape[0], -1, np.int64)
            own[np.asarray(rows[s])[np.asarray(rows[s]) >= 0]] = np.flatnonzero(
                np.asarray(rows[s]) >= 0)
            present = own[slots] >= 0
            rhs[:, present] += weights[s] * crosses[s][own[slots][present]].T
        system = gram + lam * np.eye(gram.shape[0])
        theta[slots] = np.linalg.solve(system, rhs).T
    weight = theta[:, :-1].reshape(prior.weight.shape)
    return neurons.UnitLayer(np.ascontiguousarray(weight), theta[:, -1].copy())
