"""The ``fusekit`` command: a thin front door over the Python API (no fusion logic here).

Only what a command needs is imported when it runs (the command modules import SciPy,
torch and the methods inside their functions): ``fusekit --help``, ``--version`` and the
commands' help import none of them; ``fuse --help`` imports the methods, whose
parameter declarations are its options.
"""

from __future__ import annotations

import logging

import click
import typer
import typer.main
from rich.logging import RichHandler

from fusekit._cli import (
    calibrate,
    demo,
    evaluate,
    fuse,
    inspect,
    job,
    serve,
    simulate,
    submit,
)
from fusekit._cli.options import Command, Group
from fusekit._cli.output import VerboseOption, handle_errors, set_verbose, stderr, stdout
from fusekit._version import __version__


class _Commands(Group):
    """fusekit's commands, ``fuse`` built only when it runs or shows its own help: its
    options come from every method's parameter declarations, which import the methods
    (SciPy, POT). ``fusekit --help`` lists it by its docstring alone."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return ["fuse", *(name for name in super().list_commands(ctx) if name != "fuse")]

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name == "fuse" and name not in self.commands:
            return click.Command("fuse", help=fuse.fuse.__doc__)  # listed, never run
        return super().get_command(ctx, name)

    def resolve_command(self, ctx: click.Context, args: list[str]):
        name, command, rest = super().resolve_command(ctx, args)
        if name == "fuse" and "fuse" not in self.commands:
            command = self.commands["fuse"] = _fuse_command()
        return name, command, rest


def _fuse_command() -> click.Command:
    alone = typer.Typer(pretty_exceptions_enable=False, add_completion=False)
    alone.command("fuse", cls=Command)(handle_errors(fuse.fuse_command()))
    return typer.main.get_command(alone)


app = typer.Typer(
    cls=_Commands,
    name="fusekit",
    help="One-shot, data-free fusion of neural networks (PFNM, NAFI, OT, AMS, averaging).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _version(value: bool) -> None:
    if value:
        from fusekit.engine.native import core_status

        stdout.print(f"fusekit {__version__}\n{core_status()}", highlight=False)
        raise typer.Exit()


@app.callback()
def _main(
    verbose: VerboseOption = False,
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Show the version and whether the C++ core is loaded."),
) -> None:
    logging.basicConfig(
        format="%(message)s",
        handlers=[RichHandler(console=stderr, show_time=False, show_path=False)],
        force=True,
    )
    set_verbose(verbose)


COMMANDS = {
    "inspect": inspect.inspect,
    "simulate": simulate.simulate,
    "evaluate": evaluate.evaluate,
    "stats": calibrate.stats,
    "calibrate": calibrate.calibrate,
    "align": calibrate.align,
    "refit": calibrate.refit,
    "demo": demo.demo,
    "serve": serve.serve,
    "worker": serve.worker,
    "submit": submit.submit,
    "fetch": submit.fetch,
    "contribute": submit.contribute,
}
for name, command in COMMANDS.items():  # each refuses bad input in one line (handle_errors)
    app.command(name, cls=Command)(handle_errors(command))
app.add_typer(job.app, name="job")


def main() -> None:
    app()
