"""The analyzer: exact redundant-prefix fraction on hand-built traces, trace parsing, the
LRU replay (miss-ratio curve) and the verdict."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from radixserve.bench.analyze import (
    analyze_tokens,
    kv_bytes_per_token,
    read_trace,
    replay,
    shared_prefix_lengths,
    tokenize,
)


def test_shared_prefix_is_longest_with_any_earlier_request():
    seqs = [
        [1, 2, 3, 4, 5],
        [1, 2, 3, 9],  # shares 3 with #0
        [1, 2, 3, 9, 9, 9],  # shares 4 with #1 (more than with #0)
        [7, 8],  # nothing
        [1, 2],  # a prefix of earlier ones: all of it
        [1, 2, 3, 4, 5],  # identical to #0
        [],
    ]
    assert shared_prefix_lengths(seqs) == [0, 3, 4, 0, 2, 5, 0]


def test_redundant_fraction_is_exact_at_token_granularity():
    seqs = [[1, 2, 3, 4, 5], [1, 2, 3, 9], [1, 2, 3, 9, 9, 9], [7, 8], [1, 2], [1, 2, 3, 4, 5]]
    a = analyze_tokens(seqs, block_size=2, capacities=[])
    assert a.prompt_tokens == 24
    assert a.shared_tokens == 0 + 3 + 4 + 0 + 2 + 5
    assert a.redundant_fraction == pytest.approx(14 / 24)
    # block-aligned (block of 2): 0 + 2 + 4 + 0 + 2 + 4
    assert a.shared_tokens_block == 12


def test_split_edges_keep_both_branches():
    seqs = [[5] * 10, [5] * 4 + [6] * 6, [5] * 4 + [7], [5] * 4 + [6] * 3 + [1], [5] * 12]
    assert shared_prefix_lengths(seqs) == [0, 4, 4, 7, 10]


def test_disjoint_traffic_has_no_redundancy():
    seqs = [[i] * 40 for i in range(10)]
    a = analyze_tokens(seqs, block_size=16, capacities=None)
    assert a.shared_tokens == 0 and a.redundant_fraction == 0
    assert all(p.hit_ratio == 0 for p in a.curve)
    assert a.verdict().startswith("Not worth it")


def shared_preamble_trace(n: int = 20, preamble: int = 64, tail: int = 16) -> list[list[int]]:
    return [list(range(preamble)) + [1000 + i] * tail for i in range(n)]


def test_unbounded_replay_serves_exactly_the_block_aligned_redundancy():
    seqs = shared_preamble_trace() + [[5, 5, 5] * 11, [5, 5, 5] * 12]
    a = analyze_tokens(seqs, block_size=16, capacities=[10_000])
    assert a.curve[0].hit_tokens == a.shared_tokens_block
    assert a.curve[0].hit_ratio == pytest.approx(a.redundant_fraction_block)


def test_working_set_is_the_unbounded_cache_size():
    seqs = shared_preamble_trace(n=5, preamble=64, tail=16)
    a = analyze_tokens(seqs, block_size=16, capacities=[])
    assert a.working_set_blocks == 4 + 5 * 1


def test_cache_too_small_for_the_preamble_loses_it_under_lru():
    seqs = shared_preamble_trace(n=10, preamble=64, tail=32)  # 4 shared blocks + 2 own
    big = replay(seqs, 64, 16, "lru")
    small = replay(seqs, 2, 16, "lru")
    assert big.hit_tokens == 9 * 64
    assert small.hit_tokens < big.hit_tokens


def test_hit_ratio_grows_with_cache_size_and_needed_capacity_is_found():
    seqs = [list(range(100 * k, 100 * k + 64)) + [9000 + i] * 16 for i in range(8) for k in (0, 1)]
    a = analyze_tokens(seqs, block_size=16, kv_bytes=100)
    ratios = [p.hit_ratio for p in a.curve]
    assert ratios == sorted(ratios)
    need = a.needed_capacity()
    assert need is not None and need.capacity_bytes == need.capacity_blocks * 16 * 100
    assert need.hit_ratio >= 0.9 * a.redundant_fraction_block
    assert a.verdict().startswith("Worth it")


def test_kv_bytes_per_token_of_smollm2_135m():
    cfg = SimpleNamespace(num_layers=30, num_kv_heads=3, head_dim=64)
    assert kv_bytes_per_token(cfg, "bfloat16") == 2 * 30 * 3 * 64 * 2
    assert kv_bytes_per_token(cfg, "float32") == 2 * 30 * 3 * 64 * 4


class FakeTokenizer:
    def encode(self, text):
        return [ord(c) for c in text]

    def apply_chat_template(self, messages):
        return self.encode("".join(f"<{m['role']}>{m['content']}" for m in messages) + "<a>")


def write_lines(tmp_path, lines):
    p = tmp_path / "trace.jsonl"
    p.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    return p


def test_trace_accepts_chat_prompt_token_and_batch_lines(tmp_path):
    p = write_lines(
        tmp_path,
        [
            {"id": "c", "messages": [{"role": "user", "content": "hi"}]},
            {"prompt": "abc", "model": "m", "max_tokens": 3},
            {"prompt": [1, 2, 3]},
            {"custom_id": "b", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}},
            {"prompt": ["p", "q"]},
        ],
    )
    reqs = read_trace(p)
    assert [r.id for r in reqs] == ["c", "line2", "line3", "b", "line5.0", "line5.1"]
    ids = tokenize(reqs, FakeTokenizer())
    assert ids[0] == FakeTokenizer().encode("<user>hi<a>")
    assert ids[1] == [97, 98, 99] and ids[2] == [1, 2, 3] and ids[5] == [113]


def test_trace_is_ordered_by_timestamp_when_every_line_has_one(tmp_path):
    p = write_lines(
        tmp_path,
        [
            {"id": "late", "timestamp": 2.0, "prompt": "a"},
            {"id": "early", "timestamp": 1, "prompt": "b"},
        ],
    )
    assert [r.id for r in read_trace(p)] == ["early", "late"]


def test_trace_errors_name_the_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"prompt": "ok"}\n{"nothing": 1}\n')
    with pytest.raises(ValueError, match="line 2"):
        read_trace(p)
    p.write_text("not json\n")
    with pytest.raises(ValueError, match="line 1"):
        read_trace(p)


class StrictTokenizer(FakeTokenizer):
    def apply_chat_template(self, messages):
        if any(m["role"] == "tool" for m in messages):
            raise ValueError("bad role")
        return super().apply_chat_template(messages)


def test_requests_the_template_rejects_are_skipped_or_raise():
    from radixserve.bench.analyze import TraceRequest

    reqs = [
        TraceRequest("ok", None, prompt="ab"),
        TraceRequest("bad", None, messages=[{"role": "tool", "content": "x"}]),
    ]
    skipped: list[str] = []
    assert tokenize(reqs, StrictTokenizer(), skipped) == [[97, 98]]
    assert skipped and skipped[0].startswith("bad:")
    with pytest.raises(ValueError, match="request bad"):
        tokenize(reqs, StrictTokenizer())


def test_policy_curves_replay_each_policy_at_the_same_capacities():
    from radixserve.bench.analyze_report import format_analysis

    hot = list(range(64))  # a 4-block preamble reused by every other request
    seqs = []
    for i in range(12):
        seqs.append(hot + [5000 + i] * 16)
        seqs.append([7000 + i] * 96)  # two one-off 6-block prompts between them
        seqs.append([8000 + i] * 96)
    policies = ["lru", "slru", "fanout"]
    a = analyze_tokens(seqs, block_size=16, capacities=[12, 14, 64], policies=policies)
    assert [p.capacity_blocks for p in a.policy_curves["lru"]] == [12, 14, 64]
    lru, slru, fanout = ([p.hit_ratio for p in a.policy_curves[n]] for n in policies)
    assert slru[0] > lru[0] == 0  # the preamble survives the one-offs
    assert fanout[0] > lru[0]
    assert slru[-1] == lru[-1] == fanout[-1]  # with room for everything, policies tie
    assert "hit ratio by eviction policy" in format_analysis(a)
