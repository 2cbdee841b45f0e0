"""Flower's SuperExec with warm app processes, for federations on one machine.

``python -m fusekit.flower.superexec`` (what the SuperNodes and the SuperLink of a
:class:`~fusekit.flower.local.LocalFederation` start in place of ``flower-superexec``) takes
``flower-superexec``'s arguments and runs Flower's own task loop and executor. Only how an
app process starts differs: a fresh ``flwr-clientapp`` imports Flower's runtime and torch
before its app, about 3 s of CPU for every message a node answers; here the SuperExec
starts one warm process that imports them once, and each task is a fork of it that runs
Flower's command (its arguments, output and exit as Flower gives them), importing the app
afresh. Each task still has a process of its own: nothing an app does outlives its
message. The tasks are children of the warm process, a child of the SuperExec: one process
group, as Flower's own subprocesses are.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import IO, Any

#: The task commands started warm: those of a SuperNode (its ClientApps) and of a
#: SuperLink (its ServerApps); any other is started as Flower starts it.
WARM_COMMANDS = ("flwr-clientapp", "flwr-serverapp")
#: What the warm process imports beside the commands' modules: fusekit's ClientApp and
#: ServerApp sides (torch with them).
WARM_IMPORTS = ("fusekit.flower.client", "fusekit.flower.strategy")


class WarmStarts:
    """Stands in for the ``subprocess`` module of Flower's SubprocessExecutor, whose only
    use of it is ``subprocess.Popen(args[, stdout=DEVNULL, stderr=DEVNULL])``: a warm
    command goes to the warm process as a line of JSON, any other (or any once the warm
    process has ended) to :func:`subprocess.Popen`."""

    DEVNULL = subprocess.DEVNULL

    def __init__(self) -> None:
        self.warm = subprocess.Popen([sys.executable, "-m", "fusekit.flower.superexec", "--warm"],
                                     stdin=subprocess.PIPE)

    def Popen(self, args: list[str], stdout: Any = None, stderr: Any = None) -> Any:
        if args[0] in WARM_COMMANDS and self.warm.poll() is None:
            try:
                line = json.dumps([args, stdout == self.DEVNULL]) + "\n"
                self.warm.stdin.write(line.encode())
                self.warm.stdin.flush()
                return None
            except BrokenPipeError:
                pass
        return subprocess.Popen(args, stdout=stdout, stderr=stderr)


def main() -> None:
    """``python -m fusekit.flower.superexec [flower-superexec's arguments]``."""
    from flwr.supercore.cli import flower_superexec
    from flwr.supercore.superexec.executor import subprocess_executor

    subprocess_executor.subprocess = WarmStarts()
    flower_superexec()


def serve_warm(commands: IO[bytes]) -> tuple[Callable[[], object], list[str], bool]:
    """The warm process: imports the warm commands and :data:`WARM_IMPORTS`, then forks
    a child for each line of ``commands`` until it ends (the SuperExec closed it). Returns
    in a child only: its command's entry point, arguments and whether its output goes to
    /dev/null."""
    mains = {name: next(iter(entry_points(group="console_scripts", name=name))).load()
             for name in WARM_COMMANDS}
    for module in WARM_IMPORTS:
        __import__(module)
    gc.freeze()  # the imports' objects stay shared with the children, not copied on write
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the tasks
    for line in commands:
        args, quiet = json.loads(line)
        if os.fork() == 0:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            return mains[args[0]], args, quiet
    raise SystemExit(0)


def run_task(command: Callable[[], object], args: list[str], quiet: bool) -> None:
    """In a forked child: run ``command`` as the process ``args`` names, standard input
    from /dev/null (the warm process's is the SuperExec's pipe)."""
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    if quiet:
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
    os.close(devnull)
    sys.argv = args
    command()


if __name__ == "__main__":
    if sys.argv[1:] == ["--warm"]:
        run_task(*serve_warm(sys.stdin.buffer))
    else:
        main()
