"""The spike workload's shape and its per-phase hot-prefix report."""

from __future__ import annotations

from radixserve.bench.corpus import TokenCounter
from radixserve.bench.report import RequestRecord
from radixserve.bench.spike import format_phases, phase_stats
from radixserve.bench.workloads import SUITE_WORKLOADS, Spike, build_sessions, script


def test_spike_sends_steady_traffic_around_a_burst_of_documents() -> None:
    w = Spike(steady=4, docs=3, doc_tokens=256, hot_tokens=64)
    specs = script(build_sessions(w, 0, TokenCounter(None)), "completion")
    phases = [s.session_id.split("-")[0] for s in specs]
    assert phases == ["pre"] * 4 + ["burst"] * 6 + ["post"] * 4
    docs = [s for s in specs if "doc" in s.session_id]
    assert len(docs) == 3 and len({s.prompt for s in docs}) == 3  # one-off documents
    hot = [s for s in specs if "-h0-" in s.session_id]
    assert all(s.prompt.startswith(hot[0].prompt.split("Question:")[0]) for s in hot)
    assert set(w.hot_prefix_tokens) == {"h0", "h1", "h2"}
    assert "spike" not in SUITE_WORKLOADS


def record(session_id: str, cached: int, ttft: float) -> RequestRecord:
    return RequestRecord(
        session_id + "-t0", session_id, 0, 0.0, ttft=ttft, cached_tokens=cached, prompt_tokens=99
    )


def test_phase_stats_count_the_cached_share_of_each_hot_prefix() -> None:
    records = [
        record("pre-h0-0", 0, 0.5),  # cold
        record("pre-h0-1", 64, 0.1),
        record("burst-doc0", 0, 2.0),  # not steady traffic: left out
        record("burst-h0-0", 32, 0.3),  # half of the prefix was evicted
        record("post-h0-0", 80, 0.1),  # more than the prefix (its own earlier suffix) counts 64
    ]
    stats = {s.phase: s for s in phase_stats(records, {"h0": 70}, block_size=16)}
    assert stats["pre"].requests == 2 and stats["pre"].hot_hit_ratio == 0.5
    assert stats["burst"].hot_hit_ratio == 0.5 and stats["post"].hot_hit_ratio == 1.0
    assert stats["all"].requests == 4
    assert stats["burst"].ttft_p50_ms == 300
    assert "refetched" in format_phases(list(stats.values()), refetched=3, evicted=9)
