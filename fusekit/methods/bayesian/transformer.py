"""PFNM / NAFI on transformers: the MLP hidden units of each block matched across clients,
everything else aligned to an anchor and averaged (ALGORITHMS.md §13).

1. Every client's residual stream, heads, and heads' q/k and v dimensions are aligned to
   the anchor (one pass in data-flow order, :func:`fusekit.methods.transformer.align_client`
   without the MLP groups), so that the MLP units' rows and columns live in one stream
   basis; only the takes that aligned each client are kept.
2. Block by block, the MLP units' vectors [input row, bias, output column] of every client
   (its tensors read again from the files and moved as its alignment moved them) are
   matched by :func:`~fusekit.methods.bayesian.network.match_layer` as any layer (PFNM's
   cost, or NAFI's with λ > 0; σ², σ0², γ0 estimated per block while matching,
   ALGORITHMS.md §3); the fused units are the posterior means (the members' means with
   estimated values), at the width ``width`` / ``width_ratio`` asks (one width for
   every block: config.json holds one).
3. Every other tensor is the sample-weighted average of the aligned clients, a tensor at a
   time (:func:`fusekit.methods.transformer.average_aligned`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from fusekit.core import neurons
from fusekit.core.checkpoint import Checkpoint
from fusekit.core.errors import ParameterError, SpecError
from fusekit.core.transformer import Group, TransformerSpec, unit_rows
from fusekit.engine.matching import solve_assignment
from fusekit.methods.bayesian.network import (
    BayesianParams,
    client_sigmas,
    layer_widths,
    match_layer,
)
from fusekit.methods.ot import resolve_anchor
from fusekit.methods.transformer import (
    align_all,
    aligned_tensor,
    average_aligned,
    cast_all,
    check_aligned_sizes,
)


def fuse_transformer_mlps(checkpoints: Sequence[Checkpoint], specs: Sequence[TransformerSpec],
                          params: BayesianParams, method: str
                          ) -> tuple[dict[str, np.ndarray], TransformerSpec, dict[str, Any],
                                     list[list[np.ndarray]]]:
    """Fuse transformer clients with PFNM / NAFI on their MLP units (module docstring).

    Returns:
        (state_dict, fused spec (the anchor's, MLP widths fused), report, assignments):
        per client, the fused unit of each of its units in the stream (the alignment's)
        and in each block's MLP (the matching's), as calibration reads them.

    Raises:
        IncompatibleModelsError: groups other than the MLPs of unequal sizes.
        ParameterError: ``width="unlimited"`` (each block would infer its own width).
    """
    anchor = resolve_anchor(checkpoints, None)
    mlps = specs[anchor].of_kind("mlp")
    hidden = specs[anchor].of_kind("stream", "mlp")  # the groups assignments are given for
    check_aligned_sizes(checkpoints, specs, anchor, method, matched=set(mlps))
    widths = layer_widths(params, [[sp.groups[g].size for g in mlps] for sp in specs])
    if None in widths or len(set(widths)) > 1:
        raise ParameterError(f"width: {method} on a transformer needs one MLP width for every "
                             "block (config.json holds one); give --width N or --width-ratio, "
                             f"found {params.width!r}")
    start = time.perf_counter()
    # Only the takes that aligned each client are kept; each block's MLP tensors are read
    # again from the files when the block is matched (the clients held whole, 1.76 GB on
    # four BERT-bases, were most of the peak).
    _, assignments, moves = align_all(checkpoints, specs, anchor, sweeps=0, rng=None,
                                      solver=solve_assignment, skip=set(mlps))
    align_s = time.perf_counter() - start
    sigmas = None if params.sigma is None else client_sigmas(params.sigma, len(checkpoints))
    fused_sizes, reports, fused_tensors = {}, [], {}
    for index in mlps:
        groups = [sp.groups[index] for sp in specs]
        clients = [{slot.tensor: aligned_tensor(checkpoint, slot.tensor, moved)
                    for slot in group.slots}
                   for checkpoint, group, moved in zip(checkpoints, groups, moves, strict=True)]
        means, report, matched = _match_mlp(clients, groups, params, sigmas, widths[0],
                                            index)
        for client, assigned in zip(assignments, matched, strict=True):
            client[hidden.index(index)] = assigned
        # stored as the clients store them at once, not held in float64 to the end
        fused_tensors.update(cast_all(_write_back(means, groups[anchor], clients[anchor]),
                                      checkpoints[anchor]))
        fused_sizes[groups[anchor].name] = means.shape[0]
        reports.append({"layer": groups[anchor].name, "width_asked": widths[0], **report})
    averaged = average_aligned(checkpoints, anchor, moves, skip=fused_tensors)
    state_dict = {name: fused_tensors[name] if name in fused_tensors else averaged[name]
                  for name in checkpoints[anchor].tensors}
    report = {"anchor": checkpoints[anchor].label, "align_time_s": align_s,
              "layers": reports}
    return state_dict, specs[anchor].with_group_sizes(fused_sizes), report, assignments


def _match_mlp(clients: Sequence[dict], groups: Sequence[Group], params: BayesianParams,
               sigmas, width: int, index: int
               ) -> tuple[np.ndarray, dict[str, Any], list[np.ndarray]]:
    """One block's MLP units matched across clients: (fused width, P) fused unit vectors,
    the report, per client the fused unit of each of its units."""
    vecs, labels = [], None
    for client, group in zip(clients, groups, strict=True):
        parts = [unit_rows(client[slot.tensor], slot, group.size) for slot in group.slots]
        vecs.append(np.hstack(parts))
        labels = np.concatenate([np.full(p.shape[1], i) for i, p in enumerate(parts)])
    observed = [np.ones(v.shape[1], dtype=bool) for v in vecs]
    unit = neurons.block_variances(vecs, observed, labels)
    fit = match_layer(params, sigmas, vecs, observed, unit, index, width)
    result = fit.matching
    means, shares = result.means, result.reader_shares()
    if shares is not None:  # the block's output layer reads the units: its columns
        means = means.copy()
        for part in _reader_slots(groups[0]):
            means[:, labels == part] *= shares[:, None]
    return means, {**result.report, "hyperparameters": fit.report}, result.assignments


def _reader_slots(group: Group) -> list[int]:
    """Positions of the slots of an MLP group that read its units (the output layer's
    weight): every slot but the input layer's weight and bias, the weight whose module's
    bias is in the group (as :func:`fusekit.core.transformer.calibration_points` finds it)."""
    biases = {slot.tensor for slot in group.slots if slot.tensor.endswith(".bias")}
    writers = biases | {t.removesuffix(".bias") + ".weight" for t in biases}
    readers = [i for i, slot in enumerate(group.slots) if slot.tensor not in writers]
    if len(readers) == len(group.slots) or not readers:
        raise SpecError(f"group {group.name!r}: cannot tell the MLP's input layer (the "
                        "weight with a bias in the group) from its output layer")
    return readers


def _write_back(means: np.ndarray, group: Group, like: dict[str, np.ndarray]
                ) -> dict[str, np.ndarray]:
    """The MLP tensors at the fused width from the matched units' vectors: each slot's
    columns of ``means``, put back on the slot's axis (the tensors' other axes are the
    anchor's, as in ``like``)."""
    out, start = {}, 0
    width = means.shape[0]
    for slot in group.slots:
        moved = np.moveaxis(like[slot.tensor], slot.axis, 0)
        if slot.offset or group.size * slot.block != moved.shape[0]:
            raise SpecError(f"group {group.name!r}: an MLP group must span all of axis "
                            f"{slot.axis} of tensor {slot.tensor!r} to change its width")
        rest = moved.shape[1:]
        size = int(np.prod(rest, dtype=np.int64)) * slot.block
        block = means[:, start:start + size].reshape(width * slot.block, *rest)
        start += size
        out[slot.tensor] = np.moveaxis(block, 0, slot.axis)
    return out
