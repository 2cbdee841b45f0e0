"""Cross statistics: what a client sends for an alignment round (ALGORITHMS.md §12).

A client runs the *reference* (the fused model the server sent) and its *own* model on its
own data, side by side, and records per hidden layer's pre-activation
(``preactivation:<layer>``, the same points as :mod:`fusekit.core.stats`) the joint
moments of the two models' channels, float64:

- ``<point>.count`` (1,): samples (a conv layer counts every spatial position);
- ``<point>.reference_mean``, ``<point>.reference_var`` (R,): the reference's channels;
- ``<point>.own_mean``, ``<point>.own_var`` (O,): the client's own channels;
- ``<point>.covariance`` (R, O): the (population) covariance of every reference channel
  with every own channel.

This is more than calibration's per-channel statistics (an R x O matrix per layer), and
still aggregates: no input, no label, no per-sample value. The metadata
``fusekit.cross_stats`` names both models by their content hash, the inputs run and the
mode in which the reference ran. Cross statistics files are untrusted input:
:func:`load_cross_statistics` checks them against the two models they name.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fusekit.core import metadata as meta
from fusekit.core.errors import StatisticsError
from fusekit.core.stats import (
    DEFAULT_MIN_SAMPLES,
    chan,
    check_magnitude,
    check_num_samples,
    is_statistics_header,
    point_fields,
    read_statistics_file,
    save_statistics_file,
    whole_counts,
)

FIELDS = ("count", "reference_mean", "reference_var", "own_mean", "own_var", "covariance")
#: Covariances may exceed the Cauchy-Schwarz bound by this relative slack (rounding).
SCHWARZ_SLACK = 1e-6


@dataclass
class CrossMoments:
    """Joint moments of the reference's R and the own model's O channels at one point."""

    count: np.ndarray  # (1,)
    reference_mean: np.ndarray  # (R,)
    reference_var: np.ndarray  # (R,)
    own_mean: np.ndarray  # (O,)
    own_var: np.ndarray  # (O,)
    covariance: np.ndarray  # (R, O)

    def correlation(self) -> np.ndarray:
        """(R, O) Pearson correlations; 0 where either channel is constant."""
        scale = np.sqrt(np.outer(self.reference_var, self.own_var))
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(scale > 0, self.covariance / np.where(scale > 0, scale, 1.0), 0.0)


def combine_cross(parts: Sequence[CrossMoments]) -> CrossMoments:
    """The joint moments of the union of the samples ``parts`` were computed over, exactly
    (:func:`fusekit.core.stats.chan` on the stacked means [reference, own] and spreads
    [reference var, own var, covariance]: δ_r², δ_o², δ_r δ_oᵀ)."""
    r = parts[0].reference_mean.shape[0]

    def square(delta: np.ndarray) -> np.ndarray:
        d_r, d_o = delta[:r], delta[r:]
        return np.concatenate([d_r * d_r, d_o * d_o, np.outer(d_r, d_o).ravel()])

    count, mean, spread = chan(
        [(float(p.count[0]), np.concatenate([p.reference_mean, p.own_mean]),
          np.concatenate([p.reference_var, p.own_var, p.covariance.ravel()])) for p in parts],
        square)
    o = mean.shape[0] - r
    return CrossMoments(np.array([count]), mean[:r], spread[:r], mean[r:], spread[r:r + o],
                        spread[r + o:].reshape(r, o))


@dataclass
class CrossStatistics:
    """One client's cross statistics of a reference and its own model."""

    reference: str  # content hash of the reference (the fused model sent)
    model: str  # content hash of the client's own model
    num_samples: int
    mode: str  # how the reference ran: eval, or batch (BatchNorms on batch statistics)
    points: dict[str, CrossMoments]
    label: str = "<in-memory cross statistics>"


def save_cross_statistics(path: str | os.PathLike[str], stats: CrossStatistics, *,
                          force: bool = False) -> Path:
    """Write ``stats`` as safetensors, atomically (see :func:`save_checkpoint`)."""
    return save_statistics_file(path, meta.CROSS_STATS, cross_statistics_description(stats),
                                cross_statistics_tensors(stats), stats.num_samples, force)


def cross_statistics_tensors(stats: CrossStatistics) -> dict[str, np.ndarray]:
    """A cross statistics file's tensors: ``<point>.<field>``, float64."""
    return {f"{point}.{name}": np.asarray(getattr(moments, name), np.float64)
            for point, moments in stats.points.items() for name in FIELDS}


def cross_statistics_description(stats: CrossStatistics) -> str:
    """A cross statistics file's ``fusekit.cross_stats`` metadata (JSON)."""
    return json.dumps({"format": meta.CROSS_STATS_FORMAT, "reference": stats.reference,
                       "model": stats.model, "num_samples": stats.num_samples,
                       "mode": stats.mode})


def parse_cross_statistics(description: str, tensors: Mapping[str, np.ndarray],
                           label: str) -> CrossStatistics:
    """Cross statistics from what a file holds (:func:`cross_statistics_description`'s JSON
    and :func:`cross_statistics_tensors`) received by other means (a Flower message);
    checked for form only (:func:`check_cross_statistics` checks them against the models).

    Raises:
        StatisticsError: malformed description or tensor names (the message names ``label``).
    """
    return _parse(*_received(description, tensors, label, meta.CROSS_STATS), label)


def load_cross_statistics(path: str | os.PathLike[str], *, reference: str | None = None,
                          models: Mapping[str, Mapping[str, int]] | None = None,
                          widths: Mapping[str, int] | None = None,
                          min_samples: int = DEFAULT_MIN_SAMPLES) -> CrossStatistics:
    """Read and check a cross statistics file (see :func:`check_cross_statistics`).

    Raises:
        StatisticsError: one line naming the file.
    """
    stats = parse_cross_statistics(*read_statistics_file(
        path, meta.CROSS_STATS, "cross statistics", "fusekit stats FUSED --against OWN_MODEL"),
        str(path))
    check_cross_statistics(stats, reference=reference, models=models, widths=widths,
                           min_samples=min_samples)
    return stats


def _received(description: str, tensors: Mapping[str, np.ndarray], label: str,
              key: str) -> tuple[object, dict[str, np.ndarray]]:
    """A file's ``key`` description parsed and its tensors in float64."""
    return (meta.load_json(description, f"{label}: metadata {key}", StatisticsError),
            {name: np.asarray(t, np.float64) for name, t in tensors.items()})


def _parse(description: object, tensors: Mapping[str, np.ndarray],
           label: str) -> CrossStatistics:
    if not is_statistics_header(description, meta.CROSS_STATS_FORMAT, ("reference", "model")):
        raise StatisticsError(
            f"{label}: metadata {meta.CROSS_STATS} must be {{\"format\": "
            f"\"{meta.CROSS_STATS_FORMAT}\", \"reference\": <hash>, \"model\": <hash>, "
            f"\"num_samples\": <int>, \"mode\": eval|batch}}, found "
            f"{json.dumps(description)[:120]}")
    points = {point: CrossMoments(*arrays)
              for point, arrays in point_fields(tensors, FIELDS, label).items()}
    return CrossStatistics(description["reference"], description["model"],
                           description["num_samples"], description["mode"], points, label)


def check_cross_statistics(stats: CrossStatistics, *, reference: str | None = None,
                           models: Mapping[str, Mapping[str, int]] | None = None,
                           widths: Mapping[str, int] | None = None,
                           min_samples: int = DEFAULT_MIN_SAMPLES) -> None:
    """The checks of :func:`load_cross_statistics`, for cross statistics from any source.

    Args:
        stats: the statistics.
        reference: the content hash of the reference they must be computed with.
        models: per content hash of an accepted own model, its points and widths; the
            statistics must name one of them and hold exactly its points.
        widths: the reference's width at each point.
        min_samples: refuse statistics over fewer inputs.

    Raises:
        StatisticsError: for another reference or an unknown model, too few inputs,
            missing or misshapen points, counts that are not positive multiples of the
            inputs, non-finite values, negative variances, or covariances beyond the
            Cauchy-Schwarz bound.
    """
    label = stats.label
    if reference is not None and stats.reference != reference:
        raise StatisticsError(
            f"{label}: computed against reference {stats.reference[:16]}..., expected "
            f"{reference[:16]}... (run `fusekit stats FUSED --against OWN_MODEL` with the "
            "reference that was sent)")
    own_widths = None
    if models is not None:
        if stats.model not in models:
            raise StatisticsError(
                f"{label}: computed for model {stats.model[:16]}..., which is none of the "
                f"{len(models)} client model(s) given")
        own_widths = models[stats.model]
    check_num_samples(label, "cross statistics", stats.num_samples, min_samples)
    expected = set(own_widths) if own_widths is not None else (
        set(widths) if widths is not None else None)
    if expected is not None and set(stats.points) != expected:
        absent, extra = sorted(expected - set(stats.points)), sorted(set(stats.points) - expected)
        found = f"missing {absent[:3]}" if absent else f"unexpected {extra[:3]}"
        raise StatisticsError(f"{label}: points do not match the models: {found}")
    for point, moments in stats.points.items():
        _check_moments(label, point, moments, stats.num_samples,
                       None if widths is None else widths[point],
                       None if own_widths is None else own_widths[point])


def _check_moments(label: str, point: str, moments: CrossMoments, num_samples: int,
                   reference_width: int | None, own_width: int | None) -> None:
    r = moments.reference_mean.shape[0] if moments.reference_mean.ndim == 1 else -1
    o = moments.own_mean.shape[0] if moments.own_mean.ndim == 1 else -1
    expected = {"count": (1,), "reference_mean": (r,), "reference_var": (r,),
                "own_mean": (o,), "own_var": (o,), "covariance": (r, o)}
    found = {f: getattr(moments, f).shape for f in FIELDS}
    if (found != expected or r < 1 or o < 1
            or (reference_width is not None and r != reference_width)
            or (own_width is not None and o != own_width)):
        raise StatisticsError(
            f"{label}: point {point!r}: expected count (1,), reference (R={reference_width},), "
            f"own (O={own_width},) and covariance (R, O), found {found}")
    count = float(moments.count[0])
    if not whole_counts(count, num_samples):
        raise StatisticsError(
            f"{label}: point {point!r}: expected a positive count that is a multiple of the "
            f"{num_samples} inputs, at most 2**53, found {count}")
    if not all(np.all(np.isfinite(getattr(moments, f))) for f in FIELDS[1:]):
        raise StatisticsError(f"{label}: point {point!r}: every moment must be finite")
    if np.any(moments.reference_var < 0) or np.any(moments.own_var < 0):
        raise StatisticsError(f"{label}: point {point!r}: variances must be >= 0")
    for field in FIELDS[1:]:
        check_magnitude(f"{label}: point {point!r}", field, getattr(moments, field),
                        second=not field.endswith("_mean"))
    bound = np.sqrt(np.outer(moments.reference_var, moments.own_var))
    if np.any(np.abs(moments.covariance) > bound * (1 + SCHWARZ_SLACK) + 1e-12):
        raise StatisticsError(
            f"{label}: point {point!r}: covariances exceed sqrt(var_ref * var_own) "
            "(Cauchy-Schwarz): not the moments of any data")


# Refit statistics: what a client sends for one refit round (one layer, ALGORITHMS §12).

REFIT_FIELDS = ("count", "gram", "cross")
#: Relative ridge of a refit: λ = ridge · mean diagonal of the pooled Gram matrix.
DEFAULT_RIDGE = 0.1
#: The Gram matrix may deviate from symmetry / its constant entry from 1 by this much.
GRAM_TOLERANCE = 1e-6


@dataclass
class RefitStatistics:
    """One client's moments for refitting one layer of the fused model: over every input
    position (n rows), ``gram`` = E[u uᵀ] (d+1, d+1), u the fused model's input to the layer
    (a conv's patch, C_in·kh·kw values) with a trailing 1, and ``cross`` = E[y uᵀ]
    (O, d+1), y the client's own pre-activation of that layer."""

    reference: str
    model: str
    layer: str
    num_samples: int
    count: int
    gram: np.ndarray
    cross: np.ndarray
    label: str = "<in-memory refit statistics>"


def save_refit_statistics(path: str | os.PathLike[str], stats: RefitStatistics, *,
                          force: bool = False) -> Path:
    """Write ``stats`` as safetensors, atomically (see :func:`save_checkpoint`)."""
    return save_statistics_file(path, meta.REFIT_STATS, refit_statistics_description(stats),
                                refit_statistics_tensors(stats), stats.num_samples, force)


def refit_statistics_tensors(stats: RefitStatistics) -> dict[str, np.ndarray]:
    """A refit statistics file's tensors: count (1,), gram, cross, float64."""
    return {"count": np.array([float(stats.count)]), "gram": np.asarray(stats.gram, np.float64),
            "cross": np.asarray(stats.cross, np.float64)}


def refit_statistics_description(stats: RefitStatistics) -> str:
    """A refit statistics file's ``fusekit.refit_stats`` metadata (JSON)."""
    return json.dumps({"format": meta.REFIT_STATS_FORMAT, "reference": stats.reference,
                       "model": stats.model, "layer": stats.layer,
                       "num_samples": stats.num_samples})


def load_refit_statistics(path: str | os.PathLike[str], **checks) -> RefitStatistics:
    """Read a refit statistics file and check it (:func:`check_refit_statistics`).

    Raises:
        StatisticsError: one line naming the file.
    """
    stats = parse_refit_statistics(*read_statistics_file(
        path, meta.REFIT_STATS, "refit statistics",
        "fusekit stats FUSED --against OWN_MODEL --layer NAME"), str(path))
    check_refit_statistics(stats, **checks)
    return stats


def parse_refit_statistics(description: str, tensors: Mapping[str, np.ndarray],
                           label: str) -> RefitStatistics:
    """Refit statistics from what a file holds (:func:`refit_statistics_description`'s JSON
    and :func:`refit_statistics_tensors`) received by other means (a Flower message);
    checked for form only (:func:`check_refit_statistics` checks them against the models).

    Raises:
        StatisticsError: malformed description or tensors (the message names ``label``).
    """
    return _parse_refit(*_received(description, tensors, label, meta.REFIT_STATS), label)


def _parse_refit(description: object, tensors: Mapping[str, np.ndarray],
                 label: str) -> RefitStatistics:
    if (not is_statistics_header(description, meta.REFIT_STATS_FORMAT,
                                 ("reference", "model", "layer"), with_mode=False)
            or set(tensors) != set(REFIT_FIELDS) or tensors["count"].shape != (1,)):
        raise StatisticsError(
            f"{label}: expected metadata {meta.REFIT_STATS} {{\"format\": "
            f"\"{meta.REFIT_STATS_FORMAT}\", \"reference\", \"model\", \"layer\", "
            f"\"num_samples\"}} and tensors count (1,), gram, cross; found "
            f"{json.dumps(description)[:100]} and {sorted(tensors)[:4]}")
    count = float(tensors["count"][0])
    return RefitStatistics(description["reference"], description["model"],
                           description["layer"], description["num_samples"],
                           int(count) if np.isfinite(count) and count == round(count) else -1,
                           tensors["gram"], tensors["cross"], label)


def check_refit_statistics(stats: RefitStatistics, *, reference: str | None = None,
                           models: Mapping[str, Mapping[str, int]] | None = None,
                           inputs: Mapping[str, int] | None = None,
                           min_samples: int = DEFAULT_MIN_SAMPLES) -> None:
    """Check refit statistics from any source.

    Args:
        stats: the statistics.
        reference: the content hash of the fused model they must be computed with.
        models: per accepted own model's content hash, its width per layer.
        inputs: per layer of the fused model, d (its input values per row).
        min_samples: refuse statistics over fewer inputs.

    Raises:
        StatisticsError: for another fused model, an unknown client or layer, too few
            inputs, misshapen or non-finite moments, a Gram matrix that is not symmetric or
            whose constant entry is not 1, negative diagonals.
    """
    label = stats.label
    if reference is not None and stats.reference != reference:
        raise StatisticsError(
            f"{label}: computed against fused model {stats.reference[:16]}..., expected "
            f"{reference[:16]}... (run `fusekit stats FUSED --against OWN_MODEL --layer "
            "NAME` with the model that was sent)")
    if models is not None and stats.model not in models:
        raise StatisticsError(f"{label}: computed for model {stats.model[:16]}..., which is "
                              f"none of the {len(models)} client model(s) given")
    if inputs is not None and stats.layer not in inputs:
        raise StatisticsError(f"{label}: layer {stats.layer!r} is not a layer of the fused "
                              f"model ({', '.join(list(inputs)[:4])}, ...)")
    check_num_samples(label, "refit statistics", stats.num_samples, min_samples)
    d = stats.gram.shape[0] - 1 if stats.gram.ndim == 2 else -1
    width = None if models is None else models[stats.model].get(stats.layer)
    expected_d = None if inputs is None else inputs[stats.layer]
    if (stats.gram.shape != (d + 1, d + 1) or d < 1 or stats.cross.ndim != 2
            or stats.cross.shape[1] != d + 1
            or (expected_d is not None and d != expected_d)
            or (width is not None and stats.cross.shape[0] != width)):
        raise StatisticsError(
            f"{label}: layer {stats.layer!r}: expected gram (d+1, d+1) and cross (O, d+1) "
            f"with d = {expected_d}, O = {width}; found gram {stats.gram.shape}, cross "
            f"{stats.cross.shape}")
    if not whole_counts(stats.count, stats.num_samples):
        raise StatisticsError(f"{label}: expected a positive count that is a multiple of the "
                              f"{stats.num_samples} inputs, at most 2**53, found {stats.count}")
    if not (np.all(np.isfinite(stats.gram)) and np.all(np.isfinite(stats.cross))):
        raise StatisticsError(f"{label}: layer {stats.layer!r}: every moment must be finite")
    for field in ("gram", "cross"):  # second moments, E[u uᵀ] and E[y uᵀ]
        check_magnitude(f"{label}: layer {stats.layer!r}", field, getattr(stats, field),
                        second=True)
    gram = stats.gram
    scale = max(float(np.max(np.abs(np.diag(gram)))), 1.0)
    if (np.any(np.diag(gram) < 0) or np.max(np.abs(gram - gram.T)) > GRAM_TOLERANCE * scale
            or abs(gram[-1, -1] - 1.0) > GRAM_TOLERANCE):
        raise StatisticsError(
            f"{label}: layer {stats.layer!r}: gram must be E[u uᵀ] of rows ending in 1 "
            "(symmetric, diagonal >= 0, last entry 1): not the moments of any data")
