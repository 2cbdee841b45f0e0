"""Fusion methods, one module each, registered by name in :data:`METHODS`."""

from fusekit.methods import ams, avg, bayesian, fed2, ot, rebasin  # noqa: F401  (each registers itself)
from fusekit.methods import distill  # noqa: F401, I001  (after the fusions it can start from)
from fusekit.methods.base import METHODS, FusionMethod, FusionResult, get_method, register

__all__ = ["METHODS", "FusionMethod", "FusionResult", "get_method", "register"]
