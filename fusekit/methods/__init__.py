"""Fusion methods, one module each, registered by name in :data:`METHODS`."""

from fusekit.methods import avg, nafi, pfnm  # noqa: F401  (register themselves)
from fusekit.methods.base import METHODS, FusionMethod, FusionResult, get_method, register

__all__ = ["METHODS", "FusionMethod", "FusionResult", "get_method", "register"]
