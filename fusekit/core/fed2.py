"""Fed² structure, without torch (ALGORITHMS.md §9; Fed² paper §4-5).

A Fed² model is an MLP or ConvNet whose last ``depth`` weighted layers are *decoupled*
into G groups. The settings live in ``fusekit.arch`` under ``"fed2"``::

    {"groups": G, "depth": d, "classes": [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]}

``classes[g]`` are the logits of group g (Eq. 16: each class logit is wired to one group
only). The neurons of every decoupled hidden layer are split into G contiguous blocks,
the first ``J mod G`` one neuron larger (:func:`group_sizes`); block g belongs to group g.

Connectivity, with L weighted layers numbered 0..L-1 and decoupled layers L-d..L-1:

- layer L-d reads every output of the shared layer below it (dense input, grouped
  output): each group branches off the shared trunk;
- layers L-d+1..L-2 are group-wise (Eq. 13): group g's neurons read group g's neurons only;
- the logit layer L-1 connects class k only to the neurons of the group that owns k
  (the decoupled logit layer, Eq. 16).

Layers are stored dense; the entries outside the groups are zero and masked in the forward
pass, so every tensor keeps the shape and name of the plain model.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from fusekit.core.errors import SpecError
from fusekit.core.settings import settings_object


def allocate_classes(num_classes: int, groups: int) -> list[list[int]]:
    """Group-wise allocation of C classes to G groups: contiguous blocks, the first
    ``C mod G`` groups one class larger (one class per group when G = C, Fed² Fig. 5).

    Raises:
        SpecError: G < 1 or G > C (a group without a class would get no gradient).
    """
    if not 1 <= groups <= num_classes:
        raise SpecError(
            f"fed2.groups: expected 1 <= G <= {num_classes} (the number of classes), "
            f"found {groups}"
        )
    return [list(map(int, block)) for block in np.array_split(np.arange(num_classes), groups)]


def group_sizes(width: int, groups: int) -> list[int]:
    """Neurons of each group in a decoupled layer of ``width``: contiguous, sizes differ
    by at most one, larger groups first."""
    return [len(block) for block in np.array_split(np.arange(width), groups)]


def group_slices(width: int, groups: int) -> list[slice]:
    """The neuron index range of every group in a decoupled layer of ``width``."""
    ends = np.cumsum([0, *group_sizes(width, groups)])
    return [slice(int(a), int(b)) for a, b in itertools.pairwise(ends)]


def validate_fed2(
    settings: Any, *, num_classes: int, widths: Sequence[int]
) -> dict[str, Any] | None:
    """Check the ``fed2`` entry of an architecture against its layers.

    Args:
        settings: None, or ``{"groups", "depth", "classes"?}`` (classes default to
            :func:`allocate_classes`).
        num_classes: outputs of the model.
        widths: hidden widths of the model (the weighted layers are these plus the output).

    Returns:
        The normalised settings (``classes`` filled in), or None.

    Raises:
        SpecError: unknown keys, 2 <= depth <= L violated, a decoupled layer narrower than G,
            or classes that are not a partition of 0..C-1 into G non-empty groups.
    """
    if settings_object(settings, "arch.fed2", ("groups", "depth", "classes")) is None:
        return None
    groups, depth = settings.get("groups"), settings.get("depth")
    n_layers = len(widths) + 1
    for key, value in (("groups", groups), ("depth", depth)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
            raise SpecError(f"arch.fed2.{key}: expected a positive integer, found {value!r}")
    if not 2 <= depth <= n_layers:
        raise SpecError(
            f"arch.fed2.depth: expected 2 <= depth <= {n_layers} (the weighted layers; the "
            f"logit layer and at least one hidden layer are decoupled), found {depth}"
        )
    classes = settings.get("classes") or allocate_classes(num_classes, int(groups))
    flat = sorted(int(k) for block in classes for k in block)
    if len(classes) != groups or flat != list(range(num_classes)) or not all(classes):
        raise SpecError(
            f"arch.fed2.classes: expected {groups} non-empty groups that together hold each "
            f"class 0..{num_classes - 1} once, found {classes!r}"
        )
    for index, width in enumerate(widths[n_layers - depth:], start=n_layers - depth):
        if width < groups:
            raise SpecError(
                f"arch.fed2: decoupled layer {index} has {width} neurons, fewer than the "
                f"{groups} groups"
            )
    return {"groups": int(groups), "depth": int(depth),
            "classes": [[int(k) for k in block] for block in classes]}


def output_groups(settings: Mapping[str, Any], width: int, *, logits: bool) -> np.ndarray:
    """The group of every output of a decoupled layer: by block for hidden layers, by
    class ownership for the logit layer."""
    owner = np.empty(width, dtype=np.int64)
    if logits:
        for g, block in enumerate(settings["classes"]):
            owner[block] = g
        return owner
    for g, part in enumerate(group_slices(width, settings["groups"])):
        owner[part] = g
    return owner


def layer_masks(
    settings: Mapping[str, Any], widths: Sequence[int], num_classes: int
) -> list[np.ndarray | None]:
    """Per weighted layer, a bool (outputs, input units) connectivity mask, or None for a
    dense layer. Input units are the neurons of the layer below (for a conv→linear
    flatten, channels: expand each over its H·W columns).
    """
    n_layers = len(widths) + 1
    first = n_layers - settings["depth"]
    masks: list[np.ndarray | None] = [None] * n_layers
    for index in range(first + 1, n_layers):
        logits = index == n_layers - 1
        width = num_classes if logits else widths[index]
        rows = output_groups(settings, width, logits=logits)
        cols = output_groups(settings, widths[index - 1], logits=False)
        masks[index] = rows[:, None] == cols[None, :]
    return masks
