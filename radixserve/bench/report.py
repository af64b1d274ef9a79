"""Summaries of a run (percentiles, throughput, cache hit ratio) and the tables that show them."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


def percentile(xs: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation; nan for no data."""
    if not xs:
        return math.nan
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


@dataclass
class RequestRecord:
    """What the client measured for one request (times in seconds)."""

    id: str
    session_id: str
    turn: int
    start: float  # since the start of the run
    ttft: float | None = None
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between streamed content chunks
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    chunks: int = 0
    finish_reason: str | None = None
    text: str = ""
    error: str | None = None
    tool_choice: str | None = None  # what the request sent ("named" for a named function)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI shape, as streamed
    # Speculative decoding, from the usage chunk's completion_tokens_details (OpenAI's
    # Predicted Outputs fields): tokens drafted (accepted + rejected) and accepted; None when
    # the server reported no drafts for the request.
    draft_tokens: int | None = None
    accepted_tokens: int | None = None

    @property
    def ok(self) -> bool:
        """Finished without a transport or HTTP error."""
        return self.error is None

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        n = self.completion_tokens or 0
        if self.ttft is None or n < 2:
            return None
        return (self.e2e - self.ttft) / (n - 1)

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Output tokens after the first per second after the first: (completion_tokens - 1)
        / (e2e - ttft), the decode speed speculation changes."""
        n = self.completion_tokens or 0
        if self.ttft is None or n < 2 or self.e2e <= self.ttft:
            return None
        return (n - 1) / (self.e2e - self.ttft)

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / drafted tokens (None without drafts)."""
        if not self.draft_tokens:
            return None
        return (self.accepted_tokens or 0) / self.draft_tokens


def _pcts(xs: Sequence[float]) -> dict[str, float]:
    return {
        "mean": sum(xs) / len(xs) if xs else math.nan,
        "p50": percentile(xs, 50),
        "p90": percentile(xs, 90),
        "p99": percentile(xs, 99),
    }


@dataclass
class Summary:
    """Aggregate figures of one run."""

    requests: int
    errors: int
    duration: float
    requests_per_s: float
    output_tokens_per_s: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cache_hit_ratio: float
    ttft: dict[str, float]
    itl: dict[str, float]
    tpot: dict[str, float]
    e2e: dict[str, float]
    # Decode speed: per request (completion_tokens - 1) / (e2e - ttft), and over all requests
    # (their decode tokens / their summed decode times, so a long answer weighs more).
    request_decode_tokens_per_s: dict[str, float] = field(default_factory=lambda: _pcts([]))
    decode_tokens_per_s: float = math.nan
    # Speculative decoding (zeros / nan when no request reported drafts).
    requests_with_drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    acceptance_rate: float = math.nan  # accepted / drafted over all requests
    request_acceptance_rate: dict[str, float] = field(default_factory=lambda: _pcts([]))

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)


def summarize(records: Sequence[RequestRecord], duration: float) -> Summary:
    """Percentiles (p50/p90/p99), requests/s, output tokens/s, the cache hit ratio, decode
    tokens/s, and the drafted and accepted tokens of speculative decoding."""
    ok = [r for r in records if r.ok]
    decoding = [r for r in ok if r.decode_tokens_per_s is not None]
    decode_tokens = sum((r.completion_tokens or 0) - 1 for r in decoding)
    decode_time = sum(r.e2e - (r.ttft or 0.0) for r in decoding)
    drafted = [r for r in ok if r.draft_tokens]
    draft = sum(r.draft_tokens or 0 for r in drafted)
    accepted = sum(r.accepted_tokens or 0 for r in drafted)
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    completion = sum(r.completion_tokens or 0 for r in ok)
    dur = max(duration, 1e-9)
    return Summary(
        requests=len(records),
        errors=len(records) - len(ok),
        duration=duration,
        requests_per_s=len(ok) / dur,
        output_tokens_per_s=completion / dur,
        prompt_tokens=prompt,
        cached_tokens=cached,
        completion_tokens=completion,
        cache_hit_ratio=cached / prompt if prompt else 0.0,
        ttft=_pcts([r.ttft for r in ok if r.ttft is not None]),
        itl=_pcts([x for r in ok for x in r.itl]),
        tpot=_pcts([t for r in ok if (t := r.tpot) is not None]),
        e2e=_pcts([r.e2e for r in ok]),
        request_decode_tokens_per_s=_pcts([r.decode_tokens_per_s or 0.0 for r in decoding]),
        decode_tokens_per_s=decode_tokens / decode_time if decode_time > 0 else math.nan,
        requests_with_drafts=len(drafted),
        draft_tokens=draft,
        accepted_tokens=accepted,
        acceptance_rate=accepted / draft if draft else math.nan,
        request_acceptance_rate=_pcts([r.acceptance_rate or 0.0 for r in drafted]),
    )


def _ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{x * 1000:.0f} ms"


def format_summary(s: Summary, title: str = "") -> str:
    """A short plain-text report of one run."""
    lines = [title] if title else []
    lines += [
        f"requests: {s.requests} ({s.errors} errors) in {s.duration:.1f} s: "
        f"{s.requests_per_s:.2f} req/s, {s.output_tokens_per_s:.1f} output tok/s",
        f"tokens: prompt {s.prompt_tokens}, cached {s.cached_tokens} "
        f"(hit ratio {s.cache_hit_ratio:.1%}), completion {s.completion_tokens}",
    ]
    for name in ("ttft", "itl", "tpot", "e2e"):
        d = getattr(s, name)
        lines.append(
            f"{name:>5}: p50 {_ms(d['p50'])}, p90 {_ms(d['p90'])}, p99 {_ms(d['p99'])}, "
            f"mean {_ms(d['mean'])}"
        )
    d = s.request_decode_tokens_per_s
    if not math.isnan(s.decode_tokens_per_s):
        lines.append(
            f"decode: {_rate(d['p50'])} tok/s p50, {_rate(d['mean'])} mean per request; "
            f"{_rate(s.decode_tokens_per_s)} tok/s over all requests"
        )
    if s.requests_with_drafts:
        a = s.request_acceptance_rate
        lines.append(
            f"speculation: {s.requests_with_drafts} requests with drafts, {s.draft_tokens} tokens "
            f"drafted, {s.accepted_tokens} accepted ({s.acceptance_rate:.1%}); per request "
            f"p50 {a['p50']:.1%}, mean {a['mean']:.1%}"
        )
    return "\n".join(lines)


def _rate(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.1f}"


# (label, getter, unit, higher is better)
COMPARE_ROWS: list[tuple[str, str, str, bool]] = [
    ("TTFT p50", "ttft.p50", "ms", False),
    ("TTFT p90", "ttft.p90", "ms", False),
    ("TTFT p99", "ttft.p99", "ms", False),
    ("ITL p50", "itl.p50", "ms", False),
    ("ITL p99", "itl.p99", "ms", False),
    ("TPOT p50", "tpot.p50", "ms", False),
    ("E2E p50", "e2e.p50", "ms", False),
    ("E2E p99", "e2e.p99", "ms", False),
    ("requests/s", "requests_per_s", "", True),
    ("output tok/s", "output_tokens_per_s", "", True),
    ("decode tok/s p50", "request_decode_tokens_per_s.p50", "", True),
    ("decode tok/s mean", "request_decode_tokens_per_s.mean", "", True),
    ("decode tok/s (all)", "decode_tokens_per_s", "", True),
    ("cache hit ratio", "cache_hit_ratio", "%", True),
    ("errors", "errors", "", False),
]
# Rows added when either side reported speculative drafts.
SPEC_ROWS: list[tuple[str, str, str, bool]] = [
    ("acceptance rate", "acceptance_rate", "%", True),
    ("acceptance p50/request", "request_acceptance_rate.p50", "%", True),
    ("acceptance mean/request", "request_acceptance_rate.mean", "%", True),
    ("drafted tokens", "draft_tokens", "", True),
    ("accepted tokens", "accepted_tokens", "", True),
]


def _get(s: Summary, path: str) -> float:
    head, _, key = path.partition(".")
    v = getattr(s, head)
    return float(v[key] if key else v)


def _fmt(v: float, unit: str) -> str:
    if math.isnan(v):
        return "-"
    if unit == "ms":
        return f"{v * 1000:.0f} ms"
    if unit == "%":
        return f"{v:.1%}"
    return f"{v:.2f}" if v != int(v) else f"{v:.0f}"


def ratio(a: float, b: float) -> str:
    """a / b as '1.23x' ('-' when undefined)."""
    if math.isnan(a) or math.isnan(b) or b == 0:
        return "-"
    return f"{a / b:.2f}x"


def compare_rows(a: Summary, b: Summary) -> list[tuple[str, str, str, str]]:
    """(metric, A, B, A/B) rows for a side-by-side table (decode tok/s included; the
    speculation rows too when either side reported drafts)."""
    rows = COMPARE_ROWS + (SPEC_ROWS if a.requests_with_drafts or b.requests_with_drafts else [])
    return [
        (label, _fmt(_get(a, p), unit), _fmt(_get(b, p), unit), ratio(_get(a, p), _get(b, p)))
        for label, p, unit, _ in rows
    ]


def format_compare(a: Summary, b: Summary, label_a: str, label_b: str) -> str:
    """A plain-text side-by-side table with A/B ratios."""
    rows = [("metric", label_a, label_b, f"{label_a}/{label_b}")] + compare_rows(a, b)
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    out = []
    for i, r in enumerate(rows):
        out.append(
            "  ".join(
                c.ljust(w) if j == 0 else c.rjust(w)
                for j, (c, w) in enumerate(zip(r, widths, strict=True))
            )
        )
        if i == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def same_answers(a: Sequence[RequestRecord], b: Sequence[RequestRecord]) -> tuple[int, int]:
    """(identical, paired): of the requests both sides answered without error, paired by id
    (and by order among repeats of an id), how many got the same text and tool calls (name
    and arguments; call ids are random). At
    temperature 0 two servers that decode the same way (speculation on vs off) agree on all."""
    rest: dict[str, list[RequestRecord]] = {}
    for r in b:
        rest.setdefault(r.id, []).append(r)
    same = paired = 0
    for r in a:
        others = rest.get(r.id)
        if not others:
            continue
        o = others.pop(0)
        if r.ok and o.ok:
            paired += 1
            same += (r.text, _calls(r)) == (o.text, _calls(o))
    return same, paired


def _calls(r: RequestRecord) -> list[Any]:
    """A record's tool calls without their ids (random per response)."""
    return [c.get("function") for c in r.tool_calls]


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub-flavoured Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)
