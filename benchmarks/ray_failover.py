"""A Ray Serve replica killed mid-load: is any request lost, and does routing recover?

Starts `radixserve serve --ray --replicas 2`, runs interleaved multi-turn chats (non-streamed)
through it, kills one engine replica's actor with `ray.kill` while they run, then waits for
Ray's replacement and runs a second round of chats. Reports requests answered / sent in each
phase, the seconds until the replacement was RUNNING, the later-turn cache hit ratio of each
phase and the requests each replica served.

    python benchmarks/ray_failover.py                    # default model, ~5 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from radixserve.bench.servers import ServerProcess, radixserve_command


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--kill-after", type=float, default=8.0, help="seconds into phase 1")
    p.add_argument("--kv-cache-mib", type=int, default=184)
    p.add_argument("--startup-timeout", type=float, default=900.0)
    return p.parse_args(argv)


def chat(url: str, topic: str, turns: int, max_tokens: int) -> list[tuple[int, int, int]]:
    """One conversation; (status, prompt tokens, cached tokens) per turn."""
    out = []
    messages: list[dict[str, str]] = [{"role": "system", "content": "You answer briefly."}]
    with httpx.Client(timeout=600) as c:
        for t in range(turns):
            text = f"Question {t} about {topic}: " + " ".join(f"{topic}-{t}-{j}" for j in range(12))
            messages.append({"role": "user", "content": text})
            r = c.post(
                url + "/v1/chat/completions",
                json={"messages": messages, "max_tokens": max_tokens, "temperature": 0},
            )
            if r.status_code != 200:
                out.append((r.status_code, 0, 0))
                break
            body = r.json()
            usage = body["usage"]
            out.append(
                (200, usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"])
            )
            messages.append(
                {"role": "assistant", "content": body["choices"][0]["message"]["content"]}
            )
    return out


def phase(url: str, tag: str, args: argparse.Namespace) -> dict[str, Any]:
    with ThreadPoolExecutor(args.conversations) as pool:
        futures = [
            pool.submit(chat, url, f"{tag}{i}", args.turns, args.max_tokens)
            for i in range(args.conversations)
        ]
        results = [f.result() for f in futures]
    turns = [t for conv in results for t in conv]
    later = [t for conv in results for t in conv[1:] if t[0] == 200]
    prompt = sum(p for _, p, _ in later)
    return {
        "sent": args.conversations * args.turns,
        "answered": sum(1 for s, _, _ in turns if s == 200),
        "errors": [s for s, _, _ in turns if s != 200],
        "later_turn_hit": sum(c for _, _, c in later) / prompt if prompt else float("nan"),
    }


def engine_replicas(ray: Any) -> list[str]:
    return sorted(
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith("SERVE_REPLICA::radixserve#RadixEngine#")
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import ray
    from ray import serve

    cmd = radixserve_command(
        "--ray", "--replicas", "2", "--dtype", "float32", "--num-threads", "1",
        "--max-model-len", "2048", "--kv-cache-memory", f"{args.kv_cache_mib}MiB",
        "--log-level", "warning",
    )  # fmt: skip
    server = ServerProcess(cmd).start(args.startup_timeout)
    try:
        ray.init(address="auto", log_to_driver=False)
        before = engine_replicas(ray)
        print(f"replicas: {before}", file=sys.stderr)
        killed: dict[str, Any] = {}

        def kill() -> None:
            time.sleep(args.kill_after)
            victim = before[0]
            ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
            killed.update(name=victim, at=time.monotonic())
            print(f"killed {victim}", file=sys.stderr)

        killer = threading.Thread(target=kill)
        killer.start()
        t0 = time.monotonic()
        during = phase(server.url, "a", args)
        killer.join()
        print(f"during the kill: {during}", file=sys.stderr, flush=True)
        during["seconds"] = round(time.monotonic() - t0, 1)
        while True:
            st = serve.status().applications["radixserve"].deployments["RadixEngine"]
            if st.replica_states.get("RUNNING", 0) == 2 and len(engine_replicas(ray)) == 2:
                break
            time.sleep(1)
        replaced_s = time.monotonic() - killed["at"]
        after = phase(server.url, "b", args)
        stats = httpx.get(server.url + "/v1/cache/stats", timeout=30).json()
        report = {
            "killed": killed["name"],
            "replacement_running_after_s": round(replaced_s, 1),
            "replicas_after": engine_replicas(ray),
            "during_kill": during,
            "after_recovery": after,
            "requests_per_live_replica": {
                r.rsplit("#", 1)[1]: sum(v["requests_total"].values())
                for r, v in stats["replicas"].items()
            },
        }
        print(json.dumps(report, indent=2), flush=True)
    finally:
        ray.shutdown()  # before the cluster goes: a connected driver dies with it
        server.stop(timeout=60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
