"""Weight matching to an anchor (Git Re-Basin, Ainsworth et al. 2023, §3.2 and Algorithm 1),
then weighted averaging; ALGORITHMS.md §11.

Every client is permuted onto the anchor's neuron order, one permutation per group
(hidden layer, or residual stream shared by many layers), to maximise
Σ_members ⟨W_A, P_g W_s P_h^T⟩. The problem couples the groups, so it is solved by
coordinate descent: with every other group fixed, group g's best permutation is one linear
assignment on the similarity matrix S_g = Σ_members A_part B_partᵀ (rows of the layers
writing g, columns of the layers reading it). Groups are visited in a seeded random order,
sweep after sweep, until a sweep improves nothing. The aligned clients are averaged with
sample-count weights; widths must be equal (a permutation cannot change them).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Annotated, Any

import numpy as np

from fusekit.core import neurons
from fusekit.core.checkpoint import Checkpoint
from fusekit.core.errors import IncompatibleModelsError, ParameterError
from fusekit.core.spec import GraphSpec, PermutationSpec
from fusekit.core.transformer import TransformerSpec
from fusekit.engine.matching import solve_assignment, summed_inner_products
from fusekit.methods.base import FusionResult, places_cost_kernels, register
from fusekit.methods.bayesian import BACKENDS
from fusekit.methods.ot import ANCHOR_HELP, AnchorAlignment, fuse_aligned, resolve_anchor
from fusekit.methods.params import Device, Param
from fusekit.methods.transformer import check_aligned_sizes, fuse_transformers


@register
class ReBasin(AnchorAlignment):
    name = "rebasin"
    summary = ("weight matching of every permutation group to an anchor client (Git "
               "Re-Basin), then weighted averaging; equal widths")

    @places_cost_kernels
    def fuse(
        self,
        checkpoints: Sequence[Checkpoint],
        specs: Sequence[PermutationSpec | GraphSpec],
        *,
        anchor: Annotated[str | None, Param(
            help=ANCHOR_HELP, paper="Ainsworth et al. 2023, §3.2",
            default_text="most samples")] = None,
        max_sweeps: Annotated[int, Param(
            help="sweeps of coordinate descent over the groups at most; stops earlier at a "
            "sweep that changes no permutation", paper="Git Re-Basin Algorithm 1",
            minimum=1, maximum=10_000)] = 100,
        seed: Annotated[int, Param(help="seed of the order in which groups are visited",
                                   minimum=0)] = 0,
        backend: Annotated[str, Param(
            help="core: fusekit's C++ assignment solver; numpy: SciPy's linear_sum_assignment",
            choices=BACKENDS)] = "core",
        device: Device = "auto",
    ) -> FusionResult:
        """Permute every client onto the anchor by weight matching and average them.

        Args:
            checkpoints: S clients of the same architecture and widths, canonical order.
            specs: their permutation specs (sequential or residual).
            anchor: the client whose neuron order the fused model takes (path, file name
                or content-hash prefix, as for ``ot``); default: most samples.
            max_sweeps: at most this many sweeps over the groups per client (>= 1); the
                descent stops earlier at a sweep that changes no permutation.
            seed: seeds the order in which groups are visited.
            backend: assignment solver, "core" (fusekit's C++ solver) or "numpy" (SciPy's
                ``linear_sum_assignment``; for benchmarks and cross-checks).
            device: where the groups' similarities are computed: "auto" (a CUDA device
                for the large ones, when present), "cpu" or "cuda[:N]"
                (:func:`~fusekit.methods.base.places_cost_kernels`).

        Returns:
            FusionResult at the anchor's widths; ``report["alignment"]`` per non-anchor
            client: sweeps run and the matched similarity Σ⟨W_A, P W_s⟩ before and after.

        Raises:
            IncompatibleModelsError: PAN checkpoints, or clients of different widths.
            ParameterError: unknown anchor.
        """
        neurons.refuse_position_aware(checkpoints, specs, self.name)
        anchor_index = resolve_anchor(checkpoints, anchor)
        widths = specs[anchor_index].hidden_widths
        if isinstance(specs[anchor_index], TransformerSpec):
            check_aligned_sizes(checkpoints, specs, anchor_index, self.name)
        for checkpoint, spec in zip(checkpoints, specs, strict=True):
            if spec.hidden_widths != widths:
                raise IncompatibleModelsError(
                    f"{checkpoint.label} has widths {spec.hidden_widths} but the anchor "
                    f"{checkpoints[anchor_index].label} has {widths}; weight matching "
                    "permutes neurons and needs equal widths (use ot for unequal ones)"
                )
        solver = assignment_solver(backend)
        rng = np.random.default_rng(seed)
        start = time.perf_counter()
        params = {"anchor": checkpoints[anchor_index].label if anchor is not None else None,
                  "max_sweeps": max_sweeps, "seed": seed, "backend": backend}
        if isinstance(specs[anchor_index], TransformerSpec):
            state_dict, reports, assignments = fuse_transformers(
                checkpoints, specs, anchor_index, sweeps=max_sweeps, rng=rng, solver=solver)
            report = {"anchor": checkpoints[anchor_index].label, "alignment": reports,
                      "align_time_s": time.perf_counter() - start}
            return self.result(state_dict, checkpoints, specs[anchor_index], params, report,
                               assignments)

        def aligner(anchor_layers, _spec):
            return partial(weight_matching, anchor_layers, max_sweeps=max_sweeps, rng=rng,
                           solver=solver)

        state_dict, reports, assignments = fuse_aligned(checkpoints, specs, anchor_index,
                                                        aligner)
        report = {"anchor": checkpoints[anchor_index].label, "alignment": reports,
                  "align_time_s": time.perf_counter() - start}
        return self.result(state_dict, checkpoints, specs[anchor_index], params, report,
                           assignments)


def weight_matching(
    anchor: Sequence[neurons.UnitLayer],
    layers: list[neurons.UnitLayer],
    spec: PermutationSpec | GraphSpec,
    *,
    max_sweeps: int = 100,
    rng: np.random.Generator | None = None,
    solver: Callable[..., tuple] = solve_assignment,
) -> tuple[list[neurons.UnitLayer], dict[str, Any]]:
    """Permute one client's groups onto the anchor's (Git Re-Basin weight matching).

    Args:
        anchor: the anchor's layers in unit form (BatchNorm folded).
        layers: the client's, same widths; handed over (:func:`~fusekit.core.neurons.handed_over`:
            the list is emptied).
        spec: the client's spec (``reads`` / ``writes`` / ``group_names``).
        max_sweeps: sweeps over the groups at most.
        rng: orders the groups in each sweep (default: seed 0).
        solver: ``solver(matrix, maximize=True) -> (rows, cols)`` (SciPy's contract).

    Returns:
        (the permuted layers, {"sweeps", "similarity_before", "similarity_after",
        "assignment": per group, the anchor neuron each client neuron went to}).
    """
    rng = np.random.default_rng(0) if rng is None else rng
    layers = neurons.handed_over(layers)
    n_groups = len(spec.group_names)
    before = total_similarity(anchor, layers, spec)
    order = [np.arange(layers[spec.writes.index(g)].out_features) for g in range(n_groups)]
    sweeps = 0
    for sweep in range(1, max_sweeps + 1):
        sweeps, changed = sweep, False
        for group in map(int, rng.permutation(n_groups)):
            similarity = group_similarity(anchor, layers, spec, group)
            current = float(np.trace(similarity))
            _, cols = solver(similarity, maximize=True)
            best = float(similarity[np.arange(cols.size), cols].sum())
            if best > current + 1e-12 * max(abs(current), 1.0):
                layers = neurons.move_group(layers, spec, group, cols)
                order[group] = order[group][cols]
                changed = True
        if not changed:
            break
    return layers, {"sweeps": sweeps, "similarity_before": before,
                    "similarity_after": total_similarity(anchor, layers, spec),
                    "assignment": [np.argsort(o) for o in order]}


def assignment_solver(backend: str) -> Callable[..., tuple]:
    """The assignment solver named by ``backend`` ("core" or "numpy"), never a fallback."""
    if backend == "core":
        return solve_assignment
    if backend == "numpy":
        from scipy.optimize import linear_sum_assignment

        return linear_sum_assignment
    raise ParameterError(f"backend: expected 'core' or 'numpy', got {backend!r}")


def total_similarity(anchor, layers, spec) -> float:
    """Σ_layers ⟨W_A, W_s⟩ (+ biases): the objective weight matching maximises."""
    return float(sum(np.vdot(a.weight, b.weight) + np.vdot(a.bias, b.bias)
                     for a, b in zip(anchor, layers, strict=True)))


def group_similarity(anchor: Sequence[neurons.UnitLayer], layers: Sequence[neurons.UnitLayer],
                     spec, group: int) -> np.ndarray:
    """S[j, i] = ⟨anchor neuron j, client neuron i⟩ over every member of ``group``, the
    members' products summed in order: one member's blocks are copied at a time, not
    every member's at once."""
    pairs = zip(neurons.group_parts(anchor, spec, group),
                neurons.group_parts(layers, spec, group), strict=True)
    return summed_inner_products([(mine, theirs)] for (_, mine), (_, theirs) in pairs)
