"""Process groups: ending every process a local server or federation started.

Each server is started as the leader of a process group of its own; these helpers end
those groups and the groups of all their descendants (some start sessions of their own),
SIGTERM first, then SIGKILL, with bounded waits.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path


def end_groups(processes: list[subprocess.Popen], grace: float = 10.0, *,
               terminate_first: bool = True, also: Iterable[int] = ()) -> None:
    """End the process groups ``processes`` lead, those of all their descendants (the
    SuperLink starts its SuperExec in a session of its own) and the groups in ``also``:
    SIGTERM, then SIGKILL for what is left after ``grace`` s, each followed by a bounded
    wait until no member is left. ``terminate_first=False``: SIGKILL at once, as a crash of
    the machine would end them.
    """
    groups = ({p.pid for p in processes} | descendant_groups(p.pid for p in processes)
              | set(also))
    groups.discard(os.getpgrp())  # never the caller's own group
    signals = (signal.SIGTERM, signal.SIGKILL) if terminate_first else (signal.SIGKILL,)
    for sig in signals:
        for group in groups:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, sig)
        deadline = time.monotonic() + grace
        for process in processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
        while any(group_alive(g) for g in groups) and time.monotonic() < deadline:
            time.sleep(0.1)


def descendant_groups(roots: Iterable[int]) -> set[int]:
    """The process groups of every descendant of ``roots``, read from /proc (Linux; an
    empty set elsewhere)."""
    parent_and_group = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)"
            parent_and_group[int(stat.parent.name)] = (int(fields[1]), int(fields[2]))
    found: set[int] = set()
    frontier = set(roots)
    while frontier:
        frontier = {pid for pid, (parent, _) in parent_and_group.items()
                    if parent in frontier} - found
        found |= frontier
    return {parent_and_group[pid][1] for pid in found}


def groups_with_env(name: str, value: str) -> set[int]:
    """The process groups of every process whose environment (as it was started) holds
    ``name=value``, read from /proc (Linux; an empty set elsewhere). Unlike
    :func:`descendant_groups` this finds processes whose parent ended before them, which
    the system has re-parented; give ``name`` a value private to what you started."""
    entry = f"{name}={value}".encode()
    groups = set()
    for environ in Path("/proc").glob("[0-9]*/environ"):
        with contextlib.suppress(OSError):
            if entry in environ.read_bytes().split(b"\0"):
                groups.add(os.getpgid(int(environ.parent.name)))
    return groups


def group_alive(pgid: int) -> bool:
    """Whether any process of group ``pgid`` is left (zombies included)."""
    return _answers(os.killpg, pgid)


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` is left (someone else's included)."""
    return _answers(os.kill, pid)


def _answers(send, target: int) -> bool:
    """Whether signal 0 sent with ``send`` finds ``target``: a process of another user
    refuses it (PermissionError) but is there."""
    try:
        send(target, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
