"""Jobs on disk: one folder per job, its state in ``job.json``, changed under a file lock.

    <data-dir>/jobs/<id>/job.json                  state, slots, token hashes (the commit point)
    <data-dir>/jobs/<id>/clients/<name>.<sha256>.safetensors   accepted checkpoints
    <data-dir>/jobs/<id>/statistics/<name>.<sha256>.safetensors  accepted statistics files
    <data-dir>/jobs/<id>/targets/<name>.<sha256>.safetensors     accepted targets (REPAIR's)
    <data-dir>/jobs/<id>/uploads/<host>-<pid>/     uploads in flight, per server process
    <data-dir>/jobs/<id>/result.safetensors, report.json       written atomically by the worker
    <data-dir>/jobs/<id>/fused.safetensors         the fused model of a job that calibrates
    <data-dir>/jobs/<id>/config.json               a transformer job's fused config.json
    <data-dir>/jobs/<id>/rounds/round-<k>.safetensors   the model of calibration round k > 1
    <data-dir>/jobs/<id>/heartbeat                 touched by the worker running the job
    <data-dir>/trash/                              deleted jobs, while their files are removed

Every file is written to a temporary name, fsynced and renamed, and ``job.json`` is replaced
last: whatever a crash interrupts, ``job.json`` names only complete files. The lock is
``flock`` on a file in the job's folder, so API servers and workers on several machines can
share the data folder (on a file system with working ``flock``, e.g. NFSv4).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import secrets
import shutil
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fusekit.core.checkpoint import owner_only_umask, write_atomic
from fusekit.service.auth import matches, new_token, token_hash
from fusekit.service.errors import Busy, Conflict, Forbidden, NotFound, ServiceError
from fusekit.protocol import DERIVED, Round
from fusekit.protocol import STATISTICS as STATISTICS_ROUND
from fusekit.service.rounds import what_it_asks
from fusekit.service.states import FINISHED, STATES, job_in_state
from fusekit.toolkit.processes import process_alive

ROUNDS = "rounds"  # the models of calibration rounds after the first
FUSED = "fused.safetensors"  # a calibrating job's fused model; its result is calibrated
_JOB_ID = re.compile(r"[0-9a-f]{32}")
# Letters, digits, '.', '_' and '-', not starting with '.' or '-': no separators, no
# traversal, no control or look-alike characters, safe as a file name everywhere.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_HOST = socket.gethostname()


@dataclass(frozen=True)
class SlotKind:
    """What a client uploads into its slots: ``record`` is the slots' key in ``job.json``,
    ``folder`` where accepted files live, ``states`` the job's states that take them."""

    name: str
    record: str
    folder: str
    states: tuple[str, ...]


CHECKPOINT = SlotKind("checkpoint", "slots", "clients", ("collecting",))
STATISTICS = SlotKind("statistics file", "statistics", "statistics", ("calibrating",))
#: A client's statistics of its own checkpoint: REPAIR's targets for the fused neurons its
#: neurons went into. Taken from its checkpoint's upload until calibration starts.
TARGETS = SlotKind("targets file", "targets", "targets",
                   ("collecting", "queued", "running", "calibrating"))
KINDS = (CHECKPOINT, STATISTICS, TARGETS)


def check_name(name: str, what: str = "client") -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ServiceError(
            f"{what} name {name!r}: expected 1-64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit")
    return name


class JobStore:
    """The jobs of one service, in ``<data_dir>/jobs``."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = Path(data_dir)
        self.root = Path(data_dir) / "jobs"
        self.trash = Path(data_dir) / "trash"
        self.root.mkdir(parents=True, exist_ok=True)
        self.trash.mkdir(exist_ok=True)

    # -- reading -------------------------------------------------------------------------

    def ids(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if _JOB_ID.fullmatch(p.name))

    def folder(self, job_id: str) -> Path:
        folder = self.root / job_id
        if not _JOB_ID.fullmatch(job_id) or not (folder / "job.json").is_file():
            raise NotFound(f"job {job_id!r}: no such job")
        return folder

    def read(self, job_id: str) -> dict[str, Any]:
        try:
            return _upgraded(json.loads((self.folder(job_id) / "job.json").read_text()))
        except FileNotFoundError:  # deleted meanwhile
            raise NotFound(f"job {job_id!r}: no such job") from None

    def file(self, job: dict[str, Any], client: str, kind: SlotKind) -> Path:
        """The client's accepted file of ``kind``."""
        return self.root / job["id"] / kind.folder / job[kind.record][client]["file"]

    # -- changing ------------------------------------------------------------------------

    @contextlib.contextmanager
    def locked(self, job_id: str) -> Iterator[dict[str, Any]]:
        """The job, locked against every other process; saved when the block succeeds."""
        with self._flock(job_id) as folder:
            job = self.read(job_id)
            yield job
            _save(folder, job)

    @contextlib.contextmanager
    def _flock(self, job_id: str) -> Iterator[Path]:
        folder = self.folder(job_id)
        with open(folder / "lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield folder

    def upload_folder(self, job_id: str) -> Path:
        """Where this process receives uploads for the job: one folder per server process,
        so that what a killed one leaves behind is recognised (:meth:`sweep`)."""
        folder = self.folder(job_id) / "uploads" / f"{_HOST}-{os.getpid()}"
        try:
            folder.mkdir(exist_ok=True)
        except FileNotFoundError:  # deleted meanwhile
            raise NotFound(f"job {job_id!r}: no such job") from None
        return folder

    def sweep(self, job_id: str) -> None:
        """Remove what killed processes left in the job's folder: temporary copies of
        ``job.json`` (written only under the lock held here), of the result and report when
        no worker runs the job, and uploads of this machine's dead server processes."""
        with self._flock(job_id) as folder:
            job = self.read(job_id)
            running = job["state"] == "running"
            for tmp in folder.glob(".*.tmp"):
                if not running or tmp.name.startswith(".job.json."):
                    tmp.unlink(missing_ok=True)
            for kind in KINDS:  # replaced (or of a round that is over), then a crash
                named = {slot["file"] for slot in job.get(kind.record, {}).values()}
                for stale in _files(folder / kind.folder):
                    if stale.name not in named:
                        stale.unlink(missing_ok=True)
            if not running:
                shutil.rmtree(folder / "run", ignore_errors=True)
                # The current round's model, while the job calibrates.
                current = "" if job["state"] in FINISHED else (job.get("round") or {}).get(
                    "file", "")
                for model in _files(folder / ROUNDS):  # of rounds that are over
                    if f"{ROUNDS}/{model.name}" != current:
                        model.unlink(missing_ok=True)
        with contextlib.suppress(FileNotFoundError):  # the job deleted meanwhile
            for owner in (folder / "uploads").iterdir():
                host, _, pid = owner.name.rpartition("-")
                if host == _HOST and pid.isdigit() and not process_alive(int(pid)):
                    shutil.rmtree(owner, ignore_errors=True)

    def create(self, *, method: str, params: dict[str, Any], spec: dict[str, Any] | None,
               clients: list[str], max_checkpoint_bytes: int, auto_run: bool,
               max_jobs: int, calibrate: bool = False, min_stats_samples: int = 0,
               protocol: str = "one-pass", input_moments: bool = False,
               config: dict[str, Any] | None = None
               ) -> tuple[dict[str, Any], dict[str, str]]:
        """A new job collecting one checkpoint per client; returns it and the tokens.

        With ``calibrate``, the fused model is calibrated in the rounds of ``protocol``
        (:mod:`fusekit.service.rounds`; ``input_moments``: the first layer from the
        targets' input moments) with statistics files of at least ``min_stats_samples``
        inputs each (the server's minimum when the job was made). ``config``: a
        transformer's config.json, written with the fused widths beside the fused model."""
        for client in clients:
            check_name(client)
        if len(set(clients)) != len(clients):
            raise ServiceError(f"clients: expected distinct names, found {clients}")
        with open(self.root / ".create.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if len(self.ids()) >= max_jobs:
                raise Busy(f"jobs: the service holds {max_jobs} jobs, its limit; delete "
                           "finished ones first", retry_after=30)
            tokens = {client: new_token() for client in clients}
            job = {
                "id": uuid.uuid4().hex, "method": method, "params": params, "spec": spec,
                "state": "collecting", "auto_run": auto_run,
                "max_checkpoint_bytes": max_checkpoint_bytes,
                "calibrate": calibrate, "min_stats_samples": min_stats_samples, "fused": None,
                "protocol": protocol, "input_moments": input_moments, "config": config,
                "round": None, "rounds_done": [],
                "clients": clients, "slots": {}, "statistics": {}, "targets": {},
                "token_hashes": {
                    c: token_hash(t) for c, t in tokens.items()},
                "created_at": time.time(), "queued_at": None, "started_at": None,
                "finished_at": None, "attempts": 0, "progress": None, "error": None,
            }
            staging = self.root / f".new-{job['id']}"
            for sub in ("clients", "statistics", "targets", "uploads"):
                (staging / sub).mkdir(parents=True)
            write_atomic(staging / "job.json", json.dumps(job, indent=1).encode())
            os.rename(staging, self.root / job["id"])  # the job appears whole or not at all
        return job, tokens

    def accept(self, job_id: str, client: str, part: Path, size: int, sha256: str,
               kind: SlotKind = CHECKPOINT, checkpoint: str | None = None,
               round_index: int | None = None) -> dict[str, Any]:
        """Move a complete, validated, fsynced upload into the client's slot of ``kind``
        (targets: validated against the checkpoint of SHA-256 ``checkpoint``; statistics:
        against the job's round ``round_index``, which must still be current). The job is
        queued in the same step when this completes what it waits for: its checkpoints if
        it is ``auto_run``, what its calibration needs (:func:`calibration_ready`)."""
        with self._flock(job_id) as folder:
            job = self.read(job_id)
            check_accepting(job, kind, client)
            if kind is TARGETS:
                _check_targets_checkpoint(job, client, checkpoint)
            if kind is STATISTICS and job["round"]["index"] != round_index:
                raise Conflict(f"client {client!r}: round {round_index} ended while its "
                               f"statistics were checked; the job is in "
                               f"{what_it_asks(job['round'])}")
            slots = job.setdefault(kind.record, {})
            old = slots.get(client)
            name = f"{client}.{sha256}.safetensors"
            (folder / kind.folder).mkdir(exist_ok=True)  # a job of an earlier version
            os.replace(part, folder / kind.folder / name)
            _fsync_dir(folder / kind.folder)
            slots[client] = {"file": name, "size": size, "sha256": sha256,
                             "uploaded_at": time.time()}
            stale = [(kind, old)]
            if kind is TARGETS:
                slots[client]["checkpoint"] = checkpoint
            elif kind is CHECKPOINT and job.get("targets", {}).get(client, {}).get(
                    "checkpoint", sha256) != sha256:  # targets of the replaced checkpoint
                stale.append((TARGETS, job["targets"].pop(client)))
            if (kind is CHECKPOINT and job["auto_run"] and len(slots) == len(job["clients"])
                    or kind is not CHECKPOINT and calibration_ready(job)):
                job.update(state="queued", queued_at=time.time())
            _save(folder, job)
            # Once job.json no longer names them, and still under the lock: released first,
            # a later upload of the same file could be put in place and then removed here.
            for stale_kind, slot in stale:
                if slot and slot["file"] != job[stale_kind.record].get(client, {}).get("file"):
                    (folder / stale_kind.folder / slot["file"]).unlink(missing_ok=True)
        return job

    def queue(self, job_id: str) -> dict[str, Any]:
        """collecting -> queued, once every slot is filled."""
        with self.locked(job_id) as job:
            if job["state"] != "collecting":
                raise Conflict(f"{job_in_state(job_id, job['state'])}; only a collecting job "
                               "can run")
            missing = [c for c in job["clients"] if c not in job["slots"]]
            if missing:
                raise Conflict(f"job {job_id}: no checkpoint yet from {', '.join(missing)}")
            job.update(state="queued", queued_at=time.time())
        return job

    def finish_calibration(self, job_id: str) -> dict[str, Any]:
        """calibrating -> queued: the current round finishes with the statistics received
        so far (at least one: :mod:`fusekit.protocol`'s rule for a client that did not
        answer)."""
        with self.locked(job_id) as job:
            if job["state"] != "calibrating":
                raise Conflict(f"{job_in_state(job_id, job['state'])}; only a calibrating job can "
                               "be calibrated")
            round_ = job["round"]
            if Round.from_dict(round_).asks and not job["statistics"]:
                raise Conflict(f"job {job_id}: is in {what_it_asks(round_)}; no statistics "
                               f"yet from any of its {len(round_['participants'])} clients; "
                               "calibration needs at least one")
            if _uses_targets(job) and not job.get("targets"):
                raise Conflict(f"job {job_id}: no targets yet from any of its clients; "
                               f"{NEEDS_TARGETS}: it needs at least one client's")
            job.update(state="queued", queued_at=time.time())
        return job

    def delete(self, job_id: str) -> None:
        """Cancel the job (a worker running it drops its result) and remove its files."""
        with self.locked(job_id) as job:
            if job["state"] not in FINISHED:
                job.update(state="cancelled", finished_at=time.time())
        grave = self.trash / f"{job_id}.{secrets.token_hex(4)}"
        try:
            os.rename(self.root / job_id, grave)  # gone at once for readers
        except FileNotFoundError:
            raise NotFound(f"job {job_id!r}: no such job") from None
        shutil.rmtree(grave, ignore_errors=True)

    def empty_trash(self) -> None:
        """Finish removing what a process killed during :meth:`delete` left."""
        for grave in self.trash.iterdir():
            shutil.rmtree(grave, ignore_errors=True)

    # -- what workers do -----------------------------------------------------------------

    def claim(self, job_id: str) -> dict[str, Any] | None:
        """queued -> running for this worker; None when the job is not queued (done,
        cancelled, deleted, or claimed by another worker)."""
        try:
            with self.locked(job_id) as job:
                if job["state"] != "queued":
                    return None
                self.beat(job_id)
                job.update(state="running", started_at=time.time(), progress="starting",
                           attempts=job["attempts"] + 1, error=None,
                           step_attempts=job.get("step_attempts", 0) + 1)
            return job
        except NotFound:
            return None

    def beat(self, job_id: str) -> None:
        (self.root / job_id / "heartbeat").touch()

    def silent_for(self, job_id: str) -> float:
        """Seconds since the worker running the job last signalled."""
        try:
            return time.time() - (self.root / job_id / "heartbeat").stat().st_mtime
        except FileNotFoundError:
            return float("inf")

    def runs(self, job_id: str, attempt: int) -> bool:
        """Whether the job is still running this attempt (not cancelled, deleted, re-run)."""
        try:
            return _runs(self.read(job_id), attempt)
        except NotFound:
            return False

    def conclude(self, job_id: str, attempt: int, **changes: Any) -> dict[str, Any] | None:
        """A worker's step's outcome for the job, if it is still this attempt's (None when
        not). A job entering a round that has all it waits for already (the first layer
        from targets that are in) stays running, for the same worker's next step: decided
        under the lock, so that an upload meanwhile cannot leave it waiting for nothing."""
        try:
            with self.locked(job_id) as job:
                if not _runs(job, attempt):
                    return None
                job.update(changes)
                if "round" in changes:  # a step begins: its own attempts (none yet)
                    job["step_attempts"] = 0
                if calibration_ready(job):  # ... or this one, the worker's next step
                    job.update(state="running", progress="starting the next round",
                               step_attempts=1)
            return job
        except NotFound:
            return None

    def update(self, job_id: str, attempt: int, **changes: Any) -> bool:
        """Change a running job, if it is still this attempt's (not cancelled or re-run)."""
        try:
            with self.locked(job_id) as job:
                if not _runs(job, attempt):
                    return False
                job.update(changes)
            return True
        except NotFound:
            return False


def _upgraded(job: dict[str, Any]) -> dict[str, Any]:
    """A job of an earlier version, fused before jobs had rounds: its one-pass round."""
    fused = job.get("fused")
    if fused is None or job.get("round") is not None:
        return job
    step = {"kind": STATISTICS_ROUND, "layers": None, "mode": fused.get("mode", "batch")}
    job.update(protocol="one-pass", plan=[step], rounds_done=[], round={
        **step, "index": 1, "total": 1, "model": fused["model"], "file": FUSED,
        "sha256": fused["sha256"], "size": fused["size"], "points": fused["points"],
        "max_bytes": fused["max_statistics_bytes"], "participants": list(job["clients"])})
    return job


def _runs(job: dict[str, Any], attempt: int) -> bool:
    return job["state"] == "running" and job["attempts"] == attempt


#: Why a fused model without BatchNorm (or a transformer) waits for targets.
NEEDS_TARGETS = ("its fused model has no BatchNorm to restore, so calibration renormalises "
                 "each fused neuron towards the clients' statistics of their own models "
                 "(targets: fusekit stats OWN.safetensors ..., then fusekit submit)")


def check_accepting(job: dict[str, Any], kind: SlotKind, client: str | None = None) -> None:
    """Refuse an upload of ``kind`` the job does not take now (from ``client``)."""
    if kind is not CHECKPOINT and not job.get("calibrate"):
        raise Conflict(f"job {job['id']}: was not created to calibrate; it takes no "
                       f"{kind.name}s")
    if job["state"] not in kind.states:
        raise Conflict(f"{job_in_state(job['id'], job['state'])}; {kind.name} uploads are "
                       f"accepted only while it is {' or '.join(kind.states)}")
    if kind is TARGETS and job.get("fused") and (
            job["state"] != "calibrating" or job["round"]["index"] > 1):
        raise Conflict(f"job {job['id']}: its calibration has started; targets are accepted "
                       "until it starts")
    if kind is STATISTICS:
        round_ = job["round"]
        if not Round.from_dict(round_).asks:
            raise Conflict(f"job {job['id']}: is in {what_it_asks(round_)}")
        if client is not None and client not in round_["participants"]:
            raise Conflict(f"client {client!r}: takes no part in the job's rounds since its "
                           "alignment round, which finished without its statistics")


def _check_targets_checkpoint(job: dict[str, Any], client: str, checkpoint: str | None
                              ) -> None:
    """Targets are accepted only for the checkpoint the client's slot holds now."""
    held = job["slots"].get(client, {}).get("sha256")
    if held is None or held != checkpoint:
        raise Conflict(f"client {client!r}: its checkpoint was replaced while its targets "
                       "were checked; compute them of the checkpoint it submitted last")


def calibration_ready(job: dict[str, Any]) -> bool:
    """Whether a calibrating job's round has all it waits for: every participant's
    statistics (a round that asks for them), and every client's targets where the round
    uses them (:data:`NEEDS_TARGETS`, input moments)."""
    return job["state"] == "calibrating" and not any(waiting_for(job).values())


def _missing(job: dict[str, Any], kind: SlotKind) -> list[str]:
    """The clients of the current round without a file of ``kind``."""
    held = job.get(kind.record, {})
    who = job["round"]["participants"] if kind is STATISTICS else job["clients"]
    return [c for c in who if c not in held]


def _uses_targets(job: dict[str, Any]) -> bool:
    """Whether the current round waits for the clients' targets: the first round, taking
    them (they are fixed from its end on), where calibration is REPAIR's (a fused model
    without BatchNorm) or the first layer comes from their input moments."""
    round_ = job["round"]
    return round_["index"] == 1 and (round_["kind"] == DERIVED or (
        round_["kind"] == STATISTICS_ROUND and bool(job["fused"].get("needs_targets"))))


def fused_model(job: dict[str, Any]) -> dict[str, Any] | None:
    """What anyone with a token of a job that calibrates may know of its fused model (once
    fused): size, SHA-256, content hash (which statistics files must name), when."""
    fused = job.get("fused")
    if fused is None:
        return None
    return {k: fused.get(k) for k in ("size", "sha256", "model", "fused_at", "needs_targets",
                                      "mode", "config")}


def round_view(job: dict[str, Any], client: str | None = None) -> dict[str, Any] | None:
    """What anyone with a token of the job may know of its current round: which of how
    many, what it asks for (kind, layers, mode, one line), the model to run (content hash,
    SHA-256); who takes part (to a client: whether it does)."""
    round_ = job.get("round")
    if round_ is None:
        return None
    shown = {k: round_.get(k) for k in ("index", "total", "kind", "layers", "layer", "mode",
                                        "model", "sha256", "size")}
    who = ({"participants": round_["participants"]} if client is None
           else {"taking_part": client in round_["participants"]})
    return {**shown, **who, "asks": what_it_asks(round_)}


def view(job: dict[str, Any], client: str | None = None) -> dict[str, Any]:
    """What GET /v1/jobs/{id} shows: all of it to the admin; to a client, the job's state
    and its own slots only."""
    public = {k: job[k] for k in ("id", "method", "state", "progress", "created_at",
                                  "queued_at", "started_at", "finished_at")}
    calibrate = job.get("calibrate", False)
    public.update(calibrate=calibrate, fused=fused_model(job),
                  config=job.get("config") is not None)
    if calibrate:
        public.update(protocol=job.get("protocol", "one-pass"),
                      input_moments=job.get("input_moments", False),
                      round=round_view(job, client))
    slots = {c: _slot(job["slots"].get(c)) for c in job["clients"]}
    statistics = {c: _slot(job.get("statistics", {}).get(c)) for c in job["clients"]}
    targets = {c: _slot(job.get("targets", {}).get(c)) for c in job["clients"]}
    if client is not None:
        mine = {"statistics": statistics[client],
                "targets": targets[client]} if calibrate else {}
        return {**public, "client": client, "slot": slots[client], **mine}
    received = {"statistics": statistics, "targets": targets,
                "min_stats_samples": job["min_stats_samples"],
                "rounds_done": job.get("rounds_done", []),
                "waiting_for": waiting_for(job)} if calibrate else {}
    return {**public, "params": job["params"], "auto_run": job["auto_run"],
            "max_checkpoint_bytes": job["max_checkpoint_bytes"], "attempts": job["attempts"],
            "step_attempts": job.get("step_attempts", 0), "error": job["error"], "slots": slots, **received}


def waiting_for(job: dict[str, Any]) -> dict[str, list[str]] | None:
    """What a calibrating job waits for before it calibrates by itself: the clients whose
    statistics are missing, and whose targets, when its fused model needs them."""
    if job["state"] != "calibrating":
        return None
    asks = Round.from_dict(job["round"]).asks
    missing = {"statistics": _missing(job, STATISTICS) if asks else []}
    if _uses_targets(job):
        missing["targets"] = _missing(job, TARGETS)
    return missing


def _slot(slot: dict[str, Any] | None) -> dict[str, Any]:
    if slot is None:
        return {"filled": False}
    return {"filled": True, "size": slot["size"], "sha256": slot["sha256"],
            "uploaded_at": slot["uploaded_at"]}


def authorize(job: dict[str, Any], token: str, admin: bool, client: str | None = None
              ) -> str | None:
    """Who the token is for this job: None for the admin, else the client's name.

    With ``client``, the token must be the admin's or that client's own."""
    if admin:
        return None
    owner = next((c for c, h in job["token_hashes"].items() if matches(token, h)), None)
    if owner is None:
        raise Forbidden(f"job {job['id']}: the token is neither the admin's nor one of this "
                        "job's client tokens")
    if client is not None and owner != client:
        raise Forbidden(f"client {owner!r}: its token cannot act for client {client!r}")
    return owner


def make_private(data_dir: Path) -> None:
    """The data folder and all in it readable by the service's user only: what this process
    creates from now on (0700 folders, 0600 files: umask 077), and what is already there
    (clients' checkpoints, results, job records)."""
    owner_only_umask()
    data_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(data_dir, 0o700)
    for folder, subfolders, files in os.walk(data_dir):
        for name in subfolders:
            _chmod(Path(folder) / name, 0o700)
        for name in files:
            _chmod(Path(folder) / name, 0o600)


def _chmod(path: Path, mode: int) -> None:
    with contextlib.suppress(FileNotFoundError):  # removed meanwhile (a finished upload)
        if not path.is_symlink():
            os.chmod(path, mode)


def _save(folder: Path, job: dict[str, Any]) -> None:
    """Replace ``job.json``: the commit point of every change (under the job's lock)."""
    write_atomic(folder / "job.json", json.dumps(job, indent=1).encode())


def without_paths(text: str, data_dir: Path) -> str:
    """``text`` with every path in the service's data folder reduced to its file name: a
    message names a client's file as ``fusekit fuse`` run in its folder would, and never
    shows where the server keeps it."""
    pattern = re.escape(str(data_dir)) + r"[^\s'\"]*"
    return re.sub(pattern, lambda match: os.path.basename(match.group()), text)


def _files(folder: Path) -> list[Path]:
    """The files in ``folder``; none when it does not exist (a job of an earlier version)."""
    try:
        return list(folder.iterdir())
    except FileNotFoundError:
        return []


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
