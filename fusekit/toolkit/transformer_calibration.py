"""A client's statistics of a Hugging Face transformer on its own data (ALGORITHMS.md §13,
"Calibration"): per channel count, mean and variance of every MLP's hidden pre-activation
and every LayerNorm's output, over every token that is not padding.

Padding: a token model's inputs (``input_ids``) are run with an attention mask that is 0
where a token equals the config's ``pad_token_id`` (when it has one), and those positions
are left out of the statistics; every other position of every input counts once (a ViT:
every patch and the class token). Only the aggregates leave the client.
"""

from __future__ import annotations

import numpy as np
import torch

from fusekit import api
from fusekit.core.checkpoint import Checkpoint
from fusekit.core.errors import CheckpointError, DataError
from fusekit.core.stats import Statistics
from fusekit.core.transformer import calibration_points
from fusekit.toolkit.calibration import ChannelAccumulator, recorded_statistics
from fusekit.toolkit.nn.hf import load_pretrained, model_from_tensors, modules_by_saved_name


def transformer_statistics(checkpoint: Checkpoint, inputs: np.ndarray, *, mode: str,
                           batch_size: int, device: str) -> Statistics:
    """Statistics of a transformer (a model folder, or tensors with their config) on
    ``inputs``: (N, ...) pixel values, or (N, L) token ids, as the model's main input.
    Points appear in the order the forward pass reaches them (the layer-by-layer order).

    Raises:
        DataError: inputs the model does not take (token ids that are not integers in the
            vocabulary, shapes it refuses).
    """
    spec = api.fused_spec(checkpoint)
    shapes = {name: info.shape for name, info in checkpoint.tensors.items()}
    points = calibration_points(spec, shapes)
    model = _module(checkpoint, device)
    modules = modules_by_saved_name(model)
    accumulators: dict[str, ChannelAccumulator] = {}  # filled in forward order
    mask: list[torch.Tensor | None] = [None]

    def hook(point: str):
        def record(_module, _args, output):
            tokens = output.reshape(-1, output.shape[-1]) if mask[0] is None else (
                output[mask[0]])
            accumulators.setdefault(point, ChannelAccumulator()).add(tokens)
        return record

    hooks = [modules[p.module].register_forward_hook(hook(p.point)) for p in points]

    def run(batch: np.ndarray) -> None:
        feed, mask[0] = _feed(model, batch, device)
        model(**feed)

    return recorded_statistics(run, inputs, batch_size, hooks, accumulators, checkpoint, mode)


def _module(checkpoint: Checkpoint, device: str):
    if checkpoint.path is not None and checkpoint.path.is_dir():
        return load_pretrained(checkpoint.path, device)
    if checkpoint.config is None:
        raise CheckpointError(f"{checkpoint.label}: a transformer's tensors without their "
                              "config.json cannot be run")
    return model_from_tensors(checkpoint.config, checkpoint.state_dict(), checkpoint.label,
                              device)


def _feed(model, batch: np.ndarray, device: str
          ) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """The model's keyword inputs for one batch, and the mask of the tokens counted."""
    name = model.main_input_name
    if name != "input_ids":
        values = torch.from_numpy(np.ascontiguousarray(batch, dtype=np.float32))
        return {name: values.to(device)}, None
    if batch.dtype.kind == "f" and not np.array_equal(batch, np.round(batch)):
        raise DataError("statistics: a token model's inputs must be integer token ids; "
                        f"found {batch.dtype} values that are not integers")
    ids = torch.from_numpy(np.ascontiguousarray(batch, dtype=np.int64)).to(device)
    pad = getattr(model.config, "pad_token_id", None)
    if pad is None:
        return {name: ids}, None
    mask = ids != pad
    return {name: ids, "attention_mask": mask.long()}, mask
