"""`radixserve analyze` on block-hash traces (Mooncake, Bailian), built here so that their
reusable prefill share is known by construction."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from radixserve.bench.analyze_cli import add_analyze_args, run_analyze
from radixserve.bench.hash_trace import (
    TraceLineError,
    analyze_hash_trace,
    detect_format,
    read_hash_trace,
    replay_hash_trace,
)


def write(path: Path, rows: list[dict[str, object] | str]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def mooncake(ts: int, length: int, ids: list[int], out: int = 10) -> dict[str, object]:
    return {"timestamp": ts, "input_length": length, "output_length": out, "hash_ids": ids}


def bailian(chat: int, parent: int, ts: float, length: int, ids: list[int], turn: int,
            kind: str = "text") -> dict[str, object]:  # fmt: skip
    return {
        "chat_id": chat, "parent_chat_id": parent, "timestamp": ts, "input_length": length,
        "output_length": 5, "type": kind, "turn": turn, "hash_ids": ids,
    }  # fmt: skip


def test_format_is_told_from_the_first_line(tmp_path: Path) -> None:
    assert detect_format(write(tmp_path / "m", [mooncake(0, 10, [1])])) == "mooncake"
    assert detect_format(write(tmp_path / "b", [bailian(1, -1, 0.0, 10, [1], 1)])) == "bailian"
    assert detect_format(write(tmp_path / "o", [{"prompt": "hi"}])) == "openai"


def test_mooncake_reusable_share_counts_the_tokens_of_shared_blocks(tmp_path: Path) -> None:
    # 512-token blocks. The second request shares two whole blocks (1,024 tokens); the third
    # repeats the first exactly, its last 476-token block included; the fourth shares none.
    trace = write(
        tmp_path / "t.jsonl",
        [
            mooncake(0, 1500, [1, 2, 3]),
            mooncake(1000, 1300, [1, 2, 4]),
            mooncake(2000, 1500, [1, 2, 3]),
            mooncake(3000, 100, [9]),
        ],
    )
    reqs = read_hash_trace(trace, "mooncake", 512)
    a = analyze_hash_trace(reqs, 512, "mooncake", kv_bytes=2, capacities=[])
    assert a.prompt_tokens == 1500 + 1300 + 1500 + 100
    assert a.shared_lengths == [0, 1024, 1500, 0]
    assert a.redundant_fraction_block == pytest.approx(2524 / 4400)
    assert a.working_set_blocks == 5  # 1, 2, 3, 4 and 9
    assert reqs[1].timestamp == 1.0  # milliseconds in the file


def test_bailian_is_ordered_by_timestamp_and_broken_down_by_type_and_turn(
    tmp_path: Path,
) -> None:
    # 16-token blocks. Turn 2 of chat 1 resends turn 1's three blocks (48 tokens) and adds
    # two; it comes first in the file but arrives later. Chat 2 is an unrelated search.
    trace = write(
        tmp_path / "t.jsonl",
        [
            bailian(11, 10, 5.0, 80, [1, 2, 3, 4, 5], turn=2),
            bailian(10, -1, 1.0, 48, [1, 2, 3], turn=1),
            bailian(20, -1, 2.0, 20, [7, 8], turn=1, kind="search"),
        ],
    )
    reqs = read_hash_trace(trace, "bailian", 16)
    assert [r.chat_id for r in reqs] == ["10", "20", "11"]
    assert reqs[2].parent_chat_id == "10" and reqs[0].parent_chat_id is None
    a = analyze_hash_trace(reqs, 16, "bailian", capacities=[])
    assert a.shared_lengths == [0, 0, 48]
    assert a.redundant_fraction_block == pytest.approx(48 / 148)
    assert a.breakdown["later turns"] == {"requests": 1, "prompt_tokens": 80, "reusable": 48}
    assert a.breakdown["type search"]["reusable"] == 0


def test_a_small_lru_cache_loses_what_an_unbounded_one_keeps(tmp_path: Path) -> None:
    # A 2-block preamble, then three 2-block one-offs, then the preamble again.
    rows = [mooncake(0, 32, [1, 2])] + [mooncake(i, 32, [10 + i, 20 + i]) for i in (1, 2, 3)]
    rows.append(mooncake(9, 32, [1, 2]))
    reqs = read_hash_trace(write(tmp_path / "t.jsonl", rows), "mooncake", 16)
    small, _ = replay_hash_trace(reqs, 4, 16, "lru")
    big, _ = replay_hash_trace(reqs, 10, 16, "lru")
    assert small.hit_tokens == 0 and big.hit_tokens == 32


def test_ids_beyond_32_bits_are_renumbered_with_the_same_result(tmp_path: Path) -> None:
    big = 2**40
    rows = [mooncake(0, 32, [big, big + 1]), mooncake(1, 32, [big, 7])]
    reqs = read_hash_trace(write(tmp_path / "t.jsonl", rows), "mooncake", 16)
    a = analyze_hash_trace(reqs, 16, "mooncake", capacities=[])
    assert a.shared_lengths == [0, 16]


def test_malformed_lines_are_reported_with_their_number_and_skipped(tmp_path: Path) -> None:
    rows: list[dict[str, object] | str] = [
        mooncake(0, 32, [1, 2]),
        "{not json",
        mooncake(1, 32, [1]),  # one id cannot hold 32 tokens of 16-token blocks
        {"timestamp": 2, "input_length": 16, "output_length": 1},
        mooncake(3, 32, [1, 2]),
    ]
    problems: list[str] = []
    reqs = read_hash_trace(write(tmp_path / "t.jsonl", rows), "mooncake", 16, False, problems)
    assert [r.line for r in reqs] == [1, 5]
    assert [p.split(":")[0] for p in problems] == ["line 2", "line 3", "line 4"]
    assert "needs 2 at --trace-block-size 16" in problems[1]
    with pytest.raises(TraceLineError, match="line 2"):
        read_hash_trace(tmp_path / "t.jsonl", "mooncake", 16, strict=True)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_analyze_args(parser)
    return parser.parse_args(argv)


def test_analyze_command_reads_a_mooncake_trace_without_a_tokenizer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from radixserve.engine.tokenizer import Tokenizer

    def no_tokenizer(*a: object, **k: object) -> None:
        raise AssertionError("a block-hash trace must not be tokenized")

    monkeypatch.setattr(Tokenizer, "from_dir", no_tokenizer)
    rows: list[dict[str, object] | str] = [mooncake(i, 1024, [0, 100 + i]) for i in range(6)]
    rows.insert(2, "garbage")
    trace = write(tmp_path / "t.jsonl", rows)
    out = tmp_path / "out"
    assert run_analyze(parse([str(trace), "--policy", "lru,slru", "--output-dir", str(out)])) == 0
    captured = capsys.readouterr()
    assert "skipped line 3: not JSON" in captured.err
    # six 1,024-token prompts; all but the first share block 0: 5 x 512 of 6,144 tokens
    assert "reusable prefill:         2560 (41.7%" in captured.out
    assert "hit ratio by eviction policy" in captured.out
    data = json.loads((out / "analysis.json").read_text())
    assert data["trace_format"] == "mooncake" and data["block_size"] == 512


def test_analyze_command_strict_stops_at_the_first_malformed_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = write(tmp_path / "t.jsonl", [mooncake(0, 10, [1]), "[]"])
    assert run_analyze(parse([str(trace), "--strict"])) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("radixserve analyze: error: ") and "line 2" in err[-1]
