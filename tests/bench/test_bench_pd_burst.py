"""The pd_burst workload's shape and its streams-and-documents report."""

from __future__ import annotations

import math

from radixserve.bench.corpus import TokenCounter
from radixserve.bench.pd_burst import burst_stats, format_bursts
from radixserve.bench.report import RequestRecord
from radixserve.bench.workloads import SUITE_WORKLOADS, PrefillBurst, build_sessions, script


def test_pd_burst_interleaves_long_chats_and_one_off_documents() -> None:
    w = PrefillBurst(streams=2, turns=2, bursts=3, doc_tokens=256, stream_tokens=40)
    sessions = build_sessions(w, 0, TokenCounter(None))
    assert [s.id for s in sessions] == ["stream-0", "burst-0", "stream-1", "burst-1", "burst-2"]
    specs = script(sessions, "chat")
    assert len(specs) == w.num_requests() == 7
    streams = [s for s in specs if s.session_id.startswith("stream-")]
    assert all(s.max_tokens == 40 for s in streams)
    systems = {s.messages[0]["content"] for s in streams}  # one shared system prompt
    assert len(systems) == 1
    docs = [s for s in specs if s.session_id.startswith("burst-")]
    assert len({s.messages[-1]["content"] for s in docs}) == 3 and all(
        s.max_tokens == w.burst_tokens for s in docs
    )
    assert "pd_burst" not in SUITE_WORKLOADS


def rec(session: str, ttft: float, e2e: float, tokens: int, cached: int = 0) -> RequestRecord:
    r = RequestRecord(session + "-t0", session, 0, 0.0, ttft=ttft, e2e=e2e)
    r.completion_tokens, r.prompt_tokens, r.cached_tokens = tokens, 100, cached
    r.itl = [(e2e - ttft) / (tokens - 1)] * (tokens - 1) if tokens > 1 else []
    return r


def test_burst_stats_split_the_streams_from_the_documents() -> None:
    records = [
        rec("stream-0", 0.1, 1.1, 11, cached=50),  # 100 ms a token
        rec("stream-1", 0.1, 0.6, 11, cached=0),  # 50 ms a token
        rec("burst-0", 2.0, 2.1, 2),
        rec("burst-1", 4.0, 4.1, 2),
    ]
    s = burst_stats(records, "pd")
    assert s.stream_requests == 2 and s.burst_requests == 2
    assert math.isclose(s.tpot_p50_ms, 75) and math.isclose(s.tpot_p99_ms, 99.5)
    assert math.isclose(s.stream_cached_share, 0.25)
    assert math.isclose(s.burst_ttft_p50_ms, 3000)
    other = burst_stats([rec("stream-0", 0.1, 0.3, 11), rec("burst-0", 1.0, 1.1, 2)], "co")
    table = format_bursts([other, s])
    assert "| pd | 2 |" in table and "pd / co: TPOT p99" in table
