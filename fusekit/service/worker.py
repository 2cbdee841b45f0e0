"""The job queue and the workers: fusion runs here, in worker processes, never in the API
server's event loop; each job's fusion in a process of its own, which its worker kills
when the job is deleted while it runs.

A job that calibrates runs twice: its fusion, after which it waits (``calibrating``) for
its clients' statistics of the fused model; then, queued again once they are in (or the
admin says so), its calibration, in a process of its own too (ALGORITHMS §12, one pass).

The queue is huey's: SQLite in the data folder by default (API server and workers on one
machine), Redis when workers run on several machines. A job is queued by id only; its state
lives in the job store, so a message lost with a killed worker is found again by
:func:`recover` (run by every API server at start-up and then every few seconds).
"""

from __future__ import annotations

import hashlib
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
from fusekit.api import fused_spec, fusion_summary, model_points
from fusekit.core.checkpoint import load_checkpoint, write_atomic
from fusekit.core.errors import FusekitError
from fusekit.core.stats import BN_INPUT
from fusekit.core.transformer import TransformerSpec
from fusekit.service.settings import Settings
from fusekit.service.uploads import ONE_PASS_MODE
from fusekit.service.store import (
    CHECKPOINT,
    FINISHED,
    STATISTICS,
    TARGETS,
    JobStore,
    SlotKind,
    make_private,
    without_paths,
)

log = logging.getLogger(__name__)

RESULT, REPORT = "result.safetensors", "report.json"
FUSED = "fused.safetensors"  # a calibrating job's fused model; its result is calibrated
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
    """Run one queued job: fuse its checkpoints with ``fusekit.fuse`` and store the result,
    or, for a job that calibrates, calibrate its fused model with ``fusekit.calibrate``."""
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
    step = _calibrate if job.get("fused") else _fuse
    try:
        outcome = _run_step(store, job, attempt, step)
    finally:
        stop.set()
        beat.join()
    finished_at = time.time() if outcome["state"] in FINISHED else None
    store.update(job_id, attempt, finished_at=finished_at, progress=None, **outcome)
    log.info("job %s: %s", job_id, outcome["state"])


def _run_step(store: JobStore, job: dict[str, Any], attempt: int, step) -> dict[str, Any]:
    """``step(store, job, attempt, run)`` with ``run`` a scratch folder of the job's, and
    its failure as the job's outcome: the one-line reason, never a server path."""
    run = store.root / job["id"] / "run"  # the clients' files under their own names
    try:
        shutil.rmtree(run, ignore_errors=True)  # what a killed attempt left
        run.mkdir()
        return step(store, job, attempt, run)
    except (FusekitError, _StepFailed) as exc:
        return {"state": "failed", "error": without_paths(str(exc), store.data_dir)}
    except Exception as exc:  # a bug, not bad input: keep the traceback in the worker's log
        log.exception("job %s failed", job["id"])
        return {"state": "failed", "error": without_paths(
            f"internal error: {type(exc).__name__}: {exc}", store.data_dir)}
    finally:
        shutil.rmtree(run, ignore_errors=True)


def _fuse(store: JobStore, job: dict[str, Any], attempt: int, run: Path) -> dict[str, Any]:
    folder = store.root / job["id"]
    paths = _link_inputs(store, job, run, CHECKPOINT, "safetensors")
    store.update(job["id"], attempt, progress="fusing")
    report = _apart(store, job, attempt, _fusion, [str(p) for p in paths], job["method"],
                    job["spec"], job["params"], str(run / RESULT))
    if report is None or not store.update(job["id"], attempt, progress="writing the result"):
        return {"state": "cancelled"}
    fused = _describe(run / RESULT) if job.get("calibrate") else None
    os.replace(run / RESULT, folder / (FUSED if fused else RESULT))
    write_atomic(folder / REPORT, without_paths(report, store.data_dir).encode())
    if fused:
        return {"state": "calibrating", "fused": fused, "error": None}
    return {"state": "succeeded", "error": None}


def _describe(path: Path) -> dict[str, Any]:
    """What a job that calibrates records of its fused model: what statistics must name
    (content hash, points and their widths, mode), their size limit, whether calibration needs
    the clients' targets (no BatchNorm to restore: a plain MLP, a transformer), the file's
    size and hash."""
    checkpoint = load_checkpoint(path)
    spec = fused_spec(checkpoint)
    points = model_points(checkpoint, spec)
    transformer = isinstance(spec, TransformerSpec)
    needs_targets = transformer or not any(point.startswith(f"{BN_INPUT}:") for point in points)
    with open(path, "rb") as f:
        sha256 = hashlib.file_digest(f, "sha256").hexdigest()
    # Three float64 per channel and point, and a header naming three tensors per point.
    limit = 24 * sum(points.values()) + 768 * len(points) + 4096
    return {"model": checkpoint.content_hash, "points": points, "sha256": sha256,
            "size": path.stat().st_size, "max_statistics_bytes": limit,
            "needs_targets": needs_targets, "fused_at": time.time(),
            # A transformer has no BatchNorm to normalise with the batch: eval is its one mode.
            "mode": "eval" if transformer else ONE_PASS_MODE}


def _calibrate(store: JobStore, job: dict[str, Any], attempt: int, run: Path
               ) -> dict[str, Any]:
    """Calibrate the fused model with the statistics received (all, or those the admin
    finished with) and the targets received, and make it the result; the report says what
    calibration did and whose files it had."""
    folder = store.root / job["id"]
    fused = run / FUSED
    os.link(folder / FUSED, fused)
    paths = _link_inputs(store, job, run, STATISTICS, "stats.safetensors")
    targets = _link_inputs(store, job, run, TARGETS, "targets.safetensors")
    received = [c for c in job["clients"] if c in job["statistics"]]
    store.update(job["id"], attempt, progress=f"calibrating with the statistics of "
                 f"{len(received)} of {len(job['clients'])} clients")
    calibration = _apart(store, job, attempt, _calibration, str(fused),
                         [str(p) for p in paths], [str(p) for p in targets],
                         job["min_stats_samples"], str(run / RESULT))
    if calibration is None or not store.update(job["id"], attempt,
                                               progress="writing the result"):
        return {"state": "cancelled"}
    report = json.loads((folder / REPORT).read_text())
    targets_from = [c for c in job["clients"] if c in job.get("targets", {})]
    report["calibration"] = {**json.loads(calibration), "protocol": "one pass",
                             "statistics_from": received,
                             "missing": [c for c in job["clients"] if c not in received],
                             "targets_from": targets_from,
                             "targets_missing": [c for c in job["clients"]
                                                 if c not in targets_from]}
    os.replace(run / RESULT, folder / RESULT)
    write_atomic(folder / REPORT, json.dumps(report).encode())
    return {"state": "succeeded", "error": None}


class _StepFailed(Exception):
    """The fusion or calibration process's one-line reason for failing, or its death."""


def _apart(store: JobStore, job: dict[str, Any], attempt: int, work, *args: Any) -> str | None:
    """``work(*args)`` (:func:`_fusion`, :func:`_calibration`) in a process of its own: a
    fusion cannot be stopped in a thread, a process can be killed, so a job deleted
    (cancelled) or taken over meanwhile stops within ``CANCEL_CHECK_S``. Returns what
    ``work`` returns (a report, JSON), or None when the job is no longer this attempt's.

    Raises:
        _StepFailed: the error message of ``work``, or the process died.
    """
    receiver, sender = _SPAWN.Pipe(duplex=False)
    process = _SPAWN.Process(target=_child, daemon=True, name=f"{work.__name__[1:]} "
                             f"{job['id']}", args=(sender, work, *args))
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
                raise _StepFailed(f"the {work.__name__[1:]} process stopped (exit code "
                                  f"{process.exitcode}: killed, or out of memory)") from None
            if kind == "succeeded":
                return payload
            if kind == "failed":
                raise _StepFailed(payload)
            if not store.update(job["id"], attempt, progress=payload):
                return None
    finally:
        if process.is_alive():
            process.kill()
        process.join()
        receiver.close()


def _child(sender: Connection, work, *args: Any) -> None:
    """A fusion or calibration process: run ``work(*args)`` and send the worker
    ("progress", text) for each layer fused, then ("succeeded", what ``work`` returned) or
    ("failed", message)."""
    threading.Thread(target=_exit_with, args=(os.getppid(),), daemon=True).start()
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    logging.getLogger("fusekit").addHandler(_LayerProgress(sender))
    try:
        sender.send(("succeeded", work(*args)))
    except FusekitError as exc:
        sender.send(("failed", str(exc)))
    except Exception as exc:  # a bug, not bad input: the traceback goes to the log
        log.exception("%s%s failed", work.__name__[1:], args)
        sender.send(("failed", f"internal error: {type(exc).__name__}: {exc}"))


def _fusion(paths: list[str], method: str, spec: Any, params: dict[str, Any],
            output: str) -> str:
    """Fuse, write ``output``; the report as ``fusekit fuse --json`` prints it."""
    start = time.perf_counter()
    result = fusekit.fuse(paths, method=method, spec=spec, **params)
    seconds = time.perf_counter() - start
    result.save(output, force=True)
    return json.dumps(fusion_summary(result, RESULT, seconds), default=_jsonable)


def _calibration(fused: str, statistics: list[str], targets: list[str], min_samples: int,
                 output: str) -> str:
    """Calibrate ``fused`` with ``statistics`` and ``targets``, write ``output``; what
    calibration did."""
    result = fusekit.calibrate(fused, statistics, targets=targets, min_samples=min_samples)
    result.save(output, force=True)
    return json.dumps(result.report["calibration"], default=_jsonable)


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


def _link_inputs(store: JobStore, job: dict[str, Any], run: Path, kind: SlotKind,
                 suffix: str) -> list[Path]:
    """The clients' accepted files of ``kind`` in ``run``, named ``<client>.<suffix>`` (as
    messages name them), in the job's order of clients."""
    paths = []
    for client in job["clients"]:
        if client not in job.get(kind.record, {}):
            continue
        path = run / f"{client}.{suffix}"
        os.link(store.file(job, client, kind), path)
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
