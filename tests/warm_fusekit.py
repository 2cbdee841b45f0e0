"""``fusekit`` commands forked from one warm process, for tests that run many of them.

A fresh ``python -m fusekit`` spends most of a small command's CPU importing torch; the docs
pages run about sixty. :class:`WarmFusekit` imports the command line (and torch, and what the
pages' Python blocks import) once in a process of its own and forks a child for each command a
``fusekit`` script on PATH asks for. The child is the command as a reader runs it: this tree's
``fusekit._cli.app.main`` with the caller's arguments, folder, environment, stdin, stdout and
stderr (passed over a Unix socket), its exit status the script's. ``fusekit serve`` is exec'd
afresh instead: the service's server is tested as the process it is. The ``warm-python`` script
beside it runs a Python file the same way, as ``python FILE`` would (``__main__``,
``sys.argv``). A child whose script goes away (ended with its shell's process group) is killed
with its process group; stopping the warm process ends every child it has.

The parent never runs torch code, so no thread pool exists when it forks.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

MESSAGE_BYTES = 1 << 20  # a request: arguments, folder and environment, as JSON
FRESH = ("serve",)  # commands run as a fresh process, never forked
# What the pages' Python blocks import beyond the command line, imported once here instead of
# once in each child (about 2 s of CPU each): torch._dynamo (an optimizer of torch.optim or a
# transformers model imports it), transformers' model classes, scikit-learn's data sets.
PRELOADED = ("torch._dynamo", "transformers.modeling_utils", "sklearn.datasets")

SCRIPT = """#!{python} -I
import json, os, socket, sys
if {command!r} == "fusekit" and sys.argv[1:2] and sys.argv[1] in {fresh!r}:
    os.execv({python!r}, [{python!r}, "-m", "fusekit", *sys.argv[1:]])
with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as warm:
    warm.connect({address!r})
    request = {{"command": {command!r}, "argv": sys.argv[1:], "cwd": os.getcwd(),
                "env": dict(os.environ)}}
    socket.send_fds(warm, [json.dumps(request).encode()], [0, 1, 2])
    status = warm.recv(64)  # empty if the warm process went away
sys.exit(int(status) if status else 70)
"""


class WarmFusekit:
    """The warm process and the scripts that talk to it, in ``folder``: ``fusekit`` (a
    command) and ``warm-python`` (``python FILE [ARGS]``)."""

    def __init__(self, folder: Path) -> None:
        self.address = str(folder / "warm.sock")
        self.script, self.python = folder / "fusekit", folder / "warm-python"
        for script in (self.script, self.python):
            script.write_text(SCRIPT.format(python=sys.executable, fresh=FRESH,
                                            address=self.address, command=script.name))
            script.chmod(0o755)
        self.process: subprocess.Popen | None = None

    def start(self, env: dict[str, str], timeout: float = 120.0) -> WarmFusekit:
        self.process = subprocess.Popen([sys.executable, __file__, self.address], env=env,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout  # a bound on a hang: the imports take seconds
        while not os.path.exists(self.address):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the warm fusekit process did not start "
                                   f"(exit status {self.process.returncode})")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        from fusekit.toolkit.processes import end_groups

        if self.process is not None:
            end_groups([self.process])


def serve(address: str) -> None:
    """Fork a child for each request on ``address`` until SIGTERM; answer its exit status."""
    import torch  # noqa: F401  (what most commands import first, once)

    import fusekit._cli.app  # noqa: F401

    for name in PRELOADED:
        with contextlib.suppress(ImportError):  # transformers: the [hf] extra
            importlib.import_module(name)

    from fusekit.client import tls_context

    tls_context()  # the certificates each service command's client verifies with, loaded once

    children: dict[int, socket.socket] = {}  # child pid -> its caller's connection
    signal.signal(signal.SIGTERM, lambda *_: end_all(children))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(address + ".new")
    listener.listen(64)
    os.rename(address + ".new", address)  # ready once it exists
    while True:
        ready, _, _ = select.select([listener, *children.values()], [], [], 0.05)
        for connection in ready:
            if connection is listener:
                caller, _ = listener.accept()
                pid = fork_command(caller, listener, children)
                if pid:
                    children[pid] = caller
            else:  # a caller hung up (its shell was ended): so does its command
                pid = next(p for p, c in children.items() if c is connection)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if not pid:
                break
            code = os.waitstatus_to_exitcode(status)  # -N: killed by signal N
            with children.pop(pid) as caller, contextlib.suppress(OSError):
                caller.send(str(code if code >= 0 else 128 - code).encode())


def fork_command(caller: socket.socket, listener: socket.socket,
                 children: dict[int, socket.socket]) -> int:
    """The child's pid, in the parent; the child runs the command and never returns."""
    message, fds, _, _ = socket.recv_fds(caller, MESSAGE_BYTES, 3)
    request = json.loads(message)
    pid = os.fork()
    if pid:
        with contextlib.suppress(OSError):  # the child sets it too: whichever runs first
            os.setpgid(pid, pid)
        for fd in fds:
            os.close(fd)
        return pid
    code = 70
    try:
        with contextlib.suppress(OSError):
            os.setpgid(0, 0)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        listener.close()
        for other in (caller, *children.values()):
            other.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        run(request["command"], request["argv"])
        code = 0
    except SystemExit as exit_:
        code = exit_code(exit_.code)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run(command: str, argv: list[str]) -> None:
    """``fusekit ARGV``, or ``python ARGV`` (a file, then its arguments) for ``warm-python``,
    in this process."""
    if command == "warm-python":
        sys.argv = argv
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))  # as python FILE sets it
        runpy.run_path(argv[0], run_name="__main__")
        return
    sys.argv = ["fusekit", *argv]
    from fusekit._cli.app import main

    main()


def exit_code(code: object) -> int:
    """The status ``sys.exit(code)`` gives a process (a message is printed, status 1)."""
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)
    return 1


def end_all(children: dict[int, socket.socket]) -> None:
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    sys.exit(0)


if __name__ == "__main__":
    serve(sys.argv[1])
