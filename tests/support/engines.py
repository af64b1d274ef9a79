"""Driving an unstarted engine step by step: collect its outputs, step until it is idle."""

from __future__ import annotations

from typing import Any

from radixserve.engine.outputs import RequestOutput


class Collector:
    """Records every output callback, by request id."""

    def __init__(self) -> None:
        self.outputs: dict[str, list[RequestOutput]] = {}

    def __call__(self, out: RequestOutput) -> None:
        self.outputs.setdefault(out.request_id, []).append(out)

    def final(self, rid: str) -> RequestOutput:
        """The one finished output of a single-choice request."""
        outs = self.outputs[rid]
        assert outs[-1].finished and sum(o.finished for o in outs) == 1
        return outs[-1]

    def choices(self, rid: str) -> list[RequestOutput]:
        """The finished output of each choice of a request, by index."""
        done = [o for o in self.outputs[rid] if o.finished]
        assert sorted(o.index for o in done) == list(range(len(done)))
        return sorted(done, key=lambda o: o.index)


def run_until_idle(engine: Any, max_steps: int = 10_000, check: bool = True) -> None:
    """Step `engine` until nothing waits or runs, checking the cache invariants after every
    step unless `check` is False."""
    for _ in range(max_steps):
        engine.step()
        if check:
            engine.kv.check_invariants()
        if not engine.scheduler.has_work() and not engine._inbox and not engine._aborts:
            return
    raise AssertionError("engine did not become idle")
