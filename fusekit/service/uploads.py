"""Receiving one checkpoint: streamed to disk, checked as its bytes arrive, accepted whole.

The body is never held in memory: chunks go to a temporary file in the job's ``uploads``
folder while they are counted and hashed. The safetensors header is checked as soon as its
bytes are in (:func:`fusekit.core.checkpoint.check_header`), so a bad or oversized file is
refused before its tensors are sent; the whole file is then validated as
:func:`fusekit.load_checkpoint` validates it, every tensor's values too (NaN, Inf, negative
variances: a file its job could not fuse is refused now, not when the job runs), fsynced,
and only then renamed into the slot.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import secrets
import time
from collections.abc import AsyncIterator
from pathlib import Path

from starlette.concurrency import run_in_threadpool

from fusekit.core.checkpoint import (
    MAX_HEADER_BYTES,
    PICKLE_MAGIC,
    ZIP_MAGIC,
    check_header,
    header_length,
    is_pickle_or_torch_zip,
    load_checkpoint,
)
from fusekit.core.errors import CheckpointError
from fusekit.service.errors import ServiceError, TooLarge, TooSlow
from fusekit.service.settings import Settings



class Upload:
    """One checkpoint being received for ``client``, at most ``limit`` bytes, within the
    time limits of ``settings`` (``upload_idle_s``, ``upload_min_rate``)."""

    def __init__(self, folder: Path, client: str, limit: int, settings: Settings) -> None:
        self.client, self.limit, self.settings = client, limit, settings
        self.label = f"client {client!r}"
        self.part = folder / f"{client}.{secrets.token_hex(8)}.part"
        self.size, self.expected = 0, None
        self.sha256 = hashlib.sha256()
        self._head = bytearray()

    async def receive(self, chunks: AsyncIterator[bytes]) -> None:
        """Write the body to ``self.part``; on any failure, nothing is left behind."""
        try:
            with open(self.part, "xb") as f:
                async for chunk in self._in_time(chunks):
                    self._take(chunk)
                    f.write(chunk)
                await run_in_threadpool(_sync, f)
            self._check_complete()
            await run_in_threadpool(self._validate_file)
        except BaseException:
            self.discard()
            raise

    async def _in_time(self, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """The chunks, until the client sends nothing for ``upload_idle_s`` seconds or falls
        behind ``upload_min_rate``: a stalled or trickling upload must not hold one of the
        server's upload places for ever."""
        idle_s, rate = self.settings.upload_idle_s, self.settings.upload_min_rate
        iterator, start = aiter(chunks), time.monotonic()
        while True:
            # The moment the bytes so far stop being enough for the minimum rate.
            behind_at = start + idle_s + self.size / rate
            wait = min(idle_s, behind_at - time.monotonic())
            try:
                chunk = await asyncio.wait_for(anext(iterator), max(wait, 0.0))
            except StopAsyncIteration:
                return
            except asyncio.TimeoutError:
                if wait >= idle_s:
                    raise TooSlow(f"{self.label}: no data for {idle_s:g} s after {self.size} "
                                  "bytes; upload abandoned, nothing stored") from None
                raise TooSlow(f"{self.label}: {self.size} bytes in "
                              f"{time.monotonic() - start:.0f} s, slower than {rate:g} "
                              f"bytes/s after the first {idle_s:g} s (the server's minimum); "
                              "upload abandoned, nothing stored") from None
            yield chunk

    def discard(self) -> None:
        self.part.unlink(missing_ok=True)

    def _take(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size > self.limit:
            raise TooLarge(f"{self.label}: the checkpoint is over {self.limit} bytes, this "
                           "job's limit")
        self.sha256.update(chunk)
        if self.expected is None:
            self._head += chunk[: MAX_HEADER_BYTES + 8 - len(self._head)]
            self._check_head()
        elif self.size > self.expected:
            raise ServiceError(f"{self.label}: the body runs past the {self.expected} bytes "
                               "its safetensors header declares")

    def _check_head(self) -> None:
        head = bytes(self._head)
        if head.startswith((PICKLE_MAGIC, ZIP_MAGIC)) and len(head) < 9:
            return  # pickle, zip or safetensors: byte 8 tells
        if is_pickle_or_torch_zip(head):
            raise ServiceError(f"{self.label}: the body is a pickle or torch .pt file; expected "
                               "safetensors (pickles are never loaded)")
        if len(head) < 8:
            return
        needed = 8 + header_length(head, self.label)
        if needed > self.limit:
            raise TooLarge(f"{self.label}: the safetensors header alone is {needed - 8} bytes; "
                           f"expected a file of at most {self.limit}")
        if needed > len(head):
            return  # the rest of the header is still on its way
        self.expected = check_header(head, self.label)
        self._head = bytearray()
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

    def _validate_file(self) -> None:
        try:
            load_checkpoint(self.part).check_values()
        except CheckpointError as exc:
            raise CheckpointError(str(exc).replace(str(self.part), self.label)) from None


def _sync(f) -> None:
    f.flush()
    os.fsync(f.fileno())
