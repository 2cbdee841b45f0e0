"""``fusekit.client``: talk to a fusekit service from Python (needs the ``serve`` extra).

    >>> from fusekit.client import Client
    >>> admin = Client("http://127.0.0.1:8420", token=admin_token)
    >>> job = admin.create_job("pfnm", ["a", "b"], params={"sigma": 1.0})
    >>> Client(url, token=job["tokens"]["a"]).submit(job["id"], "a", "a.safetensors")
    >>> admin.run(job["id"]); admin.wait(job["id"]); admin.result(job["id"], "fused.safetensors")

A job created with ``calibrate=True`` stops after fusion in the ``calibrating`` state: each
client downloads the fused model with its own token, computes its statistics of it on its
own data (``fusekit stats FUSED --mode batch``), and uploads them; the service calibrates
once every client's are in (or when the admin calls :meth:`Client.calibrate`):

    >>> me = Client(url, token=job["tokens"]["a"])
    >>> me.wait(job["id"]); me.fused(job["id"], "fused.safetensors")
    >>> me.submit_statistics(job["id"], "a", "a.stats.safetensors")

A job's calibration may run in several rounds (``protocol="layerwise"``, ``"align"``):
each round asks every client for one file computed on the round's model (the job's
``round`` says what); :meth:`Client.take_part` does every round for a client, whatever
the protocol (download the round's model, compute what the round asks on the client's
own inputs, upload), until the job has finished:

    >>> me.take_part(job["id"], "a", "a.safetensors", x_train, "work/")

Submitting is resumable: a submit first asks the service which file the slot holds, and a
file whose SHA-256 is already accepted there is not sent again (so re-running an interrupted
or repeated submit costs one request); an interrupted transfer is sent again from its start
(the server keeps nothing of a partial upload), up to ``retries`` times.

A busy service (HTTP 429 or 503) is asked again, every request, after the ``Retry-After`` it
names or an exponential backoff with jitter, whichever is longer, until ``busy_timeout``
seconds have passed; each wait is told to ``on_retry`` (a progress line), or else logged.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import random
import ssl
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx

from fusekit.core import metadata as meta
from fusekit.core.checkpoint import load_checkpoint, private_files, with_preprocess
from fusekit.core.errors import FusekitError, StatisticsError
from fusekit.core.stats import load_statistics
from fusekit.service.states import FINISHED, job_in_state

log = logging.getLogger(__name__)

CHUNK = 1024 * 1024
#: Where :meth:`Client.wait` stops: the job has finished, or waits for its clients'
#: statistics of its fused model.
WAITING_ON_CLIENTS = "calibrating"
BUSY = (429, 503)
CONFLICT = 409  # the job is not in the state (or round) the request was for  # the service asks to be asked again later
MAX_BACKOFF_S = 30.0
T = TypeVar("T")


@functools.cache
def tls_context() -> ssl.SSLContext:
    """The certificates every :class:`Client` of this process verifies a server with:
    those httpx would load (certifi's, or ``SSL_CERT_FILE`` / ``SSL_CERT_DIR``), loaded
    once. httpx loads them again for each client it makes, 35 ms of CPU: more than most
    requests to a service, and a client is made per command, per thread, per upload."""
    return httpx.create_ssl_context()


class ServiceError(FusekitError):
    """The service refused a request; ``status`` is the HTTP status, the message its reason."""

    def __init__(self, status: int, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status, self.retry_after = status, retry_after


class Unreachable(ServiceError):
    """The service did not answer (refused, reset, timed out); ``status`` is 0."""

    def __init__(self, url: str, exc: httpx.TransportError) -> None:
        super().__init__(0, f"{url}: cannot reach the fusekit service "
                         f"({type(exc).__name__}: {exc or 'no answer'})")


class Client:
    """One service, one token (the admin's or a client's)."""

    def __init__(self, url: str, token: str, *, timeout: float = 60.0, retries: int = 3,
                 busy_timeout: float = 600.0,
                 on_retry: Callable[[str], None] | None = None) -> None:
        self.url = url.rstrip("/")
        self.retries, self.busy_timeout, self.on_retry = retries, busy_timeout, on_retry
        self._http = httpx.Client(base_url=self.url, timeout=timeout, verify=tls_context(),
                                  headers={"Authorization": f"Bearer {token}"})

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- admin ---------------------------------------------------------------------------

    def create_job(self, method: str, clients: list[str], *, params: dict[str, Any] | None = None,
                   max_checkpoint_bytes: int | None = None, auto_run: bool = False,
                   spec: dict[str, Any] | None = None, calibrate: bool = False,
                   protocol: str = "one-pass", input_moments: bool = False,
                   config: dict[str, Any] | None = None) -> dict[str, Any]:
        """A new job; returns ``{"id": ..., "tokens": {client: token}}`` (tokens shown once).

        With ``calibrate``, the fused model is calibrated with the clients' statistics
        before it becomes the result, in the rounds of ``protocol`` (``one-pass``,
        ``layerwise``, ``align``; ``input_moments``: layerwise without the first layer's
        round), module docstring. ``config``: a transformer's config.json, so that the
        fused model and the result come as model folders its clients can run."""
        body = {"method": method, "clients": clients, "params": params or {},
                "auto_run": auto_run, "spec": spec, "calibrate": calibrate,
                "protocol": protocol, "input_moments": input_moments, "config": config}
        if max_checkpoint_bytes is not None:
            body["max_checkpoint_bytes"] = max_checkpoint_bytes
        return self._json("POST", "/v1/jobs", json=body)

    def jobs(self) -> list[dict[str, Any]]:
        """Every job, newest first: id, state, method, progress, clients, checkpoints and
        statistics received, created and finished times (the admin's)."""
        return self._json("GET", "/v1/jobs")["jobs"]

    def run(self, job: str) -> dict[str, Any]:
        return self._json("POST", f"/v1/jobs/{job}/run")

    def result(self, job: str, output: str | os.PathLike[str]) -> Path:
        """Download the fused (for a job that calibrates: calibrated) checkpoint to
        ``output`` (atomically; validated on arrival); a model folder (config.json,
        model.safetensors) for a job with a transformer's config."""
        return self._download(job, "result", output)

    def calibrate(self, job: str) -> dict[str, Any]:
        """Calibrate a calibrating job now, with the statistics received so far."""
        return self._json("POST", f"/v1/jobs/{job}/calibrate")

    def report(self, job: str) -> dict[str, Any]:
        return self._json("GET", f"/v1/jobs/{job}/report")

    def delete(self, job: str) -> dict[str, Any]:
        return self._json("DELETE", f"/v1/jobs/{job}")

    # -- everyone ------------------------------------------------------------------------

    def status(self, job: str) -> dict[str, Any]:
        return self._json("GET", f"/v1/jobs/{job}")

    def wait(self, job: str, timeout: float = 3600.0, every: float = 0.5) -> dict[str, Any]:
        """Poll until the job has succeeded, failed or been cancelled, or waits for its
        clients' statistics (``calibrating``), at most ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.status(job)
            if state["state"] in (*FINISHED, WAITING_ON_CLIENTS):
                return state
            _check_time(job, state, deadline, timeout)
            time.sleep(every)

    def submit(self, job: str, client: str, path: str | os.PathLike[str],
               progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
        """Upload ``path`` into ``client``'s slot; a no-op when the slot already holds it.

        ``progress(sent, total)`` is called as bytes go out. Returns the slot's state.
        """
        load_checkpoint(path)  # refuse locally what the server would refuse
        return self._upload(job, client, Path(path), "checkpoint", progress)

    def fused(self, job: str, output: str | os.PathLike[str]) -> Path:
        """Download the job's fused model to ``output`` (a model folder for a job with a
        transformer's config): a job that calibrates, its model before calibration; any
        other job, its result once it has succeeded. Its clients' tokens can."""
        return self._download(job, "fused", output)

    def model(self, job: str, output: str | os.PathLike[str]) -> Path:
        """Download the model of the job's current calibration round to ``output`` (a
        model folder for a job with a transformer's config): the model each client
        computes the round's statistics of (the fused model in the first round)."""
        return self._download(job, "model", output)

    def submit_statistics(self, job: str, client: str, path: str | os.PathLike[str],
                          progress: Callable[[int, int], None] | None = None,
                          round: int | None = None) -> dict[str, Any]:
        """Upload a file for the job's current round (statistics, cross or refit
        statistics of the round's model) into ``client``'s statistics slot, as
        :meth:`submit` uploads a checkpoint (resumable, a no-op when held). With
        ``round``, the round it was computed for: refused at once if that is over."""
        statistics_kind(path)  # refuse locally what is no statistics file
        return self._upload(job, client, Path(path), "statistics", progress,
                            {} if round is None else {"round": round})

    def submit_targets(self, job: str, client: str, path: str | os.PathLike[str],
                       progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
        """Upload the client's statistics of its own checkpoint (``fusekit stats OWN``) into
        its targets slot: REPAIR's targets for the layers of the fused model without
        BatchNorm. Accepted from the checkpoint's upload until calibration starts."""
        load_statistics(path, min_samples=1)
        return self._upload(job, client, Path(path), "targets", progress)

    def submit_any_statistics(self, job: str, client: str, path: str | os.PathLike[str],
                              progress: Callable[[int, int], None] | None = None
                              ) -> tuple[str, dict[str, Any]]:
        """Upload a statistics file where it belongs: into the statistics slot when it
        names the job's fused model, else into the targets slot (statistics of the
        client's own checkpoint). Returns the slot's kind and state."""
        if statistics_kind(path) != meta.STATS:  # cross or refit statistics: a round's
            return "statistics", self.submit_statistics(job, client, path, progress)
        model = load_statistics(path, min_samples=1).model
        round_ = self.status(job).get("round") or {}
        kind = "statistics" if model == round_.get("model") else "targets"
        return kind, self._upload(job, client, Path(path), kind, progress)

    def contribute(self, job: str, client: str, own: str | os.PathLike[str], inputs: Any,
                   folder: str | os.PathLike[str], *, batch_size: int = 1024,
                   device: str = "cpu", normalization: meta.Normalization | None = None
                   ) -> dict[str, Any]:
        """The client's part of the job's current round, whatever it asks: its targets
        (statistics of its ``own`` checkpoint, with input moments where the job uses
        them) while the job takes them and needs them, then the round's model downloaded
        into ``folder``, the round's statistics of it computed on ``inputs`` (its own
        data; with ``own`` for an alignment or refit round) and uploaded. Returns the
        job's status as this client saw it.

        ``inputs`` are used as stored; each model normalises them as its checkpoint
        records (``fusekit.preprocess``), or as ``normalization`` says of models that
        record none (``fusekit stats --normalize``; one recording another is refused)."""
        folder = Path(folder)
        state = self.status(job)
        round_ = state.get("round")
        if state["state"] != WAITING_ON_CLIENTS or round_ is None:
            raise ServiceError(409, f"{job_in_state(job, state['state'])}; a client "
                               "contributes to a calibrating job's rounds")
        with private_files():
            folder.mkdir(parents=True, exist_ok=True)
            if _wants_targets(state):
                targets = folder / f"{client}.targets.safetensors"
                _compute(round_, None, own, inputs, targets, batch_size, device,
                         normalization, input_moments=state.get("input_moments", False))
                self.submit_targets(job, client, targets)
            if round_["kind"] == "derived" or state["statistics"]["filled"]:
                return state
            model = self.model(job, folder / f"round-{round_['index']}.safetensors")
            stats = folder / f"{client}.round-{round_['index']}.stats.safetensors"
            _compute(round_, model, own, inputs, stats, batch_size, device, normalization)
            self.submit_statistics(job, client, stats, round=round_["index"])
        return state

    def take_part(self, job: str, client: str, own: str | os.PathLike[str], inputs: Any,
                  folder: str | os.PathLike[str], *, timeout: float = 3600.0,
                  every: float = 0.5, batch_size: int = 1024, device: str = "cpu",
                  normalization: meta.Normalization | None = None,
                  on_round: Callable[[str], None] | None = None) -> dict[str, Any]:
        """:meth:`contribute` to every round of the job that asks this client for something,
        until the job has finished (at most ``timeout`` seconds), ``normalization`` as
        there. ``on_round`` is told, in one line, what each round asked. Returns the job's
        last status."""
        deadline, done = time.monotonic() + timeout, None
        while True:
            state = self.status(job)
            if state["state"] in FINISHED:
                return state
            round_ = state.get("round")
            if state["state"] == WAITING_ON_CLIENTS and round_["index"] != done:
                if round_.get("taking_part", client in round_.get("participants", ())):
                    if on_round is not None:
                        on_round(round_["asks"])
                    try:
                        self.contribute(job, client, own, inputs, folder,
                                        batch_size=batch_size, device=device,
                                        normalization=normalization)
                    except ServiceError as exc:  # the round ended meanwhile: the next one
                        if exc.status != CONFLICT:
                            raise
                        self._tell(str(exc))
                done = round_["index"]
            _check_time(job, state, deadline, timeout)
            time.sleep(every)

    def _upload(self, job: str, client: str, path: Path, kind: str,
                progress: Callable[[int, int], None] | None,
                query: dict[str, Any] | None = None) -> dict[str, Any]:
        """PUT ``path`` to the client's ``kind`` (checkpoint, statistics, targets) unless
        held."""
        size, digest = path.stat().st_size, _sha256(path)

        def attempt() -> dict[str, Any]:
            slot = self._slot(job, client, kind)
            if slot.get("sha256") == digest:
                if progress:
                    progress(size, size)
                return slot
            return self._json_once(
                "PUT", f"/v1/jobs/{job}/clients/{client}/{kind}", params=query or None,
                content=_chunks(path, size, progress),
                headers={"Content-Length": str(size),
                         "Content-Type": "application/octet-stream"})

        return self._patiently(f"client {client}: submit", attempt, unreachable=self.retries)

    def _slot(self, job: str, client: str, kind: str) -> dict[str, Any]:
        """The client's slot of ``kind`` as the job's status shows it to this token."""
        state = self._json_once("GET", f"/v1/jobs/{job}")
        if "client" in state:  # a client's view: its own slots
            return state["slot"] if kind == "checkpoint" else state.get(kind, {})
        return state.get("slots" if kind == "checkpoint" else kind, {}).get(client, {})

    def _download(self, job: str, which: str, output: str | os.PathLike[str]) -> Path:
        """The job's ``which`` model (result, fused, model) at ``output``: a file, or, for a
        job with a transformer's config, a model folder (config.json, model.safetensors)."""
        output = Path(output)
        config = self.status(job).get("config")
        weights = output / "model.safetensors" if config else output
        if config:
            output.mkdir(exist_ok=True)
        with self._reaching(), self._http.stream("GET", f"/v1/jobs/{job}/{which}") as response:
            _raise_for(response)
            with _atomic_file(weights) as f:
                for chunk in response.iter_bytes(CHUNK):
                    f.write(chunk)
        if config:
            with self._reaching():
                response = self._http.get(f"/v1/jobs/{job}/config")
            _raise_for(response)
            with _atomic_file(output / "config.json") as f:
                f.write(response.content)
        load_checkpoint(output)
        return output

    def _json(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        return self._patiently(f"{method} {path}",
                               lambda: self._json_once(method, path, **kwargs))

    def _json_once(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        with self._reaching():
            response = self._http.request(method, path, **kwargs)
        _raise_for(response)
        return response.json()

    def _patiently(self, what: str, call: Callable[[], T], unreachable: int = 0) -> T:
        """``call()``, again while the service is busy (until ``busy_timeout``) or, up to
        ``unreachable`` times, while it does not answer."""
        deadline = time.monotonic() + self.busy_timeout
        busy = lost = 0
        while True:
            try:
                return call()
            except Unreachable:
                if lost == unreachable:
                    raise
                delay, lost = min(2.0**lost, 10.0), lost + 1
                reason = "the service does not answer"
            except ServiceError as exc:
                delay = backoff(busy, exc.retry_after)
                if exc.status not in BUSY or time.monotonic() + delay > deadline:
                    raise
                busy += 1
                reason = f"the service is busy (HTTP {exc.status})"
            self._tell(f"{what}: {reason}; trying again in {delay:.1f} s")
            time.sleep(delay)

    def _tell(self, line: str) -> None:
        """A wait's line, to ``on_retry`` where given (a front door's progress line), else
        to the log: once, not both."""
        if self.on_retry is not None:
            self.on_retry(line)
        else:
            log.info("%s", line)

    @contextlib.contextmanager
    def _reaching(self) -> Iterator[None]:
        try:
            yield
        except httpx.TransportError as exc:
            raise Unreachable(self.url, exc) from None


def statistics_kind(path: str | os.PathLike[str]) -> str:
    """Which statistics ``path`` holds (the metadata key: statistics, cross or refit
    statistics), refusing in one line a file that holds none."""
    metadata = load_checkpoint(path).metadata
    for key in (meta.STATS, meta.CROSS_STATS, meta.REFIT_STATS):
        if key in metadata:
            return key
    raise StatisticsError(f"{path}: not a statistics file (no {meta.STATS}, "
                          f"{meta.CROSS_STATS} or {meta.REFIT_STATS} metadata; write one with "
                          "`fusekit stats`)")


def _wants_targets(state: dict[str, Any]) -> bool:
    """Whether the job, as a client sees it, still takes and needs this client's targets:
    in its first round, where calibration is REPAIR's or uses input moments."""
    round_, fused = state["round"], state.get("fused") or {}
    return (round_["index"] == 1 and not state["targets"]["filled"]
            and (fused.get("needs_targets") or round_["kind"] == "derived"))


def _compute(round_: dict[str, Any], model: Path | None, own: str | os.PathLike[str],
             inputs: Any, output: Path, batch_size: int, device: str,
             normalization: meta.Normalization | None, *, input_moments: bool = False) -> Path:
    """What the round asks of this client, written to ``output``; without ``model``, its
    targets (statistics of its ``own`` model). Both models see ``inputs`` normalised as
    they record, or as ``normalization`` says."""
    from fusekit.core.cross_stats import save_cross_statistics, save_refit_statistics
    from fusekit.core.stats import save_statistics
    from fusekit.toolkit.alignment import cross_statistics, refit_statistics
    from fusekit.toolkit.calibration import client_statistics

    options = {"batch_size": batch_size, "device": device}
    if normalization is not None:  # the file untouched: its copy recording it
        own = with_preprocess(load_checkpoint(own), normalization)
        if model is not None:
            model = with_preprocess(load_checkpoint(model), normalization)
    if model is None:
        return save_statistics(output, client_statistics(
            own, inputs, input_moments=input_moments, **options), force=True)
    if round_["kind"] == "cross":
        return save_cross_statistics(output, cross_statistics(model, own, inputs, **options),
                                     force=True)
    if round_["kind"] == "refit":
        return save_refit_statistics(output, refit_statistics(
            model, own, inputs, round_["layer"], **options), force=True)
    return save_statistics(output, client_statistics(model, inputs, mode=round_["mode"],
                                                     **options), force=True)


def _check_time(job: str, state: dict[str, Any], deadline: float, timeout: float) -> None:
    if time.monotonic() > deadline:
        raise TimeoutError(f"job {job}: still {state['state']} after {timeout} s")


def backoff(attempt: int, retry_after: float | None) -> float:
    """Seconds to wait before busy try ``attempt`` + 1: exponential (1, 2, 4 ... at most
    ``MAX_BACKOFF_S``) with jitter (50-100%), so that clients refused together do not come
    back together; never less than the service's ``Retry-After``."""
    exponential = min(2.0**attempt, MAX_BACKOFF_S) * random.uniform(0.5, 1.0)
    return max(exponential, retry_after or 0.0)


def _raise_for(response: httpx.Response) -> None:
    if response.is_success:
        return
    response.read()
    try:
        message = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        message = response.text.strip() or response.reason_phrase
    raise ServiceError(response.status_code, f"{message} (HTTP {response.status_code})",
                       retry_after=_seconds(response.headers.get("Retry-After")))


def _seconds(retry_after: str | None) -> float | None:
    """A ``Retry-After`` of seconds (an HTTP date, which fusekit never sends, is ignored)."""
    try:
        return min(float(retry_after), MAX_BACKOFF_S) if retry_after else None
    except ValueError:
        return None


def _chunks(path: Path, size: int, progress: Callable[[int, int], None] | None
            ) -> Iterator[bytes]:
    sent = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            sent += len(chunk)
            yield chunk
            if progress:
                progress(sent, size)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


@contextlib.contextmanager
def _atomic_file(path: Path) -> Iterator[Any]:
    """A file streamed to a temporary name beside ``path``, fsynced and renamed on success."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
