"""The job queue and the workers: fusion runs here, in worker processes, never in the API
server's event loop; each job's fusion in a process of its own, which its worker kills
when the job is deleted while it runs.

The queue is huey's: SQLite in the data folder by default (API server and workers on one
machine), Redis when workers run on several machines. A job is queued by id only; its state
lives in the job store, so a message lost with a killed worker is found again by
:func:`recover` (run by every API server at start-up and then every few seconds).
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import shutil
import signal
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from huey import Huey, RedisHuey, SqliteHuey

import fusekit
from fusekit.api import fusion_summary
from fusekit.core.checkpoint import write_atomic
from fusekit.core.errors import FusekitError
from fusekit.service.settings import Settings
from fusekit.service.store import JobStore, make_private, without_paths

log = logging.getLogger(__name__)

RESULT, REPORT = "result.safetensors", "report.json"
TASK = "fusekit.run_job"
CANCEL_CHECK_S = 0.5  # how often a worker looks whether its running job was cancelled
LOG_FORMAT = "%(asctime)s %(name)s: %(message)s"
# Fusion processes start afresh: a fork would copy the worker's threads' locks.
_SPAWN = multiprocessing.get_context("spawn")


def make_queue(settings: Settings) -> tuple[Huey, Any]:
    """The huey queue of these settings and its one task, ``run_job(job_id)``."""
    if settings.broker:
        huey: Huey = RedisHuey("fusekit", url=settings.broker, results=False)
    else:
        huey = SqliteHuey("fusekit", filename=str(settings.data_dir / "queue.sqlite3"),
                          results=False, fsync=True)

    @huey.task(name=TASK)
    def run_job_task(job_id: str) -> None:
        run_job(settings, job_id)

    return huey, run_job_task


def run_job(settings: Settings, job_id: str) -> None:
    """Run one queued job: fuse its checkpoints with ``fusekit.fuse`` and store the result."""
    store = JobStore(settings.data_dir)
    job = store.claim(job_id)
    if job is None:
        log.info("job %s: not queued any more; nothing to do", job_id)
        return
    attempt = job["attempts"]
    stop = threading.Event()
    beat = threading.Thread(target=_heartbeat, args=(store, job_id, settings.lease_s / 5, stop),
                            daemon=True)
    beat.start()
    try:
        outcome = _fuse(store, job, attempt)
    finally:
        stop.set()
        beat.join()
    store.update(job_id, attempt, finished_at=time.time(), progress=None, **outcome)
    log.info("job %s: %s", job_id, outcome["state"])


def _fuse(store: JobStore, job: dict[str, Any], attempt: int) -> dict[str, Any]:
    folder = store.root / job["id"]
    run = folder / "run"  # the clients' files under their own names, for fusekit's messages
    try:
        paths = _link_inputs(store, job, run)
        store.update(job["id"], attempt, progress="fusing")
        report = _fuse_apart(store, job, attempt, paths, run / RESULT)
        if report is None or not store.update(job["id"], attempt,
                                              progress="writing the result"):
            return {"state": "cancelled"}
        os.replace(run / RESULT, folder / RESULT)
        write_atomic(folder / REPORT, without_paths(report, store.data_dir).encode())
        return {"state": "succeeded", "error": None}
    except (FusekitError, _FusionFailed) as exc:
        return {"state": "failed", "error": without_paths(str(exc), store.data_dir)}
    except Exception as exc:  # a bug, not bad input: keep the traceback in the worker's log
        log.exception("job %s failed", job["id"])
        return {"state": "failed", "error": without_paths(
            f"internal error: {type(exc).__name__}: {exc}", store.data_dir)}
    finally:
        shutil.rmtree(run, ignore_errors=True)


class _FusionFailed(Exception):
    """The fusion process's one-line reason for failing, or its death."""


def _fuse_apart(store: JobStore, job: dict[str, Any], attempt: int, paths: list[Path],
                output: Path) -> str | None:
    """``fusekit.fuse`` in a process of its own, writing ``output``: a fusion cannot be
    stopped in a thread, a process can be killed, so a job deleted (cancelled) or taken
    over while it fuses stops within ``CANCEL_CHECK_S``. Returns the report (JSON), or
    None when the job is no longer this attempt's.

    Raises:
        _FusionFailed: the fusion's error message, or the process died.
    """
    receiver, sender = _SPAWN.Pipe(duplex=False)
    process = _SPAWN.Process(target=_fusion, daemon=True, name=f"fusion {job['id']}", args=(
        sender, [str(p) for p in paths], job["method"], job["spec"], job["params"],
        str(output)))
    process.start()
    sender.close()  # the child holds the only sending end: its death reads as EOF
    try:
        while True:
            if not receiver.poll(CANCEL_CHECK_S):
                if not store.runs(job["id"], attempt):  # cancelled, deleted, taken over
                    return None
                continue
            try:
                kind, payload = receiver.recv()
            except EOFError:
                process.join(10)
                raise _FusionFailed(f"the fusion process stopped (exit code "
                                    f"{process.exitcode}: killed, or out of memory)") from None
            if kind == "succeeded":
                return payload
            if kind == "failed":
                raise _FusionFailed(payload)
            if not store.update(job["id"], attempt, progress=payload):
                return None
    finally:
        if process.is_alive():
            process.kill()
        process.join()
        receiver.close()


def _fusion(sender: Connection, paths: list[str], method: str, spec: Any,
            params: dict[str, Any], output: str) -> None:
    """A fusion process: fuse, write ``output``, and send the worker ("progress", text)
    for each layer, then ("succeeded", report JSON) or ("failed", message)."""
    threading.Thread(target=_exit_with, args=(os.getppid(),), daemon=True).start()
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    logging.getLogger("fusekit").addHandler(_LayerProgress(sender))
    try:
        start = time.perf_counter()
        result = fusekit.fuse(paths, method=method, spec=spec, **params)
        seconds = time.perf_counter() - start
        result.save(output, force=True)
        report = json.dumps(fusion_summary(result, RESULT, seconds), default=_jsonable)
        sender.send(("succeeded", report))
    except FusekitError as exc:
        sender.send(("failed", str(exc)))
    except Exception as exc:  # a bug, not bad input: the traceback goes to the log
        log.exception("fusion of %s failed", paths)
        sender.send(("failed", f"internal error: {type(exc).__name__}: {exc}"))


class _LayerProgress(logging.Handler):
    """The job's progress follows the layers a method logs as fused (log records with a
    ``layer`` attribute: (i, L)), sent to the worker."""

    def __init__(self, sender: Connection) -> None:
        super().__init__(logging.INFO)
        self.sender = sender

    def emit(self, record: logging.LogRecord) -> None:
        layer = getattr(record, "layer", None)
        if layer is not None:
            done, total = layer
            self.sender.send(("progress", f"fusing: layer {done} of {total} matched"))


def _link_inputs(store: JobStore, job: dict[str, Any], run: Path) -> list[Path]:
    run.mkdir(exist_ok=True)
    paths = []
    for client in job["clients"]:
        path = run / f"{client}.safetensors"
        path.unlink(missing_ok=True)
        os.link(store.checkpoint(job, client), path)
        paths.append(path)
    return paths


def _jsonable(value: Any) -> Any:
    return value.tolist() if hasattr(value, "tolist") else str(value)


def _heartbeat(store: JobStore, job_id: str, every: float, stop: threading.Event) -> None:
    while not stop.wait(every):
        store.beat(job_id)


def recover(settings: Settings, huey: Huey, run_job_task: Any) -> None:
    """Queue again what a crash lost: a queued job whose message is not in the queue, a
    running job whose worker stopped signalling (failed after ``max_attempts`` runs); and
    remove what killed processes left behind (:meth:`JobStore.sweep`, deleted jobs)."""
    store = JobStore(settings.data_dir)
    store.empty_trash()
    pending = {task.args[0] for task in huey.pending() if task.args}
    now = time.time()
    for job_id in store.ids():
        try:
            job = store.read(job_id)
            store.sweep(job_id)
            if job["state"] == "queued" and job_id not in pending and (
                    now - job["queued_at"] > settings.lease_s):
                log.warning("job %s: queued but not in the queue; queueing it again", job_id)
                run_job_task(job_id)
            elif job["state"] == "running" and store.silent_for(job_id) > settings.lease_s:
                _requeue(store, settings, job_id, huey, run_job_task)
        except FusekitError:  # deleted meanwhile
            continue


def _requeue(store: JobStore, settings: Settings, job_id: str, huey: Huey,
             run_job_task: Any) -> None:
    with store.locked(job_id) as job:
        if job["state"] != "running" or store.silent_for(job_id) <= settings.lease_s:
            return
        if job["attempts"] >= settings.max_attempts:
            job.update(state="failed", finished_at=time.time(), progress=None,
                       error=f"the worker stopped {job['attempts']} times while running this "
                       "job (killed or out of memory); not trying again")
            log.warning("job %s: %s", job_id, job["error"])
            return
        job.update(state="queued", queued_at=time.time(), progress=None)
    log.warning("job %s: its worker stopped; queueing it again", job_id)
    run_job_task(job_id)


def work(settings: Settings, parent: int | None = None) -> None:
    """Run one worker process until SIGINT/SIGTERM (or until ``parent`` exits)."""
    make_private(settings.data_dir)
    huey, _ = make_queue(settings)
    # Polls the SQLite queue at most every half second when idle (Redis blocks instead).
    consumer = huey.create_consumer(workers=1, worker_type="thread", periodic=False,
                                    initial_delay=0.1, backoff=1.5, max_delay=0.5)
    if parent is not None:
        threading.Thread(target=_exit_with, args=(parent,), daemon=True).start()
    consumer.run()


def _exit_with(parent: int) -> None:
    """A worker started by ``fusekit serve`` stops when its server is gone, even kill -9'd."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGTERM)


def main() -> None:
    """How ``fusekit serve`` starts its workers: settings from the environment."""
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    parent = os.environ.get("FUSEKIT_PARENT_PID")
    work(Settings.from_env(), parent=int(parent) if parent else None)


if __name__ == "__main__":
    # Through the imported module, so huey names the task as the API server does.
    from fusekit.service import worker

    worker.main()
