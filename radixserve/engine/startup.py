"""Start-up's phases, one log line each with its time: where a slow start goes is in the log."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

log = logging.getLogger("radixserve.startup")


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Log "start-up: <name> in <seconds> s" once the block ends (not when it raises)."""
    t = time.perf_counter()
    yield
    log.info("start-up: %s in %.2f s", name, time.perf_counter() - t)
