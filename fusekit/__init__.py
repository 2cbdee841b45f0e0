"""fusekit: one-shot, data-free fusion of neural networks.

    >>> import fusekit
    >>> result = fusekit.fuse(["a.safetensors", "b.safetensors"], method="avg")
    >>> result.save("fused.safetensors")
    >>> model = fusekit.load_fused("fused.safetensors")  # a torch module (imports torch)
    >>> fusekit.calibrate("fused.safetensors", ["a.stats.safetensors", "b.stats.safetensors"]
    ...                   ).save("calibrated.safetensors")
"""

from typing import TYPE_CHECKING

from fusekit._version import __version__
from fusekit.core.lazy import lazy_names

if TYPE_CHECKING:
    from fusekit.api import fuse
    from fusekit.calibration import align, calibrate, refit
    from fusekit.core.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
    from fusekit.core.spec import PermutationSpec, infer_spec
    from fusekit.methods import METHODS, FusionResult
    from fusekit.toolkit.nn.fused import load_fused

# Each name is imported from its module on first use: `import fusekit` (and with it every
# `fusekit.*` module, the command line's included) pays for SciPy, POT and torch only when
# a name that needs them is used.
_HOMES = {
    "align": "fusekit.calibration",
    "calibrate": "fusekit.calibration",
    "fuse": "fusekit.api",
    "refit": "fusekit.calibration",
    "Checkpoint": "fusekit.core.checkpoint",
    "load_checkpoint": "fusekit.core.checkpoint",
    "save_checkpoint": "fusekit.core.checkpoint",
    "PermutationSpec": "fusekit.core.spec",
    "infer_spec": "fusekit.core.spec",
    "METHODS": "fusekit.methods",
    "FusionResult": "fusekit.methods",
    "load_fused": "fusekit.toolkit.nn.fused",
}

__all__ = ["__version__", *sorted(_HOMES)]


# fusekit.toolkit, imported once `fuse` is, installs --method distill's training stage
__getattr__, __dir__ = lazy_names(__name__, _HOMES, globals(), then={"fuse": "fusekit.toolkit"})
