"""fusekit: one-shot, data-free fusion of neural networks.

    >>> import fusekit
    >>> result = fusekit.fuse(["a.safetensors", "b.safetensors"], method="avg")
    >>> result.save("fused.safetensors")
"""

from fusekit._version import __version__
from fusekit.api import fuse
from fusekit.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from fusekit.methods import METHODS, FusionResult
from fusekit.spec import PermutationSpec, infer_spec

__all__ = [
    "METHODS",
    "Checkpoint",
    "FusionResult",
    "PermutationSpec",
    "__version__",
    "fuse",
    "infer_spec",
    "load_checkpoint",
    "save_checkpoint",
]
