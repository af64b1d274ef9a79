"""KV offload tier and warm restart, measured side by side in one run (default model).

Run: python benchmarks/kv_offload_bench.py [--out DIR] [--conversations 20] [--skip-tiers]
Part 1 serves one multi-turn workload (`radixserve bench --workload multi_turn`) whose
working set is about 4x a 256 MiB pool against four servers, one at a time: no tier, a
host-memory tier, a disk tier, and an unbounded (2 GiB) pool; prints hit ratio and TTFT.
Part 2 times a 4k-token prefix: cold, in-memory hit, first request after a graceful
restart with --kv-persist-dir (and the load time the server logged); then checks that a
kill -9 restarts cold and healthy and that a corrupt save starts cold with a warning.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from radixserve.bench.servers import ServerProcess, radixserve_command

BASE = ["--dtype", "float32", "--kv-cache-memory", "256MiB", "--max-model-len", "8192"]
PORTS = iter(range(11401, 11499))


def server(*extra: str, log_dir: Path) -> ServerProcess:
    """A `radixserve serve` on the next port of this bench's range (11401+)."""
    s = ServerProcess(radixserve_command(*BASE, *extra, "--port", "{port}"), log_dir)
    s.port = next(PORTS)
    s.argv[s.argv.index("--port") + 1] = str(s.port)
    s.url = f"http://127.0.0.1:{s.port}"
    return s


def run_tiers(
    out: Path, pool: str, conversations: int, turns: int, user_tokens: int
) -> list[tuple[str, dict]]:
    configs = [
        ("no tier", ["--kv-cache-memory", pool]),
        ("host tier 1GiB", ["--kv-cache-memory", pool, "--kv-offload-memory", "1GiB"]),
        (
            "disk tier 1GiB",
            [
                "--kv-cache-memory",
                pool,
                "--kv-offload-dir",
                str(out / "tier"),
                "--kv-offload-memory",
                "1GiB",
            ],
        ),
        ("unbounded pool", ["--kv-cache-memory", "2GiB"]),
    ]
    rows = []
    for label, extra in configs:
        slug = re.sub(r"\W+", "-", label)
        with server(*extra, log_dir=out / slug) as s:
            cmd = [
                sys.executable, "-m", "radixserve.cli", "bench", "--url", s.url,
                "--workload", "multi_turn", "--seed", "0", "--ignore-eos", "--no-progress",
                "--concurrency", "4", "--output-dir", str(out / slug),
                "--param", f"conversations={conversations}", "--param", f"turns={turns}",
                "--param", "system_tokens=256", "--param", f"user_tokens={user_tokens}",
                "--param", "max_tokens=8",
            ]  # fmt: skip
            subprocess.run(cmd, check=True)
            metrics = httpx.get(s.url + "/metrics").text
        summary = json.loads((out / slug / "results.json").read_text())["summary"]
        m = re.search(r"^radixserve_prefix_cache_offload_hits_total (\S+)", metrics, re.M)
        summary["offload_hit_tokens"] = float(m.group(1)) if m else 0.0
        rows.append((label, summary))
        print(label, json.dumps({k: summary[k] for k in ("cache_hit_ratio", "ttft")}), flush=True)
    return rows


def ttft(url: str, prompt: list[int]) -> tuple[float, int]:
    """(seconds to the first streamed token, cached prompt tokens) of one completion."""
    body = {
        "prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    t0 = time.perf_counter()
    first = None
    cached = -1
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices"):
                first = time.perf_counter() - t0
            usage = chunk.get("usage")
            if usage:
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    assert first is not None
    return first, cached


def run_restart(out: Path) -> list[tuple[str, str]]:
    rng = random.Random(0)
    prefix = [rng.randrange(1000, 40000) for _ in range(4096)]

    def ask() -> list[int]:
        return prefix + [rng.randrange(1000, 40000) for _ in range(16)]

    persist = out / "persist"
    rows: list[tuple[str, str]] = []
    logs = out / "restart"
    s = server("--kv-persist-dir", str(persist), log_dir=logs).start()
    cold = ttft(s.url, ask())
    hit = ttft(s.url, ask())
    t0 = time.perf_counter()
    s.stop(timeout=120)
    save_s = time.perf_counter() - t0
    save_mb = (persist / "radixserve-kv-cache.bin").stat().st_size / 2**20
    t0 = time.perf_counter()
    s = server("--kv-persist-dir", str(persist), log_dir=logs).start()
    start_s = time.perf_counter() - t0
    loaded = re.findall(r"warm start: .*", s.log_path.read_text())
    warm = ttft(s.url, ask())
    rows += [
        ("TTFT, 4,096-token prefix + 16 new tokens, cold", f"{cold[0] * 1000:.0f} ms"),
        ("TTFT, same prefix, in-memory hit", f"{hit[0] * 1000:.0f} ms ({hit[1]} cached)"),
        ("graceful stop incl. writing the save", f"{save_s:.1f} s ({save_mb:.0f} MiB file)"),
        ("start to healthy with the save", f"{start_s:.1f} s; log: {loaded}"),
        ("TTFT, same prefix, first request after restart", f"{warm[0] * 1000:.0f} ms "
         f"({warm[1]} cached)"),
    ]  # fmt: skip
    # kill -9: no save is written, and the loaded one was consumed: cold and healthy.
    assert s.proc is not None
    os.killpg(s.proc.pid, signal.SIGKILL)
    s.proc.wait()
    t0 = time.perf_counter()
    s = server("--kv-persist-dir", str(persist), log_dir=logs).start()
    healthy_s = time.perf_counter() - t0
    killed = ttft(s.url, ask())
    rows.append(
        ("after kill -9: start to healthy; first request",
         f"{healthy_s:.1f} s; {killed[0] * 1000:.0f} ms ({killed[1]} cached)")
    )  # fmt: skip
    s.stop(timeout=120)  # graceful: writes a save
    path = persist / "radixserve-kv-cache.bin"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    s = server("--kv-persist-dir", str(persist), log_dir=logs).start()
    warning = re.findall(r"WARNING .*starting cold.*", s.log_path.read_text())
    corrupt = ttft(s.url, ask())
    s.stop(timeout=120)
    rows.append(
        ("corrupt save (one byte flipped): log; first request",
         f"{warning}; {corrupt[0] * 1000:.0f} ms ({corrupt[1]} cached)")
    )  # fmt: skip
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="output folder (default: a temp dir)")
    p.add_argument("--pool", default="256MiB", help="KV pool of the tier comparison")
    p.add_argument("--conversations", type=int, default=20)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--user-tokens", type=int, default=256)
    p.add_argument("--skip-tiers", action="store_true")
    p.add_argument("--skip-restart", action="store_true")
    args = p.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="kv-offload-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    lines = []
    if not args.skip_restart:
        restart = run_restart(out)
        print(restart, flush=True)
    if not args.skip_tiers:
        rows = run_tiers(out, args.pool, args.conversations, args.turns, args.user_tokens)
        base = rows[0][1]["ttft"]["p50"]
        lines += [
            f"| server (pool {args.pool}) | hit ratio | from tier | TTFT p50 | TTFT p99 "
            "| vs no tier |",
            "|---|---|---|---|---|---|",
        ]
        for label, sm in rows:
            offl = sm["offload_hit_tokens"] / max(sm["prompt_tokens"], 1)
            lines.append(
                f"| {label} | {sm['cache_hit_ratio']:.1%} | {offl:.1%} | "
                f"{sm['ttft']['p50'] * 1000:.0f} ms | {sm['ttft']['p99'] * 1000:.0f} ms | "
                f"{base / sm['ttft']['p50']:.2f}x |"
            )
    if not args.skip_restart:
        lines += ["", "| warm restart (pool 256 MiB) | result |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in restart]
    report = "\n".join(lines)
    (out / "report.md").write_text(report + "\n")
    print(report)
    print(f"(files in {out})")


if __name__ == "__main__":
    main()
