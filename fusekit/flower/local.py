"""A Flower deployment on this machine: one SuperLink and N SuperNodes on 127.0.0.1.

The processes are Flower's own (``flower-superlink``, ``flower-supernode``), started
``--insecure`` with a private ``FLWR_HOME``, each in its own process group, and apps run on
them with ``flwr run``. Every wait is bounded; leaving the ``with`` block ends every process
group it started, those of their descendants (the SuperLink starts ``flower-superexec`` in a
session of its own, which starts the ServerApp processes) and of any process left with this
federation's ``FLWR_HOME`` in its environment (one whose parent ended first). The
``flower-superexec`` the SuperLink and SuperNodes start is :mod:`fusekit.flower.superexec`:
Flower's, with each app process forked from a warm one, so that a message costs its work
and not the 3 s of imports of a fresh ClientApp. Nothing here is needed on a real
multi-host deployment, where each organisation starts its own SuperNode (see
examples/flower/README.md).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shlex
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from fusekit.toolkit.processes import end_groups, groups_with_env

log = logging.getLogger(__name__)

CONNECTION = "fusekit-local"
#: The lines of a ServerApp's log that tell a run's progress: rounds, node sampling,
#: fusekit's fusions and scores, problems.
PROGRESS = re.compile(r"\[ROUND|configure_(train|evaluate)|round \d+: |fusekit |left out|"
                      r"failed|ERROR|WARNING")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
#: The line of ``flwr run`` once the SuperLink has the run, with the run's id.
STARTED = re.compile(r"Successfully started run (\d+)")


def progress_lines(write: Callable[[str], None]) -> Callable[[str], None]:
    """An ``on_line`` for :meth:`LocalFederation.run` that passes ``write`` the progress
    lines of the run's output (:data:`PROGRESS`), colour codes removed."""

    def on_line(line: str) -> None:
        line = ANSI.sub("", line).strip()
        if PROGRESS.search(line):
            write(line)

    return on_line


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def toml_value(value: Any) -> str:
    """A run-config value as TOML (what ``flwr run --run-config`` parses)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


class LocalFederation:
    """``with LocalFederation(nodes=3) as federation: federation.run(app, {...})``.

    Args:
        nodes: how many SuperNodes; node i gets ``partition-id=i num-partitions=nodes``.
        workdir: FLWR_HOME and process logs (a temporary folder, removed on exit, if None).
        start_timeout: seconds to wait for the SuperLink's /health.
    """

    def __init__(self, nodes: int = 3, workdir: str | os.PathLike[str] | None = None,
                 start_timeout: float = 60.0):
        self.nodes = nodes
        self.start_timeout = start_timeout
        self._given_workdir = Path(workdir) if workdir is not None else None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self.processes: list[subprocess.Popen[bytes]] = []
        self.port = 0

    def __enter__(self) -> LocalFederation:
        if self._given_workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="fusekit-flower-")
        self.workdir = self._given_workdir or Path(self._tmp.name)
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def home(self) -> Path:
        """This federation's FLWR_HOME (its processes carry it in their environment)."""
        return self.workdir / "flwr-home"

    @property
    def env(self) -> dict[str, str]:
        """The environment of every Flower process: private FLWR_HOME, no telemetry,
        :attr:`bin` and this interpreter's scripts first on PATH (the SuperLink and the
        SuperNodes start ``flower-superexec`` from it), and one torch
        thread per app unless ``OMP_NUM_THREADS`` says otherwise: the nodes' apps share
        this machine's cores, and more threads each would oversubscribe them (an app's
        training then took four times the CPU on two busy cores)."""
        path = [str(self.bin), str(Path(sys.executable).parent), os.environ.get("PATH", "")]
        return {"OMP_NUM_THREADS": "1", **os.environ, "FLWR_HOME": str(self.home),
                "FLWR_TELEMETRY_ENABLED": "0", "PATH": os.pathsep.join(path)}

    @property
    def bin(self) -> Path:
        """First on the processes' PATH: its ``flower-superexec`` runs
        :mod:`fusekit.flower.superexec` (Flower's, with warm app processes)."""
        return self.workdir / "bin"

    def _start(self) -> None:
        self.bin.mkdir(exist_ok=True)
        superexec = self.bin / "flower-superexec"
        superexec.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} '
                             '-m fusekit.flower.superexec "$@"\n')
        superexec.chmod(0o755)
        self.port = free_port()
        self._spawn("superlink", ["flower-superlink", "--insecure", "--host", "127.0.0.1",
                                  "--port", str(self.port),
                                  "--disable-runtime-dependency-installation"])
        self._wait_healthy()
        for node in range(self.nodes):
            self._spawn(f"supernode-{node}", [
                "flower-supernode", "--insecure", "--superlink", f"127.0.0.1:{self.port}",
                "--host", "127.0.0.1", "--port", str(free_port()),
                "--node-config", f"partition-id={node} num-partitions={self.nodes}",
                "--max-wait-time", str(self.start_timeout),
            ])
        self._write_connection()

    def _spawn(self, name: str, command: list[str]) -> None:
        logfile = (self.workdir / f"{name}.log").open("wb")
        with logfile:
            # A new session: the process and every app process it starts form one group,
            # ended together by stop().
            self.processes.append(subprocess.Popen(
                command, stdout=logfile, stderr=subprocess.STDOUT, env=self.env,
                cwd=self.workdir, start_new_session=True))
        log.debug("started %s (pid %d): %s", name, self.processes[-1].pid, " ".join(command))

    def _wait_healthy(self) -> None:
        url = f"http://127.0.0.1:{self.port}/health"
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.processes[0].poll() is not None:
                raise RuntimeError(f"flower-superlink exited with code "
                                   f"{self.processes[0].returncode}; see {self.log('superlink')}")
            with (contextlib.suppress(urllib.error.URLError, OSError),
                  urllib.request.urlopen(url, timeout=2) as response):
                if response.status == 200:
                    return
            time.sleep(0.25)
        raise TimeoutError(f"flower-superlink not healthy at {url} after {self.start_timeout} s; "
                           f"see {self.log('superlink')}")

    def _write_connection(self) -> None:
        self.home.mkdir(exist_ok=True)
        (self.home / "config.toml").write_text(
            f'[superlink]\ndefault = "{CONNECTION}"\n\n'
            f'[superlink.{CONNECTION}]\naddress = "127.0.0.1:{self.port}"\ninsecure = true\n'
        )

    def log(self, name: str) -> Path:
        """The log file of ``superlink`` or ``supernode-<i>``."""
        return self.workdir / f"{name}.log"

    def run(self, app: str | os.PathLike[str], run_config: Mapping[str, Any] | None = None,
            timeout: float = 600.0, on_line: Callable[[str], None] | None = None
            ) -> subprocess.CompletedProcess[str]:
        """``flwr run <app> --stream`` on this federation; its output is returned. Runs
        are independent: several may go on at once (each from a thread of its own).

        Args:
            timeout: seconds the run may take once the SuperLink has started it (``flwr
                run`` gets ``start_timeout`` seconds to submit it, however busy the machine).
            on_line: called with each line of the output as it comes (the ServerApp's log:
                rounds, fusions, evaluations), for progress.

        Raises:
            subprocess.TimeoutExpired: the run took longer than ``timeout`` (the run is
                stopped on the SuperLink after the ``flwr`` process group is ended; the
                other runs go on).
            RuntimeError: ``flwr run`` failed (its output is in the message).
        """
        command = ["flwr", "run", str(app), CONNECTION, "--stream"]
        for key, value in (run_config or {}).items():
            command += ["--run-config", f"{key}={toml_value(value)}"]
        lines: list[str] = []
        started = _Started()
        with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=self.env, start_new_session=True) as process:
            reader = threading.Thread(target=_read_lines, daemon=True,
                                      args=(process.stdout, lines, on_line, started))
            reader.start()
            try:
                deadline = time.monotonic() + self.start_timeout
                while (not started.wait(0.2) and process.poll() is None
                       and time.monotonic() < deadline):
                    pass
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                end_groups([process])  # first, so that it submits nothing more
                self._stop_runs(started.run_id)
                raise
            finally:
                reader.join(timeout=10)
        output = "".join(lines)
        if process.returncode != 0:
            raise RuntimeError(f"flwr run exited with code {process.returncode}:\n{output}")
        return subprocess.CompletedProcess(command, process.returncode, output, None)

    def runs(self) -> list[dict[str, Any]]:
        """The SuperLink's runs as ``flwr ls --format json`` lists them (``run-id``,
        ``status`` such as ``finished:completed`` or ``finished:stopped``, ...)."""
        return json.loads(self._flwr("ls", CONNECTION, "--format", "json").stdout)["runs"]

    def _stop_runs(self, run_id: str | None) -> None:
        """Stop run ``run_id`` on the SuperLink: ending ``flwr run`` alone would leave its
        ServerApp waiting there. Without the id (``flwr run`` ended before it printed it),
        every run that has not finished."""
        try:
            ids = [run_id] if run_id is not None else [
                str(run["run-id"]) for run in self.runs()
                if not str(run["status"]).startswith("finished")]
            for unfinished in ids:
                self._flwr("stop", unfinished, CONNECTION)
        except (subprocess.SubprocessError, OSError, ValueError, KeyError) as exc:
            log.warning("could not stop run %s: %s", run_id or "(every unfinished one)", exc)

    def _flwr(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["flwr", *args], capture_output=True, text=True, env=self.env,
                              timeout=timeout, check=True)

    def stop(self) -> None:
        """End every process group this federation started, those of their descendants and
        of every process with its FLWR_HOME (SIGTERM, then SIGKILL)."""
        end_groups(self.processes, also=self.leftover_groups())
        self.processes.clear()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def leftover_groups(self) -> set[int]:
        """The process groups of every process still running with this federation's
        FLWR_HOME in its environment (none once it is stopped)."""
        return groups_with_env("FLWR_HOME", str(self.home)) - {os.getpgrp()}


class _Started(threading.Event):
    """Set once ``flwr run`` has printed that the SuperLink has the run, whose id it keeps."""

    run_id: str | None = None


def _read_lines(stream: Any, lines: list[str], on_line: Callable[[str], None] | None,
                started: _Started) -> None:
    for line in stream:
        lines.append(line)
        if match := STARTED.search(line):
            started.run_id = match.group(1)
            started.set()
        if on_line is not None:
            on_line(line.rstrip("\n"))
