"""The agent workload's tools and its report: the five tool schemas every turn sends, whether a
returned call is valid against them, and the figures of a run split by `tool_choice` (TTFT and
time per output token, constrained vs free decoding; valid-call rate; later turns' cache hits)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from radixserve.bench.report import RequestRecord, percentile


def _function(
    name: str, description: str, props: dict[str, Any], required: list[str]
) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": props,
                "required": required,
                "additionalProperties": False,
            },
        },
    }


_STR = {"type": "string"}
AGENT_TOOLS: list[dict[str, Any]] = [
    _function("read_file", "Read a source file of the project", {"path": _STR}, ["path"]),
    _function(
        "grep",
        "Search the project for a regular expression",
        {"pattern": _STR, "path": _STR, "max_matches": {"type": "integer"}},
        ["pattern"],
    ),
    _function(
        "run",
        "Run a shell command in the project and return its output",
        {"cmd": _STR, "timeout_s": {"type": "integer"}},
        ["cmd"],
    ),
    _function("list_dir", "List the files of a folder", {"path": _STR}, ["path"]),
    _function(
        "write_file",
        "Replace the contents of a file",
        {"path": _STR, "content": _STR, "create": {"type": "boolean"}},
        ["path", "content"],
    ),
]
"""The same five functions, sent with every turn of every agent (so their schemas, like the
system prompt, are a prefix every request shares)."""

_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
}


def valid_call(call: dict[str, Any], tools: Sequence[dict[str, Any]] = AGENT_TOOLS) -> bool:
    """Whether an OpenAI `tool_calls` entry names one of `tools` and its arguments are a JSON
    object with the function's required keys, no keys it does not declare (the schemas here all
    say `additionalProperties: false`) and values of the declared types. This covers every
    keyword the AGENT_TOOLS schemas use; it is not a general JSON Schema validator."""
    fn = call.get("function") or {}
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    schema = schemas.get(fn.get("name"))
    if schema is None:
        return False
    try:
        args = json.loads(fn.get("arguments") or "")
    except json.JSONDecodeError:
        return False
    if not isinstance(args, dict) or not set(schema["required"]) <= args.keys():
        return False
    for key, value in args.items():
        prop = schema["properties"].get(key)
        if prop is None:
            return False
        types = _TYPES[prop["type"]]
        if not isinstance(value, types) or (bool not in types and isinstance(value, bool)):
            return False
    return True


def _p50(xs: list[float]) -> float:
    return percentile(xs, 50)


def agent_stats(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """The agent run's figures: per tool_choice ("required": decoding constrained to a valid
    call; "auto": free decoding, calls parsed from the text) the request count, TTFT and TPOT
    p50 (seconds), and the share that returned only valid calls; the per-token overhead of
    constrained decoding (TPOT p50 required / auto - 1); and the cache hit share of later turns
    (cached / prompt tokens over turns >= 1), also as a share of what was cacheable: the
    previous turn's prompt and output (each turn's new tool output cannot be a hit)."""
    ok = [r for r in records if r.ok]
    out: dict[str, Any] = {}
    for choice in ("required", "auto"):
        rs = [r for r in ok if r.tool_choice == choice]
        called = [r for r in rs if r.tool_calls]
        valid = [r for r in called if all(valid_call(c) for c in r.tool_calls)]
        out[choice] = {
            "requests": len(rs),
            "ttft_p50": _p50([r.ttft for r in rs if r.ttft is not None]),
            "tpot_p50": _p50([t for r in rs if (t := r.tpot) is not None]),
            "with_calls": len(called),
            "valid_call_rate": len(valid) / len(rs) if rs else math.nan,
        }
    req, auto = out["required"]["tpot_p50"], out["auto"]["tpot_p50"]
    out["constrained_tpot_overhead"] = req / auto - 1 if auto and not math.isnan(auto) else math.nan
    later = [r for r in ok if r.turn >= 1]
    prompt = sum(r.prompt_tokens or 0 for r in later)
    cached = sum(r.cached_tokens or 0 for r in later)
    out["later_turns"] = len(later)
    out["later_turn_ttft_p50"] = _p50([r.ttft for r in later if r.ttft is not None])
    out["later_turn_cache_hit_share"] = cached / prompt if prompt else math.nan
    turns = {(r.session_id, r.turn): r for r in ok}
    reusable = 0
    for r in later:
        prev = turns.get((r.session_id, r.turn - 1))
        if prev is not None:
            seen = (prev.prompt_tokens or 0) + (prev.completion_tokens or 0)
            reusable += min(r.prompt_tokens or 0, seen)
    out["later_turn_reusable_hit_share"] = cached / reusable if reusable else math.nan
    return out


def _ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{x * 1000:.0f} ms"


def format_agent(stats: dict[str, Any], title: str = "agent") -> str:
    """A plain-text report of `agent_stats`."""
    lines = [f"{title}: tool_choice required (constrained) vs auto (free decoding)"]
    for choice in ("required", "auto"):
        s = stats[choice]
        rate = "-" if math.isnan(s["valid_call_rate"]) else f"{s['valid_call_rate']:.0%}"
        lines.append(
            f"  {choice:>8}: {s['requests']} requests, TTFT p50 {_ms(s['ttft_p50'])}, "
            f"TPOT p50 {_ms(s['tpot_p50'])}, {s['with_calls']} with calls, "
            f"valid-call rate {rate}"
        )
    over = stats["constrained_tpot_overhead"]
    hit, reuse = stats["later_turn_cache_hit_share"], stats["later_turn_reusable_hit_share"]
    lines.append(
        "  constrained time per output token: "
        + ("-" if math.isnan(over) else f"{over:+.1%} vs free decoding")
    )
    lines.append(
        f"  later turns ({stats['later_turns']}): TTFT p50 {_ms(stats['later_turn_ttft_p50'])}, "
        + ("cache hit share -" if math.isnan(hit) else f"cache hit share {hit:.1%}")
        + ("" if math.isnan(reuse) else f" ({reuse:.1%} of the previous turn's prompt + output)")
    )
    return "\n".join(lines)
