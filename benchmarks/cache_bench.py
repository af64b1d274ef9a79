"""Microbenchmark of the radix prefix cache (pure Python, no model, no server).

Run: `python benchmarks/cache_bench.py [--quick]`. Prints Markdown tables:
- match_prefix latency (median / p99, microseconds) for 1k / 8k / 32k-token prompts that
  hit fully, hit half, or miss, against trees of 10, 1,000 and 100,000 nodes, with the
  prompt passed as a list of ints and as an `array("I")`;
- match latency against the number of nodes on the matched path (the per-node cost);
- the cost of packing a prompt list into uint32 bytes (the floor for list input; pass an
  `array("I")` to skip it);
- insert latency, eviction throughput, and memory per cached block (tracemalloc).
Numbers depend on the machine and its load; compare rows of one run, not across runs.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
import tracemalloc
from array import array
from collections.abc import Callable

from radixserve.cache import BlockPool, RadixCache
from radixserve.cache.tokens import encode

BS = 16
VOCAB = 49152
PROMPT_LENGTHS = (1024, 8192, 32768)
TREE_SIZES = (10, 1_000, 100_000)


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def timed(fn: Callable[[], object], reps: int) -> tuple[float, float]:
    """Median and p99 of `reps` calls, in microseconds."""
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    samples.sort()
    return statistics.median(samples) * 1e6, samples[int(0.99 * (len(samples) - 1))] * 1e6


def put(cache: RadixCache, seq: list[int]) -> None:
    """Insert `seq` with fresh blocks, freeing the duplicates (as the engine does)."""
    n = len(seq) // BS
    result = cache.insert(seq[: n * BS], cache.allocate(n))
    cache.pool.free(result.duplicate_blocks)


def build_tree(num_nodes: int, rng: random.Random) -> tuple[RadixCache, dict[int, list[int]]]:
    """A tree with about `num_nodes` nodes holding one target path per prompt length.

    Each target path is three nodes (cut at 1/4 and 3/4, as a chat grows turn by turn)
    in every tree, so rows differ only in the size of the tree around it: filler
    sequences branch off the targets' node ends and off a few shared stems until the
    tree holds `num_nodes` nodes.
    """
    cache = RadixCache(BlockPool(4 * num_nodes + 8192), block_size=BS)
    targets = {n: tokens(rng, n) for n in PROMPT_LENGTHS}
    for path in targets.values():
        for cut in (len(path) // 4, 3 * len(path) // 4, len(path)):
            put(cache, path[:cut])
    stems = [tokens(rng, 8 * BS) for _ in range(32)]
    anchors = [path[:cut] for path in targets.values() for cut in (len(path) // 4, len(path))]
    while cache.stats().num_nodes < num_nodes:
        if rng.random() < 0.7:  # somewhere inside a shared stem (splits the stems only)
            stem = rng.choice(stems)
            base = stem[: rng.randrange(1, len(stem) // BS + 1) * BS]
        else:  # at the end of a target's node, so target nodes get wide but not split
            base = rng.choice(anchors)
        put(cache, base + tokens(rng, 2 * BS))
    return cache, targets


def bench_match(quick: bool) -> list[str]:
    rows = [
        "| tree nodes | prompt tokens | hit | list median µs | list p99 µs | array median µs |",
        "| ---: | ---: | --- | ---: | ---: | ---: |",
    ]
    rng = random.Random(0)
    for size in TREE_SIZES:
        cache, targets = build_tree(size, rng)
        for n in PROMPT_LENGTHS:
            path = targets[n]
            queries = {
                "full": path,
                "half": path[: n // 2] + tokens(rng, n - n // 2),
                "miss": tokens(rng, n),
            }
            for kind, query in queries.items():
                cache.match_prefix(query)  # warm up; a half hit splits its node once
                packed = array("I", query)
                reps = max(50, min(2000, 3_000_000 // n)) // (4 if quick else 1)
                med, p99 = timed(lambda c=cache, q=query: c.match_prefix(q), reps)
                amed, _ = timed(lambda c=cache, q=packed: c.match_prefix(q), reps)
                rows.append(
                    f"| {cache.stats().num_nodes:,} | {n:,} | {kind} "
                    f"| {med:.1f} | {p99:.1f} | {amed:.1f} |"
                )
        del cache
        gc.collect()
    return rows


def bench_depth(quick: bool) -> list[str]:
    rows = [
        "| nodes on the 8k path | list median µs | array median µs |",
        "| ---: | ---: | ---: |",
    ]
    rng = random.Random(5)
    n = 8192
    for depth in (1, 8, 64, 512):
        cache = RadixCache(BlockPool(2 * n // BS), block_size=BS)
        path = tokens(rng, n)
        for i in range(1, depth + 1):
            put(cache, path[: i * n // depth])
        packed = array("I", path)
        reps = 100 if quick else 400
        med, _ = timed(lambda c=cache, q=path: c.match_prefix(q), reps)
        amed, _ = timed(lambda c=cache, q=packed: c.match_prefix(q), reps)
        rows.append(f"| {cache.stats().num_nodes} | {med:.1f} | {amed:.1f} |")
    return rows


def bench_conversion() -> list[str]:
    rows = ["| prompt tokens | tokens.encode(list) median µs |", "| ---: | ---: |"]
    rng = random.Random(1)
    for n in PROMPT_LENGTHS:
        query = tokens(rng, n)
        med, _ = timed(lambda q=query: encode(q), 300)
        rows.append(f"| {n:,} | {med:.1f} |")
    return rows


def bench_insert(quick: bool) -> list[str]:
    rows = [
        "| prompt tokens (half already cached) | insert median µs | insert p99 µs |",
        "| ---: | ---: | ---: |",
    ]
    rng = random.Random(2)
    for n in PROMPT_LENGTHS:
        reps = 200 // (4 if quick else 1)
        cache = RadixCache(BlockPool(reps * n // BS + n // BS), block_size=BS)
        shared = tokens(rng, n // 2)
        put(cache, shared)
        seqs = [shared + tokens(rng, n - n // 2) for _ in range(reps)]
        cached_half = cache.match_prefix(shared).blocks
        block_lists = [cached_half + cache.allocate(n // 2 // BS) for _ in range(reps)]
        it = iter(zip(seqs, block_lists, strict=True))
        med, p99 = timed(lambda c=cache, it=it: c.insert(*next(it)), reps)
        rows.append(f"| {n:,} | {med:.1f} | {p99:.1f} |")
    return rows


def bench_evict(quick: bool) -> list[str]:
    rows = ["| eviction | blocks | blocks/s |", "| --- | ---: | ---: |"]
    rng = random.Random(3)
    num_leaves = 5_000 if quick else 20_000
    for label, chunk in (("evict(all) in one call", 0), ("evict(16) repeatedly", 16)):
        cache = RadixCache(BlockPool(num_leaves * 4 + 1024), block_size=BS)
        stems = [tokens(rng, 4 * BS) for _ in range(64)]
        for _ in range(num_leaves):
            put(cache, rng.choice(stems) + tokens(rng, 3 * BS))
        total = cache.stats().cached_blocks
        start = time.perf_counter()
        if chunk:
            while cache.evict(chunk):
                pass
        else:
            cache.evict(total)
        elapsed = time.perf_counter() - start
        rows.append(f"| {label} | {total:,} | {total / elapsed:,.0f} |")
    return rows


def bench_memory(quick: bool) -> list[str]:
    rows = [
        "| tree | cached blocks | nodes | bytes per cached block |",
        "| --- | ---: | ---: | ---: |",
    ]
    rng = random.Random(4)
    num_seqs = 2_000 if quick else 10_000
    for label, blocks_per_seq in (("short leaves (4 blocks)", 4), ("long leaves (64 blocks)", 64)):
        pool = BlockPool(num_seqs * (blocks_per_seq + 4))
        stems = [tokens(rng, 4 * BS) for _ in range(64)]
        seqs = [rng.choice(stems) + tokens(rng, blocks_per_seq * BS) for _ in range(num_seqs)]
        blocks = [pool.allocate(len(s) // BS) for s in seqs]
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        cache = RadixCache(pool, block_size=BS)
        for seq, ids in zip(seqs, blocks, strict=True):
            cache.insert(seq, ids)
        used = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        stats = cache.stats()
        rows.append(
            f"| {label} | {stats.cached_blocks:,} | {stats.num_nodes:,} "
            f"| {used / stats.cached_blocks:.0f} |"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (smoke run)")
    args = parser.parse_args()
    start = time.perf_counter()
    sections = [
        ("match_prefix latency (block_size 16)", bench_match(args.quick)),
        ("match_prefix of a full 8k hit vs. nodes on its path", bench_depth(args.quick)),
        ("Converting a prompt list to packed uint32 (part of list latency)", bench_conversion()),
        ("insert latency (new leaf under a cached half)", bench_insert(args.quick)),
        ("Eviction throughput (leaves of 3 blocks under shared stems)", bench_evict(args.quick)),
        ("Memory of the tree per cached block (tracemalloc)", bench_memory(args.quick)),
    ]
    print(f"# radixserve cache benchmark (Python {sys.version.split()[0]})\n")
    for title, rows in sections:
        print(f"## {title}\n")
        print("\n".join(rows) + "\n")
    print(f"_total run time {time.perf_counter() - start:.0f} s_")


if __name__ == "__main__":
    main()
