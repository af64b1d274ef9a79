"""An exclusive lock between processes that the kernel drops when its holder dies (flock), for
work written once into a shared cache: a GGUF's model directory, the CPU kernels' build."""

from __future__ import annotations

import contextlib
import fcntl
import logging
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)


@contextlib.contextmanager
def file_lock(path: Path, waiting_message: str) -> Iterator[None]:
    """Hold an exclusive lock on `path` (created if absent; never deleted, so every process
    locks the same inode). Logs `waiting_message` once when another process holds it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("%s", waiting_message)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
