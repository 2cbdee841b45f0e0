"""Loads the compiled core once; fusekit never silently replaces it with Python code."""

from __future__ import annotations

#: The core's functions this checkout calls (fusekit/_core.pyi): a core compiled from older
#: sources lacks the newer ones, and is refused whole rather than failing mid-fusion.
FUNCTIONS = ("solve_assignment", "sqeuclidean_cost", "posterior_cost", "add_rows",
             "add_moments", "log_det_rows", "finite_min", "has_openmp")

try:
    from fusekit import _core
except ImportError as exc:  # pragma: no cover - exercised only on a broken install
    _core = None
    CORE_IMPORT_ERROR: ImportError | None = exc
else:
    CORE_IMPORT_ERROR = None
    _missing = [name for name in FUNCTIONS if not hasattr(_core, name)]
    if _missing:
        CORE_IMPORT_ERROR = ImportError(
            f"{_core.__file__} was compiled from older sources (no {', '.join(_missing)}): "
            "rebuild it with 'python setup.py build_ext --inplace'")
        _core = None


def core():
    """The compiled module ``fusekit._core``; raises ImportError with the reason if missing."""
    if _core is None:
        raise ImportError(
            "fusekit's C++ core (fusekit._core) is not built or out of date: reinstall from "
            f"the checkout with 'pip install -e .' ({CORE_IMPORT_ERROR})"
        )
    return _core


def core_status() -> str:
    """One line for ``fusekit --version``: whether the C++ core is loaded, and with OpenMP."""
    if _core is None:
        return f"C++ core: NOT loaded ({CORE_IMPORT_ERROR})"
    threads = "OpenMP" if _core.has_openmp() else "no OpenMP"
    return f"C++ core: loaded ({threads})"
