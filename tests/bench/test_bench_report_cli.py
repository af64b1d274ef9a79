"""Summaries, comparison tables, plots, and the CLI's no-server paths (dry run, analyze)."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from radixserve.bench.analyze_cli import add_analyze_args, parse_capacity, run_analyze
from radixserve.bench.cli import add_bench_args, run_bench
from radixserve.bench.plots import plot_ttft_cdf, plot_ttft_vs_prompt
from radixserve.bench.report import (
    RequestRecord,
    compare_rows,
    format_compare,
    format_summary,
    percentile,
    same_answers,
    summarize,
)


def rec(i: int, ttft: float, prompt: int = 100, cached: int = 0, out: int = 10, **kw):
    return RequestRecord(
        f"r{i}", "s", 0, i * 0.1, ttft, ttft + 0.5, [0.05] * (out - 1), prompt, cached, out, **kw
    )


def test_percentiles_interpolate():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([5], 99) == 5
    assert math.isnan(percentile([], 50))


def test_summary_counts_tokens_hit_ratio_and_throughput():
    records = [rec(i, 0.1 * (i + 1), cached=50) for i in range(4)]
    records.append(rec(9, 0.0, error="HTTP 500"))
    s = summarize(records, duration=2.0)
    assert s.requests == 5 and s.errors == 1
    assert s.requests_per_s == 2.0 and s.output_tokens_per_s == 20.0
    assert s.cache_hit_ratio == 0.5
    assert s.ttft["p50"] == pytest.approx(0.25)
    assert s.tpot["p50"] == pytest.approx(0.5 / 9)


def test_compare_table_shows_both_sides_and_the_ratio():
    a = summarize([rec(i, 0.1) for i in range(3)], 1.0)
    b = summarize([rec(i, 0.4) for i in range(3)], 2.0)
    table = format_compare(a, b, "on", "off")
    line = next(x for x in table.splitlines() if x.startswith("TTFT p50"))
    assert "100 ms" in line and "400 ms" in line and "0.25x" in line
    assert "2.00x" in next(x for x in table.splitlines() if x.startswith("requests/s"))


def test_plots_are_written(tmp_path):
    runs = {
        "on": [rec(i, 0.05, 200, 160) for i in range(5)],
        "off": [rec(i, 0.3) for i in range(5)],
    }
    for f in (plot_ttft_cdf, plot_ttft_vs_prompt):
        p = f(runs, tmp_path / f"{f.__name__}.png")
        assert p.read_bytes()[:4] == b"\x89PNG"


def parse(add, argv):
    p = argparse.ArgumentParser()
    add(p)
    return p.parse_args(argv)


def test_bench_refuses_a_non_loopback_url(capsys):
    args = parse(add_bench_args, ["--url", "http://192.0.2.1:8000", "--tokenizer", "none"])
    assert run_bench(args) == 2
    assert "loopback" in capsys.readouterr().err


def test_dry_run_trace_feeds_analyze(tmp_path, capsys, tokenizer):
    trace = tmp_path / "rag.jsonl"
    argv = ["--workload", "rag", "--dry-run", "--trace-out", str(trace)]
    argv += ["--param", "requests=4", "--param", "preamble_tokens=256"]
    assert run_bench(parse(add_bench_args, argv)) == 0
    lines = [json.loads(x) for x in trace.read_text().splitlines()]
    assert len(lines) == 4 and all("messages" in x and "timestamp" in x for x in lines)

    out = tmp_path / "an"
    args = parse(add_analyze_args, [str(trace), "--output-dir", str(out)])
    assert run_analyze(args) == 0
    text = capsys.readouterr().out
    assert "Worth it" in text and "block-aligned" in text
    data = json.loads((out / "analysis.json").read_text())
    assert data["redundant_fraction"] > 0.6
    assert (out / "miss_ratio_curve.png").exists() and (out / "shared_prefix_hist.png").exists()


def test_capacities_in_blocks_or_bytes():
    assert parse_capacity("128", 1000) == 128
    assert parse_capacity("1MiB", 2**10) == 1024
    assert parse_capacity("2GB", 10**6) == 2000


def test_decode_rate_per_request_is_tokens_after_the_first_over_time_after_the_first():
    r = rec(0, 0.2, out=11)  # e2e 0.7: 10 tokens in 0.5 s
    assert r.decode_tokens_per_s == pytest.approx(20.0)
    assert rec(1, 0.2, out=1).decode_tokens_per_s is None  # nothing decoded after the first
    assert RequestRecord("x", "s", 0, 0.0).decode_tokens_per_s is None  # no first token


def test_summary_decode_rate_has_per_request_percentiles_and_a_token_weighted_aggregate():
    fast = rec(0, 0.1, out=11)  # 10 tokens / 0.5 s = 20 tok/s
    slow = rec(1, 0.1, out=6)  # 5 tokens / 0.5 s = 10 tok/s
    s = summarize([fast, slow, rec(2, 0.1, out=1), rec(3, 0.1, error="HTTP 500")], 1.0)
    assert s.request_decode_tokens_per_s["p50"] == pytest.approx(15.0)
    assert s.request_decode_tokens_per_s["mean"] == pytest.approx(15.0)
    assert s.decode_tokens_per_s == pytest.approx(15 / 1.0)  # (10 + 5) tokens / (0.5 + 0.5) s
    assert "decode: 15.0 tok/s p50" in format_summary(s)


def test_summary_counts_drafts_and_acceptance_overall_and_per_request():
    records = [
        rec(0, 0.1, draft_tokens=10, accepted_tokens=9),
        rec(1, 0.1, draft_tokens=30, accepted_tokens=3),
        rec(2, 0.1, draft_tokens=20, accepted_tokens=10),
        rec(3, 0.1),  # no drafts reported: not part of the acceptance figures
        rec(4, 0.1, draft_tokens=0, accepted_tokens=0),  # fields present, nothing drafted
    ]
    assert records[0].acceptance_rate == pytest.approx(0.9) and records[3].acceptance_rate is None
    s = summarize(records, 1.0)
    assert s.requests_with_drafts == 3
    assert s.draft_tokens == 60 and s.accepted_tokens == 22
    assert s.acceptance_rate == pytest.approx(22 / 60)
    assert s.request_acceptance_rate["p50"] == pytest.approx(0.5)
    assert s.request_acceptance_rate["mean"] == pytest.approx((0.9 + 0.1 + 0.5) / 3)
    text = format_summary(s)
    assert "60 tokens drafted, 22 accepted (36.7%)" in text and "p50 50.0%" in text
    data = json.loads(json.dumps(s.to_json()))
    assert data["draft_tokens"] == 60 and data["request_acceptance_rate"]["p50"] == 0.5


def test_a_run_without_drafts_reports_no_speculation():
    s = summarize([rec(i, 0.1) for i in range(3)], 1.0)
    assert s.requests_with_drafts == 0 and math.isnan(s.acceptance_rate)
    assert "speculation" not in format_summary(s)
    assert not any(r[0].startswith("acceptance") for r in compare_rows(s, s))


def test_compare_table_shows_decode_rates_side_by_side_with_the_ratio():
    on = summarize([rec(i, 0.1, out=21, draft_tokens=20, accepted_tokens=15) for i in range(3)], 1)
    off = summarize([rec(i, 0.1, out=11) for i in range(3)], 1.0)  # 20 vs 40 tok/s
    rows = {r[0]: r[1:] for r in compare_rows(on, off)}
    assert rows["decode tok/s p50"] == ("40", "20", "2.00x")
    assert rows["decode tok/s mean"][2] == "2.00x" and rows["decode tok/s (all)"][2] == "2.00x"
    assert rows["acceptance rate"][:2] == ("75.0%", "-")
    assert rows["drafted tokens"][:2] == ("60", "0")
    table = format_compare(on, off, "spec", "plain")
    assert "decode tok/s p50" in table and "spec/plain" in table


def test_same_answers_pairs_requests_by_id_and_counts_identical_ones() -> None:
    def rec(rid: str, text: str, error: str | None = None) -> RequestRecord:
        return RequestRecord(rid, "s", 0, 0.0, text=text, error=error)

    a = [rec("r1", "x"), rec("r2", "y"), rec("r1", "z"), rec("r3", "w", "boom")]
    b = [rec("r1", "x"), rec("r1", "q"), rec("r2", "y"), rec("r3", "w")]
    assert same_answers(a, b) == (2, 3)
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    c = [RequestRecord("t", "s", 0, 0.0, tool_calls=[call])]
    d = [RequestRecord("t", "s", 0, 0.0, tool_calls=[{**call, "id": "call_2"}])]
    assert same_answers(c, d) == (1, 1)
