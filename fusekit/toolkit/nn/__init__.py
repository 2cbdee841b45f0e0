"""Neural-network modules for fusekit models (MLP, ConvNet, PANs).

``fusekit.core.arch`` (architecture JSON: validation, hidden widths) is torch-free; the torch
modules in ``fusekit.toolkit.nn.modules`` are imported lazily so that ``import fusekit.core.arch``
does not import torch.
"""

from __future__ import annotations

from typing import Any

from fusekit.core.arch import (
    convnet_arch,
    describe_arch,
    hidden_widths,
    mlp_arch,
    pan_encoding,
    parse_arch_string,
    validate_arch,
    with_hidden_widths,
)

_TORCH_NAMES = (
    "FusekitConvNet",
    "FusekitMLP",
    "PositionEncoding",
    "build_model",
    "load_model",
    "load_state_into",
    "pan_buffer_names",
    "state_dict_to_torch",
)

__all__ = [
    "convnet_arch",
    "describe_arch",
    "hidden_widths",
    "mlp_arch",
    "pan_encoding",
    "parse_arch_string",
    "validate_arch",
    "with_hidden_widths",
    *_TORCH_NAMES,
]


def __getattr__(name: str) -> Any:
    if name in _TORCH_NAMES:
        from fusekit.toolkit.nn import modules

        return getattr(modules, name)
    raise AttributeError(f"module 'fusekit.toolkit.nn' has no attribute {name!r}")
