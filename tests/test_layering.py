"""Imports run one way: front doors → toolkit → methods → engine → core (never upward).

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
              "fusekit.protocol")


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
