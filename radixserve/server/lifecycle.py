"""How the server ends: draining on SIGTERM, exiting when the engine dies, injected faults.

- `Drain` (ASGI middleware) counts requests in flight; once draining, every new request gets
  503 `shutting_down` (with Retry-After) while those in flight run to completion.
- `watch_engine` notices a dead engine loop so the process can exit non-zero and a supervisor
  (systemd, Kubernetes, `serve --workers N`) restarts it.
- `install_fault_injection` is the debug hook behind RADIXSERVE_FAULT_INJECT=step:N: the
  engine's Nth step raises, to test the path above. It is set up once at start-up and leaves
  the step code itself untouched.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from starlette.types import ASGIApp, Receive, Scope, Send

from radixserve.server.errors import RETRY_AFTER_SECONDS, APIError

if TYPE_CHECKING:
    from radixserve.server.engine_api import ServedEngine

log = logging.getLogger("radixserve.server")

FAULT_ENV = "RADIXSERVE_FAULT_INJECT"
# Routes that never end on their own (closed at shutdown instead) or must keep answering.
_NOT_COUNTED = ("/v1/cache/events",)
_ALWAYS_SERVED = ("/metrics",)


class Drain:
    """ASGI middleware: counts in-flight HTTP requests; after `begin()` new ones get 503."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.in_flight = 0
        self.draining = False
        self._idle = asyncio.Event()
        self._idle.set()

    def begin(self) -> None:
        """Refuse new requests from now on (idempotent)."""
        self.draining = True

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no counted request is in flight; False if `timeout` ran out first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Refuse the request while draining, else pass it through and count it."""
        path = scope.get("path", "")
        if scope["type"] != "http" or path in _ALWAYS_SERVED:
            await self.app(scope, receive, send)
            return
        if self.draining:
            err = APIError(
                503,
                "the server is shutting down; retry on another instance",
                code="shutting_down",
                headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
            )
            await err.response()(scope, receive, send)
            return
        if path in _NOT_COUNTED:
            await self.app(scope, receive, send)
            return
        self.in_flight += 1
        self._idle.clear()
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()


async def watch_engine(
    engine: ServedEngine, on_dead: Callable[[], None], interval: float = 0.2
) -> None:
    """Call `on_dead()` once, as soon as the engine loop is no longer alive."""
    while engine.is_alive():
        await asyncio.sleep(interval)
    on_dead()


class InjectedFault(RuntimeError):
    """Raised by an engine step when RADIXSERVE_FAULT_INJECT asks for it."""


def install_fault_injection(engine: Any, spec: str) -> None:
    """Make the engine's step number N (1-based) raise InjectedFault; `spec` is "step:N".

    Wraps the engine's bound `step` once, on this instance only; raises ValueError for a spec
    it does not understand (a typo must not silently disable the test it was meant for).
    """
    kind, _, value = spec.partition(":")
    if kind != "step" or not value.isdigit() or int(value) < 1:
        raise ValueError(f"{FAULT_ENV}={spec!r}: expected 'step:N' with N >= 1")
    fail_at, step = int(value), engine.step
    count = 0

    def faulty_step() -> None:
        nonlocal count
        count += 1
        if count == fail_at:
            raise InjectedFault(f"{FAULT_ENV}: injected failure in engine step {count}")
        step()

    engine.step = faulty_step
    log.warning("fault injection on: engine step %d will raise (%s)", fail_at, FAULT_ENV)
