"""fusekit: one-shot, data-free fusion of neural networks."""

from fusekit._version import __version__

__all__ = ["__version__"]
