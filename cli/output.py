"""What every command shares: consoles, JSON output, and the error policy of the CLI.

Exit codes: 0 success, 2 bad input (one line on stderr naming what is wrong), 1 a failed
run. ``--verbose`` shows tracebacks. ``--json`` puts machine-readable output on stdout;
progress and logs always go to stderr.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import logging
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from fusekit.core.errors import FusekitError

stdout = Console()
stderr = Console(stderr=True)
state = {"verbose": False}


VerboseOption = Annotated[
    bool, typer.Option("--verbose", "-v", help="Debug logs and tracebacks.")
]


def set_verbose(verbose: bool) -> None:
    state["verbose"] = verbose
    logging.getLogger().setLevel(logging.DEBUG if verbose else logging.INFO)
    # One line per HTTP request of the service client is debugging detail.
    logging.getLogger("httpx").setLevel(logging.DEBUG if verbose else logging.WARNING)


def handle_errors(command):
    """A command with the CLI's error policy and its own ``-v``/``--verbose``.

    Bad input -> one line and exit 2; any other failure -> exit 1 (traceback with -v).
    ``-v`` works before the command (``fusekit -v fuse``) and after it (``fusekit fuse -v``).
    """
    signature = inspect.signature(command, eval_str=True)
    verbose = inspect.Parameter("verbose", inspect.Parameter.KEYWORD_ONLY,
                                annotation=VerboseOption, default=False)
    params = [*signature.parameters.values(), verbose]

    @functools.wraps(command)
    def wrapper(*args, verbose: bool = False, **kwargs):
        if verbose:
            set_verbose(True)
        try:
            return command(*args, **kwargs)
        except FusekitError as exc:
            fail(exc, code=2)
        except (typer.Exit, typer.Abort, KeyboardInterrupt):
            raise
        except Exception as exc:
            fail(exc, code=1)

    wrapper.__signature__ = signature.replace(parameters=params)
    wrapper.__annotations__ = {p.name: p.annotation for p in params}
    return wrapper


def fail(exc: Exception | str, code: int) -> None:
    if state["verbose"] and isinstance(exc, Exception):
        stderr.print_exception()
    message = in_cli_words(exc) if isinstance(exc, FusekitError) else str(exc)
    stderr.print("[bold red]error:[/]", escape(message), highlight=False, soft_wrap=True)
    raise typer.Exit(code)


#: A fusion shows its progress once it has run this long (seconds); plain lines (stderr not
#: a terminal) come at most this often.
PROGRESS_AFTER_S = 2.0
PLAIN_EVERY_S = 5.0


@contextlib.contextmanager
def step_progress(label: str) -> Iterator[None]:
    """Show the steps the library reports (``fusekit.core.progress``) during the block, once
    it has run ``PROGRESS_AFTER_S``: a bar on a terminal, else a plain line on stderr at most
    every ``PLAIN_EVERY_S`` (and the last step of each kind)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
    from rich.progress import TimeElapsedColumn

    from fusekit.core import progress

    start = time.monotonic()
    state: dict[str, Any] = {"bar": None, "printed": start}

    def show(what: str, done: int, total: int) -> None:
        now = time.monotonic()
        if now - start < PROGRESS_AFTER_S:
            return
        if not stderr.is_terminal:
            if done == total or now - state["printed"] >= PLAIN_EVERY_S:
                state["printed"] = now
                stderr.print(f"{label}: {done} of {total} {what} ({now - start:.0f} s)",
                             highlight=False, soft_wrap=True)
            return
        if state["bar"] is None:
            state["bar"] = Progress(TextColumn(f"{label}: {{task.description}}"), BarColumn(),
                                    MofNCompleteColumn(), TimeElapsedColumn(), console=stderr,
                                    transient=True)
            state["bar"].start()
            state["task"] = state["bar"].add_task(what, total=total)
        state["bar"].update(state["task"], description=what, completed=done, total=total)

    handler = progress.listen(show)
    try:
        yield
    finally:
        progress.stop_listening(handler)
        if state["bar"] is not None:
            state["bar"].stop()


def in_cli_words(error: FusekitError) -> str:
    """The error's message with the keyword arguments it names said as the options of the
    command line (``width_ratio`` -> ``--width-ratio``, ``force=True`` -> ``--force``); an
    option left out is its keyword's None, so "or None" goes too."""
    message = str(error)
    for keyword in error.keywords:
        flag = "--" + keyword.replace("_", "-")
        message = re.sub(rf"(?<![\w-]){re.escape(keyword)}(=True)?(?![\w=])", flag, message)
    return message.replace(", or None", "") if error.keywords else message


def emit_json(payload: Any) -> None:
    """Machine-readable output: plain JSON on stdout, nothing else."""
    sys.stdout.write(json.dumps(payload, indent=2, default=_jsonable) + "\n")
    sys.stdout.flush()


def _jsonable(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON-serialisable: {type(value).__name__}")

