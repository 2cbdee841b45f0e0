"""The service's refusals: each a FusekitError with the HTTP status it is answered with."""

from __future__ import annotations

from fusekit.core.errors import FusekitError


class ServiceError(FusekitError):
    """A request the service refuses; ``status`` is the HTTP status of the answer."""

    status = 400


class Unauthorized(ServiceError):
    status = 401


class Forbidden(ServiceError):
    status = 403


class NotFound(ServiceError, LookupError):
    status = 404


class TooSlow(ServiceError):
    """An upload that stalled or fell below the minimum transfer rate."""

    status = 408


class Conflict(ServiceError):
    status = 409


class TooLarge(ServiceError):
    status = 413


class Busy(ServiceError):
    """Refused for now: answered 429 with ``Retry-After: <retry_after>`` (seconds)."""

    status = 429

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


def bounded(text: str, limit: int, rest: str) -> str:
    """``text`` cut to ``limit`` characters, saying how long it was and ``rest`` (where the
    whole text is, or that it was left out): what every status request returns and a
    page draws stays small whatever a value a message quotes."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters; {rest})"
