"""continuation: the cached tokens that follow a sequence lying on a cached path."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.cache import BlockPool, NullCache

from .helpers import BS, make_cache, put


def test_a_prefix_of_a_cached_sequence_continues_with_its_next_tokens() -> None:
    cache = make_cache()
    tokens = list(range(100, 124))
    put(cache, tokens)
    assert cache.continuation(tokens[:6], max_tokens=5) == tokens[6:11]
    assert cache.continuation(tokens[:8], max_tokens=3) == tokens[8:11]
    assert cache.continuation(tokens[:20], max_tokens=10) == tokens[20:]


def test_no_continuation_off_the_tree_or_in_another_namespace() -> None:
    cache = make_cache()
    tokens = list(range(100, 124))
    put(cache, tokens)
    assert cache.continuation([*tokens[:5], 7], max_tokens=4) == []  # the partial block differs
    assert cache.continuation([1, 2, 3, 4, 5], max_tokens=4) == []  # a whole block differs
    assert cache.continuation(tokens[:6], "tenant-b", max_tokens=4) == []
    assert cache.continuation(tokens, max_tokens=4) == []  # nothing cached after it


def test_a_fork_follows_the_most_recently_used_branch() -> None:
    cache = make_cache()
    head = list(range(100, 108))
    put(cache, head + [1] * 8)
    put(cache, head + [2] * 8)
    assert cache.continuation(head[:6], max_tokens=6) == head[6:] + [2] * 4
    cache.match_prefix(head + [1] * 8)  # touches the first branch
    assert cache.continuation(head[:6], max_tokens=6) == head[6:] + [1] * 4


def test_continuation_changes_nothing() -> None:
    cache = make_cache()
    tokens = list(range(100, 124))
    put(cache, tokens)
    before = cache.snapshot()
    lookups = cache.counters.lookups
    cache.continuation(tokens[:10], max_tokens=8)
    assert cache.counters.lookups == lookups
    assert cache.snapshot().rows == before.rows
    cache.check_invariants(num_private_blocks=0)


def test_a_cache_that_holds_nothing_has_no_continuation() -> None:
    assert NullCache(BlockPool(8), BS).continuation([1, 2, 3, 4, 5], max_tokens=4) == []


@settings(max_examples=60, deadline=None)
@given(
    seqs=st.lists(
        st.lists(st.integers(1, 3), min_size=BS, max_size=6 * BS), min_size=1, max_size=6
    ),
    pick=st.integers(0, 5),
    cut=st.integers(0, 6 * BS),
    k=st.integers(1, 12),
)
def test_any_continuation_is_the_tail_of_some_cached_sequence(
    seqs: list[list[int]], pick: int, cut: int, k: int
) -> None:
    """Whatever is cached, query + continuation is a prefix of a cached sequence (whole
    blocks), and a proper prefix of the last sequence cached always has one."""
    cache = make_cache(num_blocks=256)
    cached = []
    for s in seqs:
        whole = s[: len(s) // BS * BS]
        put(cache, whole)
        cached.append(whole)
    target = cached[pick % len(cached)]
    query = target[: min(cut, len(target))]
    got = cache.continuation(query, max_tokens=k)
    assert len(got) <= k
    if got:
        assert any(c[: len(query) + len(got)] == query + got for c in cached)
    if query and len(query) < len(cached[-1]) and cached[-1][: len(query)] == query:
        assert got
