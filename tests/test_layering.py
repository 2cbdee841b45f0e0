"""Imports run one way: front doors → service/toolkit → protocol → calibration → api →
methods → engine → core (never upward), with no circle: no module imports, through any
chain of imports, a module that imports it back (the benchmarks among themselves too).

The layer of a module is the first rule below whose prefix it starts with. Every
``import`` statement in the package, at any depth (function-local ones too), is checked.
"""

import ast
from pathlib import Path

import pytest

import fusekit

PACKAGE = Path(fusekit.__file__).parent
CLI = PACKAGE.parent / "cli"

# (module prefix, layer rank): a module may import only modules of its rank or below.
LAYERS = [
    ("fusekit._version", 0),
    ("fusekit.core", 0),
    ("fusekit._core", 1),
    ("fusekit.engine", 1),
    ("fusekit.methods", 2),
    ("fusekit.api", 2),
    ("fusekit.calibration", 2),  # fusekit.calibrate, align, refit: files in, methods' math
    ("fusekit.protocol", 2),  # the round protocol: steps through fusekit.calibrate/align/refit
    ("fusekit.toolkit", 3),
    ("fusekit._cli", 4),
    ("fusekit.service", 4),
    ("fusekit.client", 4),
    ("fusekit.flower", 4),
    ("fusekit.__main__", 4),
    ("fusekit", 4),  # the package's own __init__: the Python front door
]
TORCH_FREE = ("fusekit.core", "fusekit.engine", "fusekit.methods", "fusekit.api",
              "fusekit.calibration", "fusekit.protocol")


def rank(module: str) -> int:
    for prefix, layer in LAYERS:
        if module == prefix or module.startswith(prefix + "."):
            return layer
    raise AssertionError(f"{module} belongs to no layer")


def modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        yield ".".join(p for p in parts if p != "__init__"), path, path.name == "__init__.py"
    for path in sorted(CLI.glob("*.py")):
        name = "fusekit._cli" if path.stem == "__init__" else f"fusekit._cli.{path.stem}"
        yield name, path, path.name == "__init__.py"


def imported(module: str, path: Path, is_package: bool):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module
            yield target
            # `from fusekit import x` imports the submodule fusekit.x when there is one
            for alias in node.names:
                yield f"{target}.{alias.name}"


def submodule_exists(name: str) -> bool:
    rel = Path(*name.split(".")[1:])
    return (PACKAGE / rel).with_suffix(".py").exists() or (PACKAGE / rel / "__init__.py").exists()


CASES = list(modules())


@pytest.mark.parametrize(("module", "path", "is_package"), CASES, ids=[c[0] for c in CASES])
def test_imports_run_downward(module, path, is_package):
    own = rank(module)
    for target in imported(module, path, is_package):
        if target == "fusekit" or not target.startswith("fusekit."):
            continue
        compiled_or_mapped = target.startswith(("fusekit._core", "fusekit._cli"))
        if not submodule_exists(target) and not compiled_or_mapped:
            continue  # `from fusekit.x import name` of a non-module name: checked via fusekit.x
        assert rank(target) <= own, (
            f"{module} (layer {own}) imports {target} (layer {rank(target)})")


@pytest.mark.parametrize(("module", "path", "is_package"), CASES, ids=[c[0] for c in CASES])
def test_fusion_layers_do_not_import_torch(module, path, is_package):
    if not module.startswith(TORCH_FREE):
        return
    for target in imported(module, path, is_package):
        assert target.split(".")[0] != "torch", f"{module} imports torch"


def imports_of(module: str, path: Path, is_package: bool) -> set[str]:
    """The package's modules ``module`` imports, at any depth: ``from X import name``
    imports X.name where that is a module, else X itself (its ``__init__``)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = module.split(".")[: len(module.split(".")) - node.level
                                     + (1 if is_package else 0)] if node.level else []
            target = ".".join([*base, node.module] if node.module else base)
            for alias in node.names:
                name = f"{target}.{alias.name}"
                module_named = name.startswith("fusekit.") and (
                    submodule_exists(name) or name == "fusekit._core")  # compiled
                out.add(name if module_named else target)
    return {name for name in out if name in MODULES}


# The benchmarks, by the bare names they import each other by.
BENCHMARKS = [(path.stem, path, False)
              for path in sorted((PACKAGE.parent / "benchmarks").glob("*.py"))]
MODULES = {module for module, _, _ in CASES + BENCHMARKS}


def test_no_import_circle():
    """No module of the package (or benchmark) imports, through any chain of imports, a
    module that imports it back (Tarjan's strongly connected components of the import
    graph)."""
    graph = {module: imports_of(module, path, is_package)
             for module, path, is_package in CASES + BENCHMARKS}
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(module: str) -> None:
        order[module] = low[module] = len(order)
        stack.append(module)
        for target in graph[module]:
            if target not in order:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], order[target])
        if low[module] == order[module]:
            component = stack[stack.index(module):]
            del stack[stack.index(module):]
            if len(component) > 1:
                circles.append(sorted(component))

    for module in graph:
        if module not in order:
            visit(module)
    assert circles == []


def test_lazy_names_import_on_first_use_and_keep_what_they_imported():
    """fusekit's and fusekit.flower's names come from core.lazy.lazy_names: a name is its
    module's object, imported on first use (with the module ``then`` asks for), kept in the
    package's namespace; an unknown name raises AttributeError naming the package."""
    import sys

    from fusekit.core.lazy import lazy_names

    namespace: dict = {}
    getattr_, dir_ = lazy_names("pkg", {"dedent": "textwrap"}, namespace,
                                then={"dedent": "colorsys"})
    sys.modules.pop("colorsys", None)
    import textwrap

    assert getattr_("dedent") is textwrap.dedent and namespace == {"dedent": textwrap.dedent}
    assert "colorsys" in sys.modules and dir_() == ["dedent"]
    with pytest.raises(AttributeError, match="module 'pkg' has no attribute 'nope'"):
        getattr_("nope")
    assert fusekit.__getattr__("fuse") is fusekit.fuse and "fusekit.toolkit" in sys.modules
