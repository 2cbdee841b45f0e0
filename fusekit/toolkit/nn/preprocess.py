"""A model's recorded input normalisation (``fusekit.preprocess``), applied where data meets
the model.

Preprocessing belongs to the model, not to the data: loaders return arrays as stored, and
every module fusekit builds from a checkpoint that records a normalisation computes
``(x - mean) / std`` on its inputs first (a forward pre-hook, so the module's names and
state_dict stay the checkpoint's, and hooks on its layers see what the layers see).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from fusekit.core.errors import DataError
from fusekit.core.metadata import PREPROCESS, Normalization


def normalized(x: torch.Tensor, normalization: Normalization, label: str) -> torch.Tensor:
    """``(x - mean) / std`` with ``mean``/``std`` broadcast as one value, one per channel
    (axis 1) or one per feature (every element of a sample).

    Raises:
        DataError: naming ``label``: ``x``'s shape fits none of the three.
    """
    size = len(normalization.mean)
    mean = torch.tensor(normalization.mean, dtype=x.dtype, device=x.device)
    std = torch.tensor(normalization.std, dtype=x.dtype, device=x.device)
    if size == 1 or (x.ndim >= 2 and x.shape[1] == size):
        shape = (1, size, *([1] * (x.ndim - 2))) if size > 1 else (1,)
        return (x - mean.view(shape)) / std.view(shape)
    if x.ndim >= 2 and math.prod(x.shape[1:]) == size:
        return ((x.flatten(1) - mean) / std).view(x.shape)
    raise DataError(
        f"{label}: metadata {PREPROCESS} holds {size} means and stds; expected inputs with "
        f"{size} channels (axis 1) or {size} features per sample, found shape "
        f"{tuple(x.shape)}")


_ATTRIBUTE = "_fusekit_normalization"


def attach_normalization(model: nn.Module, normalization: Normalization | None,
                         label: str) -> nn.Module:
    """``model`` normalising its inputs first (nothing changes for None); returns it.
    :func:`model_normalization` tells what it applies (a checkpoint of it records that)."""
    if normalization is not None:
        model.register_forward_pre_hook(
            lambda _module, args: (normalized(args[0], normalization, label), *args[1:]))
        setattr(model, _ATTRIBUTE, normalization)
    return model


def model_normalization(model: nn.Module) -> Normalization | None:
    """What :func:`attach_normalization` made ``model`` apply to its inputs, or None."""
    return getattr(model, _ATTRIBUTE, None)
