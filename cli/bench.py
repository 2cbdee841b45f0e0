"""``fusekit bench ...``: benchmarks shared with the scripts in benchmarks/."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from fusekit._cli.output import handle_errors

app = typer.Typer(help="Run fusekit's benchmarks (tables on stdout, optional JSON).")


@app.command()
@handle_errors
def matching(
    quick: Annotated[bool, typer.Option(help="Skip the 4000x4000 problems.")] = False,
    lapx_path: Annotated[
        str | None,
        typer.Option(envvar="FUSEKIT_BENCH_LAPX_PATH", help="Directory holding lapx's 'lap'."),
    ] = None,
    lap_path: Annotated[
        str | None,
        typer.Option(envvar="FUSEKIT_BENCH_LAP_PATH", help="Directory holding gatagat's 'lap'."),
    ] = None,
    json_out: Annotated[
        Path | None, typer.Option("--json-out", help="Write the results as JSON here.")
    ] = None,
) -> None:
    """Assignment solvers and cost kernels against SciPy, lapx, lap, lapjv and POT."""
    from fusekit.bench.matching import main

    argv = ["--quick"] if quick else []
    if lapx_path:
        argv += ["--lapx-path", lapx_path]
    if lap_path:
        argv += ["--lap-path", lap_path]
    if json_out:
        argv += ["--json", str(json_out)]
    raise typer.Exit(main(argv))


@app.command()
@handle_errors
def fusion(
    clients: Annotated[
        list[int] | None, typer.Option(help="Client counts S of the MLP case [default: 10 20 30].")
    ] = None,
    numpy_clients: Annotated[
        list[int] | None, typer.Option(help="S values also run on the numpy backend [default: 10].")
    ] = None,
    cnn: Annotated[bool, typer.Option(help="Also fuse 16 CNN clients.")] = True,
    json_out: Annotated[
        Path | None, typer.Option("--json-out", help="Write the results as JSON here.")
    ] = None,
) -> None:
    """PFNM and NAFI on generative MLP clients and a 16-client CNN, C++ vs numpy backend."""
    from fusekit.bench.fusion import main

    argv = []
    if clients:
        argv += ["--clients", *map(str, clients)]
    if numpy_clients is not None:
        argv += ["--numpy-clients", *map(str, numpy_clients)]
    if not cnn:
        argv.append("--no-cnn")
    if json_out:
        argv += ["--json", str(json_out)]
    raise typer.Exit(main(argv))


@app.command("ot-ams")
@handle_errors
def ot_ams(
    clients: Annotated[
        list[int] | None, typer.Option(help="Client counts of the OT MLP case [default: 10 30].")
    ] = None,
    json_out: Annotated[
        Path | None, typer.Option("--json-out", help="Write the results as JSON here.")
    ] = None,
) -> None:
    """OT fusion against a POT-only alignment, and AMS inference throughput."""
    from fusekit.bench.ot_ams import main

    argv = ["--clients", *map(str, clients)] if clients else []
    if json_out:
        argv += ["--json", str(json_out)]
    raise typer.Exit(main(argv))
