"""Recipes (``fusekit fuse --config recipe.yaml``) and output folders (``-o DIR/``).

A recipe is a YAML mapping with the keys below; paths in it are relative to the recipe's
own folder::

    method: nafi
    inputs: [clients/client_00.safetensors, clients/client_01.safetensors]
    parameters: {lam: 0.05, sweeps: 10}
    output: fused/            # a trailing slash: an output folder
    spec: null                # optional permutation spec file
    activations: null         # ot only: {source: inputs.npy, samples: 256, seed: 0}
    normalize: null           # what clients recording no preprocessing expect:
                              # {mean: [0.1307], std: [0.3081]} (one value per channel)

An output folder holds ``fused.safetensors``, ``recipe.yaml`` (the recipe as run, with the
parameters the method used), ``report.json`` (what ``fusekit fuse --json`` prints) and a
``README.md`` model card; it appears all at once (written aside, then renamed).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fusekit._cli.card import model_card
from fusekit.core.checkpoint import (
    check_output_folder,
    check_output_path,
    swap_in_folder,
    write_model_files,
)
from fusekit.core.errors import OutputError, ParameterError
from fusekit.core.metadata import Normalization, normalization

log = logging.getLogger(__name__)

RECIPE_KEYS = ("method", "inputs", "parameters", "output", "spec", "activations", "normalize")
ACTIVATION_KEYS = ("source", "samples", "seed", "data_dir")
FOLDER_FILES = ("fused.safetensors", "recipe.yaml", "report.json", "README.md")


@dataclass(frozen=True)
class Recipe:
    method: str = "avg"
    inputs: list[str] = field(default_factory=list)
    parameters: dict[str, Any] = field(default_factory=dict)
    output: str | None = None
    spec: str | None = None
    activations: dict[str, Any] = field(default_factory=dict)
    normalize: Normalization | None = None

    def override(self, *, inputs, method, output, spec, parameters, activations,
                 normalize=None) -> Recipe:
        """This recipe with what the command line gave replacing it (None: not given)."""
        return dataclasses.replace(
            self,
            inputs=[os.fspath(p) for p in inputs] if inputs else self.inputs,
            method=method or self.method,
            output=output if output is not None else self.output,
            spec=os.fspath(spec) if spec is not None else self.spec,
            parameters={**self.parameters, **parameters},
            activations={**self.activations, **activations},
            normalize=normalize if normalize is not None else self.normalize,
        )


def load_recipe(path: Path) -> Recipe:
    """Read a recipe file, refusing unknown keys and values of the wrong shape.

    Raises:
        ParameterError: naming the file and the key at fault.
    """
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ParameterError(f"{path}: recipe file does not exist") from None
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        detail = " ".join(str(exc).split())
        raise ParameterError(f"{path}: not a readable YAML recipe ({detail})") from None
    if not isinstance(data, dict):
        raise ParameterError(f"{path}: expected a mapping of {', '.join(RECIPE_KEYS)}, "
                             f"found {type(data).__name__}")
    _refuse_unknown(path, "", data, RECIPE_KEYS)
    base = path.parent

    def local(value: Any, key: str) -> str:
        if not isinstance(value, str) or not value:
            raise ParameterError(f"{path}: {key}: expected a path, found {value!r}")
        return os.fspath(base / value) if not os.path.isabs(value) else value

    inputs = data.get("inputs") or []
    if not isinstance(inputs, list):
        raise ParameterError(f"{path}: inputs: expected a list of paths, found {inputs!r}")
    method = data.get("method", "avg")
    if not isinstance(method, str):
        raise ParameterError(f"{path}: method: expected a method name, found {method!r}")
    parameters = _mapping(path, "parameters", data.get("parameters"))
    activations = _mapping(path, "activations", data.get("activations"))
    _refuse_unknown(path, "activations.", activations, ACTIVATION_KEYS)
    for key in ("source", "data_dir"):
        if key in activations and activations[key] is not None:
            activations[key] = local(activations[key], f"activations.{key}")
    output = data.get("output")
    return Recipe(
        method=method,
        inputs=[local(p, f"inputs[{i}]") for i, p in enumerate(inputs)],
        parameters=_from_text(method, parameters),
        output=local(output, "output") + ("/" if str(output).endswith("/") else "")
        if output is not None else None,
        spec=local(data["spec"], "spec") if data.get("spec") is not None else None,
        activations={k: v for k, v in activations.items() if v is not None},
        normalize=_normalization(path, data.get("normalize")),
    )


def _normalization(path: Path, value: Any) -> Normalization | None:
    """The recipe's ``normalize: {mean: [...], std: [...]}``."""
    if value is None:
        return None
    _refuse_unknown(path, "normalize.", _mapping(path, "normalize", value), ("mean", "std"))
    try:
        return normalization(value.get("mean"), value.get("std"))
    except ValueError as exc:
        raise ParameterError(f"{path}: normalize: {exc}; found {value!r}") from None


def _mapping(path: Path, key: str, value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ParameterError(f"{path}: {key}: expected a mapping, found {value!r}")
    return dict(value)


def _refuse_unknown(path: Path, prefix: str, data: dict[str, Any], known) -> None:
    unknown = sorted(map(str, set(data) - set(known)))
    if unknown:
        raise ParameterError(
            f"{path}: unknown key {prefix}{unknown[0]!r}; expected one of {', '.join(known)}"
        )


def _from_text(method: str, parameters: dict[str, Any]) -> dict[str, Any]:
    """YAML 1.1 reads ``1e-3`` as text: read such values of float parameters as numbers."""
    from fusekit.methods import METHODS
    from fusekit.methods.params import method_params

    if method not in METHODS:
        return parameters
    floats = {p.name for p in method_params(METHODS[method]) if p.kind in ("float", "floats")}
    out = dict(parameters)
    for name, value in parameters.items():
        if name in floats and isinstance(value, str):
            with contextlib.suppress(ValueError):
                out[name] = float(value)
    return out


@dataclass(frozen=True)
class OutputTarget:
    path: Path
    folder: bool


def resolve_output(output: str | None, method: str, *, force: bool,
                   inputs: Sequence[str | os.PathLike[str]]) -> OutputTarget:
    """Where ``-o`` writes: a file, or a folder when the name ends with a slash.

    Raises:
        OutputError: an empty name, an existing directory named without the slash, an
            output that is or holds an input (even with ``force``), an existing output
            without ``force``, or a missing or unwritable parent folder.
    """
    if output is None:  # model folders in, an output folder out
        folders = any(Path(p).is_dir() for p in inputs)
        output = f"fused-{method}" + ("/" if folders else ".safetensors")
    if not output.strip():
        raise OutputError("--output: expected a file name or a folder name ending with '/', "
                          "found an empty string")
    path = Path(output)
    if not output.endswith(("/", os.sep)):
        if path.is_dir():
            raise OutputError(
                f"{output}: is a directory; to write an output folder end the name with a "
                f"slash (-o {output}/), or name a .safetensors file"
            )
        check_output_path(path, force=force, inputs=inputs)
        return OutputTarget(path, folder=False)
    check_output_folder(path, force=force, inputs=inputs)
    return OutputTarget(path, folder=True)


def write_folder(path: Path, result, recipe: Recipe, summary: dict[str, Any], *,
                 force: bool) -> None:
    """Write the output folder aside, then rename it into place (replacing it with force)."""
    import yaml

    parent = path.parent if str(path.parent) else Path(".")
    staging = Path(tempfile.mkdtemp(dir=parent, prefix=f".{path.name}.", suffix=".tmp"))
    try:
        os.chmod(staging, 0o777 & ~_umask())
        if result.config is not None:  # a Hugging Face model folder
            write_model_files(staging, result.state_dict, result.metadata, result.config)
        else:
            result.save(staging / "fused.safetensors", force=True)
        as_run = _as_run(recipe, result, path)
        (staging / "recipe.yaml").write_text(yaml.safe_dump(as_run, sort_keys=False))
        (staging / "report.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
        clients = [_from_folder(p, path) for p in result.report.get("clients", [])]
        (staging / "README.md").write_text(model_card(result, as_run, clients))
        swap_in_folder(staging, path, force=force)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _as_run(recipe: Recipe, result, folder: Path) -> dict[str, Any]:
    """The recipe that reproduces this run: every parameter at the value the method used,
    files named relative to ``folder`` (where the recipe goes), so that the folder moved
    with its inputs beside it still reruns."""
    from fusekit.methods import METHODS
    from fusekit.methods.params import method_params

    declared = {p.name for p in method_params(METHODS[result.method])}
    parameters = {k: v for k, v in result.params.items() if k in declared and k != "activations"}
    as_run: dict[str, Any] = {
        "method": result.method,
        "inputs": [_from_folder(p, folder) for p in recipe.inputs],
        "parameters": parameters,
    }
    if recipe.spec is not None:
        as_run["spec"] = _from_folder(recipe.spec, folder)
    if recipe.activations:
        as_run["activations"] = {k: _from_folder(v, folder) if _is_file_path(v) else v
                                 for k, v in recipe.activations.items()}
    if recipe.normalize is not None:
        as_run["normalize"] = {"mean": list(recipe.normalize.mean),
                               "std": list(recipe.normalize.std)}
    return as_run


def _is_file_path(value: Any) -> bool:
    """Files and folders are rewritten; data-set names and numbers stay."""
    return isinstance(value, (str, os.PathLike)) and os.path.exists(value)


def _from_folder(path: str | os.PathLike[str], folder: Path) -> str:
    """``path`` relative to ``folder`` (absolute where no relative path leads there)."""
    try:
        return os.path.relpath(os.path.abspath(path), os.path.abspath(folder))
    except ValueError:  # another drive (Windows)
        return os.path.abspath(path)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
