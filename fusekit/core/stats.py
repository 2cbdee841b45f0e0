"""Statistics files: what a client sends for calibration (ALGORITHMS.md §12).

A statistics file holds, for one model run on one client's data, per channel of every
*point* of the network its sample count, mean and (population) variance, float64:

- ``preactivation:<layer>``: a hidden layer's pre-activation (its output after the
  BatchNorm, if any, before the ReLU);
- ``bn_input:<batchnorm>``: a BatchNorm's input;
- for transformers, ``mlp_hidden:<module>`` (an MLP's hidden pre-activation) and
  ``layernorm:<module>`` (a LayerNorm's output), over every token that is not padding:
  their counts are token counts (:data:`TOKEN_POINTS`);
- ``input:<layer>`` (opt-in, the first layer only): the vectors the first layer multiplies
  (a Linear's inputs, a Conv2d's zero-padded patches at every output position): their
  count, mean (d,) and population covariance (d, d) (tensors ``.count``, ``.mean``,
  ``.cov``), from which the fused first layer's statistics follow exactly, without a
  round (:func:`fusekit.methods.calibration.derived_moments`).

Conv layers count every spatial position of a channel as one sample. Tensors are named
``<point>.count``, ``<point>.mean``, ``<point>.var``; the metadata ``fusekit.stats`` names
the model by its canonical content hash, the number of inputs run and the mode (``eval``:
the model as it is; ``batch``: every BatchNorm normalised with the batch's statistics).
Nothing else leaves a client: no input, no label, no per-sample value.

Statistics files are untrusted input: :func:`load_statistics` checks them against the
model they are meant for. :func:`pool` combines clients exactly (Chan et al.'s update), as
one pass over the union of their data would.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fusekit.core import metadata as meta
from fusekit.core.checkpoint import load_checkpoint, save_checkpoint
from fusekit.core.errors import CheckpointError, StatisticsError
from fusekit.core.transformer import LAYERNORM, MLP_HIDDEN

PREACTIVATION = "preactivation"
BN_INPUT = "bn_input"
INPUT = "input"
FIELDS = ("count", "mean", "var")
INPUT_FIELDS = ("count", "mean", "cov")
#: An input covariance may be asymmetric, or have negative eigenvalues, by this much
#: relative to its largest entry (float64 rounding), and no more.
COVARIANCE_TOLERANCE = 1e-8
MODES = ("eval", "batch")
#: Point kinds whose samples are tokens (a count need not be a multiple of the inputs).
TOKEN_POINTS = (MLP_HIDDEN, LAYERNORM)
#: Statistics over fewer inputs than this are refused: per-channel moments of a handful
#: of samples come close to revealing the samples themselves.
DEFAULT_MIN_SAMPLES = 32
#: The largest |mean| or standard deviation a statistics file may report (second moments:
#: its square). Real activations stay far below; beyond it the float32 tensors calibration
#: writes could overflow (REPAIR scales a neuron by up to its target std / MIN_STD).
MAX_MAGNITUDE = 1e12
#: The largest count (of inputs, or of values at a point) a statistics file may report:
#: float64 holds whole numbers exactly up to it, and pooled sums of count x mean stay finite.
MAX_COUNT = 2**53


@dataclass
class Moments:
    """Per-channel sample count, mean and population variance, float64 (C,) each."""

    count: np.ndarray
    mean: np.ndarray
    var: np.ndarray

    @property
    def std(self) -> np.ndarray:
        return np.sqrt(self.var)

    @property
    def unbiased_var(self) -> np.ndarray:
        """The variance torch's BatchNorm stores as ``running_var``: sum of squares / (n-1)."""
        return self.var * self.count / np.maximum(self.count - 1, 1)


@dataclass
class InputMoments:
    """A layer's input vectors: their count, mean (d,) and population covariance (d, d),
    float64."""

    count: float
    mean: np.ndarray
    cov: np.ndarray


@dataclass
class Statistics:
    """One client's statistics of one model (see the module docstring)."""

    model: str  # canonical content hash of the model
    num_samples: int
    mode: str
    points: dict[str, Moments]
    label: str = "<in-memory statistics>"
    inputs: dict[str, InputMoments] = field(default_factory=dict)  # input:<layer> (opt-in)


def preactivation_point(layer_name: str) -> str:
    return f"{PREACTIVATION}:{layer_name}"


def bn_input_point(norm_prefix: str) -> str:
    return f"{BN_INPUT}:{norm_prefix}"


def input_point(layer_name: str) -> str:
    return f"{INPUT}:{layer_name}"


def calibrated_point(layer) -> str:
    """The point whose pooled moments calibrate ``layer``: its BatchNorm's input, else its
    pre-activation (REPAIR)."""
    return bn_input_point(layer.norm.prefix) if layer.norm else preactivation_point(layer.name)


def statistic_points(spec) -> dict[str, int]:
    """Every point a statistics file of a model with this spec holds, with its width."""
    points = {}
    for layer in spec.layers[:-1]:
        points[preactivation_point(layer.name)] = layer.out_features
        if layer.norm is not None:
            points[bn_input_point(layer.norm.prefix)] = layer.out_features
    return points


def save_statistics(path: str | os.PathLike[str], stats: Statistics, *,
                    force: bool = False) -> Path:
    """Write ``stats`` as safetensors, atomically (see :func:`save_checkpoint`)."""
    return save_statistics_file(path, meta.STATS, statistics_description(stats),
                                statistics_tensors(stats), stats.num_samples, force)


def save_statistics_file(path: str | os.PathLike[str], key: str, description: str,
                         tensors: Mapping[str, np.ndarray], num_samples: int,
                         force: bool) -> Path:
    """A statistics file of any kind (per-channel, cross, refit): its tensors, and its
    description under the metadata ``key`` beside the number of inputs it covers."""
    return save_checkpoint(path, tensors, {key: description,
                                           meta.NUM_SAMPLES: str(num_samples)}, force=force)


def read_statistics_file(path: str | os.PathLike[str], key: str, kind: str,
                         command: str | None = None) -> tuple[str, dict[str, np.ndarray]]:
    """A statistics file of any kind (what :func:`save_statistics_file` wrote): its
    description under the metadata ``key``, as written, and its tensors.

    Raises:
        StatisticsError: unreadable, or not a ``kind`` file (the message names the
            ``command`` that writes one).
    """
    try:
        checkpoint = load_checkpoint(path)
        raw = checkpoint.metadata.get(key)
        if raw is None:
            how = f"; write one with `{command}`" if command else ""
            raise StatisticsError(f"{path}: not a {kind} file (no {key} metadata{how})")
        tensors = {name: np.asarray(checkpoint.tensor(name)) for name in checkpoint.tensors}
    except CheckpointError as exc:
        raise StatisticsError(f"{kind} file {exc}") from None
    return raw, tensors


def statistics_tensors(stats: Statistics) -> dict[str, np.ndarray]:
    """A statistics file's tensors: ``<point>.count``, ``.mean``, ``.var``, float64 (input
    moments: ``.count`` (1,), ``.mean``, ``.cov``)."""
    tensors = {f"{point}.{name}": np.asarray(getattr(moments, name), np.float64)
               for point, moments in stats.points.items() for name in FIELDS}
    tensors.update({f"{point}.{name}": np.atleast_1d(np.asarray(getattr(moments, name),
                                                                np.float64))
                    for point, moments in stats.inputs.items() for name in INPUT_FIELDS})
    return tensors


def statistics_description(stats: Statistics) -> str:
    """A statistics file's ``fusekit.stats`` metadata (JSON): format, model, inputs, mode."""
    return json.dumps({"format": meta.STATS_FORMAT, "model": stats.model,
                       "num_samples": stats.num_samples, "mode": stats.mode})


def parse_statistics(description: str, tensors: Mapping[str, np.ndarray],
                     label: str) -> Statistics:
    """Statistics from what a file holds (:func:`statistics_description`'s JSON and
    :func:`statistics_tensors`) received by other means (a Flower message); checked for
    form only: :func:`check_statistics` checks them against a model.

    Raises:
        StatisticsError: malformed description or tensor names (the message names ``label``).
    """
    parsed = meta.load_json(description, f"{label}: metadata {meta.STATS}", StatisticsError)
    return _parse(parsed, tensors, label)


def load_statistics(path: str | os.PathLike[str], *, model: str | None = None,
                    points: Mapping[str, int] | None = None,
                    min_samples: int = DEFAULT_MIN_SAMPLES,
                    inputs: Mapping[str, int] | None = None) -> Statistics:
    """Read and check a statistics file.

    Args:
        path: the file.
        model: the content hash it must name (None: any model).
        points: the points it must hold, with their widths (None: whatever it holds).
        min_samples: refuse statistics over fewer inputs.
        inputs: the input moments it may hold, with their dimension d (None: any).

    Raises:
        StatisticsError: one line naming the file: unreadable, not a statistics file, for
            another model, missing or misshapen points, counts not positive or not a
            multiple of the inputs run, non-finite means, negative or non-finite
            variances, moments beyond :data:`MAX_MAGNITUDE`, input moments of another
            point or dimension, misshapen, non-finite, not symmetric positive
            semi-definite or over no more vectors than their dimension, or fewer than
            ``min_samples`` inputs.
    """
    stats = parse_statistics(*read_statistics_file(path, meta.STATS, "statistics"), str(path))
    check_statistics(stats, model=model, points=points, min_samples=min_samples,
                     inputs=inputs)
    return stats


def _parse(description: object, tensors: Mapping[str, np.ndarray], label: str) -> Statistics:
    if not is_statistics_header(description, meta.STATS_FORMAT, ("model",)):
        raise StatisticsError(
            f"{label}: metadata {meta.STATS} must be {{\"format\": \"{meta.STATS_FORMAT}\", "
            f"\"model\": <hash>, \"num_samples\": <int>, \"mode\": eval|batch}}, found "
            f"{json.dumps(description)[:120]}"
        )
    inputs = {name: array for name, array in tensors.items() if name.startswith(f"{INPUT}:")}
    points = {point: Moments(*arrays) for point, arrays in point_fields(
        {n: a for n, a in tensors.items() if n not in inputs}, FIELDS, label).items()}
    moments = {point: InputMoments(count.item() if count.size == 1 else count, mean, cov)
               for point, (count, mean, cov) in point_fields(inputs, INPUT_FIELDS,
                                                             label).items()}
    return Statistics(description["model"], description["num_samples"], description["mode"],
                      points, label, moments)


def is_statistics_header(description: object, format_: str, names: Sequence[str], *,
                         with_mode: bool = True) -> bool:
    """Whether a statistics file's metadata is a dict in ``format_`` with a string (a
    content hash, a layer) at each of ``names``, an integer ``num_samples`` and, when
    ``with_mode``, a ``mode`` of :data:`MODES`."""
    return (isinstance(description, dict) and description.get("format") == format_
            and all(isinstance(description.get(name), str) for name in names)
            and (not with_mode or description.get("mode") in MODES)
            and isinstance(description.get("num_samples"), int)
            and not isinstance(description.get("num_samples"), bool))


def point_fields(tensors: Mapping[str, np.ndarray], fields: Sequence[str],
                 label: str) -> dict[str, list[np.ndarray]]:
    """Tensors named ``<point>.<field>`` grouped by point, float64, in ``fields``' order.

    Raises:
        StatisticsError: a tensor of another name, or a point that lacks a field.
    """
    grouped: dict[str, dict[str, np.ndarray]] = {}
    for name, array in tensors.items():
        point, _, field = name.rpartition(".")
        if field not in fields or not point:
            raise StatisticsError(f"{label}: tensor {name!r} is not <point>.{'/'.join(fields)}")
        grouped.setdefault(point, {})[field] = array
    out = {}
    for point, found in grouped.items():
        missing = [f for f in fields if f not in found]
        if missing:
            raise StatisticsError(f"{label}: point {point!r} lacks {', '.join(missing)}")
        out[point] = [np.asarray(found[f], np.float64) for f in fields]
    return out


def check_statistics(stats: Statistics, *, model: str | None = None,
                     points: Mapping[str, int] | None = None,
                     min_samples: int = DEFAULT_MIN_SAMPLES,
                     inputs: Mapping[str, int] | None = None) -> None:
    """The checks of :func:`load_statistics`, for statistics from any source."""
    label = stats.label
    if model is not None and stats.model != model:
        raise StatisticsError(
            f"{label}: computed for model {stats.model[:16]}..., expected {model[:16]}... "
            "(run `fusekit stats` on this model)")
    check_num_samples(label, "statistics", stats.num_samples, min_samples)
    if points is not None:
        absent = sorted(set(points) - set(stats.points))
        extra = sorted(set(stats.points) - set(points))
        if absent or extra:
            found = f"missing {absent[:3]}" if absent else f"unexpected {extra[:3]}"
            raise StatisticsError(f"{label}: points do not match the model: {found}")
    for point, moments in stats.points.items():
        _check_moments(label, point, moments, None if points is None else points[point],
                       stats.num_samples)
    for point, moments in stats.inputs.items():
        where = f"{label}: point {point!r}"
        if inputs is not None:
            _check_input_point(where, point, moments, inputs)
        check_input_moments(where, moments, stats.num_samples)


def _check_input_point(where: str, point: str, moments: InputMoments,
                       inputs: Mapping[str, int]) -> None:
    """Input moments of a point the model has, of its dimension: checked before their
    values, so that checking costs what the model's d allows, never what a file claims."""
    if point not in inputs:
        raise StatisticsError(f"{where}: not an input point of the model; expected "
                              f"{', '.join(map(repr, inputs)) or 'none'}")
    found = np.shape(moments.mean)
    if found != (inputs[point],):
        raise StatisticsError(f"{where}: input moments of shape {found}; the layer "
                              f"multiplies vectors of {inputs[point]}")


def check_num_samples(label: str, what: str, num_samples: int, min_samples: int) -> None:
    """The number of inputs a file of ``what`` reports: at least ``min_samples`` (moments of
    a few samples reveal them), at most :data:`MAX_COUNT`."""
    if num_samples > MAX_COUNT:
        raise StatisticsError(f"{label}: {what} over {str(num_samples)[:24]} inputs; expected "
                              "at most 2**53")
    if num_samples < min_samples:
        raise StatisticsError(
            f"{label}: {what} over {num_samples} inputs; at least {min_samples} are "
            "required (moments of a few samples reveal them)")


def whole_counts(count: np.ndarray | float, multiple: int) -> bool:
    """Whether ``count`` holds positive whole multiples of ``multiple``, none above
    :data:`MAX_COUNT`."""
    count = np.asarray(count, np.float64)
    with np.errstate(invalid="ignore"):  # inf % multiple: NaN, which is no multiple
        return bool(np.all((count > 0) & (count == np.round(count)) & (count % multiple == 0)
                           & (count <= MAX_COUNT)))


def check_input_moments(label: str, moments: InputMoments, num_samples: int) -> None:
    """Input moments as untrusted input: shapes (1,), (d,), (d, d); a count that is a
    multiple of the inputs run and above d (no more vectors than dimensions lie in a
    subspace their covariance reveals); a finite mean; a finite, symmetric, positive
    semi-definite covariance (within :data:`COVARIANCE_TOLERANCE`).

    Raises:
        StatisticsError: one line starting with ``label``.
    """
    count, mean, cov = (np.asarray(getattr(moments, f)) for f in INPUT_FIELDS)
    d = mean.shape[0] if mean.ndim == 1 else 0
    if count.size != 1 or d < 1 or cov.shape != (d, d):
        raise StatisticsError(
            f"{label}: expected count (1,), mean (d,) and cov (d, d), found "
            f"{count.shape}, {mean.shape}, {cov.shape}")
    n = float(count.reshape(-1)[0])
    if not (n > d and whole_counts(n, num_samples)):
        raise StatisticsError(
            f"{label}: expected a count above the dimension {d} that is a multiple of the "
            f"{num_samples} inputs, at most 2**53, found {n:g}")
    if not (np.all(np.isfinite(mean)) and np.all(np.isfinite(cov))):
        raise StatisticsError(f"{label}: mean and covariance must be finite")
    check_magnitude(label, "mean", mean)
    check_magnitude(label, "covariance", cov, second=True)
    tolerance = COVARIANCE_TOLERANCE * max(float(np.abs(cov).max()), 1e-300)
    if np.abs(cov - cov.T).max() > tolerance:
        raise StatisticsError(f"{label}: the covariance is not symmetric")
    lowest = float(np.linalg.eigvalsh(cov).min())
    if lowest < -tolerance * d:
        raise StatisticsError(
            f"{label}: the covariance is not positive semi-definite (eigenvalue {lowest:.3g})")


def _check_moments(label: str, point: str, moments: Moments, width: int | None,
                   num_samples: int) -> None:
    shapes = {f: getattr(moments, f).shape for f in FIELDS}
    if len(set(shapes.values())) != 1 or len(shapes["count"]) != 1 or (
            width is not None and shapes["count"] != (width,)):
        raise StatisticsError(
            f"{label}: point {point!r}: expected count, mean and var of shape ({width},), "
            f"found {shapes}")
    count = moments.count
    tokens = point.partition(":")[0] in TOKEN_POINTS
    if not whole_counts(count, 1 if tokens else num_samples):
        expected = "positive integer counts" if tokens else (
            f"positive counts that are multiples of the {num_samples} inputs")
        expected += " of at most 2**53"
        raise StatisticsError(f"{label}: point {point!r}: expected {expected}, found "
                              f"{np.unique(count)[:4].tolist()}")
    if not np.all(np.isfinite(moments.mean)):
        raise StatisticsError(f"{label}: point {point!r}: means must be finite")
    if not np.all(np.isfinite(moments.var) & (moments.var >= 0)):
        raise StatisticsError(
            f"{label}: point {point!r}: variances must be finite and >= 0, found "
            f"{moments.var[~(np.isfinite(moments.var) & (moments.var >= 0))][:3].tolist()}")
    check_magnitude(f"{label}: point {point!r}", "means", moments.mean)
    check_magnitude(f"{label}: point {point!r}", "variances", moments.var, second=True)


def check_magnitude(label: str, what: str, values: np.ndarray, second: bool = False) -> None:
    """Refuse finite moments beyond :data:`MAX_MAGNITUDE` (``second``: its square), in one
    line starting with ``label``."""
    bound = MAX_MAGNITUDE ** 2 if second else MAX_MAGNITUDE
    largest = float(np.abs(values).max(initial=0.0))
    if largest > bound:
        raise StatisticsError(f"{label}: {what} up to {largest:.3g}; expected at most "
                              f"{bound:.0e} in magnitude (beyond, a calibrated float32 model "
                              "overflows)")


def pool(clients: Sequence[Statistics]) -> dict[str, Moments]:
    """Combine clients' statistics of the same model and points, exactly.

    Per point, :func:`combine` (Chan et al.'s update): equal to one pass over the union of
    the clients' data, without the cancellation of Σx² - n·mean².

    Raises:
        StatisticsError: no statistics, or statistics of different models, modes or points.
    """
    if not clients:
        raise StatisticsError("calibration: expected at least one statistics file, got none")
    first = clients[0]
    for other in clients[1:]:
        if (other.model, other.mode, set(other.points)) != (first.model, first.mode,
                                                              set(first.points)):
            raise StatisticsError(
                f"{other.label}: not pooled with {first.label}: expected the same model, "
                f"mode and points, found model {other.model[:16]}... vs {first.model[:16]}..., "
                f"mode {other.mode} vs {first.mode}")
    return {point: combine([c.points[point] for c in clients]) for point in first.points}


def combine(parts: Sequence[Moments]) -> Moments:
    """The moments of the union of the samples ``parts`` were computed over (Chan et al.):
    n = Σ n_s, mean = Σ n_s mean_s / n, M2 = Σ n_s var_s + Σ n_s (mean_s - mean)²,
    var = M2 / n."""
    return Moments(*chan([(p.count, p.mean, p.var) for p in parts], np.square))


def combine_inputs(parts: Sequence[InputMoments]) -> InputMoments:
    """:func:`combine` for input moments: M2 = Σ n_s cov_s + Σ n_s δ_s δ_sᵀ,
    δ_s = mean_s - mean."""
    count, mean, cov = chan([(float(np.asarray(p.count).reshape(-1)[0]), p.mean, p.cov)
                              for p in parts], lambda delta: np.outer(delta, delta))
    return InputMoments(count, mean, cov)


def chan(parts, square):
    """(count, mean, M2 / count) of the union of parts given as (count, mean, spread):
    Chan et al.'s update, the one merge of every moment kind (``square(δ)`` is δ's
    contribution to the spread: δ², δ δᵀ, or the cross kind's blocks)."""
    count = sum(n for n, _, _ in parts)
    mean = sum(n * m for n, m, _ in parts) / count
    m2 = sum(n * (spread + square(m - mean)) for n, m, spread in parts)
    return count, mean, m2 / count
