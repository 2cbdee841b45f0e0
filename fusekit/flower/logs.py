"""fusekit's log lines in a Flower app, formatted and shipped as Flower's own."""

from __future__ import annotations

import logging

from flwr.common.logger import console_handler


def log_to_flower(level: int | str = logging.INFO) -> None:
    """Send the ``fusekit`` logger's records at ``level`` and above to Flower's console
    handler: they read ``INFO :      round 1: pfnm fused 3 models ...``, with their level,
    among Flower's lines, and reach ``flwr run --stream`` and ``flwr log`` as Flower's do.

    Without it fusekit's logger has no handler: its INFO lines are dropped and Python
    prints its warnings bare. Call it once per process, in the ServerApp's ``main`` (and in
    a ClientApp if its fusekit lines matter); calling it again changes only the level.
    """
    logger = logging.getLogger("fusekit")
    logger.setLevel(level)
    if console_handler not in logger.handlers:
        logger.addHandler(console_handler)
    logger.propagate = False  # once, even where the root logger has a handler too
