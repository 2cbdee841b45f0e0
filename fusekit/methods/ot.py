"""Optimal-transport fusion (Singh & Jaggi 2020, "Model Fusion via Optimal Transport");
ALGORITHMS.md §5.

Every client is aligned to an anchor model A, layer by layer, bottom-up, and the aligned
clients are averaged with sample-count weights; the fused widths are the anchor's.

For hidden layer l of client s (unit form, BatchNorm folded, see :mod:`fusekit.core.neurons`):

1. incoming weights are mapped into the anchor's index space of layer l-1 with the
   previous transport map, per kernel position / per spatial block:
   W_s(aligned inputs)[j, g, b] = Σ_i W_s[j, i, b] T̂_{l-1}[i, g],  T̂ = T diag(1/β);
2. ground cost M_ij = ‖w_si − w_Aj‖² between the neuron vectors [aligned incoming
   weights, bias] (``weights`` mode, data-free), or between the neurons' pre-activations
   on a batch of inputs (``activations`` mode);
3. transport plan T (J_s × J_A) with uniform marginals: when J_s = J_A the optimal plan is
   a permutation / J, found by fusekit's C++ assignment solver; otherwise exact EMD
   (POT's ``ot.emd``);
4. aligned layer W̃_s = diag(1/β) Tᵀ W_s(aligned inputs), b̃_s = diag(1/β) Tᵀ b_s with
   β = Tᵀ 1 (column sums): each anchor neuron receives the transported mass-weighted mean
   of the client neurons sent to it.

The output layer only gets step 1: its class axis is never transported.

Residual networks (:class:`~fusekit.core.spec.GraphSpec`) are aligned group by group
(:func:`align_groups`): a group's ground cost compares the rows of the layers that write it
and whose inputs are already aligned, and its plan then moves every member (ALGORITHMS §11).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Annotated, Any

import numpy as np

from fusekit.core import neurons, progress
from fusekit.core.checkpoint import Checkpoint
from fusekit.core.errors import DataError, ParameterError
from fusekit.core.spec import GraphSpec, PermutationSpec
from fusekit.core.transformer import TransformerSpec
from fusekit.engine.matching import inner_products, solve_assignment, sqeuclidean_cost
from fusekit.methods.avg import add_weighted, average_tensor, check_same_shapes
from fusekit.methods.base import (
    FusionMethod,
    FusionResult,
    places_cost_kernels,
    register,
    sample_weights,
)
from fusekit.methods.params import Device, Param
from fusekit.methods.transformer import check_aligned_sizes, fuse_transformers

log = logging.getLogger(__name__)

#: (checkpoint, spec) -> per hidden layer, (samples, J) pre-activations of that client on
#: one shared batch of inputs (``fusekit.toolkit.activations.ActivationInputs`` is one).
ActivationProvider = Callable[[Checkpoint, PermutationSpec], Sequence[np.ndarray]]


#: The precision of the products that compare units of residual networks and transformers:
#: float32, the weights' own as stored, at twice float64's speed; the assignments of ten
#: ResNet-50s and four BERT-bases were those of float64 products (benchmarks/RESULTS.md).
PRODUCTS = np.float32
#: Rows widened to float64 at a time for the assigned pairs' distances (the report's cost).
PAIR_ROWS = 256

#: How ``anchor`` (ot, rebasin) names a client: :func:`resolve_anchor` reads it.
ANCHOR_HELP = ("the client to align to: its path, file name or content-hash prefix "
               "(>= 8 hex digits)")


class AnchorAlignment(FusionMethod):
    """A method that permutes every client's neurons to an anchor client and averages them
    (ot, rebasin): any network it can permute, residual networks and transformers
    included, BatchNorms folded first."""

    permutes_neurons = True
    folds_batchnorm = True
    handles_groups = True
    handles_transformers = True


@register
class OptimalTransport(AnchorAlignment):
    name = "ot"
    summary = ("optimal-transport alignment to an anchor client, then weighted averaging "
               "(Singh & Jaggi); fused widths = the anchor's")

    @places_cost_kernels
    def fuse(
        self,
        checkpoints: Sequence[Checkpoint],
        specs: Sequence[PermutationSpec],
        *,
        anchor: Annotated[str | None, Param(
            help=ANCHOR_HELP, paper="Singh & Jaggi 2020, §4", default_text="most samples",
        )] = None,
        activations: Annotated[ActivationProvider | None, Param(
            help="compare neurons by their pre-activations on shared inputs instead of by "
            "weights: a callable (checkpoint, spec) -> per-hidden-layer pre-activations, "
            "such as fusekit.toolkit.activations.ActivationInputs",
            paper="Singh & Jaggi 2020, §4 (activation-based alignment)",
            default_text="weights",
        )] = None,
        device: Device = "auto",
    ) -> FusionResult:
        """Align every client to the anchor with optimal transport and average them.

        Args:
            checkpoints: S clients of the same layer structure (widths may differ), in
                canonical order.
            specs: their permutation specs.
            anchor: the client whose neuron order and widths the fused model takes: its
                path (as given, or its file name) or a prefix (>= 8 hex digits) of its
                content hash. Default: the client with the most samples (first in
                canonical order on ties).
            activations: None for the data-free weight cost (default); otherwise a callable
                returning, for one client, its pre-activations on a batch of inputs shared
                by all clients: per hidden layer an array (samples, J) (conv layers: every
                spatial position is a sample).
            device: where the ground costs are computed: "auto" (a CUDA device for the
                large ones, when present), "cpu" or "cuda[:N]"
                (:func:`~fusekit.methods.base.places_cost_kernels`).

        Returns:
            FusionResult at the anchor's widths; report per layer: transport kind
            ("assignment" or "emd") and mean transport cost per client.

        Raises:
            IncompatibleModelsError: PAN checkpoints (positions matter; use avg).
            ParameterError: unknown anchor.
            DataError: pre-activations that do not fit the models.
        """
        neurons.refuse_position_aware(checkpoints, specs, self.name)
        anchor_index = resolve_anchor(checkpoints, anchor)
        params = {
            "anchor": checkpoints[anchor_index].label if anchor is not None else None,
            "activations": (getattr(activations, "description", type(activations).__name__)
                            if activations is not None else None),
        }
        start = time.perf_counter()
        if isinstance(specs[0], TransformerSpec):
            return self._fuse_transformers(checkpoints, specs, anchor_index, params,
                                           activations)
        if isinstance(specs[0], GraphSpec):
            if activations is not None:
                raise ParameterError("activations: the activation cost needs a sequential "
                                     "network; residual networks use the weight cost")
            state_dict, client_reports, assignments = fuse_aligned(
                checkpoints, specs, anchor_index, group_aligner, PRODUCTS)
            report = {"anchor": checkpoints[anchor_index].label, "cost": "weights",
                      "alignment": client_reports, "align_time_s": time.perf_counter() - start}
            return self.result(state_dict, checkpoints, specs[anchor_index], params, report,
                               assignments)
        preactivations = None
        if activations is not None:
            preactivations = [_checked_preactivations(activations(c, s), c, s)
                              for c, s in zip(checkpoints, specs, strict=True)]
            samples = {tuple(len(a) for a in client) for client in preactivations}
            if len(samples) > 1:
                raise DataError(
                    "activations: expected every client to be run on the same inputs, found "
                    f"samples per layer {sorted(samples)}"
                )
        clients = [neurons.client_layers(c, s, release=True)
                   for c, s in zip(checkpoints, specs, strict=True)]
        aligned, layer_reports, assignments = align_to_anchor(clients, anchor_index,
                                                              preactivations)
        weights = sample_weights(checkpoints)
        fused = [average_layers([client[li] for client in aligned], weights)
                 for li in range(len(specs[0].layers))]
        spec = specs[anchor_index]
        state_dict = neurons.to_state_dict(checkpoints, spec, fused)
        report = {
            "anchor": checkpoints[anchor_index].label,
            "cost": "activations" if activations is not None else "weights",
            "layers": layer_reports,
            "align_time_s": time.perf_counter() - start,
        }
        return self.result(state_dict, checkpoints, spec, params, report, assignments)


    def _fuse_transformers(self, checkpoints, specs, anchor_index, params,
                           activations) -> FusionResult:
        """One pass over the groups in data-flow order (:mod:`fusekit.methods.transformer`):
        with equal widths and uniform masses the transport plan is a permutation. The
        similarities are float32 products (``PRODUCTS``)."""
        if activations is not None:
            raise ParameterError("activations: transformers are aligned by their weights; "
                                 "leave --activations out")
        check_aligned_sizes(checkpoints, specs, anchor_index, self.name)
        start = time.perf_counter()
        state_dict, reports, assignments = fuse_transformers(
            checkpoints, specs, anchor_index, sweeps=0, rng=None, solver=solve_assignment,
            products=PRODUCTS)
        report = {"anchor": checkpoints[anchor_index].label, "cost": "weights",
                  "alignment": reports, "align_time_s": time.perf_counter() - start}
        return self.result(state_dict, checkpoints, specs[anchor_index], params, report,
                           assignments)


def _checked_preactivations(arrays: Sequence[np.ndarray], checkpoint: Checkpoint,
                            spec: PermutationSpec) -> list[np.ndarray]:
    """One client's pre-activations, checked against its hidden widths."""
    widths = spec.hidden_widths
    arrays = [np.asarray(a, dtype=np.float64) for a in arrays]
    shapes = [a.shape for a in arrays]
    if len(arrays) != len(widths) or any(
            a.ndim != 2 or a.shape[1] != w or len(a) == 0
            for a, w in zip(arrays, widths, strict=True)):
        raise DataError(
            f"activations of {checkpoint.label}: expected one (samples, J) array per hidden "
            f"layer with J = {widths}, found shapes {shapes}"
        )
    if not all(np.isfinite(a).all() for a in arrays):
        raise DataError(f"activations of {checkpoint.label}: found NaN or infinite values")
    return arrays


def resolve_anchor(checkpoints: Sequence[Checkpoint], anchor: str | None) -> int:
    """Index of the anchor client (see :meth:`OptimalTransport.fuse`).

    Raises:
        ParameterError: ``anchor`` matches no client, or several.
    """
    if anchor is None:
        counts = [c.num_samples or 0 for c in checkpoints]
        return int(np.argmax(counts))  # first maximum: canonical order breaks ties
    if not isinstance(anchor, (str, os.PathLike)):
        raise ParameterError(
            f"anchor: expected a checkpoint path or content-hash prefix, got {anchor!r}"
        )
    text = os.fspath(anchor)
    matches = [i for i, c in enumerate(checkpoints) if _is_anchor(c, text)]
    if len(matches) != 1:
        found = "no client" if not matches else f"{len(matches)} clients"
        raise ParameterError(
            f"anchor {text!r} matches {found}; expected the path or file name of one input, "
            f"or a content-hash prefix of >= 8 hex digits; inputs: "
            f"{', '.join(c.label for c in checkpoints)}"
        )
    return matches[0]


def _is_anchor(checkpoint: Checkpoint, text: str) -> bool:
    if checkpoint.path is not None:
        path = Path(checkpoint.path)
        if text in (str(path), path.name) or Path(text).resolve() == path.resolve():
            return True
    lowered = text.lower()
    return (len(lowered) >= 8 and all(ch in "0123456789abcdef" for ch in lowered)
            and checkpoint.content_hash.startswith(lowered))


def align_to_anchor(
    clients: Sequence[Sequence[neurons.UnitLayer]],
    anchor: int,
    preactivations: Sequence[Sequence[np.ndarray]] | None = None,
    *,
    solver: str = "auto",
) -> tuple[list[list[neurons.UnitLayer]], list[dict[str, Any]]]:
    """Align every client's layers to the anchor's neuron order (steps 1-4 of §5).

    Args:
        clients: per client, its layers in unit form (BatchNorm folded), input to output.
        anchor: index of the anchor client (returned unchanged).
        preactivations: per client, per hidden layer, (samples, J) pre-activations for the
            activation cost; None for the weight cost.
        solver: see :func:`transport_plan` (``"emd"`` is the benchmarks' peer).

    Returns:
        (aligned, reports, assignments): per client its layers at the anchor's widths; per
        hidden layer a dict with the transport kind and the mean plan cost ⟨T, M⟩ per
        client; per client and hidden layer the anchor neuron each of its neurons sends
        most of its mass to.
    """
    n_layers = len(clients[anchor])
    aligned: list[list[neurons.UnitLayer]] = [[] for _ in clients]
    maps: list[np.ndarray | None] = [None] * len(clients)  # T̂ of the layer below
    assignments: list[list[np.ndarray]] = [[] for _ in clients]
    reports = []
    for li in range(n_layers):
        kinds, costs = set(), []
        for s, layers in enumerate(clients):
            layer = align_incoming(layers[li], maps[s])
            if s == anchor or li == n_layers - 1:
                aligned[s].append(layer)
                if li < n_layers - 1:
                    assignments[s].append(np.arange(layer.out_features))
                continue
            anchor_layer = clients[anchor][li]
            if preactivations is None:
                cost = sqeuclidean_cost(neuron_matrix(layer), neuron_matrix(anchor_layer))
            else:
                cost = sqeuclidean_cost(preactivations[s][li].T, preactivations[anchor][li].T)
            plan, kind = transport_plan(cost, solver)
            kinds.add(kind)
            costs.append(transport_cost(plan, cost))
            normalised = plan / plan.sum(axis=0, keepdims=True)  # T diag(1/β)
            maps[s] = normalised
            assignments[s].append(plan.argmax(axis=1))
            aligned[s].append(neurons.UnitLayer(
                weight=np.tensordot(normalised, layer.weight, axes=(0, 0)),  # (G, U, B)
                bias=normalised.T @ layer.bias,
            ))
        if li < n_layers - 1:
            reports.append({"layer": li, "width": clients[anchor][li].out_features,
                            "transport": sorted(kinds), "mean_cost": costs})
        progress.advance("layers aligned", li + 1, n_layers)
    return aligned, reports, assignments


def group_order(spec: GraphSpec) -> list[tuple[int, list[int]]]:
    """The groups in the order their first writer appears, each with the layers that write
    it and whose input group comes earlier (the first writer always does): what a group's
    ground cost compares."""
    done: set[int] = set()
    out = []
    for group in sorted(range(len(spec.group_names)), key=spec.writes.index):
        out.append((group, [i for i, g in enumerate(spec.writes)
                            if g == group and (spec.reads[i] is None or spec.reads[i] in done)]))
        done.add(group)
    return out


def group_aligner(anchor: Sequence[neurons.UnitLayer], spec: GraphSpec
                  ) -> Callable[..., tuple[list[neurons.UnitLayer], dict[str, Any]]]:
    """:func:`align_groups` bound to the anchor's group rows, stacked once for every client
    in ``PRODUCTS`` precision (the anchor's layers are not kept)."""
    rows = {group: neurons.writer_rows(anchor, spec, group, ready, PRODUCTS)
            for group, ready in group_order(spec)}
    return partial(align_groups, rows)


def align_groups(anchor_rows: Mapping[int, np.ndarray], layers: list[neurons.UnitLayer],
                 spec: GraphSpec) -> tuple[list[neurons.UnitLayer], dict[str, Any]]:
    """Align one client's groups to the anchor with optimal transport (§5 on groups, §11).

    Groups are visited in :func:`group_order`. A group's ground cost is the squared
    distance between the concatenated rows [incoming weights, bias] of the layers that
    write it and whose input group is already aligned (``anchor_rows[group]``: the
    anchor's, in the precision they are compared in); its transport plan then moves every
    member, writers' rows and readers' columns. At equal widths the plan is the assignment
    that minimises the summed distances, that is maximises the summed inner products of
    the rows (the rows' norms add the same to every assignment): one product, no distances.
    ``layers`` are handed over (:func:`~fusekit.core.neurons.handed_over`: the list is
    emptied).

    Returns:
        (the client's layers at the anchor's widths, {"transport": kinds used,
        "mean_cost": per group ⟨T, M⟩, "assignment": per group, the anchor neuron each
        client neuron sends most of its mass to}).
    """
    layers = neurons.handed_over(layers)
    kinds = set()
    costs: list[Future[float]] = []  # the assigned pairs' distances, on a second thread
    assignment: list[np.ndarray] = [np.empty(0, np.int64)] * len(anchor_rows)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="fusekit-cost") as pool:
        for group, ready in group_order(spec):
            theirs = anchor_rows[group]
            mine = neurons.writer_rows(layers, spec, group, ready, theirs.dtype)
            if len(mine) == len(theirs):  # the plan is a permutation / J: no dense plan
                similarity = inner_products([(mine, theirs)])
                # minimised as it is negated in place: no negated copy (exact)
                rows, cols = solve_assignment(np.negative(similarity, out=similarity))
                kinds.add("assignment")
                costs.append(pool.submit(paired_distances, mine, theirs, cols))
                mapping = np.empty_like(rows)
                mapping[cols] = rows  # new neuron j = old neuron mapping[j]
                assignment[group] = cols
            else:
                cost = sqeuclidean_cost(mine, theirs)
                plan, kind = transport_plan(cost)
                kinds.add(kind)
                costs.append(pool.submit(transport_cost, plan, cost))
                mapping = plan / plan.sum(0)
                assignment[group] = plan.argmax(axis=1)
            del mine
            layers = neurons.move_group(layers, spec, group, mapping)
    return list(layers), {"transport": sorted(kinds),
                          "mean_cost": [cost.result() for cost in costs],
                          "assignment": assignment}


def transport_cost(plan: np.ndarray, cost: np.ndarray) -> float:
    """⟨T, M⟩: the cost of a transport plan."""
    return float((plan * cost).sum())


def paired_distances(a: np.ndarray, b: np.ndarray, cols: np.ndarray) -> float:
    """``sum_i ||a[i] - b[cols[i]]||^2 / len(a)`` in float64, ``PAIR_ROWS`` rows at a time
    (the mean cost of a permutation's plan)."""
    total = 0.0
    for first in range(0, len(a), PAIR_ROWS):
        chunk = a[first:first + PAIR_ROWS].astype(np.float64)
        chunk -= b[cols[first:first + PAIR_ROWS]]
        total += float(np.einsum("ij,ij->", chunk, chunk))
    return total / len(a)


def fuse_aligned(checkpoints: Sequence[Checkpoint], specs: Sequence[PermutationSpec | GraphSpec],
                 anchor: int, aligner, dtype: type = np.float64
                 ) -> tuple[dict[str, np.ndarray], list[dict[str, Any]]]:
    """Align every client to the anchor, one client at a time, and average them (step 5).

    Only the running weighted sum (float64) and one client (its BatchNorms folded into
    ``dtype``: float32 for ot, whose units are compared in float32) are held, with what
    the aligner keeps of the anchor, whatever the number of clients: each client's
    tensors are read when its turn comes and released after.

    Args:
        checkpoints, specs: the clients in canonical order.
        anchor: index of the anchor client.
        aligner: ``aligner(anchor_layers, anchor_spec) -> align``, with ``align(client_layers,
            client_spec) -> (aligned layers, report dict)``, unit-form layers in and out;
            the anchor's layers are dropped once ``align`` is made (it keeps what it needs).

    Returns:
        (fused state_dict with the anchor's widths, per non-anchor client its report, per
        client and group the anchor neuron each of its neurons went to: ``align``'s
        report's "assignment", taken out of the report).
    """
    weights = sample_weights(checkpoints)
    spec = specs[anchor]
    anchor_layers = neurons.client_layers(checkpoints[anchor], spec, release=True,
                                          dtype=dtype)
    align = aligner(anchor_layers, spec)
    total = [neurons.UnitLayer(weights[anchor] * layer.weight, weights[anchor] * layer.bias)
             for layer in anchor_layers]
    del anchor_layers
    reports = []
    identity = [np.arange(width) for width in spec.hidden_widths]
    assignments = [identity] * len(checkpoints)
    for s, (checkpoint, client_spec) in enumerate(zip(checkpoints, specs, strict=True)):
        if s == anchor:
            continue
        start = time.perf_counter()
        # the client's layers are handed over, not kept: align frees each one it replaces
        aligned, report = align(neurons.client_layers(checkpoint, client_spec, release=True,
                                                      dtype=dtype), client_spec)
        for into, layer in zip(total, aligned, strict=True):
            add_weighted(into.weight, weights[s], layer.weight)
            into.bias += weights[s] * layer.bias
        del aligned
        assignments[s] = report.pop("assignment")
        reports.append({"client": checkpoint.label, **report,
                        "time_s": time.perf_counter() - start})
        progress.advance("clients aligned", len(reports), len(checkpoints) - 1)
    state_dict = neurons.to_state_dict(checkpoints, spec, total)
    check_same_shapes(checkpoints, spec.other)
    state_dict.update({name: average_tensor([c.tensor(name) for c in checkpoints], weights, name)
                       for name in spec.other})
    for checkpoint in checkpoints:
        checkpoint.release()
    return state_dict, reports, assignments


def average_layers(layers: Sequence[neurons.UnitLayer], weights: np.ndarray) -> neurons.UnitLayer:
    """Σ_s α_s layer_s of layers already aligned to the same neuron order (step 5)."""
    pairs = list(zip(weights, layers, strict=True))
    return neurons.UnitLayer(weight=sum(a * layer.weight for a, layer in pairs),
                             bias=sum(a * layer.bias for a, layer in pairs))


def align_incoming(layer: neurons.UnitLayer, normalised: np.ndarray | None) -> neurons.UnitLayer:
    """Map a unit-form layer's input units into the anchor's space below (step 1):
    ``W[j, g, b] = Σ_i W[j, i, b] T̂[i, g]`` for every kernel position / spatial block b."""
    if normalised is None:
        return layer
    mapped = np.tensordot(layer.weight, normalised, axes=(1, 0))  # (J, B, G): BLAS, not einsum
    return neurons.UnitLayer(np.ascontiguousarray(mapped.transpose(0, 2, 1)), layer.bias)


def neuron_matrix(layer: neurons.UnitLayer) -> np.ndarray:
    """(J, P) neuron vectors [incoming weights (all kernel positions), bias]."""
    return np.hstack([layer.weight.reshape(layer.out_features, -1), layer.bias[:, None]])


def transport_plan(cost: np.ndarray, solver: str = "auto") -> tuple[np.ndarray, str]:
    """Optimal plan between uniform marginals 1/n and 1/m for an (n, m) ground cost.

    When n = m the optimum is a permutation matrix / n (Birkhoff), solved exactly by the C++
    assignment solver; otherwise by POT's exact network simplex ``ot.emd``. ``solver="emd"``
    uses ``ot.emd`` for every shape (what the authors' code does; the benchmarks' peer).

    Returns:
        (plan (n, m) float64 with row sums 1/n and column sums 1/m, "assignment" | "emd").
    """
    if solver not in ("auto", "emd"):
        raise ParameterError(f"solver: expected 'auto' or 'emd', got {solver!r}")
    n, m = cost.shape
    if n == m and solver == "auto":
        rows, cols = solve_assignment(cost)
        plan = np.zeros((n, m))
        plan[rows, cols] = 1.0 / n
        return plan, "assignment"
    import ot  # POT: only needed for unequal widths

    plan = ot.emd(np.full(n, 1.0 / n), np.full(m, 1.0 / m), np.ascontiguousarray(cost))
    return np.asarray(plan, dtype=np.float64), "emd"
