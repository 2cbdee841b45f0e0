"""``fusekit fuse``: checkpoints in, one fused checkpoint out."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

import fusekit
from fusekit._cli.output import emit_json, stdout
from fusekit.errors import OutputError
from fusekit.methods import METHODS

_METHODS_HELP = "; ".join(f"{name}: {cls.summary}" for name, cls in sorted(METHODS.items()))


def fuse(
    checkpoints: Annotated[list[Path], typer.Argument(help="Client checkpoints (.safetensors).",
                                                      show_default=False)],
    method: Annotated[
        str, typer.Option("--method", "-m", help=f"Fusion method. {_METHODS_HELP}.")
    ] = "avg",
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Where to write the fused model "
                                  "[default: fused-METHOD.safetensors].")
    ] = None,
    force: Annotated[
        bool, typer.Option("--force", help="Replace an existing output file.")
    ] = False,
    spec: Annotated[
        Path | None, typer.Option("--spec", help="JSON permutation spec for models whose "
                                  "structure cannot be inferred from names and shapes.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    class_weighted: Annotated[
        bool | None, typer.Option("--class-weighted/--no-class-weighted",
                                  help="avg: average output rows with per-class sample shares.")
    ] = None,
) -> None:
    """Fuse client checkpoints into one model, in one shot and without data."""
    params = _given(class_weighted=class_weighted)
    output = output or Path(f"fused-{method}.safetensors")
    if output.exists() and not force:
        raise OutputError(f"{output}: output file exists; pass --force to replace it")
    start = time.perf_counter()
    result = fusekit.fuse(checkpoints, method=method, spec=spec, **params)
    path = result.save(output, force=force)
    summary: dict[str, Any] = {
        "output": str(path),
        "method": result.method,
        "params": result.params,
        "widths": result.widths,
        "time_s": time.perf_counter() - start,
        "report": result.report,
    }
    if as_json:
        emit_json(summary)
    else:
        _print_summary(summary)


def _given(**options: Any) -> dict[str, Any]:
    """Only the options the user set, so each method keeps its own defaults."""
    return {k: v for k, v in options.items() if v is not None}


def _print_summary(summary: dict[str, Any]) -> None:
    table = Table(title=f"fused with {summary['method']}", show_header=False)
    table.add_row("output", summary["output"])
    table.add_row("hidden widths", ", ".join(map(str, summary["widths"])) or "-")
    table.add_row("parameters", ", ".join(f"{k}={v}" for k, v in summary["params"].items()) or "-")
    table.add_row("time", f"{summary['time_s']:.3f} s")
    stdout.print(table)
