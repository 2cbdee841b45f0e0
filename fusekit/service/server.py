"""``fusekit serve``: the API server (uvicorn) plus the worker processes it starts and stops."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable

import uvicorn

from fusekit.service.app import create_app
from fusekit.service.settings import Settings

log = logging.getLogger(__name__)


def serve(settings: Settings, host: str = "127.0.0.1", port: int = 8420, workers: int = 1,
          announce: Callable[[str], None] = log.info) -> None:
    """Serve until SIGINT/SIGTERM, with ``workers`` worker processes (0: workers run
    elsewhere, started by ``fusekit worker``); stop them on the way out."""
    app = create_app(settings)
    token_file = app.state.admin_token_file
    announce("admin token: from FUSEKIT_ADMIN_TOKEN" if token_file is None
             else f"admin token: {token_file}")
    announce(f"web page: http://{host}:{port}/ (coordinator; clients upload at /upload)")
    # uvicorn re-raises SIGTERM once it has shut down; as an exception it lets the workers
    # be stopped below instead of killing this process on the spot.
    signal.signal(signal.SIGTERM, _exit)
    started = [start_worker(settings) for _ in range(workers)]
    stop = threading.Event()
    supervisor = threading.Thread(target=_supervise, args=(settings, started, stop),
                                  daemon=True)
    supervisor.start()
    try:
        # No access log: paths are harmless, but a service log should hold only its own lines.
        uvicorn.run(app, host=host, port=port, log_level="info", access_log=False)
    finally:
        stop.set()
        supervisor.join()
        for process in started:
            stop_worker(process)


def _supervise(settings: Settings, workers: list[subprocess.Popen], stop: threading.Event
               ) -> None:
    """Replace a worker that died (killed, out of memory); its job is run again once its
    lease runs out (:func:`fusekit.service.worker.recover`)."""
    while not stop.wait(1.0):
        for i, process in enumerate(workers):
            if process.poll() is not None:
                log.warning("worker %d exited (%s); starting another", process.pid,
                            process.returncode)
                workers[i] = start_worker(settings)


def _exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def start_worker(settings: Settings) -> subprocess.Popen:
    env = {**os.environ, **settings.to_env(), "FUSEKIT_PARENT_PID": str(os.getpid())}
    return subprocess.Popen([sys.executable, "-m", "fusekit.service.worker"], env=env)


def stop_worker(process: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGTERM (a running job is given up and run again by the next worker), then SIGKILL."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout)
