"""The drain middleware and the fault-injection hook, without a model."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from radixserve.server.lifecycle import Drain, InjectedFault, install_fault_injection


@pytest.mark.parametrize("spec", ["step", "step:", "step:0", "step:-1", "steps:3", "loop:3"])
def test_fault_spec_that_is_not_step_n_is_refused(spec: str) -> None:
    with pytest.raises(ValueError, match="step:N"):
        install_fault_injection(SimpleNamespace(step=lambda: None), spec)


def test_injected_fault_fires_on_exactly_the_nth_step() -> None:
    ran: list[int] = []
    engine = SimpleNamespace(step=lambda: ran.append(1))
    install_fault_injection(engine, "step:3")
    engine.step()
    engine.step()
    with pytest.raises(InjectedFault):
        engine.step()
    assert len(ran) == 2


def test_drain_lets_in_flight_finish_and_refuses_new_requests() -> None:
    release = asyncio.Event()

    async def slow(request: object) -> PlainTextResponse:
        await release.wait()
        return PlainTextResponse("done")

    drain = Drain(Starlette(routes=[Route("/slow", slow), Route("/metrics", slow)]))

    async def scenario() -> None:
        transport = httpx.ASGITransport(app=drain)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            first = asyncio.create_task(client.get("/slow"))
            while drain.in_flight == 0:
                await asyncio.sleep(0.01)
            drain.begin()
            late = await client.get("/slow")
            assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
            assert not await drain.wait_idle(0.05)
            release.set()
            assert (await first).text == "done"
            assert await drain.wait_idle(1.0)
            assert (await client.get("/metrics")).status_code == 200  # scrapes still answered

    asyncio.run(scenario())
