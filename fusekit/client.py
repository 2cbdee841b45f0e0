"""``fusekit.client``: talk to a fusekit service from Python (needs the ``serve`` extra).

    >>> from fusekit.client import Client
    >>> admin = Client("http://127.0.0.1:8420", token=admin_token)
    >>> job = admin.create_job("pfnm", ["a", "b"], params={"sigma": 1.0})
    >>> Client(url, token=job["tokens"]["a"]).submit(job["id"], "a", "a.safetensors")
    >>> admin.run(job["id"]); admin.wait(job["id"]); admin.result(job["id"], "fused.safetensors")

Submitting is resumable: a submit first asks the service which file the slot holds, and a
file whose SHA-256 is already accepted there is not sent again (so re-running an interrupted
or repeated submit costs one request); an interrupted transfer is sent again from its start
(the server keeps nothing of a partial upload), up to ``retries`` times.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from fusekit.core.checkpoint import load_checkpoint
from fusekit.core.errors import FusekitError

CHUNK = 1024 * 1024
FINISHED = ("succeeded", "failed", "cancelled")


class ServiceError(FusekitError):
    """The service refused a request; ``status`` is the HTTP status, the message its reason."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Unreachable(ServiceError):
    """The service did not answer (refused, reset, timed out); ``status`` is 0."""

    def __init__(self, url: str, exc: httpx.TransportError) -> None:
        super().__init__(0, f"{url}: cannot reach the fusekit service "
                         f"({type(exc).__name__}: {exc or 'no answer'})")


class Client:
    """One service, one token (the admin's or a client's)."""

    def __init__(self, url: str, token: str, *, timeout: float = 60.0, retries: int = 3) -> None:
        self.url = url.rstrip("/")
        self.retries = retries
        self._http = httpx.Client(base_url=self.url, timeout=timeout,
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
                   spec: dict[str, Any] | None = None) -> dict[str, Any]:
        """A new job; returns ``{"id": ..., "tokens": {client: token}}`` (tokens shown once)."""
        body = {"method": method, "clients": clients, "params": params or {},
                "auto_run": auto_run, "spec": spec}
        if max_checkpoint_bytes is not None:
            body["max_checkpoint_bytes"] = max_checkpoint_bytes
        return self._json("POST", "/v1/jobs", json=body)

    def run(self, job: str) -> dict[str, Any]:
        return self._json("POST", f"/v1/jobs/{job}/run")

    def result(self, job: str, output: str | os.PathLike[str]) -> Path:
        """Download the fused checkpoint to ``output`` (atomically; validated on arrival)."""
        output = Path(output)
        with self._reaching(), self._http.stream("GET", f"/v1/jobs/{job}/result") as response:
            _raise_for(response)
            with _atomic_file(output) as f:
                for chunk in response.iter_bytes(CHUNK):
                    f.write(chunk)
        load_checkpoint(output)
        return output

    def report(self, job: str) -> dict[str, Any]:
        return self._json("GET", f"/v1/jobs/{job}/report")

    def delete(self, job: str) -> dict[str, Any]:
        return self._json("DELETE", f"/v1/jobs/{job}")

    # -- everyone ------------------------------------------------------------------------

    def status(self, job: str) -> dict[str, Any]:
        return self._json("GET", f"/v1/jobs/{job}")

    def wait(self, job: str, timeout: float = 3600.0, every: float = 0.5) -> dict[str, Any]:
        """Poll until the job has succeeded, failed or been cancelled (at most ``timeout``)."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.status(job)
            if state["state"] in FINISHED:
                return state
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job}: still {state['state']} after {timeout} s")
            time.sleep(every)

    def submit(self, job: str, client: str, path: str | os.PathLike[str],
               progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
        """Upload ``path`` into ``client``'s slot; a no-op when the slot already holds it.

        ``progress(sent, total)`` is called as bytes go out. Returns the slot's state.
        """
        path = Path(path)
        load_checkpoint(path)  # refuse locally what the server would refuse
        size, digest = path.stat().st_size, _sha256(path)
        for attempt in range(self.retries + 1):
            try:
                slot = self._slot(job, client)
                if slot.get("sha256") == digest:
                    if progress:
                        progress(size, size)
                    return slot
                return self._json(
                    "PUT", f"/v1/jobs/{job}/clients/{client}/checkpoint",
                    content=_chunks(path, size, progress),
                    headers={"Content-Length": str(size),
                             "Content-Type": "application/octet-stream"})
            except Unreachable:
                if attempt == self.retries:
                    raise
                time.sleep(min(2.0**attempt, 10.0))
        raise AssertionError("unreachable")

    def _slot(self, job: str, client: str) -> dict[str, Any]:
        state = self.status(job)
        return state["slot"] if "slot" in state else state["slots"][client]

    def _json(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        with self._reaching():
            response = self._http.request(method, path, **kwargs)
        _raise_for(response)
        return response.json()

    @contextlib.contextmanager
    def _reaching(self) -> Iterator[None]:
        try:
            yield
        except httpx.TransportError as exc:
            raise Unreachable(self.url, exc) from None


def _raise_for(response: httpx.Response) -> None:
    if response.is_success:
        return
    response.read()
    try:
        message = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        message = response.text.strip() or response.reason_phrase
    raise ServiceError(response.status_code, f"{message} (HTTP {response.status_code})")


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
