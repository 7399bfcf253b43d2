"""Logging for our stages inside Ray workers, where the root logger has no handler."""

from __future__ import annotations

import logging
import os
import sys

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_worker_logging() -> None:
    """Send INFO (or the level in `RAYPACK_LOG_LEVEL`, which the job command sets from its
    --log-level: pipeline/commands/console.py) from the `pipeline` loggers to stderr (which Ray
    streams to the driver).

    Does nothing where logging is already configured (a driver script, pytest), so it is
    safe to call from every stage constructor.
    """
    root = logging.getLogger()
    ours = logging.getLogger("pipeline")
    if root.handlers or ours.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_FORMAT))
    ours.addHandler(handler)
    ours.setLevel(os.environ.get("RAYPACK_LOG_LEVEL", "INFO"))
    ours.propagate = False
