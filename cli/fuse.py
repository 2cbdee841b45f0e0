"""``fusekit fuse``: checkpoints in, one fused checkpoint out."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

import fusekit
from fusekit._cli.options import JsonOption
from fusekit._cli.output import emit_json, stdout
from fusekit.core.errors import OutputError
from fusekit.methods import METHODS

_METHODS_HELP = "; ".join(f"{name}: {cls.summary}" for name, cls in sorted(METHODS.items()))
_AVG, _PFNM, _OT, _AMS = ("avg options", "pfnm / nafi options", "ot / rebasin options",
                          "ams options")


def fuse(
    checkpoints: Annotated[
        list[Path], typer.Argument(help="Client checkpoints (.safetensors).", show_default=False)
    ],
    method: Annotated[
        str, typer.Option("--method", "-m", help=f"Fusion method. {_METHODS_HELP}.")
    ] = "avg",
    output: Annotated[
        Path | None,
        typer.Option(
            "--output",
            "-o",
            help="Where to write the fused model [default: fused-METHOD.safetensors].",
        ),
    ] = None,
    force: Annotated[
        bool, typer.Option("--force", help="Replace an existing output file.")
    ] = False,
    spec: Annotated[
        Path | None,
        typer.Option(
            "--spec",
            help="JSON permutation spec for models whose "
            "structure cannot be inferred from names and shapes.",
        ),
    ] = None,
    as_json: JsonOption = False,
    class_weighted: Annotated[
        bool | None,
        typer.Option(
            "--class-weighted/--no-class-weighted",
            rich_help_panel=_AVG,
            help="avg: average output rows with per-class sample shares.",
        ),
    ] = None,
    sigma: Annotated[
        list[float] | None,
        typer.Option(
            "--sigma",
            rich_help_panel=_PFNM,
            help="pfnm/nafi: client noise variance sigma^2, in multiples of the "
            "layer's per-coordinate weight variance (see --variance-units); repeat once per "
            "client for per-client values, in the order of the checkpoints [default: 1.0].",
            show_default=False,
        ),
    ] = None,
    sigma0: Annotated[
        float | None,
        typer.Option(
            "--sigma0",
            rich_help_panel=_PFNM,
            help="pfnm/nafi: prior variance sigma0^2 of global neurons, same units [default: 1.0].",
            show_default=False,
        ),
    ] = None,
    gamma: Annotated[
        float | None,
        typer.Option(
            "--gamma",
            rich_help_panel=_PFNM,
            help="pfnm/nafi: Beta-process mass gamma0 [default: 1.0].",
            show_default=False,
        ),
    ] = None,
    mu0: Annotated[
        float | None,
        typer.Option(
            "--mu0",
            rich_help_panel=_PFNM,
            help="pfnm/nafi: prior mean of global neurons [default: 0.0].",
            show_default=False,
        ),
    ] = None,
    sweeps: Annotated[
        int | None,
        typer.Option(
            "--sweeps",
            rich_help_panel=_PFNM,
            help="pfnm/nafi: refinement sweeps after the greedy pass [default: 5].",
            show_default=False,
        ),
    ] = None,
    seed: Annotated[
        int | None,
        typer.Option(
            "--seed",
            rich_help_panel=_PFNM,
            help="pfnm/nafi: seed of the sweep order; rebasin: of the group order; ot: "
            "seed of the --activations subset [default: 0].",
            show_default=False,
        ),
    ] = None,
    lam: Annotated[
        float | None,
        typer.Option(
            "--lam",
            "--lambda",
            rich_help_panel=_PFNM,
            help="nafi: weight of the KL penalty [default: 0.01].",
            show_default=False,
        ),
    ] = None,
    max_width: Annotated[
        int | None,
        typer.Option(
            "--max-width",
            rich_help_panel=_PFNM,
            help="pfnm/nafi: cap on every fused hidden width [default: none].",
            show_default=False,
        ),
    ] = None,
    class_share: Annotated[
        bool | None,
        typer.Option(
            "--class-share/--no-class-share",
            rich_help_panel=_PFNM,
            help="pfnm/nafi: class-share precision of outgoing weights "
            "[default: on when every client has class counts].",
            show_default=False,
        ),
    ] = None,
    unobserved: Annotated[
        str | None,
        typer.Option(
            "--unobserved",
            rich_help_panel=_PFNM,
            help="pfnm/nafi: 'mask' (weights a client "
            "lacks are unobserved) or 'zeros' (observed zeros, as the "
            "authors' code) [default: mask].",
            show_default=False,
        ),
    ] = None,
    variance_units: Annotated[
        str | None,
        typer.Option(
            "--variance-units",
            rich_help_panel=_PFNM,
            help="pfnm/nafi: 'relative' (sigma, "
            "sigma0 in multiples of the weight variance) or 'absolute' "
            "[default: relative].",
            show_default=False,
        ),
    ] = None,
    backend: Annotated[
        str | None,
        typer.Option(
            "--backend",
            rich_help_panel=_PFNM,
            help="pfnm/nafi/rebasin: 'core' (C++) or 'numpy' (reference kernels + SciPy) "
            "[default: core].",
            show_default=False,
        ),
    ] = None,
    anchor: Annotated[
        str | None,
        typer.Option(
            "--anchor",
            rich_help_panel=_OT,
            help="ot/rebasin: the client to align to (its path, file "
            "name or content-hash prefix) [default: most samples].",
        ),
    ] = None,
    max_sweeps: Annotated[
        int | None,
        typer.Option(
            "--max-sweeps",
            rich_help_panel=_OT,
            help="rebasin: sweeps of weight matching over the groups at most [default: 100].",
            show_default=False,
        ),
    ] = None,
    activations: Annotated[
        str | None,
        typer.Option(
            "--activations",
            rich_help_panel=_OT,
            help="ot: compare neurons by their "
            "pre-activations on these inputs instead of by weights: a "
            ".npy (N, ...), a .npz with x or x_train, or a data set name.",
        ),
    ] = None,
    activation_samples: Annotated[
        int | None,
        typer.Option(
            "--activation-samples",
            rich_help_panel=_OT,
            help="ot: at most this many inputs for --activations [default: 256].",
        ),
    ] = None,
    data_dir: Annotated[
        Path | None,
        typer.Option(
            "--data-dir",
            rich_help_panel=_OT,
            help="ot: folder of the data set named by "
            "--activations (mnist, fashion-mnist, cifar10).",
        ),
    ] = None,
    mode: Annotated[
        str | None,
        typer.Option(
            "--mode",
            rich_help_panel=_AMS,
            help="ams: top1 (most confident model), topk (sum "
            "of the k most confident) or full (sum of all) [default: top1].",
        ),
    ] = None,
    k: Annotated[
        int | None,
        typer.Option("--k", rich_help_panel=_AMS, help="ams: models summed by --mode topk."),
    ] = None,
) -> None:
    """Fuse client checkpoints into one model, in one shot and without data."""
    params = _given(
        class_weighted=class_weighted,
        sigma=(sigma[0] if len(sigma) == 1 else sigma) if sigma else None,
        sigma0=sigma0,
        gamma=gamma,
        mu0=mu0,
        sweeps=sweeps,
        seed=seed,
        lam=lam,
        max_width=max_width,
        class_share=class_share,
        unobserved=unobserved,
        variance_units=variance_units,
        backend=backend,
        anchor=anchor,
        max_sweeps=max_sweeps,
        activations=activations,
        activation_samples=activation_samples,
        data_dir=data_dir,
        mode=mode,
        k=k,
    )
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
    table.add_row("peak memory", f"{summary['report'].get('peak_memory_mb', 0):.1f} MB")
    for layer in summary["report"].get("layers", []):
        new = [c["new"] for c in layer["clients"]]
        table.add_row(
            f"layer {layer['layer']}", f"width {layer['width']}, new neurons per client {new}"
        )
    stdout.print(table)
