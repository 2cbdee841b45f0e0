"""Receiving one upload (a checkpoint, or a statistics file for calibration): streamed to
disk, checked as its bytes arrive, accepted whole.

The body is never held in memory: chunks go to a temporary file in the job's ``uploads``
folder while they are counted and hashed. The safetensors header is checked as soon as its
bytes are in (:func:`fusekit.core.checkpoint.check_header`), so a bad or oversized file is
refused before its tensors are sent; the whole file is then validated as
:func:`fusekit.load_checkpoint` validates it, every tensor's values too (NaN, Inf, negative
variances: a file its job could not fuse is refused now, not when the job runs), fsynced,
and only then renamed into the slot. A statistics file is validated as the worker will
read it (:func:`fusekit.calibrate`, ``align``, ``refit``), against the job's current round
(:func:`round_check`: its model, its kind, its layer);
a targets file (a client's statistics of its own model) against that client's checkpoint
(:func:`targets_check`).

Both checks run in :class:`Checker`'s processes, never in the API server's: parsing a header
of many MB (json, safetensors) holds the interpreter's lock for seconds, which in a thread
would stall the event loop and every other request with it. The value check reads each
tensor in pieces, within ``Settings.upload_check_bytes`` of memory whatever its size.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import multiprocessing
import os
import secrets
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any, TypeVar

from starlette.concurrency import run_in_threadpool

from fusekit.core.checkpoint import (
    check_header,
    header_length,
    is_pickle_or_torch_zip,
    load_checkpoint,
)
from fusekit.core.errors import CheckpointError, FusekitError, StatisticsError
from fusekit.core.model_spec import client_spec, input_points, model_points
from fusekit.core.stats import load_statistics
from fusekit.service.errors import ServiceError, TooLarge, TooSlow
from fusekit.service.rounds import check_upload, statistics_bytes
from fusekit.service.settings import Settings

T = TypeVar("T")
# Checker processes start afresh: a fork of the server would copy its threads' locks.
_SPAWN = multiprocessing.get_context("spawn")


class Upload:
    """One file being received for ``client``, at most ``limit`` bytes, within the time
    limits of ``settings`` (``upload_idle_s``, ``upload_min_rate``), and checked whole with
    ``validate(part, label)`` (:func:`checkpoint_check`, :func:`round_check`) in a
    checker process. ``what`` names it in refusals."""

    def __init__(self, folder: Path, client: str, limit: int, settings: Settings,
                 validate: Callable[[Path, str], None], what: str = "checkpoint") -> None:
        self.client, self.limit, self.settings = client, limit, settings
        self.validate, self.what = validate, what
        self.label = f"client {client!r}"
        self.part = folder / f"{client}.{secrets.token_hex(8)}.part"
        self.size, self.expected = 0, None
        self.sha256 = hashlib.sha256()
        self._head = bytearray()  # the safetensors header, until it is checked
        self._needed: int | None = None  # its length with the 8 bytes that give it

    async def receive(self, chunks: AsyncIterator[bytes], checker: Checker) -> None:
        """Write the body to ``self.part``; on any failure, nothing is left behind."""
        try:
            with open(self.part, "xb") as f:
                async for chunk in self._in_time(chunks):
                    header_complete = self._take(chunk)
                    f.write(chunk)
                    if header_complete:  # parsed once, in a checker process
                        self._declared(await checker.run(
                            check_header, bytes(self._head[:self._needed]), self.label))
                await run_in_threadpool(_sync, f)
            self._check_complete()
            await checker.run(self.validate, self.part, self.label)
        except BaseException:
            self.discard()
            raise

    async def _in_time(self, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """The chunks, until the client sends nothing for ``upload_idle_s`` seconds or falls
        behind ``upload_min_rate``: a stalled or trickling upload must not hold one of the
        server's upload places for ever."""
        idle_s, rate = self.settings.upload_idle_s, self.settings.upload_min_rate
        iterator, waited = aiter(chunks), 0.0  # the client's time: not the server's checks
        while True:
            # How long until the bytes so far stop being enough for the minimum rate.
            wait = min(idle_s, idle_s + self.size / rate - waited)
            start = time.monotonic()
            try:
                chunk = await asyncio.wait_for(anext(iterator), max(wait, 0.0))
            except StopAsyncIteration:
                return
            except asyncio.TimeoutError:
                if wait >= idle_s:
                    raise TooSlow(f"{self.label}: no data for {idle_s:g} s after {self.size} "
                                  "bytes; upload abandoned, nothing stored") from None
                raise TooSlow(f"{self.label}: {self.size} bytes in {waited + wait:.0f} s, "
                              f"slower than {rate:g} bytes/s after the first {idle_s:g} s "
                              "(the server's minimum); upload abandoned, nothing stored"
                              ) from None
            waited += time.monotonic() - start
            yield chunk

    def discard(self) -> None:
        self.part.unlink(missing_ok=True)

    def _take(self, chunk: bytes) -> bool:
        """Count and hash a chunk; True when it completes the safetensors header."""
        self.size += len(chunk)
        if self.size > self.limit:
            raise TooLarge(f"{self.label}: the {self.what} is over {self.limit} bytes, this "
                           "job's limit")
        self.sha256.update(chunk)
        if self.expected is not None:
            if self.size > self.expected:
                raise ServiceError(f"{self.label}: the body runs past the {self.expected} "
                                   "bytes its safetensors header declares")
            return False
        if self._needed is None:  # the first 9 bytes tell the format and the header's length
            start = 9 - len(self._head)
            self._head += chunk[:start]
            chunk = chunk[start:]
            self._check_start()
        if self._needed is None:
            return False
        self._head += chunk[:max(0, self._needed - len(self._head))]  # never copied whole
        return len(self._head) >= self._needed

    def _check_start(self) -> None:
        head = bytes(self._head)
        if len(head) < 9:  # byte 8 tells a pickle or zip from a safetensors header
            return
        if is_pickle_or_torch_zip(head):
            raise ServiceError(f"{self.label}: the body is a pickle or torch .pt file; expected "
                               "safetensors (pickles are never loaded)")
        self._needed = 8 + header_length(head, self.label)
        if self._needed > self.limit:
            raise TooLarge(f"{self.label}: the safetensors header alone is "
                           f"{self._needed - 8} bytes; expected a file of at most {self.limit}")

    def _declared(self, expected: int) -> None:
        """The file's size, as its checked header declares it."""
        self.expected, self._head = expected, bytearray()
        if self.expected > self.limit:
            raise TooLarge(f"{self.label}: the safetensors header declares a file of "
                           f"{self.expected} bytes; expected at most {self.limit}")
        if self.size > self.expected:
            raise ServiceError(f"{self.label}: the body runs past the {self.expected} bytes "
                               "its safetensors header declares")

    def _check_complete(self) -> None:
        if self.expected is None or self.size != self.expected:
            declared = "" if self.expected is None else f" of the {self.expected} declared"
            raise CheckpointError(f"{self.label}: truncated upload: {self.size} bytes"
                                  f"{declared}; expected a whole safetensors file")


class Checker:
    """Processes that check uploads: ``processes`` at most, each started when a check finds
    none idle, so that a server that is sent nothing starts none (each costs about a
    quarter of a second of CPU importing the checks, and its stop waits for them)."""

    def __init__(self, processes: int) -> None:
        self.processes = processes
        self._pool: ProcessPoolExecutor | None = None

    def _started(self) -> ProcessPoolExecutor:
        if self._pool is None:  # each process imports this module (the checks) as it starts
            self._pool = ProcessPoolExecutor(self.processes, mp_context=_SPAWN,
                                             initializer=_ready)
        return self._pool

    async def run(self, check: Callable[..., T], *args: Any) -> T:
        pool = self._started()
        try:
            return await asyncio.get_running_loop().run_in_executor(pool, check, *args)
        except BrokenProcessPool:  # a checker killed (out of memory?): start others
            if self._pool is pool:
                self._pool = None
            raise ServiceError("the upload's check stopped (the checking process was "
                               "killed); try again") from None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _ready() -> None:
    """A checker process's start: importing this module (for ``initializer``) is the work."""


def checkpoint_check(settings: Settings) -> Callable[[Path, str], None]:
    return functools.partial(_validate_checkpoint, budget=settings.upload_check_bytes)


def round_check(round_: dict[str, Any], own: Path | None, spec: dict[str, Any] | None,
                min_samples: int, earlier: dict[str, int]) -> Callable[[Path, str], None]:
    """A file for the job's current round (:func:`fusekit.service.rounds.check_upload`):
    statistics, cross or refit statistics of the round's model, over at least
    ``min_samples`` inputs; ``own`` is the client's checkpoint, ``earlier`` the models of
    the rounds before (content hash -> round), whose files are refused as stale."""
    return functools.partial(check_upload, round_=round_, own=own, spec=spec,
                             min_samples=min_samples, earlier=earlier)


def targets_check(checkpoint: Path, spec: dict[str, Any] | None, min_samples: int,
                  input_moments: bool = False) -> Callable[[Path, str], None]:
    """Statistics of the client's checkpoint at ``checkpoint`` (its content hash, its points
    under the job's ``spec``), over at least ``min_samples`` inputs, in either mode; with
    the first layer's input moments where the job derives that layer from them."""
    return functools.partial(_validate_targets, checkpoint=checkpoint, spec=spec,
                             min_samples=min_samples, input_moments=input_moments)


def targets_bytes(checkpoint: Path, spec: dict[str, Any] | None, limit: int) -> int:
    """The size limit of targets of the client's checkpoint at ``checkpoint``: the largest
    honest statistics file of it, input moments included (at most ``limit``, the job's
    checkpoint limit, where the checkpoint's points cannot be told)."""
    try:
        own = load_checkpoint(checkpoint)
        spec_ = client_spec(own, spec)
        return min(limit, statistics_bytes(model_points(own, spec_), input_points(own, spec_)))
    except (FileNotFoundError, FusekitError):  # replaced, or not fusable: checked whole
        return limit


def _validate_checkpoint(part: Path, label: str, budget: int) -> None:
    """In a checker process: the whole file as load_checkpoint sees it, and its values."""
    try:
        load_checkpoint(part).check_values(budget)
    except CheckpointError as exc:
        raise CheckpointError(str(exc).replace(str(part), label)) from None


def _validate_targets(part: Path, label: str, checkpoint: Path, spec: dict[str, Any] | None,
                      min_samples: int, input_moments: bool = False) -> None:
    """In a checker process: the file as statistics of the client's own checkpoint."""
    try:
        own = load_checkpoint(checkpoint)
        own_spec = client_spec(own, spec)
    except FileNotFoundError:  # replaced meanwhile: store.accept refuses it by name
        return
    named = f"targets of {label}"
    try:
        stats = load_statistics(part, model=own.content_hash, points=model_points(
            own, own_spec), min_samples=min_samples, inputs=input_points(own, own_spec))
        if input_moments and not stats.inputs:
            raise StatisticsError(f"{part}: no input moments; this job derives its first "
                                  "layer from every client's (fusekit stats OWN "
                                  "--input-moments ...)")
    except StatisticsError as exc:
        raise _named(exc, part, named, ("(run `fusekit stats` on this model)",
                                        "(the checkpoint it submitted: targets are "
                                        "`fusekit stats` of it)")) from None


def _named(exc: StatisticsError, part: Path, named: str, *replacements: tuple[str, str]
           ) -> StatisticsError:
    """``exc`` naming the upload as ``named``, never by its temporary file."""
    text = str(exc).replace(f"statistics file {part}", named).replace(str(part), named)
    for old, new in replacements:
        text = text.replace(old, new)
    return StatisticsError(text)


def _sync(f) -> None:
    f.flush()
    os.fsync(f.fileno())
