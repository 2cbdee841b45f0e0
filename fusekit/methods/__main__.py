"""``python -m fusekit.methods``: print the parameter reference (docs/PARAMETERS.md)."""

from fusekit.methods import METHODS
from fusekit.methods.params import parameter_reference

print(parameter_reference(METHODS), end="")
