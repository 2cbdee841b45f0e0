"""``fusekit bench ...``: benchmarks shared with the scripts in benchmarks/."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(help="Run fusekit's benchmarks (tables on stdout, optional JSON).")


@app.command()
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
    json: Annotated[Path | None, typer.Option(help="Write the results as JSON here.")] = None,
) -> None:
    """Assignment solvers and cost kernels against SciPy, lapx, lap, lapjv and POT."""
    from fusekit.bench.matching import main

    argv = ["--quick"] if quick else []
    if lapx_path:
        argv += ["--lapx-path", lapx_path]
    if lap_path:
        argv += ["--lap-path", lap_path]
    if json:
        argv += ["--json", str(json)]
    raise typer.Exit(main(argv))
