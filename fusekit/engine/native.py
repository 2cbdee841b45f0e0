"""Loads the compiled core once; fusekit never silently replaces it with Python code."""

from __future__ import annotations

try:
    from fusekit import _core
except ImportError as exc:  # pragma: no cover - exercised only on a broken install
    _core = None
    CORE_IMPORT_ERROR: ImportError | None = exc
else:
    CORE_IMPORT_ERROR = None


def core():
    """The compiled module ``fusekit._core``; raises ImportError with the reason if missing."""
    if _core is None:
        raise ImportError(
            "fusekit's C++ core (fusekit._core) is not built: reinstall from the checkout with "
            f"'pip install -e .' ({CORE_IMPORT_ERROR})"
        )
    return _core


def core_status() -> str:
    """One line for ``fusekit --version``: whether the C++ core is loaded, and with OpenMP."""
    if _core is None:
        return f"C++ core: NOT loaded ({CORE_IMPORT_ERROR})"
    threads = "OpenMP" if _core.has_openmp() else "no OpenMP"
    return f"C++ core: loaded ({threads})"
