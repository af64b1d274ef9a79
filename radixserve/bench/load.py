"""The load driver: fixed concurrency or Poisson arrivals, bounded in count and time.

Sessions wait in a ready queue (round-robin, so conversations interleave). A session goes back
to the queue only when its previous turn's answer has arrived, and its next prompt carries that
answer, so multi-turn and agent workloads never send turn k+1 early.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx
from tqdm import tqdm

from radixserve.bench.client import fetch_model, send_request
from radixserve.bench.corpus import TokenCounter
from radixserve.bench.report import RequestRecord
from radixserve.bench.workloads import Session, Workload, build_sessions

TRACE_DROP = ("stream", "stream_options")


@dataclass
class LoadConfig:
    """How hard and how long to drive the server."""

    concurrency: int = 4
    rate: float | None = None  # requests/s (Poisson arrivals); None = fixed concurrency
    max_requests: int | None = None
    duration: float | None = None  # seconds; no new request is sent after it
    seed: int = 0  # of the Poisson arrival times

    def describe(self) -> str:
        """'concurrency 4' or 'Poisson 2.0 req/s'."""
        mode = f"Poisson {self.rate:g} req/s" if self.rate else f"concurrency {self.concurrency}"
        bounds = [f"max {self.max_requests} requests"] if self.max_requests else []
        bounds += [f"max {self.duration:g} s"] if self.duration else []
        return ", ".join([mode, *bounds])


@dataclass
class RunResult:
    """Records of every request sent, the wall time, and the trace of request bodies."""

    records: list[RequestRecord]
    duration: float
    trace: list[dict[str, Any]] = field(default_factory=list)


async def run_load(
    client: httpx.AsyncClient,
    base_url: str,
    sessions: list[Session],
    api: str,
    model: str,
    cfg: LoadConfig,
    temperature: float = 0.0,
    extra_body: dict[str, Any] | None = None,
    progress: bool = True,
    desc: str = "",
) -> RunResult:
    """Send the sessions' requests to `base_url` under `cfg`; in-flight requests are awaited
    when the count or time bound stops dispatch. Failed requests end their session."""
    total = sum(len(s.inputs) - len(s.answers) for s in sessions)
    limit = min(cfg.max_requests or total, total)
    ready: deque[Session] = deque(s for s in sessions if not s.done)
    records: list[RequestRecord] = []
    trace: list[dict[str, Any]] = []
    cond = asyncio.Condition()
    state = {"sent": 0, "in_flight": 0}
    t0 = time.perf_counter()
    deadline = t0 + cfg.duration if cfg.duration else math.inf
    bar = tqdm(total=limit, desc=desc or None, unit="req", disable=not progress, leave=False)

    async def next_session() -> Session | None:
        async with cond:
            while True:
                if state["sent"] >= limit or time.perf_counter() >= deadline:
                    return None
                if ready:
                    state["sent"] += 1
                    state["in_flight"] += 1
                    return ready.popleft()
                if state["in_flight"] == 0:
                    return None
                left = deadline - time.perf_counter()
                try:
                    await asyncio.wait_for(cond.wait(), None if left == math.inf else left)
                except asyncio.TimeoutError:
                    return None

    async def run_one(s: Session) -> None:
        spec = s.next_request(api)
        body = spec.body(model, temperature, **(extra_body or {}))
        stamp = time.perf_counter() - t0
        entry = {"id": spec.id, "session_id": spec.session_id, "turn": spec.turn}
        entry["timestamp"] = round(stamp, 6)
        trace.append(entry | {k: v for k, v in body.items() if k not in TRACE_DROP})
        rec = await send_request(client, base_url, spec, body, t0)
        records.append(rec)
        bar.update(1)
        async with cond:
            state["in_flight"] -= 1
            if rec.ok:
                s.record(rec.text, rec.tool_calls)
                if not s.done:
                    ready.append(s)
            cond.notify_all()

    try:
        if cfg.rate:
            await _poisson_arrivals(cfg.rate, cfg.seed, next_session, run_one)
        else:
            await _fixed_concurrency(cfg.concurrency, next_session, run_one)
    finally:
        bar.close()
    duration = max((r.start + r.e2e for r in records), default=0.0)
    trace.sort(key=lambda e: e["timestamp"])
    return RunResult(records, duration, trace)


_NextSession = Callable[[], Awaitable[Session | None]]  # the next ready turn; None: stop sending
_RunOne = Callable[[Session], Coroutine[Any, Any, None]]  # send a session's next turn and record it


async def _poisson_arrivals(
    rate: float, seed: int, next_session: _NextSession, run_one: _RunOne
) -> None:
    """Send a turn at each arrival of a Poisson process of `rate` per second (seeded by
    `seed`) until `next_session` stops; wait for every request sent."""
    rng = random.Random(f"arrivals:{seed}")
    tasks: list[asyncio.Task[None]] = []
    at = time.perf_counter()
    while True:
        at += rng.expovariate(rate)
        await asyncio.sleep(max(0.0, at - time.perf_counter()))
        s = await next_session()
        if s is None:
            break
        # a session that had to wait for its previous answer arrives late, not in a burst
        at = max(at, time.perf_counter())
        tasks.append(asyncio.create_task(run_one(s)))
    await asyncio.gather(*tasks)


async def _fixed_concurrency(
    concurrency: int, next_session: _NextSession, run_one: _RunOne
) -> None:
    """Keep `concurrency` requests in flight (at least one), each sender taking the next
    ready turn as its answer arrives, until `next_session` stops."""

    async def sender() -> None:
        while (s := await next_session()) is not None:
            await run_one(s)

    await asyncio.gather(*(sender() for _ in range(max(1, concurrency))))


class Described(Protocol):
    """What a report says about a plan's load (`LoadConfig`, or a trace's arrivals)."""

    def describe(self) -> str: ...


class Sized(Protocol):
    """What a report says about a plan's traffic (a `Workload`, or a trace)."""

    @property
    def name(self) -> str: ...

    def params(self) -> dict[str, Any]: ...


class RunPlan(Protocol):
    """Anything a comparison can drive: a workload's `BenchPlan` or a trace's `TracePlan`."""

    @property
    def workload(self) -> Sized: ...

    @property
    def load(self) -> Described: ...

    async def run(
        self,
        client: httpx.AsyncClient,
        base_url: str,
        seed_offset: int = 0,
        progress: bool = True,
        desc: str = "",
    ) -> RunResult: ...


@dataclass
class BenchPlan:
    """A workload and how to send it; `run` rebuilds fresh sessions every time."""

    workload: Workload
    load: LoadConfig = field(default_factory=LoadConfig)
    seed: int = 0
    api: str | None = None  # None: the workload's default
    model: str | None = None  # None: the first model the server lists
    temperature: float = 0.0
    extra_body: dict[str, Any] = field(default_factory=dict)
    counter: TokenCounter | None = None

    @property
    def api_name(self) -> str:
        """The API the requests go to ('chat' or 'completion')."""
        return self.api or self.workload.default_api

    async def run(
        self,
        client: httpx.AsyncClient,
        base_url: str,
        seed_offset: int = 0,
        progress: bool = True,
        desc: str = "",
    ) -> RunResult:
        """Build the sessions for seed + seed_offset and drive them against `base_url`."""
        model = self.model or await fetch_model(client, base_url)
        sessions = build_sessions(self.workload, self.seed + seed_offset, self.counter)
        return await run_load(
            client,
            base_url,
            sessions,
            self.api_name,
            model,
            self.load,
            self.temperature,
            self.extra_body,
            progress,
            desc or self.workload.name,
        )
