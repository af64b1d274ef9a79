"""Trace analysis: how much prefill a radix cache would remove, and how much memory it needs.

Reads a JSONL trace (see docs/bench.md), tokenizes every request the way the server does
(chat template for messages), measures each request's longest prefix shared with any earlier
request (exact, with a compressed token trie), and replays the trace through `RadixCache`
with the server's default eviction policy at several capacities (a miss-ratio curve), and
with each policy asked for at the same capacities (one curve per policy).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from radixserve.bench.report import percentile
from radixserve.cache import DEFAULT_POLICY

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}
WORTH_IT = 0.30  # block-aligned redundant fraction above which the cache clearly pays
MARGINAL = 0.10  # below this, it does not
KNEE = 0.90  # "enough memory" keeps this share of the unbounded cache's savings


class ChatTokenizer(Protocol):
    """What the analyzer needs from a tokenizer (radixserve.engine.tokenizer.Tokenizer)."""

    def encode(self, text: str) -> list[int]: ...

    def apply_chat_template(self, messages: Sequence[dict[str, Any]]) -> list[int]: ...


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace, before tokenization."""

    id: str
    timestamp: float | None
    messages: list[dict[str, Any]] | None = None
    prompt: str | list[int] | None = None


def _requests_of(obj: dict[str, Any], lineno: int) -> list[TraceRequest]:
    body = obj.get("body", obj)  # OpenAI Batch API lines wrap the body
    if not isinstance(body, dict):
        raise ValueError(f"line {lineno}: 'body' must be an object")
    rid = str(obj.get("id", obj.get("custom_id", body.get("id", f"line{lineno}"))))
    ts = obj.get("timestamp", body.get("timestamp"))
    ts = float(ts) if ts is not None else None
    if "messages" in body:
        if not isinstance(body["messages"], list):
            raise ValueError(f"line {lineno}: 'messages' must be a list")
        return [TraceRequest(rid, ts, messages=body["messages"])]
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [TraceRequest(rid, ts, prompt=prompt)]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return [TraceRequest(rid, ts, prompt=list(prompt))]
    if isinstance(prompt, list) and all(isinstance(p, (str, list)) for p in prompt):
        return [TraceRequest(f"{rid}.{i}", ts, prompt=p) for i, p in enumerate(prompt)]
    raise ValueError(f"line {lineno}: needs 'messages' or 'prompt'")


def read_trace(path: str | Path) -> list[TraceRequest]:
    """Requests of a JSONL trace, in arrival order (by timestamp when every line has one)."""
    out: list[TraceRequest] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"line {lineno}: not JSON: {e}") from e
            if not isinstance(obj, dict):
                raise ValueError(f"line {lineno}: expected a JSON object")
            out.extend(_requests_of(obj, lineno))
    if out and all(r.timestamp is not None for r in out):
        out.sort(key=lambda r: r.timestamp or 0.0)  # stable: ties keep file order
    return out


def tokenize(
    requests: Iterable[TraceRequest],
    tokenizer: ChatTokenizer,
    skipped: list[str] | None = None,
) -> list[list[int]]:
    """Prompt token ids of each request (chat template with the generation prompt). A request
    the template rejects raises ValueError, or is left out and noted in `skipped` if given."""
    out = []
    for r in requests:
        try:
            if r.messages is not None:
                out.append(list(tokenizer.apply_chat_template(r.messages)))
            elif isinstance(r.prompt, list):
                out.append(list(r.prompt))
            else:
                out.append(tokenizer.encode(r.prompt or ""))
        except ValueError as e:
            if skipped is None:
                raise ValueError(f"request {r.id}: {e}") from e
            skipped.append(f"{r.id}: {e}")
    return out


class _Node:
    __slots__ = ("children",)

    def __init__(self) -> None:
        self.children: dict[int, tuple[list[int], _Node]] = {}


def shared_prefix_lengths(seqs: Iterable[Sequence[int]]) -> list[int]:
    """For each sequence, the length of its longest common prefix with any earlier one
    (exact, token granularity; a compressed trie keeps it O(total tokens))."""
    root = _Node()
    out = []
    for seq in seqs:
        node, i, n = root, 0, len(seq)
        while i < n:
            entry = node.children.get(seq[i])
            if entry is None:
                node.children[seq[i]] = (list(seq[i:]), _Node())
                break
            edge, child = entry
            j, m = 1, min(len(edge), n - i)
            while j < m and edge[j] == seq[i + j]:
                j += 1
            i += j
            if j < len(edge):
                if i < n:  # diverges inside the edge: split it and hang the rest off the split
                    mid = _Node()
                    mid.children[edge[j]] = (edge[j:], child)
                    mid.children[seq[i]] = (list(seq[i:]), _Node())
                    node.children[edge[0]] = (edge[:j], mid)
                break
            node = child
        out.append(i)
    return out


@dataclass
class CachePoint:
    """Replay result at one cache capacity."""

    capacity_blocks: int
    capacity_bytes: int
    hit_tokens: int
    hit_ratio: float
    evicted_blocks: int


def replay(
    seqs: Sequence[Sequence[int]],
    capacity_blocks: int,
    block_size: int,
    policy: str = DEFAULT_POLICY,
) -> CachePoint:
    """Send the trace through a `RadixCache` of `capacity_blocks` evicting by `policy` (a
    name of `radixserve.cache.POLICIES`); each request's full blocks are inserted after it
    is looked up (as the server does)."""
    from radixserve.cache import BlockPool, RadixCache, make_policy

    pool = BlockPool(num_blocks=capacity_blocks)
    cache = RadixCache(pool, block_size=block_size, policy=make_policy(policy))
    hit = total = evicted = 0
    for seq in seqs:
        total += len(seq)
        m = cache.match_prefix(list(seq))
        hit += m.num_tokens
        need = len(seq) // block_size - len(m.blocks)
        if need <= 0:
            continue
        cache.lock(m.node)
        if pool.num_free < need:
            evicted += cache.evict(need - pool.num_free)
        new = pool.allocate(min(need, pool.num_free))
        cache.unlock(m.node)
        if not new:
            continue
        blocks = list(m.blocks) + new
        res = cache.insert(list(seq[: len(blocks) * block_size]), blocks)
        if res.duplicate_blocks:
            pool.free(res.duplicate_blocks)
    return CachePoint(capacity_blocks, 0, hit, hit / total if total else 0.0, evicted)


def kv_bytes_per_token(model_config: Any, dtype: str = "bfloat16") -> int:
    """2 (K and V) * layers * kv_heads * head_dim * bytes per element."""
    c = model_config
    return int(2 * c.num_layers * c.num_kv_heads * c.head_dim * DTYPE_BYTES[dtype])


def default_capacities(working_set_blocks: int) -> list[int]:
    """Capacities from 1/64 of the unbounded cache's size up to all of it."""
    caps = {max(1, math.ceil(working_set_blocks / d)) for d in (64, 32, 16, 8, 4, 2, 4 / 3, 1)}
    return sorted(caps)


@dataclass
class Analysis:
    """Everything `radixserve analyze` reports."""

    num_requests: int
    prompt_tokens: int
    shared_tokens: int
    shared_tokens_block: int
    block_size: int
    kv_bytes_per_token: int
    kv_dtype: str
    working_set_blocks: int
    shared_lengths: list[int] = field(repr=False)
    curve: list[CachePoint] = field(default_factory=list)
    policy: str = DEFAULT_POLICY  # of `curve`
    policy_curves: dict[str, list[CachePoint]] = field(default_factory=dict)
    # False for block-hash traces: shares are known only at the trace's block granularity.
    exact: bool = True
    trace_format: str = "openai"
    # Block-hash traces with request kinds or turns: label -> requests, prompt_tokens, reusable.
    breakdown: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def redundant_fraction(self) -> float:
        """Exact share of prompt tokens that repeat a prefix of an earlier request."""
        return self.shared_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def redundant_fraction_block(self) -> float:
        """The same, counting only whole blocks (what a block-granular cache can serve)."""
        return self.shared_tokens_block / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def bytes_per_block(self) -> int:
        """KV bytes of one cache block."""
        return self.kv_bytes_per_token * self.block_size

    def needed_capacity(self) -> CachePoint | None:
        """Smallest replayed capacity keeping KNEE of the unbounded cache's savings."""
        goal = KNEE * self.redundant_fraction_block
        for p in self.curve:
            if goal > 0 and p.hit_ratio >= goal - 1e-12:
                return p
        return None

    def verdict(self) -> str:
        """A plain recommendation."""
        f = self.redundant_fraction_block
        need = self.needed_capacity()
        mem = (
            f" A cache of {human_bytes(need.capacity_bytes)} ({need.capacity_blocks} blocks) "
            f"keeps {need.hit_ratio:.0%} of prompt tokens out of prefill "
            f"(an unbounded one: {f:.0%})."
            if need
            else ""
        )
        if f >= WORTH_IT:
            return f"Worth it: {f:.0%} of prompt tokens are a repeated prefix.{mem}"
        if f >= MARGINAL:
            return f"Modest gain: {f:.0%} of prompt tokens are a repeated prefix.{mem}"
        return (
            f"Not worth it: only {f:.0%} of prompt tokens are a repeated prefix; "
            "the cache would mostly hold single-use entries."
        )

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (with derived figures)."""
        d = asdict(self)
        d.update(
            redundant_fraction=self.redundant_fraction,
            redundant_fraction_block=self.redundant_fraction_block,
            shared_prefix_percentiles=self.shared_percentiles(),
            verdict=self.verdict(),
        )
        return d

    def shared_percentiles(self) -> dict[str, float]:
        """p50/p90/p99/max of the per-request shared-prefix length, in tokens."""
        xs = [float(x) for x in self.shared_lengths]
        return {
            "p50": percentile(xs, 50),
            "p90": percentile(xs, 90),
            "p99": percentile(xs, 99),
            "max": max(xs, default=0.0),
        }


def analyze_tokens(
    seqs: Sequence[Sequence[int]],
    block_size: int = 16,
    kv_bytes: int = 0,
    kv_dtype: str = "bfloat16",
    capacities: Sequence[int] | None = None,
    policies: Sequence[str] = (),
) -> Analysis:
    """Analyze already-tokenized prompts (in arrival order); with `policies`, also replay
    each of them at the capacities of the main curve."""
    lengths = shared_prefix_lengths(seqs)
    block_shared = [lcp // block_size * block_size for lcp in lengths]
    working = sum(
        len(s) // block_size - b // block_size for s, b in zip(seqs, block_shared, strict=True)
    )
    a = Analysis(
        num_requests=len(seqs),
        prompt_tokens=sum(len(s) for s in seqs),
        shared_tokens=sum(lengths),
        shared_tokens_block=sum(block_shared),
        block_size=block_size,
        kv_bytes_per_token=kv_bytes,
        kv_dtype=kv_dtype,
        working_set_blocks=working,
        shared_lengths=lengths,
    )

    def point(cap: int, policy: str = DEFAULT_POLICY) -> CachePoint:
        p = replay(seqs, cap, block_size, policy)
        p.capacity_bytes = cap * a.bytes_per_block
        return p

    fill_curves(a, point, capacities, policies)
    return a


def fill_curves(
    a: Analysis,
    point: Callable[[int, str], CachePoint],
    capacities: Sequence[int] | None,
    policies: Sequence[str],
) -> None:
    """Fill `a`'s miss-ratio curve (the default policy) and one curve per named policy, from
    `point(capacity, policy)`, over `capacities` or a grid around `a`'s working set (then
    refined around the knee)."""
    given = capacities is not None
    grid = list(capacities) if capacities is not None else default_capacities(a.working_set_blocks)
    a.curve = [point(c, DEFAULT_POLICY) for c in grid]
    for name in policies:
        a.policy_curves[name] = [point(c, name) for c in grid]
    if not given:
        refine_knee(a, lambda cap: point(cap, DEFAULT_POLICY))


def refine_knee(a: Analysis, point: Callable[[int], CachePoint]) -> None:
    """Bisect between the grid points around the knee so `needed_capacity` is tight."""
    found = a.needed_capacity()
    if found is None:
        return
    i = a.curve.index(found)
    lo = a.curve[i - 1].capacity_blocks if i > 0 else 0
    hi = found.capacity_blocks
    goal = KNEE * a.redundant_fraction_block
    while hi - lo > max(1, hi // 50):
        mid = (lo + hi) // 2
        p = point(mid)
        a.curve.append(p)
        if p.hit_ratio >= goal - 1e-12:
            hi = mid
        else:
            lo = mid
    a.curve.sort(key=lambda p: p.capacity_blocks)


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
