"""Exceptions raised by fusekit.

Every message names the file, tensor or argument at fault and says what was expected and
what was found. Subclasses are also the builtin exception a caller would expect
(``ValueError``, ``FileNotFoundError``, ...), so ``except ValueError`` keeps working.
"""

from __future__ import annotations


class FusekitError(Exception):
    """Base class of every error fusekit raises for bad input or an impossible request.

    Messages say arguments in Python's words (``width_ratio``, ``force=True``);
    :meth:`naming` records which keyword arguments a message names, so that the command
    line can say them as its options (``--width-ratio``, ``--force``).
    """

    keywords: tuple[str, ...] = ()

    def naming(self, *keywords: str) -> FusekitError:
        """This error, recording that its message names the keyword arguments ``keywords``."""
        self.keywords = keywords
        return self


class CheckpointError(FusekitError, ValueError):
    """A checkpoint file is missing, unreadable, corrupt or holds unusable tensors."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """A checkpoint path does not exist or is not a file."""


class IncompatibleModelsError(FusekitError, ValueError):
    """The checkpoints cannot be fused together (different layers, shapes or outputs)."""


class SpecError(FusekitError, ValueError):
    """A permutation spec cannot be inferred from a state_dict, or a spec file is invalid."""


class UnknownMethodError(FusekitError, ValueError):
    """The requested fusion method is not registered."""


class ParameterError(FusekitError, ValueError):
    """A fusion, simulation or evaluation parameter is out of range or of the wrong type."""


class OutputError(FusekitError, OSError):
    """The output path cannot be written (missing directory, or an existing file)."""


class InfeasibleAssignmentError(FusekitError, ValueError):
    """No complete assignment exists without using a forbidden (+inf) pair."""


class DataError(FusekitError, ValueError):
    """A data set is missing, malformed, or does not fit the model."""


class NonFiniteOutputError(FusekitError, ValueError):
    """A computed tensor holds NaN or Inf; nothing is written."""


class ParameterTypeError(ParameterError, TypeError):
    """An argument has a type fusekit cannot use (e.g. a non-numeric array)."""


class StatisticsError(FusekitError, ValueError):
    """A statistics file (calibration) is unreadable, malformed, for another model, or
    computed over too few samples."""
