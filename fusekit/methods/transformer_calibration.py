"""Calibration of a fused transformer from its clients' statistics (ALGORITHMS.md §13,
"Calibration"). Numpy only: the forward passes run in :mod:`fusekit.toolkit`.

A transformer has no BatchNorm whose running statistics could be restored, so every point
is calibrated REPAIR's way (§12), towards the clients' statistics of their own models,
mapped through the fusion's assignments:

- an MLP's hidden units (``mlp_hidden``): the rows and bias of the MLP's input layer, so
  that each fused unit's pre-activation has the mean and standard deviation of the client
  units matched into it;
- a LayerNorm (``layernorm``): its γ and β, so that each output channel of the fused
  LayerNorm has the mean and standard deviation of the client channels matched into it
  (the residual stream's assignments: every LayerNorm sits on the stream).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import numpy as np

from fusekit.core.stats import Moments, Statistics
from fusekit.core.transformer import CalibrationPoint, TransformerSpec
from fusekit.methods.calibration import Target, point_target, repair_affine


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
