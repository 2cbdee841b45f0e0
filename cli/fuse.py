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
    anchor: Annotated[
        str | None, typer.Option("--anchor", help="ot: the client to align to (its path, file "
                                 "name or content-hash prefix) [default: most samples].")
    ] = None,
    activations: Annotated[
        str | None, typer.Option("--activations", help="ot: compare neurons by their "
                                 "pre-activations on these inputs instead of by weights: a "
                                 ".npy (N, ...), a .npz with x or x_train, or a data set name.")
    ] = None,
    activation_samples: Annotated[
        int | None, typer.Option("--activation-samples", help="ot: at most this many inputs "
                                 "for --activations [default: 256].")
    ] = None,
    data_dir: Annotated[
        Path | None, typer.Option("--data-dir", help="ot: folder of the data set named by "
                                  "--activations (mnist, fashion-mnist, cifar10).")
    ] = None,
    mode: Annotated[
        str | None, typer.Option("--mode", help="ams: top1 (most confident model), topk (sum "
                                 "of the k most confident) or full (sum of all) [default: top1].")
    ] = None,
    k: Annotated[int | None, typer.Option("--k", help="ams: models summed by --mode topk.")] = None,
) -> None:
    """Fuse client checkpoints into one model, in one shot and without data."""
    params = _given(class_weighted=class_weighted, anchor=anchor, activations=activations,
                    activation_samples=activation_samples, data_dir=data_dir, mode=mode, k=k)
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
