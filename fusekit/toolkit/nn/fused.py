"""``load_fused``: any fusekit checkpoint (a client, or any method's fused output) as a torch
module ready for inference.

- AMS artefacts (``fusekit.ams`` metadata) load as :class:`~fusekit.toolkit.nn.ams.AMSModel`, each
  sub-model rebuilt from its own description.
- Plain checkpoints with ``fusekit.arch`` (written with the fused widths by every method,
  since PFNM/NAFI change widths) are built by :func:`fusekit.toolkit.nn.build_model`.
- Checkpoints without ``fusekit.arch`` holding a torchvision ResNet or VGG (by names and
  shapes, :func:`fusekit.core.arch.infer_arch`) are built as that architecture.
- Other checkpoints without ``fusekit.arch`` (clients that came from outside fusekit) are read
  from their permutation spec (``fusekit.core.spec`` metadata, else inferred from names and
  shapes) as a ReLU MLP: Linear, optional BatchNorm, ReLU, ..., Linear, whose modules keep
  the checkpoint's own tensor names. Convolutional models need ``fusekit.arch`` (padding
  and pooling are not in the tensors).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from fusekit.core import metadata as meta
from fusekit.core.arch import infer_arch
from fusekit.core.checkpoint import Checkpoint, load_checkpoint
from fusekit.core.errors import CheckpointError, DataError, SpecError
from fusekit.core.spec import PermutationSpec, infer_spec, shapes_of, spec_from_json
from fusekit.methods.ams import ams_class_counts, read_ams_metadata
from fusekit.toolkit.nn.ams import AMSModel
from fusekit.toolkit.nn.modules import build_model, load_state_into, state_dict_to_torch
from fusekit.toolkit.nn.preprocess import attach_normalization
from fusekit.toolkit.train import resolve_device

log = logging.getLogger(__name__)


def load_fused(
    path_or_checkpoint: str | os.PathLike[str] | Checkpoint,
    device: str | torch.device = "auto",
) -> nn.Module:
    """Load a fused (or client) checkpoint as a torch module in eval mode.

    Args:
        path_or_checkpoint: a safetensors path, a Hugging Face model folder (loaded by
            ``transformers``, whose output object it returns) or a loaded :class:`Checkpoint`.
        device: ``auto`` (CUDA when available, else CPU), ``cpu`` or ``cuda[:N]``.

    Returns:
        For AMS artefacts an :class:`AMSModel` (all sub-models on ``device``, selection per
        sample with the stored mode and k; change it with ``set_mode``); otherwise the
        model the checkpoint's architecture describes, with the stored (fused) widths.
        Either maps inputs (B, ...) to logits (B, C), normalising them first as the
        checkpoint's ``fusekit.preprocess`` records (so it takes the data as stored).

    Raises:
        CheckpointError: unreadable file, malformed metadata, tensors that do not match
            the described architecture, or a convolutional model without ``fusekit.arch``.
        ParameterError: an unknown device, or CUDA requested without one.
    """
    checkpoint = (path_or_checkpoint if isinstance(path_or_checkpoint, Checkpoint)
                  else load_checkpoint(path_or_checkpoint))
    target = resolve_device(device)
    if checkpoint.config is not None:  # a Hugging Face model folder
        from fusekit.toolkit.nn.hf import load_pretrained

        return load_pretrained(checkpoint.path, target)
    if meta.AMS in checkpoint.metadata:
        model = _load_ams(checkpoint)
    else:
        spec = checkpoint.metadata.get(meta.SPEC)
        spec_json = meta.parse_json_object(spec, meta.SPEC, checkpoint.label) if spec else None
        model = build_plain_model(checkpoint.state_dict(), checkpoint.arch, spec_json,
                                  checkpoint.label)
    attach_normalization(model, checkpoint.preprocess, checkpoint.label)
    return model.to(target).eval()


def _load_ams(checkpoint: Checkpoint) -> AMSModel:
    description = read_ams_metadata(checkpoint.metadata, checkpoint.label)
    tensors = checkpoint.state_dict()
    models, claimed = [], set()
    for index, entry in enumerate(description["models"]):
        prefix = entry.get("prefix") if isinstance(entry, Mapping) else None
        if not isinstance(prefix, str):
            raise CheckpointError(
                f"{checkpoint.label}: {meta.AMS} models[{index}] has no \"prefix\""
            )
        own = {name[len(prefix):]: value for name, value in tensors.items()
               if name.startswith(prefix)}
        if not own:
            raise CheckpointError(
                f"{checkpoint.label}: AMS sub-model {index} has no tensors under {prefix!r}"
            )
        claimed.update(prefix + name for name in own)
        label = f"{checkpoint.label} [{prefix}*]"
        if isinstance(entry.get("config"), Mapping):  # a Hugging Face classifier
            from fusekit.toolkit.nn.hf import classifier_from_tensors

            models.append(classifier_from_tensors(entry["config"], own, label))
            continue
        models.append(build_plain_model(own, entry.get("arch"), entry.get("spec"), label))
    stray = sorted(set(tensors) - claimed)
    if stray:
        raise CheckpointError(
            f"{checkpoint.label}: tensor(s) {stray[:4]} belong to no AMS sub-model; expected "
            "every tensor under a models.<i>. prefix listed in the metadata"
        )
    return AMSModel(models, mode=description["mode"], k=description["k"],
                    confidence=description["confidence"],
                    class_counts=ams_class_counts(description, checkpoint.label))


def build_plain_model(
    state_dict: Mapping[str, np.ndarray],
    arch: Mapping[str, Any] | None,
    spec_json: Mapping[str, Any] | None,
    label: str,
) -> nn.Module:
    """The module of one plain model: from its architecture when known (given, or a
    torchvision ResNet/VGG recognised from names and shapes), else its spec.

    Raises:
        CheckpointError: an invalid architecture or spec, tensors that do not match it, or
            a model the spec alone cannot describe (convolutions, extra tensors).
    """
    shapes = shapes_of(state_dict)
    arch = arch if arch is not None else infer_arch(shapes)
    if arch is not None:
        try:
            model = build_model(arch)
        except SpecError as exc:
            raise CheckpointError(f"{label}: invalid fusekit.arch ({exc})") from None
        return load_state_into(model, state_dict, label)
    try:
        spec = (spec_from_json(spec_json, shapes, label=label) if spec_json is not None
                else infer_spec(shapes, label=label))
    except SpecError as exc:
        raise CheckpointError(str(exc)) from None
    return SpecMLP(spec, state_dict, label)


def hidden_preactivations(checkpoint: Checkpoint, spec: PermutationSpec,
                          inputs: np.ndarray) -> list[np.ndarray]:
    """A client's pre-activations on ``inputs``, for activation-mode OT fusion (§5).

    The pre-activation of a hidden neuron is its layer's output after the BatchNorm (if
    any) and before the ReLU, i.e. the output of the BatchNorm-folded layer.

    Args:
        checkpoint: the client (built with :func:`build_plain_model`, on the CPU).
        spec: its permutation spec.
        inputs: float32 (N, ...) inputs as stored (the model's ``fusekit.preprocess`` is
            applied; flattened for an MLP).

    Returns:
        Per hidden layer, float64 (samples, J): linear layers give N rows; conv layers
        give N*H*W rows (every spatial position of a channel is a sample of that neuron).

    Raises:
        DataError: the inputs do not fit the model.
    """
    spec_json = spec.to_json() if checkpoint.arch is None else None
    model = build_plain_model(checkpoint.state_dict(), checkpoint.arch, spec_json,
                              checkpoint.label).eval()
    attach_normalization(model, checkpoint.preprocess, checkpoint.label)
    captured: list[torch.Tensor] = []
    hooks = [module.register_forward_hook(lambda _m, _i, out: captured.append(out.clone()))
             for module in preactivation_modules(model, spec)[:-1]]
    try:
        with torch.no_grad():
            model(torch.from_numpy(np.ascontiguousarray(inputs, dtype=np.float32)))
    except RuntimeError as exc:
        raise DataError(
            f"activations: inputs of shape {tuple(inputs.shape)} do not fit "
            f"{checkpoint.label} ({str(exc).splitlines()[0]})"
        ) from None
    finally:
        for hook in hooks:
            hook.remove()
    out = []
    for value in captured:
        if value.dim() == 4:  # (N, C, H, W) -> (N*H*W, C)
            value = value.permute(0, 2, 3, 1).reshape(-1, value.shape[1])
        out.append(value.double().numpy())
    return out


def preactivation_modules(model: nn.Module, spec: PermutationSpec) -> list[nn.Module]:
    """Per spec layer, the module whose output is that layer's pre-activation."""
    if isinstance(model, SpecMLP):
        return list(model.preactivation)
    return [model.get_submodule(layer.norm.prefix if layer.norm else layer.name)
            for layer in spec.layers]


class SpecMLP(nn.Module):
    """A ReLU MLP read from a permutation spec: Linear, (BatchNorm1d), ReLU, ..., Linear.

    Its modules sit at the checkpoint's own module paths, so ``state_dict()`` has the
    checkpoint's tensor names (``fc1.weight`` stays ``fc1.weight``).
    """

    def __init__(self, spec: PermutationSpec, state_dict: Mapping[str, np.ndarray], label: str):
        super().__init__()
        if any(layer.kind != "linear" for layer in spec.layers):
            raise CheckpointError(
                f"{label}: a convolutional model needs fusekit.arch metadata to be rebuilt "
                "(padding and pooling are not stored in the tensors); found none"
            )
        if spec.other:
            raise CheckpointError(
                f"{label}: tensor(s) {list(spec.other)[:4]} are not part of any Linear or "
                "BatchNorm layer; without fusekit.arch fusekit cannot tell what they do"
            )
        tensors = state_dict_to_torch(state_dict)
        self.steps: list[nn.Module] = []
        self.preactivation: list[nn.Module] = []
        for index, layer in enumerate(spec.layers):
            linear = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
            names = {"weight": layer.weight, "bias": layer.bias}
            self._place(linear, names, tensors, label)
            if layer.norm is not None:
                norm = nn.BatchNorm1d(layer.out_features, eps=layer.norm.eps,
                                      affine=layer.norm.weight is not None)
                names = {"weight": layer.norm.weight, "bias": layer.norm.bias,
                         "running_mean": layer.norm.running_mean,
                         "running_var": layer.norm.running_var,
                         "num_batches_tracked": layer.norm.num_batches_tracked}
                self._place(norm, names, tensors, label)
            self.preactivation.append(self.steps[-1])
            if index < len(spec.layers) - 1:
                self.steps.append(nn.ReLU())

    def _place(self, module: nn.Module, names: Mapping[str, str | None],
               tensors: Mapping[str, torch.Tensor], label: str) -> None:
        """Put ``module`` at the path its tensors name, with their values."""
        given = {attr: name for attr, name in names.items() if name is not None}
        path = next(iter(given.values())).rpartition(".")[0]
        if not path or any(name != f"{path}.{attr}" for attr, name in given.items()):
            raise CheckpointError(
                f"{label}: tensors {sorted(given.values())} do not read as one module's "
                "<path>.weight/.bias; describe the architecture in fusekit.arch metadata "
                "(see fusekit.core.arch) or load the tensors into your own model"
            )
        for attr, value in module.state_dict().items():
            if attr not in given:  # e.g. a counter the checkpoint does not have
                module.register_buffer(attr, None)
            elif tuple(value.shape) != tuple(tensors[given[attr]].shape):
                raise CheckpointError(
                    f"{label}: tensor {given[attr]!r} has shape "
                    f"{tuple(tensors[given[attr]].shape)}; expected {tuple(value.shape)}")
        with torch.no_grad():
            for attr, name in given.items():
                getattr(module, attr).copy_(tensors[name])
        parent: nn.Module = self
        *parents, leaf = path.split(".")
        try:
            for part in parents:
                if part not in parent._modules:
                    parent.add_module(part, nn.Module())
                parent = parent._modules[part]
            parent.add_module(leaf, module)
        except KeyError as exc:
            raise CheckpointError(
                f"{label}: module path {path!r} cannot be rebuilt ({exc.args[0]}); describe "
                "the architecture in fusekit.arch metadata (see fusekit.core.arch)"
            ) from None
        self.steps.append(module)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)
        for step in self.steps:
            x = step(x)
        return x
