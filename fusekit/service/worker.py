"""The job queue and the workers: fusion runs here, in worker processes, never in the API
server's event loop; each job's fusion in a process of its own, which its worker kills
when the job is deleted while it runs.

A job that calibrates runs once more per calibration round (:mod:`fusekit.service.rounds`):
after its fusion it waits (``calibrating``) for its clients' statistics of the round's
model; queued again once they are in (or the admin says so), the worker computes the next
round's model from them, in a process of its own too (ALGORITHMS §12), and the job waits
for the next round's statistics, until the last round's model is the result.

The queue is huey's: SQLite in the data folder by default (API server and workers on one
machine), Redis when workers run on several machines. A job is queued by id only; its state
lives in the job store, so a message lost with a killed worker is found again by
:func:`recover` (run by every API server at start-up and then every few seconds).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import math
import multiprocessing
import os
import shutil
import signal
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from huey import Huey, RedisHuey, SqliteHuey

import fusekit
from fusekit.api import fusion_summary
from fusekit.core import progress
from fusekit.core.checkpoint import load_checkpoint, write_atomic
from fusekit.core.errors import FusekitError, ParameterError
from fusekit.core.model_spec import client_spec, fused_spec, model_points
from fusekit.core.spec import PermutationSpec
from fusekit.core.transformer import TransformerSpec, config_with_widths, infer_transformer
from fusekit.methods.alignment import layer_inputs
from fusekit.protocol import CROSS, DERIVED, ONE_PASS_MODE, REFIT
from fusekit.service import rounds
from fusekit.service.errors import bounded
from fusekit.service.settings import GiB, Settings
from fusekit.service.store import (
    CHECKPOINT,
    FINISHED,
    FUSED,
    ROUNDS,
    STATISTICS,
    TARGETS,
    JobStore,
    SlotKind,
    make_private,
    without_paths,
)

log = logging.getLogger(__name__)

RESULT, REPORT = "result.safetensors", "report.json"
CONFIG = "config.json"  # a transformer job's fused config.json (the job's, fused widths)
TASK = "fusekit.run_job"
CANCEL_CHECK_S = 0.5  # how often a worker looks whether its running job was cancelled
PROGRESS_EVERY_S = 0.5  # at most one record write per this many seconds of a fusion's steps
ERROR_CHARS = 300  # of a failed job's error in its status; the whole text in its report
LOG_FORMAT = "%(asctime)s %(name)s: %(message)s"
# Fusion and calibration processes are forked by multiprocessing's fork server, a process
# of its own that imported this module once: a fork of the worker would copy its threads'
# locks, and a process started afresh spends half a second of CPU importing fusekit for
# every job and every round.
_PROCESSES = multiprocessing.get_context("forkserver")
_PROCESSES.set_forkserver_preload(["fusekit.service.worker"])


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
    step = _round if job.get("fused") else functools.partial(
        _fuse, memory=settings.max_job_memory)
    try:
        while True:
            outcome = _run_step(store, job, attempt, step)
            finished_at = time.time() if outcome["state"] in FINISHED else None
            job = store.conclude(job_id, attempt, finished_at=finished_at, progress=None,
                                 **outcome)
            if job is None or job["state"] != "running":
                break
            step = _round  # a round with all it waits for already (derived from targets)
    finally:
        stop.set()
        beat.join()
    with contextlib.suppress(FusekitError):  # a round's files once it is over
        store.sweep(job_id)
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
        return _failed(store, job, str(exc))
    except Exception as exc:  # a bug, not bad input: keep the traceback in the worker's log
        log.exception("job %s failed", job["id"])
        return _failed(store, job, f"internal error: {type(exc).__name__}: {exc}")
    finally:
        shutil.rmtree(run, ignore_errors=True)


def _failed(store: JobStore, job: dict[str, Any], error: str) -> dict[str, Any]:
    """A failed step's outcome: its error within ``ERROR_CHARS`` in the job (every status
    request returns it, the page draws it), the whole text in the job's report."""
    error = without_paths(error, store.data_dir)
    report = store.root / job["id"] / REPORT
    with contextlib.suppress(FileNotFoundError, ValueError):  # deleted meanwhile; unreadable
        kept = json.loads(report.read_text()) if report.is_file() else {}
        write_atomic(report, json.dumps({**kept, "error": error}).encode())
    return {"state": "failed",
            "error": bounded(error, ERROR_CHARS, "the whole error is in the job's report")}


def _fuse(store: JobStore, job: dict[str, Any], attempt: int, run: Path, memory: int
          ) -> dict[str, Any]:
    folder = store.root / job["id"]
    paths = list(_link_inputs(store, job, run, CHECKPOINT, "safetensors").values())
    _check_memory(job, paths, memory)
    store.update(job["id"], attempt, progress="fusing")
    report = _apart(store, job, attempt, _fusion, [str(p) for p in paths], job["method"],
                    job["spec"], job["params"], str(run / RESULT), job.get("config"))
    if report is None or not store.update(job["id"], attempt, progress="writing the result"):
        return {"state": "cancelled"}
    config = _fused_config(job, run / RESULT)
    fused = _describe(run / RESULT, config) if job.get("calibrate") else None
    if fused:  # the rounds, and the first one's record, before the model is in place
        plan = rounds.plan(job.get("protocol", "one-pass"), run / RESULT,
                           input_moments=job.get("input_moments", False))
        first = rounds.describe(plan[0], 1, len(plan), run / RESULT, FUSED,
                                paths, job["spec"], list(job["clients"]))
    if config is not None:
        write_atomic(folder / CONFIG, json.dumps(config, indent=1).encode())
    os.replace(run / RESULT, folder / (FUSED if fused else RESULT))
    write_atomic(folder / REPORT, without_paths(report, store.data_dir).encode())
    if fused:
        return {"state": "calibrating", "fused": fused, "plan": plan, "round": first,
                "error": None}
    return {"state": "succeeded", "error": None}


def fusion_memory(widths: Sequence[int], inputs: int, outputs: int, clients: int) -> int:
    """The least memory, in bytes, of a fusion to the hidden ``widths``: per fused neuron,
    float64 weights from the layer below (``inputs`` values into the first hidden layer), a
    bias, weights into the layer above (``outputs`` from the last), and a column of each
    client's cost matrix."""
    dims = [inputs, *widths, outputs]
    return 8 * sum(w * (dims[i] + 1 + dims[i + 2] + clients) for i, w in enumerate(widths))


def _check_memory(job: dict[str, Any], paths: list[Path], memory: int) -> None:
    """A job's ``width`` against ``memory``, with its clients' input and output sizes: the
    creation check knew neither. Refused before the fusion starts, not after minutes of
    it or a MemoryError."""
    width = job["params"].get("width")
    if width is None or isinstance(width, str):  # the default, 'unlimited': what clients have
        return
    spec = client_spec(load_checkpoint(paths[0]), job["spec"])
    if type(spec) is not PermutationSpec:  # a graph's, a transformer's widths are per group
        return
    widths = width if isinstance(width, list) else [width] * (len(spec.layers) - 1)
    if len(widths) != len(spec.layers) - 1:
        return  # the fusion refuses it, naming both counts
    need = fusion_memory(widths, layer_inputs(spec)[spec.layers[0].name],
                         spec.layers[-1].out_features, len(paths))
    if need > memory:
        raise ParameterError(f"width: fused widths {widths} need at least {in_units(need)} "
                             f"with these {len(paths)} clients' models ({spec.layers[0].name!r}"
                             f" reads {layer_inputs(spec)[spec.layers[0].name]} values), over "
                             f"the {in_units(memory)} a job may use (fusekit serve "
                             "--max-job-memory)")


def in_units(size: int) -> str:
    """A size in bytes as people read it: MiB, or GiB from one GiB on."""
    return f"{size / GiB:.1f} GiB" if size >= GiB else f"{size / 2**20:.1f} MiB"


def _fused_config(job: dict[str, Any], path: Path) -> dict[str, Any] | None:
    """A transformer job's config.json with the fused widths (None without one): what
    makes the fused model a model folder its clients can run."""
    if job.get("config") is None:
        return None
    checkpoint = load_checkpoint(path)
    spec = fused_spec(checkpoint)
    if not isinstance(spec, TransformerSpec):
        raise ParameterError("config: given for a job whose models are not transformers; "
                             "expected it only with a transformer's weight files")
    config = config_with_widths(job["config"], spec)
    infer_transformer(config, {name: info.shape for name, info in checkpoint.tensors.items()},
                      label="config")  # it describes the fused weights
    return config


def _describe(path: Path, config: dict[str, Any] | None) -> dict[str, Any]:
    """What a job that calibrates records of its fused model: its content hash, points and
    mode of its one-pass statistics, whether calibration needs the clients' targets (no
    BatchNorm to restore: a plain MLP, a transformer), the file's size and hash, and
    whether a config.json goes with it."""
    checkpoint = load_checkpoint(path)
    spec = fused_spec(checkpoint)
    transformer = isinstance(spec, TransformerSpec)
    return {"model": checkpoint.content_hash, "points": model_points(checkpoint, spec),
            **rounds.file_record(path), "needs_targets": rounds.needs_targets(checkpoint, spec),
            "fused_at": time.time(), "config": config is not None,
            # A transformer has no BatchNorm to normalise with the batch: eval is its one mode.
            "mode": "eval" if transformer else ONE_PASS_MODE}


def _round(store: JobStore, job: dict[str, Any], attempt: int, run: Path) -> dict[str, Any]:
    """The current round's step: the next model from the statistics received (all, or
    those the admin finished with) and the targets; the next round, or, after the last,
    the result, with a report of every round and whose files it had."""
    folder, round_ = store.root / job["id"], job["round"]
    index, total, kind = round_["index"], round_["total"], round_["kind"]
    model = run / f"round-{index}.safetensors"
    os.link(folder / round_["file"], model)
    paths = _link_inputs(store, job, run, STATISTICS, "stats.safetensors")
    targets = _link_inputs(store, job, run, TARGETS, "targets.safetensors")
    received = [c for c in round_["participants"] if c in job["statistics"]]
    clients = _link_inputs(store, job, run, CHECKPOINT, "safetensors", round_["participants"])
    store.update(job["id"], attempt, progress=_working_on(round_, received))
    step = _apart(store, job, attempt, _calibration, round_, str(model), _as_text(paths),
                  _as_text(targets), _as_text(clients), job["min_stats_samples"],
                  str(run / RESULT))
    if step is None or not store.update(job["id"], attempt, progress="writing the result"):
        return {"state": "cancelled"}
    report = json.loads(step)
    participants = report.pop("participants")
    done = {"round": index, "kind": kind, "model": round_["model"],
            **{k: round_[k] for k in ("layers", "layer", "mode") if k in round_},
            "statistics_from": received,
            "missing": [c for c in round_["participants"] if c not in received], **report}
    history = [*job.get("rounds_done", []), done]
    if index < total:
        following = f"{ROUNDS}/round-{index + 1}.safetensors"
        (folder / ROUNDS).mkdir(exist_ok=True)
        os.replace(run / RESULT, folder / following)
        upcoming = rounds.describe(job["plan"][index], index + 1, total, folder / following,
                                   following, [clients[c] for c in participants], job["spec"],
                                   participants)
        return {"state": "calibrating", "round": upcoming, "statistics": {},
                "rounds_done": history, "error": None}
    report = json.loads((folder / REPORT).read_text())
    report["calibration"] = _calibration_report(job, history)
    os.replace(run / RESULT, folder / RESULT)
    write_atomic(folder / REPORT, json.dumps(report).encode())
    return {"state": "succeeded", "rounds_done": history, "error": None}


def _working_on(round_: dict[str, Any], received: list[str]) -> str:
    """The job's progress while the worker computes a round's step."""
    files = f"of {len(received)} of {len(round_['participants'])} clients"
    kind = round_["kind"]
    if kind == DERIVED:
        what = f"calibrating layer {round_['layers'][0]!r} from the targets' input moments"
    elif kind == CROSS:
        what = f"aligning with the cross statistics {files}"
    elif kind == REFIT:
        what = f"refitting layer {round_['layer']!r} with the refit statistics {files}"
    else:
        what = f"calibrating with the statistics {files}"
    if round_["total"] == 1:
        return what
    return f"round {round_['index']} of {round_['total']}: {what}"


def _calibration_report(job: dict[str, Any], history: list[dict[str, Any]]
                        ) -> dict[str, Any]:
    """What the report says of the calibration: one pass as the last round's calibration
    report; rounds, each round's report; with whose statistics and targets."""
    targets_from = [c for c in job["clients"] if c in job.get("targets", {})]
    whose = {"targets_from": targets_from,
             "targets_missing": [c for c in job["clients"] if c not in targets_from]}
    protocol = job.get("protocol", "one-pass")
    if protocol == "one-pass":
        (last,) = history
        return {**last["calibration"], "protocol": "one pass",
                "statistics_from": last["statistics_from"], "missing": last["missing"],
                **whose}
    return {"protocol": protocol, "input_moments": job.get("input_moments", False),
            "rounds": history, **whose}


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
    receiver, sender = _PROCESSES.Pipe(duplex=False)
    process = _PROCESSES.Process(target=_child, daemon=True, name=f"{work.__name__[1:]} "
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
    ("failed", message). Its parent is the fork server, which exits with the worker."""
    threading.Thread(target=_exit_with, args=(os.getppid(),), daemon=True).start()
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    progress.listen(_progress_sender(sender))
    try:
        sender.send(("succeeded", work(*args)))
    except FusekitError as exc:
        sender.send(("failed", str(exc)))
    except Exception as exc:  # a bug, not bad input: the traceback goes to the log
        log.exception("%s%s failed", work.__name__[1:], args)
        sender.send(("failed", f"internal error: {type(exc).__name__}: {exc}"))


def _fusion(paths: list[str], method: str, spec: Any, params: dict[str, Any],
            output: str, config: dict[str, Any] | None = None) -> str:
    """Fuse, write ``output``; the report as ``fusekit fuse --json`` prints it. A
    transformer job's ``config`` goes with every client, as it would in its model folder
    (distill runs the clients as transformers models); ``output`` stays the tensors file,
    the job writes the fused config.json beside it."""
    inputs = [load_checkpoint(p) if config is None
              else dataclasses.replace(load_checkpoint(p), config=dict(config)) for p in paths]
    start = time.perf_counter()
    result = fusekit.fuse(inputs, method=method, spec=spec, **params)
    seconds = time.perf_counter() - start
    dataclasses.replace(result, config=None).save(output, force=True)
    return json.dumps(fusion_summary(result, RESULT, seconds), default=rounds.jsonable)


def _calibration(round_: dict[str, Any], model: str, statistics: dict[str, str],
                 targets: dict[str, str], clients: dict[str, str], min_samples: int,
                 output: str) -> str:
    """A round's step (:func:`fusekit.service.rounds.advance`), writing ``output``."""
    return rounds.advance(round_, model, statistics, targets, clients, min_samples, output)


def _progress_sender(sender: Connection):
    """Send the worker a fusion's steps: the first, the last of each kind, and others at most
    every ``PROGRESS_EVERY_S`` (each one is a write of the job's record)."""
    last = -math.inf

    def send(what: str, done: int, total: int) -> None:
        nonlocal last
        now = time.monotonic()
        if done == total or now - last >= PROGRESS_EVERY_S:
            last = now
            sender.send(("progress", _step_text(what, done, total)))

    return send


def _step_text(what: str, done: int, total: int) -> str:
    """A fusion's step as the job's progress shows it ("fusing: layer 2 of 3 matched")."""
    if what == "layers matched":
        return f"fusing: layer {done} of {total} matched"
    return f"fusing: {done} of {total} {what}"


def _link_inputs(store: JobStore, job: dict[str, Any], run: Path, kind: SlotKind,
                 suffix: str, clients: list[str] | None = None) -> dict[str, Path]:
    """The accepted files of ``kind`` of the job's ``clients`` (default all) in ``run``,
    named ``<client>.<suffix>`` (as messages name them), by client in the job's order."""
    paths = {}
    for client in job["clients"]:
        if client not in job.get(kind.record, {}) or client not in (clients or job["clients"]):
            continue
        path = run / f"{client}.{suffix}"
        if not path.exists():  # linked already for an earlier use in this step
            os.link(store.file(job, client, kind), path)
        paths[client] = path
    return paths


def _as_text(paths: dict[str, Path]) -> dict[str, str]:
    return {client: str(path) for client, path in paths.items()}


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
        tries = job.get("step_attempts", job["attempts"])  # a job of an earlier version
        if tries >= settings.max_attempts:
            step = rounds.what_it_asks(job["round"]) if job.get("fused") else "its fusion"
            job.update(state="failed", finished_at=time.time(), progress=None,
                       error=f"{step}: the worker stopped {tries} times while computing it "
                       "(killed or out of memory); not trying again")
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
