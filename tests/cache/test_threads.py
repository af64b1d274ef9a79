"""Readers on other threads while the engine thread mutates the cache."""

from __future__ import annotations

import random
import threading
import time

from radixserve.cache import BlockPool, CacheFullError, RadixCache, RadixNode

BS = 4


def test_concurrent_readers_and_one_writer_keep_the_cache_consistent() -> None:
    cache = RadixCache(BlockPool(256), block_size=BS)
    stems = [[s] * (3 * BS) for s in range(4)]
    stop = threading.Event()
    errors: list[BaseException] = []

    def prompt(rng: random.Random) -> list[int]:
        return rng.choice(stems) + [rng.randrange(5) for _ in range(rng.randrange(0, 6 * BS))]

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        try:
            while not stop.is_set():
                tokens = prompt(rng)
                cache.peek_prefix(tokens)
                m = cache.match_prefix(tokens)
                assert m.num_tokens == len(m.blocks) * BS
                stats = cache.stats()
                assert stats.locked_blocks <= stats.cached_blocks
        except BaseException as exc:  # re-raised in the main thread
            errors.append(exc)

    def writer() -> None:
        rng = random.Random(0)
        pinned: list[tuple[RadixNode, list[int]]] = []
        try:
            while not stop.is_set():
                tokens = prompt(rng)
                tokens = tokens[: len(tokens) // BS * BS]
                m = cache.match_prefix(tokens)
                cache.lock(m.node)
                try:
                    private = cache.allocate(len(tokens) // BS - len(m.blocks))
                except CacheFullError:
                    cache.unlock(m.node)
                    private = []
                else:
                    result = cache.insert(tokens, m.blocks + private)
                    cache.pool.free(result.duplicate_blocks)
                    pinned.append((result.node, m.blocks))
                    cache.lock(result.node)
                    cache.unlock(m.node)
                if len(pinned) > 8 or (pinned and rng.random() < 0.3):
                    node, _ = pinned.pop(rng.randrange(len(pinned)))
                    cache.unlock(node)
                if rng.random() < 0.2:
                    cache.evict(rng.randrange(1, 32))
            for node, _ in pinned:
                cache.unlock(node)
        except BaseException as exc:  # re-raised in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=reader, args=(seed,)) for seed in range(1, 4)]
    threads.append(threading.Thread(target=writer))
    for thread in threads:
        thread.start()
    time.sleep(1.0)
    stop.set()
    for thread in threads:
        thread.join(timeout=10)
    assert not errors, errors
    cache.check_invariants(num_private_blocks=0)
    stats = cache.stats()
    assert stats.locked_blocks == 0 and stats.lookups > 0 and stats.inserts > 0
