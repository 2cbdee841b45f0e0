"""How far a long fusion has got, for front doors to show; library code never prints.

Methods call :func:`advance` as they finish a step (a tensor averaged, a client aligned, a
layer or permutation group matched). It logs a DEBUG record on the ``fusekit.progress``
logger carrying ``progress = (what, done, total)``; a front door that shows progress (the
CLI's bar, the service's job state) sets that logger's level to DEBUG, stops it
propagating and attaches a handler that reads :func:`progress_of` each record. Otherwise
a step costs one level check.
"""

from __future__ import annotations

import logging

LOGGER = logging.getLogger("fusekit.progress")


def advance(what: str, done: int, total: int) -> None:
    """Say that ``done`` of ``total`` steps are finished; ``what`` names the steps in the
    plural, as a line would end: "groups matched", "clients aligned"."""
    if LOGGER.isEnabledFor(logging.DEBUG):
        LOGGER.debug("%d of %d %s", done, total, what, extra={"progress": (what, done, total)})


def progress_of(record: logging.LogRecord) -> tuple[str, int, int] | None:
    """A record's (what, done, total), or None for a record that is not a step."""
    return getattr(record, "progress", None)


class ProgressHandler(logging.Handler):
    """Calls ``show(what, done, total)`` for each step; attach it with :func:`listen`."""

    def __init__(self, show) -> None:
        super().__init__(logging.DEBUG)
        self.show = show

    def emit(self, record: logging.LogRecord) -> None:
        step = progress_of(record)
        if step is not None:
            self.show(*step)


def listen(show) -> ProgressHandler:
    """Send every step to ``show(what, done, total)`` (and no longer to the log's other
    handlers); returns the handler, which :func:`stop_listening` removes."""
    handler = ProgressHandler(show)
    LOGGER.setLevel(logging.DEBUG)
    LOGGER.propagate = False
    LOGGER.addHandler(handler)
    return handler


def stop_listening(handler: ProgressHandler) -> None:
    LOGGER.removeHandler(handler)
    if not LOGGER.handlers:
        LOGGER.setLevel(logging.NOTSET)
        LOGGER.propagate = True
