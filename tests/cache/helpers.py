"""Small builders shared by the cache tests."""

from __future__ import annotations

from radixserve.cache import BlockPool, CacheEvent, InsertResult, RadixCache

BS = 4  # block size of the unit tests: short enough to write token lists by hand


def make_cache(num_blocks: int = 64, block_size: int = BS, **kwargs: object) -> RadixCache:
    """A cache over a fresh pool."""
    return RadixCache(BlockPool(num_blocks), block_size=block_size, **kwargs)  # type: ignore[arg-type]


def seq(*runs: tuple[int, int]) -> list[int]:
    """Token ids from (value, count) runs, e.g. seq((1, 8), (2, 4)) == [1]*8 + [2]*4."""
    out: list[int] = []
    for value, count in runs:
        out += [value] * count
    return out


def put(
    cache: RadixCache, tokens: list[int], namespace: object = None, **kwargs: int
) -> InsertResult:
    """Allocate fresh blocks for `tokens`, insert them and free the duplicates."""
    blocks = cache.pool.allocate(len(tokens) // cache.block_size)
    result = cache.insert(tokens, blocks, namespace, **kwargs)
    cache.pool.free(result.duplicate_blocks)
    return result


class Recorder:
    """A listener that keeps every event."""

    def __init__(self) -> None:
        self.events: list[CacheEvent] = []

    def __call__(self, event: CacheEvent) -> None:
        self.events.append(event)

    def kinds(self) -> list[tuple[str, int, int]]:
        """(kind, path length, run length) of each event."""
        return [(e.kind, len(e.token_ids), e.num_tokens) for e in self.events]
