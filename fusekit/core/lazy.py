"""Names a package imports from their modules on first use (PEP 562's module
``__getattr__``), so that importing the package costs nothing its caller does not use."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from importlib import import_module
from typing import Any


def lazy_names(package: str, homes: Mapping[str, str], namespace: dict[str, Any],
               then: Mapping[str, str] | None = None
               ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``, whose names in ``homes`` (name ->
    module) are imported from their modules on first use and put in ``namespace`` (the
    package's globals), so that later uses skip ``__getattr__``. ``then``: per name, a module
    to import once that name's is."""

    def __getattr__(name: str) -> Any:
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(import_module(homes[name]), name)
        if then and name in then:
            import_module(then[name])
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *homes})

    return __getattr__, __dir__
