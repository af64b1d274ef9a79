"""Packing token runs, and walks that end anywhere inside a long run."""

from __future__ import annotations

from array import array

import pytest

from radixserve.cache.tokens import TOKEN_BYTES, LazyQuery, decode, encode

from .helpers import make_cache, put

TOKENS = [0, 1, 255, 256, 65535, 70000, 2**32 - 1]


@pytest.mark.parametrize(
    "sequence", [TOKENS, tuple(TOKENS), array("I", TOKENS), array("q", TOKENS), range(300, 310)]
)
def test_encode_round_trips_any_int_sequence(sequence: list[int]) -> None:
    assert decode(encode(sequence)) == tuple(sequence)


def test_encode_slices_without_changing_values() -> None:
    tokens = list(range(100, 120))
    assert decode(encode(tokens, 3, 9)) == tuple(tokens[3:9])
    assert decode(encode(array("I", tokens), 3, 9)) == tuple(tokens[3:9])


@pytest.mark.parametrize("bad", [-1, 2**32])
def test_encode_rejects_ids_outside_uint32(bad: int) -> None:
    with pytest.raises(ValueError):
        encode([1, bad])


def test_lazy_query_converts_only_what_is_asked_plus_bounded_lookahead() -> None:
    tokens = list(range(10_000))
    query = LazyQuery(tokens, limit=9_984)
    assert query.data == b""
    assert len(query.ensure(16 * TOKEN_BYTES)) == 16 * TOKEN_BYTES
    grown = query.ensure(100 * TOKEN_BYTES)
    assert 100 * TOKEN_BYTES <= len(grown) <= (100 + 1024) * TOKEN_BYTES
    assert decode(grown) == tuple(tokens[: len(grown) // TOKEN_BYTES])
    full = query.ensure(10**9)
    assert decode(full)[:9_984] == tuple(tokens[:9_984])


@pytest.mark.parametrize("diverge_at", [1, 2, 3, 7, 8, 20, 38, 39])
def test_match_finds_exact_divergence_block_inside_a_long_run(diverge_at: int) -> None:
    bs = 4
    cache = make_cache(num_blocks=128, block_size=bs)
    tokens = list(range(1000, 1000 + 40 * bs))
    put(cache, tokens)
    query = tokens[: diverge_at * bs] + [7] + tokens[diverge_at * bs + 1 :]
    assert cache.peek_prefix(query) == diverge_at * bs
    assert cache.peek_prefix(tokens[: diverge_at * bs + 3]) == diverge_at * bs
    m = cache.match_prefix(query)
    assert m.num_tokens == diverge_at * bs and len(m.blocks) == diverge_at
    assert cache.match_prefix(tokens).num_tokens == len(tokens)
    cache.check_invariants(num_private_blocks=0)
