"""What the cache dashboard costs, and a screenshot of it under load.

python benchmarks/dashboard_bench.py cost --nodes 100000
    builds a RadixCache of that many nodes (chats under a few shared system prompts),
    then times what one /v1/cache/tree request does: the copy under the cache lock (the
    only part the engine thread can wait on), the folding to max_nodes, the JSON, and,
    with Chromium installed, the page's JSON.parse and render of the result.

python benchmarks/dashboard_bench.py screenshot --url http://127.0.0.1:8000 --out shot.png
    opens URL/dashboard in headless Chromium, waits --wait seconds (run traffic, e.g.
    `radixserve bench --workload multi_turn`, meanwhile) and saves a screenshot.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

from radixserve.bench import dashboard
from radixserve.server.cache_tree import tree_json


def timed(fn: Callable[[], Any], repeat: int = 5) -> tuple[str, Any]:
    """Median wall and CPU time of `fn()` over `repeat` runs (as text), and its last result.

    CPU time is the fairer figure on a shared machine: it leaves out waiting for a core.
    """
    wall, cpu, out = [], [], None
    for _ in range(repeat):
        t, c = time.perf_counter(), time.process_time()
        out = fn()
        wall.append((time.perf_counter() - t) * 1000)
        cpu.append((time.process_time() - c) * 1000)
    return f"{statistics.median(wall):.0f} ms wall / {statistics.median(cpu):.0f} ms CPU", out


def cost(args: argparse.Namespace) -> None:
    cache = dashboard.synthetic_cache(args.nodes)
    print(f"tree: {cache.stats().num_nodes} nodes, {cache.stats().cached_blocks} blocks")
    snap_ms, snap = timed(lambda: cache.snapshot())
    print(f"snapshot under the cache lock: {snap_ms} (median of 5)")
    decode: Callable[[list[list[int]]], list[str]] = lambda ls: [f"{len(x)} tokens" for x in ls]  # noqa: E731
    now = time.monotonic()
    bodies: dict[int, dict[str, Any]] = {}
    for max_nodes in (2000, 200_000):
        fold_ms, body = timed(lambda m=max_nodes: tree_json(snap, m, decode, now), 3)
        dump_ms, raw = timed(lambda b=body: json.dumps(b), 3)
        bodies[max_nodes] = body
        print(
            f"max_nodes={max_nodes}: {len(body['nodes'])} nodes out, fold {fold_ms}, "
            f"json {dump_ms}, {len(raw) / 1e6:.1f} MB"
        )
    why = dashboard.missing()
    if why or not args.url:
        print(f"browser render skipped: {why or 'no --url (a server whose /dashboard to use)'}")
        return
    with dashboard.headless_chromium() as driver:
        driver.get(args.url + "/dashboard")
        time.sleep(2)
        driver.execute_script("document.getElementById('pause').checked = true")
        for body in bodies.values():
            body["enabled"] = True
            driver.execute_script("window.bigTree = arguments[0]", body)
            parse = driver.execute_script(
                "const s = JSON.stringify(window.bigTree); const t = performance.now();"
                "JSON.parse(s); return performance.now() - t"
            )
            renders = [
                driver.execute_script("return radixDashboard.renderTree(0, window.bigTree)")
                for _ in range(5)
            ]
            print(
                f"browser, {len(body['nodes'])} nodes: JSON.parse {parse:.0f} ms, render median "
                f"{statistics.median(renders):.0f} ms (of {[round(r) for r in renders]})"
            )


def screenshot(args: argparse.Namespace) -> None:
    why = dashboard.missing()
    if why:
        raise SystemExit(why)
    with dashboard.headless_chromium(args.width, args.height) as driver:
        driver.get(args.url + "/dashboard")
        time.sleep(args.wait)
        driver.save_screenshot(args.out)
        print(f"saved {args.out}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("cost")
    c.add_argument("--nodes", type=int, default=100_000)
    c.add_argument("--url", help="a running server, for the in-browser render timing")
    s = sub.add_parser("screenshot")
    s.add_argument("--url", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--wait", type=float, default=30.0)
    s.add_argument("--width", type=int, default=1400)
    s.add_argument("--height", type=int, default=1100)
    args = p.parse_args()
    cost(args) if args.cmd == "cost" else screenshot(args)


if __name__ == "__main__":
    main()
