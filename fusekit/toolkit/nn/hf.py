"""Hugging Face model folders back as ``transformers`` modules (the ``[hf]`` extra).

The only place fusekit imports ``transformers``: fusion itself reads and writes the folders
with numpy (:mod:`fusekit.core.checkpoint`, :mod:`fusekit.core.transformer`).
"""

from __future__ import annotations

import os
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from fusekit.core.checkpoint import HF_CONFIG, write_model_files
from fusekit.core.errors import CheckpointError
from fusekit.core.metadata import read_json_file

# from_pretrained swaps PreTrainedModel.tie_weights and init_weights for no-ops and back,
# process-wide: two loads in threads at once can leave the no-op in place, and every model
# built after that has its tied weights untied. One load at a time.
_LOADING = threading.Lock()


def load_pretrained(folder: str | os.PathLike[str], device: Any = "cpu"):
    """The model class ``config.json`` names (``architectures[0]``, e.g.
    ``ViTForImageClassification``; ``AutoModel`` when it names none), loaded with
    ``from_pretrained`` from the folder, in eval mode.

    Raises:
        CheckpointError: transformers is not installed, or the config names a class it
            does not have.
    """
    config = read_json_file(Path(folder) / HF_CONFIG, "model config", CheckpointError)
    cls = model_class(config, str(folder))
    bars = _transformers(str(folder)).utils.logging
    with _LOADING:
        shown = bars.is_progress_bar_enabled()
        bars.disable_progress_bar()  # library code never prints ("Loading weights" bars)
        try:
            model = cls.from_pretrained(folder)
        finally:
            if shown:
                bars.enable_progress_bar()
    return model.to(device).eval()


def model_class(config: Mapping[str, Any], label: str) -> Any:
    """The transformers class a config names (``architectures[0]``, else ``AutoModel``).

    Raises:
        CheckpointError: transformers is not installed, or has no such class.
    """
    transformers = _transformers(label)
    name = (config.get("architectures") or ["AutoModel"])[0]
    cls = getattr(transformers, name, None)
    if cls is None:
        raise CheckpointError(f"{label}: config.json names the class {name!r}, which "
                              f"transformers {transformers.__version__} does not have")
    return cls


def _transformers(label: str) -> Any:
    try:
        import transformers
    except ImportError:
        raise CheckpointError(f"{label}: a Hugging Face model needs the transformers "
                              "package: pip install 'fusekit-oneshot[hf]'") from None
    return transformers


class ClassifierLogits(nn.Module):
    """A transformers model as a module from its one input tensor (``pixel_values`` or
    ``input_ids``) to logits (answers, classes): a classifier's (batch, classes), a
    language model's every position as one row (batch x tokens, vocabulary). How an AMS
    artefact runs a classifier and distillation its teacher and student."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(**{self.model.main_input_name: x}).logits.flatten(0, -2)


def classifier_from_tensors(config: Mapping[str, Any], tensors: Mapping[str, np.ndarray],
                            label: str) -> ClassifierLogits:
    """A classifier built from its config.json and its tensors (an AMS sub-model): see
    :func:`model_from_tensors`."""
    return ClassifierLogits(model_from_tensors(config, tensors, label))


def model_from_tensors(config: Mapping[str, Any], tensors: Mapping[str, np.ndarray],
                       label: str, device: Any = "cpu"):
    """The model a config.json describes, with these tensors, through a model folder
    written aside: ``from_pretrained`` is what maps the saved tensor names to the
    module's (transformers renames some modules in memory).

    Raises:
        CheckpointError: transformers is missing, or cannot load the tensors as the
            config's model.
    """
    model_class(config, label)  # a clear error before anything is written
    with tempfile.TemporaryDirectory(prefix="fusekit-hf-") as folder:
        write_model_files(Path(folder), tensors, {}, config)
        try:
            return load_pretrained(folder, device)
        except (OSError, ValueError, RuntimeError) as exc:
            raise CheckpointError(f"{label}: transformers cannot load it as the model its "
                                  f"config describes ({str(exc).splitlines()[0]})") from None


def saved_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors under the names ``save_pretrained`` writes (transformers 5
    renames some modules in memory; tied weights appear once)."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers before 5 saves tensors under their own names
        return model.state_dict()
    return revert_weight_conversion(model, model.state_dict())


def modules_by_saved_name(model: nn.Module) -> dict[str, nn.Module]:
    """Every module that holds parameters, by the name ``save_pretrained`` writes its
    tensors under (transformers 5 renames some modules in memory: a ViT's
    ``encoder.layer.N.attention.attention.query`` is ``layers.N.attention.q_proj``)."""
    names = [name for name, _ in model.named_parameters()]
    saved = _saved_names(model, names)
    return {saved.get(name, name).rpartition(".")[0]: model.get_submodule(name.rpartition(".")[0])
            for name in names}


def _saved_names(model: nn.Module, names: list[str]) -> dict[str, str]:
    """Parameter name in memory -> name in model.safetensors, for the parameters
    transformers saves one to one: each is replaced by a one-entry marker holding its index
    and run through the conversion ``save_pretrained`` applies."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers before 5 saves parameters under their own names
        return {}
    markers = {name: torch.full((1,), float(i)) for i, name in enumerate(names)}
    reverted = revert_weight_conversion(model, markers)
    return {names[int(marker.reshape(-1)[0])]: name for name, marker in reverted.items()
            if marker.numel() == 1}
