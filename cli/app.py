"""The ``fusekit`` command: a thin front door over the Python API (no fusion logic here)."""

from __future__ import annotations

import logging
from typing import Annotated

import typer
from rich.logging import RichHandler

from fusekit._cli import demo, evaluate, fuse, inspect, job, serve, simulate, submit
from fusekit._cli.output import handle_errors, state, stderr, stdout
from fusekit._version import __version__
from fusekit.engine.native import core_status

app = typer.Typer(
    name="fusekit",
    help="One-shot, data-free fusion of neural networks (PFNM, NAFI, OT, AMS, averaging).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _version(value: bool) -> None:
    if value:
        stdout.print(f"fusekit {__version__}\n{core_status()}", highlight=False)
        raise typer.Exit()


@app.callback()
def _main(
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="Debug logs and tracebacks.")
    ] = False,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True,
                           help="Show the version and whether the C++ core is loaded.")
    ] = False,
) -> None:
    state["verbose"] = verbose
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(message)s",
        handlers=[RichHandler(console=stderr, show_time=False, show_path=False)],
        force=True,
    )
    # One line per HTTP request of the service client is debugging detail.
    logging.getLogger("httpx").setLevel(logging.DEBUG if verbose else logging.WARNING)


app.command("fuse")(handle_errors(fuse.fuse))
app.command("inspect")(handle_errors(inspect.inspect))
app.command("simulate")(handle_errors(simulate.simulate))
app.command("evaluate")(handle_errors(evaluate.evaluate))
app.command("demo")(handle_errors(demo.demo))
app.command("serve")(handle_errors(serve.serve))
app.command("worker")(handle_errors(serve.worker))
app.command("submit")(handle_errors(submit.submit))
app.add_typer(job.app, name="job")


def main() -> None:
    app()
