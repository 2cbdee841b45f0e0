"""Fed² feature-paired averaging, ALGORITHMS.md §9 (Fed² paper §5.2, Eq. 18-19)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated, Any

import numpy as np

from fusekit.core.arch import validate_arch
from fusekit.core.checkpoint import Checkpoint
from fusekit.core.errors import CheckpointError, IncompatibleModelsError, SpecError
from fusekit.core.fed2 import group_slices
from fusekit.core.spec import PermutationSpec, permute
from fusekit.methods.avg import average_arrays, check_equal_shapes
from fusekit.methods.base import FusionMethod, FusionResult, register, sample_weights
from fusekit.methods.params import Param


@register
class FeaturePairedAverage(FusionMethod):
    name = "fed2"
    summary = "Fed² feature-paired averaging of grouped models (groups paired by their classes)"
    client_structure = "fed2"

    def fuse(
        self,
        checkpoints: Sequence[Checkpoint],
        specs: Sequence[PermutationSpec],
        *,
        uniform: Annotated[bool, Param(
            help="weight clients equally (the paper's E(.)) instead of by sample count",
            paper="Fed² Eq. 18-19")] = False,
    ) -> FusionResult:
        """Shared layers: coordinate averaging (Eq. 18). Decoupled layers: group g of the
        fused model averages, from every client, the group that holds the same class
        logits (Eq. 19); clients may order their groups differently.

        Args:
            checkpoints: Fed² clients (``"fed2"`` in ``fusekit.arch``) of one architecture
                up to the order of their groups.
            specs: their permutation specs.
            uniform: weight clients equally (the paper's E(·)) instead of by sample count.

        Raises:
            IncompatibleModelsError: a client without Fed² structure, different
                architectures or class sets, or a paired group of a different size.
        """
        check_equal_shapes(checkpoints)
        reference = fed2_settings(checkpoints[0])
        widths = specs[0].hidden_widths
        aligned = []
        for checkpoint, spec in zip(checkpoints, specs, strict=True):
            perms = group_pairing(reference, fed2_settings(checkpoint), widths, checkpoint.label)
            if any(p is not None for p in perms) and (checkpoint.arch or {}).get("pan"):
                raise IncompatibleModelsError(
                    f"{checkpoint.label}: orders its Fed² groups differently from "
                    f"{checkpoints[0].label} and has position-aware neurons, which pairing "
                    "would move; expected one group order for PAN models"
                )
            aligned.append(permute(checkpoint.state_dict(), spec, perms))
        weights = (np.full(len(checkpoints), 1.0 / len(checkpoints)) if uniform
                   else sample_weights(checkpoints))
        fused = {name: average_arrays([a[name] for a in aligned], weights, name)
                 for name in checkpoints[0].tensors}
        report = {"groups": reference["groups"], "depth": reference["depth"],
                  "classes": reference["classes"]}
        return self.result(fused, checkpoints, specs[0], {"uniform": uniform}, report)

    def check_client(self, checkpoint: Checkpoint, spec: PermutationSpec) -> None:
        """Refuse a client without a valid Fed² structure (see :func:`fed2_settings`)."""
        fed2_settings(checkpoint)


def fed2_settings(checkpoint: Checkpoint) -> Mapping[str, Any]:
    """The ``fed2`` entry of a checkpoint's architecture.

    Raises:
        IncompatibleModelsError: the checkpoint is not a Fed² model.
        CheckpointError: its architecture is invalid.
    """
    arch = checkpoint.arch or {}
    if not arch.get("fed2"):
        raise IncompatibleModelsError(
            f"{checkpoint.label}: 'fed2' fuses Fed² models (\"fed2\" in fusekit.arch, "
            "written by `fusekit simulate --fed2`); this checkpoint has none"
        )
    try:
        return validate_arch(arch)["fed2"]
    except SpecError as exc:
        raise CheckpointError(f"{checkpoint.label}: invalid fusekit.arch ({exc})") from None


def group_pairing(
    reference: Mapping[str, Any], client: Mapping[str, Any], widths: Sequence[int], label: str
) -> list[np.ndarray | None]:
    """Per hidden layer, the client's neuron order that puts its group paired with the
    reference's group g at g's position (``perm[new] = old``); None where nothing moves.

    Two groups are paired iff they hold the same class logits (Eq. 19).

    Raises:
        IncompatibleModelsError: different group counts, depths or class sets, or paired
            groups of different sizes.
    """
    if (client["groups"], client["depth"]) != (reference["groups"], reference["depth"]):
        raise IncompatibleModelsError(
            f"{label}: Fed² structure G={client['groups']}, depth={client['depth']}; expected "
            f"G={reference['groups']}, depth={reference['depth']} like the other clients"
        )
    owner = {frozenset(block): h for h, block in enumerate(client["classes"])}
    try:
        pairs = [owner[frozenset(block)] for block in reference["classes"]]
    except KeyError:
        raise IncompatibleModelsError(
            f"{label}: Fed² class groups {client['classes']} cannot be paired with "
            f"{reference['classes']}; expected the same sets of classes"
        ) from None
    groups = reference["groups"]
    n_layers = len(widths) + 1
    perms: list[np.ndarray | None] = [None] * len(widths)
    if pairs == list(range(groups)):
        return perms
    for hidden in range(n_layers - reference["depth"], n_layers - 1):
        slices = group_slices(widths[hidden], groups)
        if any(slices[g].stop - slices[g].start != slices[h].stop - slices[h].start
               for g, h in enumerate(pairs)):
            raise IncompatibleModelsError(
                f"{label}: a paired Fed² group has a different number of neurons in hidden "
                f"layer {hidden} (width {widths[hidden]} does not split evenly into "
                f"{groups} groups); cannot average it"
            )
        perms[hidden] = np.concatenate([np.arange(slices[h].start, slices[h].stop)
                                        for h in pairs])
    return perms
