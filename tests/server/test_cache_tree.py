"""`tree_json`: the `/v1/cache/tree` body built from a real cache's snapshot (no server)."""

from __future__ import annotations

import random
import time
from typing import Any

from radixserve.cache import BlockPool, RadixCache
from radixserve.server.cache_tree import tree_json

BS = 4
SYSTEM = list(range(100, 116))  # 4 blocks shared by every "request"


def _traffic(num_requests: int = 60, seed: int = 0) -> RadixCache:
    """A system prompt reused by every request, unique suffixes, and a second tenant."""
    rng = random.Random(seed)
    cache = RadixCache(BlockPool(2048), BS)
    for _ in range(num_requests):
        seq = SYSTEM + [rng.randrange(1000) for _ in range(rng.choice((4, 8, 12)))]
        cache.match_prefix(seq + [0])
        res = cache.insert(seq, cache.allocate(len(seq) // BS))
        cache.pool.free(res.duplicate_blocks)
    cache.insert([7] * 8, cache.allocate(2), "tenant-b")
    return cache


def _decode(lists: list[list[int]]) -> list[str]:
    return [" ".join(map(str, ids)) for ids in lists]


def _body(cache: RadixCache, max_nodes: int, decode: Any = _decode) -> dict[str, Any]:
    return tree_json(cache.snapshot(), max_nodes, decode, time.monotonic())


def test_unfolded_tree_has_every_node_and_the_system_prompt_on_top() -> None:
    cache = _traffic()
    body = tree_json(cache.snapshot(), 10_000, _decode, time.monotonic(), token_ids=True)
    real = [n for n in body["nodes"] if n["parent"] is not None]
    assert len(real) == body["num_nodes"] == cache.stats().num_nodes
    assert not any(n["aggregated"] for n in body["nodes"])
    widest = max(real, key=lambda n: n["subtree_tokens"])
    assert widest["text"] == " ".join(map(str, SYSTEM))
    assert widest["token_ids"] == SYSTEM
    assert widest["hits"] == 59  # every request but the first found it
    assert body["cached_tokens"] == cache.stats().cached_blocks * BS


def test_small_subtrees_fold_into_one_node_within_the_budget() -> None:
    cache = _traffic()
    full = _body(cache, 10_000)
    for budget in (4, 10, 25):
        body = _body(cache, budget)
        assert len(body["nodes"]) <= budget
        folded = [n for n in body["nodes"] if n["aggregated"]]
        assert folded, "a 60-request tree cannot fit in this budget unfolded"
        for n in folded:
            assert "text" not in n and n["tokens"] == n["subtree_tokens"] > 0
        # Nothing is lost: shown plus folded nodes and tokens add up to the whole tree.
        assert (
            sum(n["subtree_nodes"] for n in folded)
            + sum(1 for n in body["nodes"] if n["parent"] is not None and not n["aggregated"])
            == full["num_nodes"]
        )
        roots = [n for n in body["nodes"] if n["parent"] is None]
        assert sum(n["subtree_tokens"] for n in roots) == full["cached_tokens"]


def test_token_ids_only_when_asked_for() -> None:
    assert not any("token_ids" in n for n in _body(_traffic(), 100)["nodes"])


def test_biggest_subtree_is_expanded_first() -> None:
    body = _body(_traffic(), 6)
    shown = [n for n in body["nodes"] if n["parent"] is not None and not n["aggregated"]]
    assert shown[0]["text"] == " ".join(map(str, SYSTEM))


def test_without_a_decoder_the_body_has_counts_but_no_text_or_names() -> None:
    body = _body(_traffic(), 50, decode=None)
    assert body["text"] is False
    for n in body["nodes"]:
        assert "text" not in n and "token_ids" not in n
    names = {n.get("namespace") for n in body["nodes"] if n["parent"] is None}
    assert None in names and "tenant-b" not in names
    assert any(isinstance(x, str) and x.startswith("ns-") for x in names)
    assert all("text" not in p for p in body["top_prefixes"])


def test_top_prefixes_rank_by_tokens_saved() -> None:
    top = _body(_traffic(), 50)["top_prefixes"]
    assert top[0]["tokens"] == len(SYSTEM) and top[0]["hits"] == 59
    assert top[0]["saved_tokens"] == 59 * len(SYSTEM)
    saved = [p["saved_tokens"] for p in top]
    assert saved == sorted(saved, reverse=True)


def test_empty_cache_is_one_empty_root() -> None:
    body = _body(RadixCache(BlockPool(8), BS), 10)
    assert body["num_nodes"] == 0 and len(body["nodes"]) == 1 and body["top_prefixes"] == []
