"""Bearer tokens: random, stored only as hashes, compared in constant time.

Tokens carry 256 random bits, so a plain SHA-256 is a sufficient hash (nothing to brute-force
as with passwords). The admin token comes from ``FUSEKIT_ADMIN_TOKEN`` or, when that is unset,
from ``<data-dir>/admin.token``, generated once with mode 0600.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
from pathlib import Path

from fusekit.service.errors import Unauthorized

ADMIN_TOKEN_ENV = "FUSEKIT_ADMIN_TOKEN"
ADMIN_TOKEN_FILE = "admin.token"


def new_token() -> str:
    return secrets.token_urlsafe(32)


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def matches(token: str, digest: str) -> bool:
    return hmac.compare_digest(token_hash(token), digest)


def bearer(authorization: str | None) -> str:
    """The token of an ``Authorization: Bearer <token>`` header.

    A refusal never quotes the header: a malformed one (``Bearer<TAB><token>``, a token
    without its scheme) may hold the token itself, and no answer or log line may."""
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthorized("Authorization: expected 'Bearer <token>' (one space), found "
                           + ("nothing" if not authorization else "a header of another form"))
    return token.strip()


def admin_token_hash(data_dir: Path) -> tuple[str, Path | None]:
    """The admin token's hash, and the file it was read from (None: the environment)."""
    token = os.environ.get(ADMIN_TOKEN_ENV, "").strip()
    if token:
        return token_hash(token), None
    path = data_dir / ADMIN_TOKEN_FILE
    with contextlib.suppress(FileExistsError):
        _create_secret_file(path, new_token())
    return token_hash(path.read_text().strip()), path


def _create_secret_file(path: Path, secret: str) -> None:
    """Write ``secret`` to a new file readable by its owner only; never replace one."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secret + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.link(tmp, path)  # fails, leaving the first token, when another process won
    finally:
        os.unlink(tmp)
