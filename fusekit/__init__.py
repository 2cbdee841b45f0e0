"""fusekit: one-shot, data-free fusion of neural networks.

    >>> import fusekit
    >>> result = fusekit.fuse(["a.safetensors", "b.safetensors"], method="avg")
    >>> result.save("fused.safetensors")
    >>> model = fusekit.load_fused("fused.safetensors")  # a torch module (imports torch)
    >>> fusekit.calibrate("fused.safetensors", ["a.stats.safetensors", "b.stats.safetensors"]
    ...                   ).save("calibrated.safetensors")
"""

from typing import Any

from fusekit._version import __version__
from fusekit.api import calibrate, fuse
from fusekit.core.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from fusekit.core.spec import PermutationSpec, infer_spec
from fusekit.methods import METHODS, FusionResult

__all__ = [
    "METHODS",
    "Checkpoint",
    "FusionResult",
    "PermutationSpec",
    "__version__",
    "calibrate",
    "fuse",
    "infer_spec",
    "load_checkpoint",
    "load_fused",
    "save_checkpoint",
]


def __getattr__(name: str) -> Any:
    # load_fused needs torch; importing it lazily keeps `import fusekit` (and the fusion
    # path) free of torch's import time.
    if name == "load_fused":
        from fusekit.toolkit.nn.fused import load_fused

        return load_fused
    raise AttributeError(f"module 'fusekit' has no attribute {name!r}")
