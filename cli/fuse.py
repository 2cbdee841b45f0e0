"""``fusekit fuse``: checkpoints in, one fused checkpoint (or an output folder) out.

The method options are not written here: :func:`method_options` builds one option per
parameter that the registered methods declare (``fusekit.methods.params``), grouped by
method in ``--help``.
"""

from __future__ import annotations

import inspect
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

import fusekit
from fusekit._cli.options import JsonOption, NormalizeOption, described, normalization_option
from fusekit._cli.output import emit_json, stdout, step_progress
from fusekit.core.checkpoint import private_files
from fusekit.core.errors import FusekitError, OutputError, ParameterError

if TYPE_CHECKING:
    from fusekit._cli.recipe import Recipe
    from fusekit.methods.params import ParamSpec

log = logging.getLogger(__name__)

_OT_INPUTS = "ot options"
# How the CLI spells each kind of parameter: (annotation, metavar).
_TEXT_TYPES: dict[str, tuple[Any, str]] = {
    "int": (int | None, "INT"),
    "float": (float | None, "FLOAT"),
    "str": (str | None, "TEXT"),
    "path": (Path | None, "PATH"),
    "floats": (list[float] | None, "FLOAT"),
    "ints": (str | None, "N|N1,N2,..."),
    "bool": (bool | None, ""),
}


def _method_help() -> str:
    from fusekit.methods import METHODS

    return "Fusion method \\[default: avg]: " + "; ".join(
        f"{name}: {cls.summary}" for name, cls in sorted(METHODS.items())) + "."


def fuse(
    checkpoints: Annotated[
        list[Path] | None,
        typer.Argument(help="One or more client checkpoints (.safetensors); or give them "
                       "in --config.", metavar="CHECKPOINTS...", show_default=False),
    ] = None,
    method: Annotated[
        str | None,
        typer.Option("--method", "-m", metavar="NAME", help=_method_help(),
                     show_default=False),
    ] = None,
    output: Annotated[
        str | None,
        typer.Option("--output", "-o", metavar="FILE|DIR/",
                     help="A .safetensors file, or a folder when the name ends with a slash "
                     "(fused.safetensors, recipe.yaml, report.json and a README.md model card) "
                     "\\[default: ./fused-<method>.safetensors].", show_default=False),
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option("--config", "-c", metavar="RECIPE.yaml",
                     help="A recipe: inputs, method, parameters, output; options given on the "
                     "command line override it.", show_default=False),
    ] = None,
    force: Annotated[
        bool, typer.Option("--force", help="Replace an existing output file or folder.")
    ] = False,
    spec: Annotated[
        Path | None,
        typer.Option("--spec", metavar="PATH", show_default=False,
                     help="JSON permutation spec for models whose structure cannot be inferred "
                     "from names and shapes."),
    ] = None,
    as_json: JsonOption = False,
    activations: Annotated[
        str | None,
        typer.Option("--activations", metavar="FILE|NAME", rich_help_panel=_OT_INPUTS,
                     show_default=False,
                     help="Compare neurons by their pre-activations on these inputs instead of "
                     "by weights: a .npy (N, ...), a .npz with x or x_train, or a data set name "
                     "\\[default: weights]."),
    ] = None,
    activation_samples: Annotated[
        int | None,
        typer.Option("--activation-samples", metavar="INT", rich_help_panel=_OT_INPUTS,
                     show_default=False,
                     help="At most this many inputs for --activations \\[default: 256]."),
    ] = None,
    activation_seed: Annotated[
        int | None,
        typer.Option("--activation-seed", metavar="INT", rich_help_panel=_OT_INPUTS,
                     show_default=False, help="Seed of the --activations subset \\[default: 0]."),
    ] = None,
    data_dir: Annotated[
        Path | None,
        typer.Option("--data-dir", metavar="PATH", rich_help_panel=_OT_INPUTS,
                     show_default=False,
                     help="Folder of the data set named by --activations (mnist, "
                     "fashion-mnist, cifar10)."),
    ] = None,
    normalize: NormalizeOption = None,
    **method_values: Any,
) -> None:
    """Fuse client checkpoints into one model, in one shot and without data."""
    from fusekit._cli.recipe import Recipe, load_recipe

    recipe = load_recipe(config) if config is not None else Recipe()
    recipe = recipe.override(
        inputs=checkpoints or None, method=method, output=output, spec=spec,
        parameters={k: v for k, v in method_values.items() if v is not None},
        activations={k: v for k, v in {"source": activations, "samples": activation_samples,
                                       "seed": activation_seed, "data_dir": data_dir}.items()
                     if v is not None},
        normalize=normalization_option(normalize),
    )
    if not recipe.inputs:
        raise ParameterError("CHECKPOINTS: expected at least one checkpoint (on the command "
                             "line or as inputs: in --config), found none")
    from fusekit._cli.recipe import resolve_output, write_folder
    from fusekit.api import fusion_summary

    target = resolve_output(recipe.output, recipe.method, force=force, inputs=recipe.inputs)
    start = time.perf_counter()
    result = _run(recipe)
    # A transformer's fused model is a model folder: an output folder (with its card,
    # recipe and report) whether or not -o ends with a slash.
    folder = target.folder or result.config is not None
    summary = fusion_summary(result, str(target.path) + ("/" if folder else ""),
                             time.perf_counter() - start)
    try:
        with private_files():
            if folder:
                write_folder(target.path, result, recipe, summary, force=force)
            else:
                result.save(target.path, force=force)
        if not folder:
            _warn_about_suffix(target.path)
    except OSError as exc:
        if isinstance(exc, FusekitError):
            raise
        raise OutputError(f"{summary['output']}: cannot write the output "
                          f"({exc.strerror or exc})") from None
    if as_json:
        emit_json(summary)
    else:
        _print_summary(summary)


def _warn_about_suffix(path: Path) -> None:
    if path.suffix not in ("", ".safetensors"):
        log.warning("%s: written in safetensors format whatever the suffix; name it "
                    "%s.safetensors to say so", path, path.stem)


def _run(recipe: Recipe):
    from fusekit.methods import METHODS
    from fusekit.methods.params import from_text, method_params

    params = dict(recipe.parameters)
    for spec in method_params(METHODS[recipe.method]) if recipe.method in METHODS else ():
        if spec.kind == "ints" and isinstance(params.get(spec.name), str):  # N or N1,N2
            params[spec.name] = from_text(spec, params[spec.name])
    if recipe.activations:
        params["activations"] = _activation_provider(recipe.activations)
    inputs = [described(Path(p), recipe.normalize) for p in recipe.inputs]
    with step_progress(f"fusing with {recipe.method}"):
        return fusekit.fuse(inputs, method=recipe.method, spec=recipe.spec, **params)


def _activation_provider(settings: dict[str, Any]):
    from fusekit.toolkit.activations import ActivationInputs  # torch: only in this mode

    if "source" not in settings:
        raise ParameterError(
            f"--activation-samples/--activation-seed/--data-dir need --activations; found "
            f"only {', '.join(sorted(settings))}"
        )
    return ActivationInputs(**settings)


def method_options() -> list[inspect.Parameter]:
    """One CLI option per parameter declared by the registered methods.

    A parameter several methods declare appears once, in the panel of all of them, typed
    by its first declaration (methods in name order); its default is only shown (the
    method's own default applies when the option is not given). Parameters no text can
    spell (callables) are Python-only.
    """
    from fusekit.methods import METHODS
    from fusekit.methods.params import method_params

    declared: dict[str, list[tuple[str, ParamSpec]]] = {}
    for name in sorted(METHODS):
        for spec in method_params(METHODS[name]):
            if spec.kind in _TEXT_TYPES:
                declared.setdefault(spec.name, []).append((name, spec))
    return [_option(name, entries) for name, entries in declared.items()]


def _option(name: str, entries: list[tuple[str, ParamSpec]]) -> inspect.Parameter:
    methods = [m for m, _ in entries]
    spec = entries[0][1]
    annotation, metavar = _TEXT_TYPES[spec.kind]
    defaults = {s.describe_default() for _, s in entries}
    shown = (defaults.pop() if len(defaults) == 1
             else ", ".join(f"{m} {s.describe_default()}" for m, s in entries))
    flags = [spec.flag, *spec.param.flags]
    if spec.kind == "bool":
        flags = [f"{spec.flag}/--no-{spec.flag[2:]}"]
    help_text = spec.param.help[:1].upper() + spec.param.help[1:]
    if spec.param.choices:
        metavar, help_text = _with_choices(metavar, help_text, spec)
    bounds = spec.describe_bounds()
    if bounds:
        help_text += f"; {bounds}"
    if spec.per_client:
        help_text += "; repeat once per client"
    # Rich markup would swallow an unescaped [default: ...]; click would put it in parentheses.
    option = typer.Option(*flags, help=f"{help_text} \\[default: {shown}].", metavar=metavar,
                          show_default=False, rich_help_panel=" / ".join(methods) + " options")
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY,
                             annotation=Annotated[annotation, option], default=None)


# Longer metavars would be wrapped mid-word in an 80-column --help.
_MAX_METAVAR = 17


def _with_choices(metavar: str, help_text: str, spec: ParamSpec) -> tuple[str, str]:
    """The choices in the metavar (``top1|topk|full``) where they fit, else in the help."""
    choices = list(spec.param.choices or ())
    joined = "|".join([metavar] * (spec.kind == "ints") + choices)
    if len(joined) <= _MAX_METAVAR:
        return joined, help_text
    missing = [c for c in choices if repr(c) not in help_text]
    if missing:
        help_text += "; or " + " or ".join(map(repr, missing))
    return metavar, help_text


def fuse_command():
    """:func:`fuse` with the method options added to its signature, for Typer."""
    signature = inspect.signature(fuse, eval_str=True)
    fixed = [p for p in signature.parameters.values() if p.kind is not p.VAR_KEYWORD]
    params = fixed + method_options()

    def command(**values: Any) -> None:
        known = {p.name for p in fixed}
        fuse(**{k: v for k, v in values.items() if k in known},
             **{k: _one_or_list(v) for k, v in values.items() if k not in known})

    command.__doc__ = fuse.__doc__
    command.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in params}
    command.__name__ = "fuse"
    return command


def _one_or_list(value: Any) -> Any:
    """A repeatable option given once is one value (``--sigma 2``), else a list."""
    if isinstance(value, list | tuple):
        return (value[0] if len(value) == 1 else list(value)) if value else None
    return value


def _shown_params(summary: dict[str, Any]) -> str:
    """The parameters as run: a width left to the method shows the widths it delivered
    (hidden layers in order), any other parameter left to it shows as auto."""
    params = dict(summary["params"])
    if "width" in params and params["width"] is None:
        params["width"] = ",".join(map(str, summary["widths"]))
        if params.get("width_ratio") is None:
            del params["width_ratio"]
    return ", ".join(f"{k}={'auto' if v is None else v}" for k, v in params.items())


def _print_summary(summary: dict[str, Any]) -> None:
    table = Table(title=f"fused with {summary['method']}", show_header=False)
    table.add_row("output", summary["output"])
    table.add_row("hidden widths", ", ".join(map(str, summary["widths"])) or "-")
    table.add_row("parameters", _shown_params(summary) or "-")
    table.add_row("time", f"{summary['time_s']:.3f} s")
    peak = summary["report"].get("peak_memory_mb")
    if peak is not None:
        table.add_row("peak memory", f"{peak:.1f} MB (resident)")
    for layer in summary["report"].get("layers", []):
        details = [f"width {layer['width']}"]
        if "clients" in layer:
            details.append(f"new neurons per client {[c['new'] for c in layer['clients']]}")
        if "transport" in layer:
            details.append(f"transport {', '.join(layer['transport'])}")
        table.add_row(f"layer {layer['layer']}", ", ".join(details))
    differ = summary["report"].get("heterogeneity")
    if differ is not None:
        table.add_row("clients", heterogeneity_line(differ))
    stdout.print(table)


def heterogeneity_line(differ: dict[str, Any]) -> str:
    """The report's ``heterogeneity`` in words (what the clients' checkpoints tell)."""
    parts = []
    if differ["matched_share"] is not None:
        parts.append(f"{differ['matched_share']:.0%} of neurons matched across clients")
    if differ["class_contrast"] is not None:
        parts.append(f"class contrast {differ['class_contrast']:.2f}")
    if differ["classes_without_contrast"]:
        parts.append(f"classes held only by one-class clients {differ['classes_without_contrast']}")
    if not differ["compact_ok"]:
        parts.append("too different for a compact fused model: compare with ams")
    return ", ".join(parts) or "-"

