"""Ports and waiting: what a test needs to talk to something that starts in the background."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now (another process may take it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(
    predicate: Callable[[], T], timeout: float = 10.0, what: str = "condition", every: float = 0.05
) -> T:
    """Call `predicate()` every `every` seconds until it returns something truthy, and return
    that; raise AssertionError naming `what` (and the last value) after `timeout` seconds.

    Tests wait with this instead of sleeping a fixed time: a busy machine only makes it slower.
    """
    deadline = time.monotonic() + timeout
    while True:
        last = predicate()
        if last:
            return last
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}: {last!r}")
        time.sleep(every)
