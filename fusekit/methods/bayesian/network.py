"""Whole networks: hidden layers matched bottom-up (ALGORITHMS.md §2-3), then the output layer
and the tensors outside the layers.

Each client's incoming weights are first mapped into the global index space of the layer
below (``fusekit.core.neurons``), BatchNorm folded. The last hidden layer's vectors also
carry the outgoing weights (NAFI paper, Problem Formulation). Every local neuron gets a
global neuron (a target width is never below the widest client), so the next layer's
incoming dimension is always the fused width of the layer below, and the weights leaving
a global neuron are those of its members. Residual networks (a GraphSpec) are matched
group by group instead (:func:`fuse_groups`, ALGORITHMS.md §11).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from fusekit.core import neurons, progress
from fusekit.core.errors import IncompatibleModelsError, ParameterError
from fusekit.methods.avg import (
    average_tensor,
    class_counts_matrix,
    class_information,
    class_shares,
    information_shares,
)
from fusekit.methods.base import sample_weights
from fusekit.methods.bayesian import empirical
from fusekit.methods.bayesian.layer import LayerMatching, check_width, member_means

logger = logging.getLogger(__name__)

VARIANCE_UNITS = ("relative", "absolute")
UNOBSERVED = ("mask", "zeros")
#: Per-class client weights of the output layer (ALGORITHMS.md §3): ``information``
#: N_sk (1 - N_sk / N_s), normalised over clients; ``counts`` the NAFI paper's N_sk.
CLASS_WEIGHTS = ("information", "counts")
#: Below this class contrast (see :func:`heterogeneity`) the clients' output layers hold
#: too little one-against-the-rest evidence for any compact fused model to match an
#: ensemble of the clients (benchmarks/RESULTS.md, "Non-iid floor").
LOW_CLASS_CONTRAST = 0.5
UNLIMITED = "unlimited"
#: Default fused width, relative to the widest client (see docs/methods.md, "PFNM and NAFI").
DEFAULT_WIDTH_RATIO = 1.5


@dataclass(frozen=True)
class BayesianParams:
    """Parameters of PFNM / NAFI; see ``BayesianMatching.fuse`` for their meaning and units.

    ``sigma`` / ``sigma0`` / ``gamma`` are None when estimated (empirical Bayes); ``width``
    is None (use ``width_ratio``), an int, a tuple per hidden layer, or ``"unlimited"``.
    """

    lam: float = 0.0
    width: int | tuple[int, ...] | str | None = None
    width_ratio: float | None = None
    sigma: float | tuple[float, ...] | None = None
    sigma0: float | None = None
    gamma: float | None = None
    mu0: float = 0.0
    sweeps: int = 5
    seed: int = 0
    class_share: bool | None = None
    class_weights: str = "information"
    unobserved: str = "mask"
    variance_units: str = "relative"
    backend: str = "core"

    def as_json(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        for key in ("sigma", "width"):
            if isinstance(out[key], tuple):
                out[key] = list(out[key])
        return out


def as_sigma(sigma: Any) -> float | tuple[float, ...] | None:
    """``sigma`` as None, one variance or a tuple of per-client variances (never a string)."""
    if sigma is None:
        return None
    if isinstance(sigma, str):
        raise ParameterError(f"sigma: expected a number or one number per client, found {sigma!r}")
    try:
        values = np.asarray(sigma, dtype=np.float64)
    except (TypeError, ValueError):
        raise ParameterError(
            f"sigma: expected a number or one number per client, found {sigma!r}"
        ) from None
    if values.ndim > 1:
        raise ParameterError(f"sigma: expected a number or a 1-D list, found shape {values.shape}")
    return float(values) if values.ndim == 0 else tuple(values.tolist())


def as_width(width: Any) -> int | tuple[int, ...] | str | None:
    """``width`` as None, ``"unlimited"``, one int or a tuple of ints (one per hidden layer);
    a string of digits or comma-separated digits (the CLI's form) is read as numbers."""
    if width is None or width == UNLIMITED:
        return width
    if isinstance(width, str):
        try:
            parts = [int(p) for p in width.split(",")]
        except ValueError:
            raise ParameterError(
                f"width: expected an integer, a comma-separated list of integers or "
                f"{UNLIMITED!r}, found {width!r}"
            ) from None
        return parts[0] if len(parts) == 1 else tuple(parts)
    if isinstance(width, Sequence):
        values = tuple(width)
        for value in values:
            check_width(value, 1)
        return values
    check_width(width, 1)
    return int(width)


def ratio_width(ratio: float, widest: int) -> int:
    """``ratio`` x ``widest`` rounded half up (1.5 x 7 = 11), never below ``widest``."""
    return max(widest, math.floor(ratio * widest + 0.5))


def layer_widths(
    params: BayesianParams, client_widths: Sequence[Sequence[int]]
) -> list[int | None]:
    """The width asked for each hidden layer (None: inferred), from ``width`` or the ratio.

    Args:
        params: the parameters.
        client_widths: per client, its hidden widths.

    Raises:
        ParameterError: both width and width_ratio given, a ratio below 1, a list of the
            wrong length, or a width below the widest client.
    """
    widest = [max(ws) for ws in zip(*client_widths, strict=True)]
    if params.width is not None and params.width_ratio is not None:
        raise ParameterError("width and width_ratio: expected one of them, found both"
                             ).naming("width", "width_ratio")
    if params.width == UNLIMITED:
        return [None] * len(widest)
    if params.width is None:
        ratio = DEFAULT_WIDTH_RATIO if params.width_ratio is None else params.width_ratio
        if not (math.isfinite(ratio) and ratio >= 1.0):
            raise ParameterError(f"width_ratio: expected a finite number >= 1, found {ratio}")
        return [ratio_width(ratio, w) for w in widest]
    asked = (list(params.width) if isinstance(params.width, tuple)
             else [params.width] * len(widest))
    if len(asked) != len(widest):
        raise ParameterError(
            f"width: expected one value or one per hidden layer ({len(widest)}), "
            f"found {len(asked)}"
        )
    for index, (value, least) in enumerate(zip(asked, widest, strict=True)):
        check_width(value, least, f"width (hidden layer {index})")
    return asked


def client_sigmas(sigma: float | Sequence[float], n_clients: int) -> np.ndarray:
    values = np.atleast_1d(np.asarray(sigma, dtype=np.float64))
    if values.ndim != 1 or values.size not in (1, n_clients):
        raise ParameterError(
            f"sigma: expected one variance or one per client ({n_clients}), found {values.size}"
        )
    if not (np.isfinite(values).all() and (values > 0).all()):
        raise ParameterError(
            f"sigma: expected finite variances > 0, found minimum {np.nanmin(values):.3g}"
            if np.isfinite(values).any() else "sigma: expected finite variances > 0"
        )
    return np.broadcast_to(values, (n_clients,)).copy()


def _class_shares(checkpoints, n_classes: int, params: BayesianParams) -> np.ndarray | None:
    """(S, K) per-class client weights when class-share weighting is on, else None:
    information shares or the NAFI paper's class shares f_sk (``params.class_weights``)."""
    wanted = params.class_share
    if wanted is None:
        wanted = all(c.class_counts is not None for c in checkpoints)
    if not wanted:
        return None
    if params.class_weights not in CLASS_WEIGHTS:
        raise ParameterError(f"class_weights: expected one of {', '.join(CLASS_WEIGHTS)}, "
                             f"found {params.class_weights!r}")
    rule = information_shares if params.class_weights == "information" else class_shares
    return rule(checkpoints, n_classes)


def heterogeneity(checkpoints, n_classes: int, last_layer: dict[str, Any]) -> dict[str, Any]:
    """How different the clients are, from what the checkpoints carry (no data).

    ``matched_share``: share of the last hidden layer's client neurons that share a fused
    neuron with another client's. ``class_contrast``: sum_sk N_sk (1 - N_sk / N_s) over
    N (1 - 1/K), the clients' one-against-the-rest evidence relative to balanced clients
    (1: every client balanced; 0: every client holds one class); None without class counts.
    ``classes_without_contrast``: classes held only by one-class clients (no client's
    output layer separates them from the rest). ``compact_ok`` is False when the class
    contrast is below :data:`LOW_CLASS_CONTRAST` or some class has no contrast: no compact
    fused model is then expected to reach an ensemble of the clients.
    """
    clients = last_layer.get("clients", [])
    total = sum(c["width"] for c in clients)
    out: dict[str, Any] = {
        "matched_share": sum(c["matched"] for c in clients) / total if total else None,
        "class_contrast": None, "classes_without_contrast": [], "compact_ok": True,
    }
    if any(c.class_counts is None for c in checkpoints) or n_classes < 2:
        return out
    counts = class_counts_matrix(checkpoints, n_classes)
    information = class_information(counts)
    contrast = information.sum() / max(counts.sum() * (1.0 - 1.0 / n_classes), 1e-300)
    blind = np.flatnonzero((counts.sum(axis=0) > 0) & (information.sum(axis=0) == 0))
    out.update(class_contrast=float(contrast), classes_without_contrast=blind.tolist(),
               compact_ok=bool(contrast >= LOW_CLASS_CONTRAST and blind.size == 0))
    return out


class LayerFit(NamedTuple):
    """One matched layer and the values it was matched with.

    Attributes:
        matching: the LayerMatching.
        sigma2: (S, P) per-client sigma^2 in weight units.
        sigma0_2: (P,) sigma0^2 in weight units.
        posterior_means: the fused neurons are posterior means (Eq. 4); False: their
            members' means (an estimated variance).
        report: the report entry of the hyperparameters.
    """

    matching: LayerMatching
    sigma2: np.ndarray
    sigma0_2: np.ndarray
    posterior_means: bool
    report: dict[str, Any]


def match_layer(params, sigmas, vecs, observed, unit, index, width, weights=None) -> LayerFit:
    """Match one layer: given values as they are, the others estimated while matching
    (:func:`.empirical.estimate_and_match`, in units of v).

    Args:
        weights: per client, (P,) precision factors (default: the observed masks).
    """
    scale = np.ones_like(unit) if params.variance_units == "relative" else 1.0 / unit
    result, refit = empirical.estimate_and_match(
        vecs, observed, unit, weights=weights,
        sigma2=None if sigmas is None else sigmas[:, None] * scale,
        sigma0_2=None if params.sigma0 is None else params.sigma0 * scale,
        gamma0=params.gamma, mu0=params.mu0, sweeps=params.sweeps, seed=params.seed + index,
        lam=params.lam, width=width, backend=params.backend,
    )
    found = refit.result()
    sigma2, sigma0_2 = refit.variances()
    report = {
        "sigma2": float(np.mean(sigma2)), "sigma0_2": float(np.mean(sigma0_2)),
        "sigma2_relative": float(np.mean(sigma2 / unit)),
        "sigma0_2_relative": float(np.mean(sigma0_2 / unit)),
        "gamma0": found.gamma0, "estimated": list(found.estimated), "em_rounds": found.rounds,
        "em_converged": found.converged,
        "means": "posterior" if refit.posterior_means else "members",
    }
    return LayerFit(result, sigma2, sigma0_2, refit.posterior_means, report)


def fuse_network(checkpoints, specs, params: BayesianParams, method: str):
    """Fuse sequential MLP/CNN clients with PFNM (``params.lam == 0``) or NAFI.

    Output layer: with one hidden layer, the outgoing part of the matched vectors; deeper,
    the output weights mapped to global indices and averaged over the clients that observe
    each column. Its weights use class shares f_sk = N_sk / sum_s N_sk when class-share
    weighting is on, else sample shares; the output bias likewise (NAFI Algorithm 2,
    line 7). Class-share precision: an outgoing weight to class k gets precision
    f_sk / sigma_s^2.

    Units: v (per coordinate, constant within the incoming, bias and outgoing blocks) is the
    per-coordinate variance of all clients' neuron vectors of the layer averaged over the
    block (:func:`fusekit.core.neurons.block_variances`). Estimated sigma^2 / sigma0^2 are
    multiples of v; given ones are multiples of v with ``variance_units="relative"``,
    variances in weight units with ``"absolute"``. ``mu0`` is in weight units.

    Args:
        checkpoints: clients in canonical order.
        specs: their permutation specs (same structure, any hidden widths).
        params: BayesianParams.
        method: name used in messages.

    Returns:
        (state_dict, fused PermutationSpec, report dict, assignments: per client, per
        hidden layer, the global index of each of its neurons).

    Raises:
        IncompatibleModelsError: PAN checkpoints, or tensors outside the layers that differ.
        ParameterError: out-of-range parameters.
    """
    neurons.refuse_position_aware(checkpoints, specs, method)
    n_clients = len(checkpoints)
    sigmas = None if params.sigma is None else client_sigmas(params.sigma, n_clients)
    spec = specs[0]
    widths = layer_widths(params, [sp.hidden_widths for sp in specs])
    clients = [neurons.client_layers(c, sp, release=True)
               for c, sp in zip(checkpoints, specs, strict=True)]
    n_hidden = len(spec.layers) - 1
    shares = _class_shares(checkpoints, spec.out_features, params)
    alphas = sample_weights(checkpoints)
    fused: list[neurons.UnitLayer] = []
    below: list[np.ndarray | None] = [None] * n_clients
    n_below = spec.in_features
    layer_reports = []
    outgoing = shares_below = None
    assignments: list[list[np.ndarray]] = [[] for _ in range(n_clients)]
    for index in range(n_hidden):
        start = time.perf_counter()
        last = index == n_hidden - 1
        vecs, observed = [], []
        for s in range(n_clients):
            vec, obs, layout = neurons.neuron_vectors(
                clients[s][index], below[s], n_below, clients[s][index + 1] if last else None
            )
            vecs.append(vec)
            clients[s][index] = None  # its neuron vectors hold it now: one copy, not two
            observed.append(obs if params.unobserved == "mask" else np.ones(layout.size, bool))
        unit = neurons.block_variances(vecs, observed, layout)
        weights = [o.astype(np.float64) for o in observed]
        if last and shares is not None:
            for s in range(n_clients):
                weights[s][layout.outgoing] *= np.repeat(shares[s], layout.block_out)
        fit = match_layer(params, sigmas, vecs, observed, unit, index, widths[index], weights)
        result, hyper = fit.matching, fit.report
        incoming, bias, outgoing = layout.split(result.means)
        if shares_below is not None and params.unobserved == "mask":
            # (with "zeros" the clients lacking a part already averaged in as zeros)
            incoming = incoming * shares_below[None, :, None]
        shares_below = result.reader_shares()
        fused.append(neurons.UnitLayer(incoming, bias))
        layer_reports.append({"layer": spec.layers[index].name, "width_asked": widths[index],
                              **result.report, "hyperparameters": hyper,
                              "variance_unit": sorted({float(u) for u in unit})})
        logger.info("%s: hidden layer %d/%d (%s): width %d (inferred %d), sigma^2/v=%.3g, "
                    "sigma0^2/v=%.3g, gamma0=%.3g, %.2f s", method, index + 1, n_hidden,
                    spec.layers[index].name, result.width, result.report["inferred_width"],
                    hyper["sigma2_relative"], hyper["sigma0_2_relative"], hyper["gamma0"],
                    time.perf_counter() - start)
        progress.advance("layers matched", index + 1, n_hidden)
        below, n_below = result.assignments, result.width
        for s, assigned in enumerate(below):
            assignments[s].append(assigned)
    head = [c[-1] for c in clients]
    fused.append(_output_layer(head, below, n_below, outgoing if n_hidden == 1 else None,
                               shares, alphas))
    if shares_below is not None:
        fused[-1].weight[...] *= shares_below[None, :, None]
    fused_spec = spec.with_hidden_widths([layer.out_features for layer in fused[:-1]])
    report = _report(layer_reports, shares,
                     heterogeneity(checkpoints, spec.out_features,
                                   layer_reports[-1] if layer_reports else {}))
    return _state_dict(checkpoints, spec, fused, alphas), fused_spec, report, assignments


def _state_dict(checkpoints, spec, fused, alphas) -> dict[str, np.ndarray]:
    """The fused layers as the clients' tensors, plus the tensors outside the layers."""
    state_dict = neurons.to_state_dict(checkpoints, spec, fused)
    state_dict.update(_other_tensors(checkpoints, spec, alphas))
    return state_dict


def _report(layer_reports, shares, clients_differ: dict[str, Any]) -> dict[str, Any]:
    if not clients_differ["compact_ok"]:
        logger.warning("clients too different for a compact fused model: class contrast "
                       "%.2f, classes only one-class clients hold: %s; an ensemble (ams) "
                       "keeps what they know", clients_differ["class_contrast"],
                       clients_differ["classes_without_contrast"] or "none")
    return {
        "layers": layer_reports,
        "class_share": shares is not None,
        "heterogeneity": clients_differ,
        "time_cost_s": sum(r["time_cost_s"] for r in layer_reports),
        "time_assignment_s": sum(r["time_assignment_s"] for r in layer_reports),
    }


def _output_layer(head, below, n_below, matched_outgoing, shares, alphas):
    """The fused output layer in unit form (see :func:`fuse_network`)."""
    weights = shares if shares is not None else np.repeat(alphas[:, None], head[0].bias.size, 1)
    bias = np.einsum("sk,sk->k", weights, np.stack([h.bias for h in head]))
    bias /= weights.sum(0)
    if matched_outgoing is not None:
        return neurons.UnitLayer(matched_outgoing, bias)
    mapped = [neurons.map_incoming(h.weight, below[s], n_below) for s, h in enumerate(head)]
    stacked = np.stack([m for m, _ in mapped])  # (S, K, J, block)
    seen = np.stack([o for _, o in mapped]).astype(np.float64)  # (S, J)

    def average(w):  # w: (S, K)
        num = np.einsum("sk,sj,skjb->kjb", w, seen, stacked)
        den = np.einsum("sk,sj->kj", w, seen)
        return num, den

    num, den = average(weights)
    if (den <= 0).any():
        # No observer of column j has data of class k (or column j is an inert padded
        # global no client observes): use sample shares, and 0 where nobody observes j.
        fallback_num, fallback_den = average(np.repeat(alphas[:, None], num.shape[0], 1))
        num = np.where((den > 0)[..., None], num, fallback_num)
        den = np.where(den > 0, den, fallback_den)
    return neurons.UnitLayer(num / np.maximum(den, 1e-300)[..., None], bias)


def _other_tensors(checkpoints, spec, alphas) -> dict[str, np.ndarray]:
    """Tensors outside the layers (never width-dependent here): sample-weighted average."""
    out = {}
    for name in spec.other:
        arrays = [c.tensor(name) for c in checkpoints]
        if any(a.shape != arrays[0].shape for a in arrays):
            raise IncompatibleModelsError(
                f"tensor {name!r} is outside the matched layers and its shape differs between "
                "clients; describe it in a JSON spec file (--spec) or fuse with avg"
            )
        out[name] = average_tensor(arrays, alphas, name)
    return out


def fuse_groups(checkpoints, specs, params: BayesianParams, method: str):
    """Fuse residual-network clients (GraphSpec) with PFNM / NAFI, group by group (§11).

    Groups are matched in the order of their first writer. A group's neuron vector
    concatenates what its member layers hold for the neuron, in global coordinates: the
    rows [incoming weights, bias] of every layer writing the group whose input (the image
    or a group) is already matched, and the columns of every layer reading the group whose
    output (the classes or a group) is already matched. Members whose other side is not yet
    matched (a block's last conv when its stream group is matched at the stem) still grow
    with the group. Once every group is matched, each layer is fused once, at the
    fused widths of the groups it reads and writes: hidden layers as posterior means
    (prior mu0, precisions from the group's sigma^2 and sigma0^2 relative to the layer's
    own variance unit, so only their ratio matters; the members' means when sigma^2 or
    sigma0^2 was estimated, as :func:`.empirical.estimate_and_match`), the classifier as in
    :func:`fuse_network` (class or sample shares over the clients observing a column).

    Clients' tensors are read per group and released after, so memory holds one group of
    every client and its posterior, then the fused model, never every client's model.

    Returns:
        (state_dict, fused GraphSpec, report dict, assignments per client and group).
    """
    neurons.refuse_position_aware(checkpoints, specs, method)
    n_clients = len(checkpoints)
    sigmas = None if params.sigma is None else client_sigmas(params.sigma, n_clients)
    spec = specs[0]
    n_groups = len(spec.group_names)
    widths = layer_widths(params, [sp.hidden_widths for sp in specs])
    assignments: list[list[np.ndarray | None]] = [[None] * n_groups for _ in checkpoints]
    fused_widths: list[int | None] = [None] * n_groups
    relative: list[tuple[np.ndarray, float] | None] = [None] * n_groups
    reader_shares: list[np.ndarray | None] = [None] * n_groups
    bases: list[np.ndarray | None] = [None] * n_groups
    reports = []
    for group in sorted(range(n_groups), key=spec.writes.index):
        start = time.perf_counter()
        result, relative[group], hyper = _match_group(checkpoints, specs, group, assignments,
                                                      fused_widths, params, sigmas,
                                                      widths[group])
        for s in range(n_clients):
            assignments[s][group] = result.assignments[s]
        fused_widths[group] = result.width
        reader_shares[group], bases[group] = result.reader_shares(), result.base
        reports.append({"layer": spec.group_names[group], "width_asked": widths[group],
                        **result.report, "hyperparameters": hyper,
                        "members": len(spec.writers(group)) + len(spec.readers(group))})
        logger.info("%s: group %s: width %d (inferred %d), %.2f s", method,
                    spec.group_names[group], result.width, result.report["inferred_width"],
                    time.perf_counter() - start)
        del result  # its posterior arrays: one group's worth of memory
        progress.advance("groups matched", len(reports), n_groups)
    shares = _class_shares(checkpoints, spec.out_features, params)
    alphas = sample_weights(checkpoints)
    fused = []
    for index in range(len(spec.layers)):
        layer = _fuse_layer(checkpoints, specs, index, assignments, fused_widths, relative,
                            bases, params.mu0, shares, alphas)
        source = spec.reads[index]
        if source is not None and reader_shares[source] is not None:
            layer.weight[...] *= reader_shares[source][None, :, None]
        # finished: kept in the stored dtype, so the float64 model never exists whole
        fused.append(neurons.as_stored(layer, neurons.stored_dtype(checkpoints[0],
                                                                   spec.layers[index])))
    fused_spec = spec.with_hidden_widths(fused_widths)
    state_dict = _state_dict(checkpoints, spec, fused, alphas)
    for checkpoint in checkpoints:
        checkpoint.release()
    return state_dict, fused_spec, _report(
        reports, shares, heterogeneity(checkpoints, spec.out_features, reports[-1])), assignments


def _match_group(checkpoints, specs, group, assignments, fused_widths, params, sigmas,
                 width):
    """Match one group (see :func:`fuse_groups`): the LayerMatching, the group's (per-client
    sigma^2 / v, sigma0^2 / v) and its hyperparameter report. The clients' vectors live
    only while this runs."""
    built = [_group_vector(checkpoints[s], specs[s], group, assignments[s], fused_widths)
             for s in range(len(checkpoints))]
    vecs = [v for v, _, _ in built]
    observed = [o if params.unobserved == "mask" else np.ones_like(o) for _, o, _ in built]
    unit = neurons.block_variances(vecs, observed, built[0][2])
    fit = match_layer(params, sigmas, vecs, observed, unit, group, width)
    # sigma0^2 = inf: no prior term in the fused means (the members' means, as the matching).
    prior = float(np.mean(fit.sigma0_2 / unit)) if fit.posterior_means else math.inf
    return fit.matching, ((fit.sigma2 / unit).mean(axis=1), prior), fit.report


def _read_layer(checkpoint, layer) -> neurons.UnitLayer:
    """One layer in unit form (BatchNorm folded); its tensors are released from memory."""
    unit = neurons.fold_batchnorm(checkpoint, layer)
    checkpoint.release(*layer.tensors)
    return unit


def _group_vector(checkpoint, spec, group, assigned, fused_widths):
    """One client's (J, P) neuron vectors of ``group`` from the members that can be put in
    global coordinates, their (P,) observed mask and (P,) block labels (one per part)."""
    parts, observed, labels = [], [], []
    for index in spec.writers(group):
        source = spec.reads[index]
        if source is not None and fused_widths[source] is None:
            continue
        layer = _read_layer(checkpoint, spec.layers[index])
        n_in = layer.weight.shape[1] if source is None else fused_widths[source]
        mapped, seen = neurons.map_incoming(
            layer.weight, None if source is None else assigned[source], n_in)
        parts += [mapped.reshape(len(mapped), -1), layer.bias[:, None]]
        observed += [np.repeat(seen, mapped.shape[2]), [True]]
        labels += [np.full(mapped[0].size, len(labels)), [len(labels) + 1]]
    for index in spec.readers(group):
        target = spec.writes[index]
        if target is not None and fused_widths[target] is None:
            continue
        weight = _read_layer(checkpoint, spec.layers[index]).weight
        if target is not None:  # the reader's rows into the global space it writes
            mapped, seen = neurons.map_incoming(weight.transpose(1, 0, 2), assigned[target],
                                                fused_widths[target])
            weight = mapped.transpose(1, 0, 2)
        else:
            seen = np.ones(weight.shape[0], dtype=bool)
        parts.append(neurons.outgoing_weights(weight))
        observed.append(np.repeat(seen, weight.shape[2]))
        labels.append(np.full(parts[-1].shape[1], len(labels)))
    return (np.hstack(parts), np.concatenate(observed).astype(bool),
            np.concatenate(labels).astype(np.int64))


def _fuse_layer(checkpoints, specs, index, assignments, fused_widths, relative, bases, mu0,
                shares, alphas) -> neurons.UnitLayer:
    """Layer ``index`` at the fused widths of the groups it reads and writes (see
    :func:`fuse_groups`); hidden layers read one client at a time. A group from one base
    (``bases``) has its rows fused per base neuron, then copied to each global holding it."""
    source, target = specs[0].reads[index], specs[0].writes[index]
    below = [None if source is None else a[source] for a in assignments]
    n_below = specs[0].layers[index].in_features if source is None else fused_widths[source]
    if target is None:
        head = [_read_layer(c, sp.layers[index]) for c, sp in zip(checkpoints, specs,
                                                                   strict=True)]
        return _output_layer(head, below, n_below, None, shares, alphas)
    per_client, prior = relative[target]
    base = bases[target]
    width = fused_widths[target] if base is None else int(base.max()) + 1
    total = bias_total = precision = bias_precision = None
    for s, (checkpoint, spec) in enumerate(zip(checkpoints, specs, strict=True)):
        layer = _read_layer(checkpoint, spec.layers[index])
        mapped, seen = neurons.map_incoming(layer.weight, below[s], n_below)
        if total is None:  # the prior: mean mu0 at precision 1/sigma0^2 (0 when inf)
            total = np.full((width, *mapped.shape[1:]), mu0 / prior)
            precision = np.full((width, n_below), 1.0 / prior)
            bias_total, bias_precision = np.full(width, mu0 / prior), np.full(width, 1.0 / prior)
        rows, weight = assignments[s][target], 1.0 / per_client[s]
        if base is not None:
            rows = base[rows]
        total[rows] += weight * mapped
        precision[rows] += weight * seen
        bias_total[rows] += weight * layer.bias
        bias_precision[rows] += weight
    precision = np.broadcast_to(precision[:, :, None], total.shape)
    weight = member_means(total, precision, np.float64(mu0))
    bias = member_means(bias_total, bias_precision, np.float64(mu0))
    if base is None:
        return neurons.UnitLayer(weight, bias)
    copies = np.where(base >= 0, base, width)  # a global without members: the prior, mu0
    return neurons.UnitLayer(np.concatenate([weight, np.full_like(weight[:1], mu0)])[copies],
                             np.append(bias, mu0)[copies])
