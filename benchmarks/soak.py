"""Soak test: mixed traffic against a real server for a set time, watching for slow leaks.

Traffic (weights): shared-prefix chat sessions, RAG questions over a few long documents, unique
prompts, streams the client abandons after a few chunks, and 5% bad requests. Once a second it
samples the server's RSS, open file descriptors and threads (from /proc), the KV pool
(free / cached / locked / private blocks from /v1/cache/stats), in-flight requests and latency.

It fails (exit 1) when RSS grows more than --max-rss-growth after warm-up (median of the first
minute after warm-up vs median of the last minute), when any block stays locked or private once
the traffic has stopped, on any 5xx, or when any request is lost (the client saw neither a
response nor an error: timeouts, dropped connections, a stream that ended without [DONE]).

    python benchmarks/soak.py --duration 1500                       # starts its own server
    python benchmarks/soak.py --url http://127.0.0.1:8000 --pid 1234 --duration 600
Writes soak.json and soak.png to --out (default bench-results/soak).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from radixserve.bench.client import make_client
from radixserve.bench.corpus import Corpus
from radixserve.bench.report import percentile
from radixserve.bench.servers import ServerProcess, radixserve_command

DEFAULT_SERVE = "--kv-cache-memory 128MiB --max-model-len 2048 --dtype float32"
KINDS = {"chat": 0.35, "rag": 0.25, "unique": 0.20, "cancelled_stream": 0.15, "bad": 0.05}
BAD_BODIES: list[tuple[str, dict[str, Any]]] = [
    ("/v1/chat/completions", {"json": {"messages": [{"role": "user"}]}}),
    ("/v1/chat/completions", {"json": {"messages": [{"role": "user", "content": None}]}}),
    (
        "/v1/chat/completions",
        {"json": {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}},
    ),
    ("/v1/completions", {"json": {"prompt": "hi", "max_tokens": -1}}),
    ("/v1/completions", {"content": b'{"prompt": "hi",'}),
    ("/v1/completions", {"json": {"prompt": "hi", "model": "no-such-model"}}),
    ("/v1/completions", {"json": {"prompt": [10**9]}}),
]


@dataclass
class Outcome:
    """How one request ended, as the client saw it."""

    kind: str
    start: float
    latency: float
    status: int | None  # None: no response at all
    result: str  # ok | rejected (4xx) | cancelled | server_error | lost | unexpected


@dataclass
class Sample:
    """One second of the server's life."""

    t: float
    rss_mb: float | None
    fds: int | None
    threads: int | None
    blocks_free: int
    blocks_cached: int
    blocks_locked: int
    blocks_private: int
    in_flight: int
    done: int
    p50_ms: float | None
    p99_ms: float | None


@dataclass
class Soak:
    """Shared state of one soak run."""

    url: str
    pid: int | None
    rng: random.Random
    corpus: Corpus
    max_tokens: int
    outcomes: list[Outcome] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    in_flight: int = 0
    stop: bool = False


def proc_stats(pid: int | None) -> tuple[float | None, int | None, int | None]:
    """RSS in MiB, open fds and threads of `pid`, read from /proc (None where unreadable)."""
    if pid is None:
        return None, None, None
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        rss = int(fields["VmRSS"].split()[0]) / 1024
        threads = int(fields["Threads"])
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        return rss, fds, threads
    except (OSError, KeyError, ValueError):
        return None, None, None


def text(soak: Soak, tokens: int) -> str:
    """Fresh corpus text, or random words once the corpus runs dry."""
    try:
        return soak.corpus.passage(tokens)
    except RuntimeError:
        return " ".join(f"w{soak.rng.randrange(10**6)}" for _ in range(tokens))


async def one_request(client: httpx.AsyncClient, soak: Soak, kind: str, state: dict) -> None:
    """Send one request of `kind`, record its outcome; never raises."""
    rng = soak.rng
    max_tokens = rng.randint(4, soak.max_tokens)
    stream, cancel_after = False, None
    path, kwargs = "/v1/chat/completions", {}
    if kind == "chat":
        history = state.setdefault("history", [])
        if len(history) >= 8:
            history.clear()
        history.append({"role": "user", "content": soak.corpus.sentence(30)})
        messages = [{"role": "system", "content": state["system"]}, *history]
        stream = rng.random() < 0.5
        kwargs = {"json": {"messages": messages, "max_tokens": max_tokens, "stream": stream}}
    elif kind == "rag":
        doc = rng.choice(state["docs"])
        question = f"Question: {soak.corpus.sentence(25)} Answer from the document."
        msgs = [{"role": "user", "content": f"Document:\n{doc}\n\n{question}"}]
        kwargs = {"json": {"messages": msgs, "max_tokens": max_tokens}}
    elif kind == "unique":
        path = "/v1/completions"
        body = {"prompt": text(soak, rng.randint(30, 300)), "max_tokens": max_tokens}
        kwargs = {"json": body}
    elif kind == "cancelled_stream":
        stream, cancel_after = True, rng.randint(1, 4)
        msgs = [{"role": "user", "content": text(soak, rng.randint(20, 120))}]
        kwargs = {"json": {"messages": msgs, "max_tokens": 64, "stream": True}}
    else:
        path, kwargs = rng.choice(BAD_BODIES)
    start = time.monotonic()
    status: int | None = None
    result = "lost"
    soak.in_flight += 1
    try:
        if stream:
            async with client.stream("POST", soak.url + path, **kwargs) as r:
                status = r.status_code
                if status != 200:
                    await r.aread()
                    result = classify(status, kind)
                else:
                    chunks, saw_done, reply = 0, False, []
                    async for line in r.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        if line == "data: [DONE]":
                            saw_done = True
                            break
                        chunks += 1
                        if '"error"' in line[:20]:
                            result = "server_error"
                            break
                        reply.append(json.loads(line[6:])["choices"][0]["delta"].get("content"))
                        if cancel_after is not None and chunks >= cancel_after:
                            result = "cancelled"
                            break  # leaving the block closes the connection mid-stream
                    if saw_done:
                        result = "ok"
                        if kind == "chat":
                            content = "".join(c for c in reply if c)
                            state["history"].append({"role": "assistant", "content": content})
        else:
            r = await client.post(soak.url + path, **kwargs)
            status = r.status_code
            result = classify(status, kind)
            if result == "ok" and kind == "chat":
                reply = r.json()["choices"][0]["message"]["content"]
                state["history"].append({"role": "assistant", "content": reply})
    except (httpx.HTTPError, ValueError, KeyError):
        result = "lost" if result not in ("cancelled",) else result
    finally:
        soak.in_flight -= 1
    if kind == "chat" and result != "ok":
        state["history"].clear()  # keep the roles alternating
    soak.outcomes.append(Outcome(kind, start, time.monotonic() - start, status, result))


def classify(status: int, kind: str) -> str:
    """The result a final status stands for (a bad request must be rejected with a 4xx)."""
    if status >= 500:
        return "server_error"
    if 400 <= status < 500:
        return "rejected" if kind == "bad" else "unexpected"
    return "ok" if kind != "bad" else "unexpected"


async def client_loop(client: httpx.AsyncClient, soak: Soak, docs: list[str], sys_p: str) -> None:
    """One virtual user: picks a kind by weight, sends it, repeats until told to stop."""
    state: dict[str, Any] = {"docs": docs, "system": sys_p}
    kinds, weights = list(KINDS), list(KINDS.values())
    while not soak.stop:
        await one_request(client, soak, soak.rng.choices(kinds, weights)[0], state)


async def sampler(client: httpx.AsyncClient, soak: Soak, t0: float) -> None:
    """Append one Sample per second until told to stop."""
    seen = 0
    while not soak.stop:
        await asyncio.sleep(1.0)
        soak.samples.append(await take_sample(client, soak, t0, seen))
        seen = len(soak.outcomes)


async def take_sample(client: httpx.AsyncClient, soak: Soak, t0: float, seen: int) -> Sample:
    """Process, pool and latency figures now; latency over outcomes since index `seen`."""
    rss, fds, threads = proc_stats(soak.pid)
    try:
        stats = (await client.get(soak.url + "/v1/cache/stats", timeout=10)).json()
    except (httpx.HTTPError, ValueError):
        stats = {}
    recent = [o.latency * 1000 for o in soak.outcomes[seen:] if o.result == "ok"]
    return Sample(
        t=round(time.monotonic() - t0, 2),
        rss_mb=rss,
        fds=fds,
        threads=threads,
        blocks_free=int(stats.get("free_blocks", -1)),
        blocks_cached=int(stats.get("cached_blocks", -1)),
        blocks_locked=int(stats.get("locked_blocks", -1)),
        blocks_private=int(stats.get("private_blocks", -1)),
        in_flight=soak.in_flight,
        done=len(soak.outcomes) - seen,
        p50_ms=percentile(recent, 50) if recent else None,
        p99_ms=percentile(recent, 99) if recent else None,
    )


def rss_growth(samples: list[Sample], warmup: float, window: float = 60.0) -> dict[str, Any]:
    """Median RSS of the first `window` s after warm-up vs of the last `window` s."""
    after = [s for s in samples if s.t >= warmup and s.rss_mb is not None]
    if not after:
        return {"baseline_mb": None, "final_mb": None, "growth": None}
    end = after[-1].t
    first = [s.rss_mb for s in after if s.t < warmup + window]
    last = [s.rss_mb for s in after if s.t > end - window]
    base, final = statistics.median(first), statistics.median(last)  # type: ignore[type-var]
    return {"baseline_mb": base, "final_mb": final, "growth": final / base - 1}


def summarize(soak: Soak, idle: Sample, warmup: float, max_growth: float) -> dict[str, Any]:
    """Counts, latencies, RSS growth, idle blocks and the list of failed checks."""
    outcomes = soak.outcomes
    by_result = Counter(o.result for o in outcomes)
    by_kind = {k: dict(Counter(o.result for o in outcomes if o.kind == k)) for k in KINDS}
    ok_ms = sorted(o.latency * 1000 for o in outcomes if o.result == "ok")
    growth = rss_growth(soak.samples, warmup)
    fives = sum(1 for o in outcomes if o.status is not None and o.status >= 500)
    lost = by_result.get("lost", 0)
    failures = []
    if growth["growth"] is not None and growth["growth"] > max_growth:
        failures.append(f"RSS grew {growth['growth']:.1%} after warm-up (limit {max_growth:.0%})")
    if idle.blocks_locked != 0 or idle.blocks_private != 0:
        failures.append(
            f"idle pool holds {idle.blocks_locked} locked / {idle.blocks_private} private blocks"
        )
    if fives:
        failures.append(f"{fives} responses with a 5xx status")
    if by_result.get("server_error", 0) > fives:
        failures.append("streams ended with an error event")
    if lost:
        failures.append(f"{lost} requests lost (no response, no error)")
    if by_result.get("unexpected", 0):
        failures.append(f"{by_result['unexpected']} unexpected statuses")
    procs = [s for s in soak.samples if s.fds is not None]
    return {
        "requests": len(outcomes),
        "by_result": dict(by_result),
        "by_kind": by_kind,
        "status_5xx": fives,
        "lost": lost,
        "latency_ok_ms": {
            "p50": percentile(ok_ms, 50) if ok_ms else None,
            "p99": percentile(ok_ms, 99) if ok_ms else None,
        },
        "rss": growth,
        "fds_first_last": [procs[0].fds, procs[-1].fds] if procs else None,
        "threads_first_last": [procs[0].threads, procs[-1].threads] if procs else None,
        "idle_blocks": {
            "locked": idle.blocks_locked,
            "private": idle.blocks_private,
            "cached": idle.blocks_cached,
            "free": idle.blocks_free,
        },
        "failures": failures,
        "passed": not failures,
    }


def plot(
    samples: list[Sample], outcomes: list[Outcome], t0: float, warmup: float, path: Path
) -> None:
    """Four panels over time: RSS, fds/threads, pool blocks, latency of each request."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s.t / 60 for s in samples]
    fig, ax = plt.subplots(4, 1, figsize=(9, 10), sharex=True)
    ax[0].plot(t, [s.rss_mb for s in samples], label="RSS MiB")
    ax[0].axvline(warmup / 60, color="grey", ls="--", label="end of warm-up")
    ax[1].plot(t, [s.fds for s in samples], label="open fds")
    ax[1].plot(t, [s.threads for s in samples], label="threads")
    for name in ("free", "cached", "locked", "private"):
        ax[2].plot(t, [getattr(s, f"blocks_{name}") for s in samples], label=f"{name} blocks")
    for result, color in (("ok", "tab:blue"), ("rejected", "tab:orange")):
        done = [o for o in outcomes if o.result == result]
        ax[3].scatter(
            [(o.start + o.latency - t0) / 60 for o in done],
            [o.latency * 1000 for o in done],
            s=6,
            color=color,
            label=f"latency ms ({result})",
        )
    ax[3].set_xlabel("minutes")
    for a in ax:
        a.legend(loc="upper left", fontsize=8)
        a.grid(alpha=0.3)
    fig.suptitle("radixserve soak")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


async def run(args: argparse.Namespace, url: str, pid: int | None) -> dict[str, Any]:
    """Drive the traffic for args.duration seconds, then check the idle server."""
    rng = random.Random(args.seed)
    corpus = Corpus(args.seed)
    soak = Soak(url=url, pid=pid, rng=rng, corpus=corpus, max_tokens=args.max_tokens)
    docs = [corpus.passage(400) for _ in range(6)]
    system = "You are a concise assistant. " + corpus.passage(150)
    t0 = time.monotonic()
    async with make_client(args.api_key, timeout=args.request_timeout) as client:
        tasks = [
            asyncio.create_task(client_loop(client, soak, docs, system))
            for _ in range(args.concurrency)
        ]
        sampling = asyncio.create_task(sampler(client, soak, t0))
        while time.monotonic() - t0 < args.duration:
            await asyncio.sleep(5)
            if args.progress and soak.samples:
                s = soak.samples[-1]
                print(
                    f"t={s.t:6.0f}s requests={len(soak.outcomes)} rss={s.rss_mb}MiB "
                    f"fds={s.fds} locked={s.blocks_locked} in_flight={s.in_flight}",
                    flush=True,
                )
        soak.stop = True
        await asyncio.gather(*tasks)  # every request in flight ends: a response or an error
        await sampling
        await asyncio.sleep(args.idle_wait)
        idle = await take_sample(client, soak, t0, len(soak.outcomes))
    result = summarize(soak, idle, args.warmup, args.max_rss_growth)
    result["config"] = {k: v for k, v in vars(args).items() if k != "api_key"}
    result["duration_s"] = round(time.monotonic() - t0, 1)
    result["samples"] = [asdict(s) for s in soak.samples]
    result["outcomes"] = [{**asdict(o), "start": round(o.start - t0, 3)} for o in soak.outcomes]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(result, indent=1))
    plot(soak.samples, soak.outcomes, t0, args.warmup, out / "soak.png")
    return result


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, start the server unless --url is given, soak, print the verdict."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", help="soak this server instead of starting one")
    p.add_argument("--pid", type=int, help="with --url: the server's pid, for RSS/fds/threads")
    p.add_argument("--serve-args", default=DEFAULT_SERVE, help="options of the started server")
    p.add_argument("--api-key", default=None)
    p.add_argument("--duration", type=float, default=1500.0, help="seconds of traffic")
    p.add_argument("--warmup", type=float, default=180.0, help="seconds before RSS is judged")
    p.add_argument("--concurrency", type=int, default=6, help="virtual users")
    p.add_argument("--max-tokens", type=int, default=24, help="upper bound of max_tokens")
    p.add_argument("--max-rss-growth", type=float, default=0.05)
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--idle-wait", type=float, default=3.0, help="seconds before the idle check")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-results/soak")
    p.add_argument("--progress", action="store_true", help="print a line every 5 s")
    args = p.parse_args(argv)
    if args.url:
        result = asyncio.run(run(args, args.url.rstrip("/"), args.pid))
    else:
        server = ServerProcess(radixserve_command(*args.serve_args.split()), args.out)
        with server:
            assert server.proc is not None
            result = asyncio.run(run(args, server.url, server.proc.pid))
    summary = {k: v for k, v in result.items() if k not in ("samples", "outcomes", "config")}
    print(json.dumps(summary, indent=1))
    print("PASS" if result["passed"] else "FAIL: " + "; ".join(result["failures"]))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
