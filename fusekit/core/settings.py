"""Checks shared by the optional settings objects of an architecture (``arch.pan``,
``arch.fed2``): JSON null or an object holding only known keys."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fusekit.core.errors import SpecError


def settings_object(value: Any, where: str, allowed: Sequence[str]) -> Mapping[str, Any] | None:
    """``value`` itself when it is None or an object whose keys are all in ``allowed``.

    Raises:
        SpecError: naming ``where``, for anything else or for an unknown key.
    """
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise SpecError(f"{where}: expected null or an object, found {type(value).__name__}")
    unknown = sorted(set(value) - set(allowed))
    if unknown:
        raise SpecError(f"{where}: unknown key(s) {unknown}; allowed {', '.join(allowed)}")
    return value
