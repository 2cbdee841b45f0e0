"""``fusekit bench ...``: benchmarks shared with the scripts in benchmarks/."""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(help="Run fusekit's benchmarks (tables on stdout, optional JSON).")


@app.command()
def matching(
    quick: bool = typer.Option(False, help="Skip the 4000x4000 problems."),
    lapx_path: str | None = typer.Option(
        None, envvar="FUSEKIT_BENCH_LAPX_PATH", help="Directory holding lapx's 'lap' module."
    ),
    lap_path: str | None = typer.Option(
        None, envvar="FUSEKIT_BENCH_LAP_PATH", help="Directory holding gatagat's 'lap' module."
    ),
    json: Path | None = typer.Option(None, help="Write the results as JSON here."),
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
