"""The routing policies as pure functions over fake worker states."""

from __future__ import annotations

import random

import pytest

from radixserve.router.policy import (
    CACHE_HIT,
    LEAST_LOAD,
    LOAD_IMBALANCE,
    MOST_FREE_CACHE,
    NoWorkerError,
    PolicyConfig,
    WorkerView,
    choose,
    choose_cache_aware,
    choose_least_load,
    choose_round_robin,
    is_imbalanced,
    rank_cache_aware,
)

CFG = PolicyConfig(cache_threshold=0.3, balance_abs_threshold=4, balance_rel_threshold=1.5)


def views(*specs: tuple[int, int]) -> list[WorkerView]:
    """Workers from (in_flight, matched_tokens) pairs."""
    return [WorkerView(i, load, matched) for i, (load, matched) in enumerate(specs)]


def test_longest_match_wins_when_it_saves_enough_prefill() -> None:
    d = choose_cache_aware(views((1, 0), (2, 160)), prompt_len=200, cfg=CFG)
    assert (d.index, d.reason, d.matched_tokens) == (1, CACHE_HIT, 160)


def test_prefix_every_worker_holds_does_not_pin_traffic() -> None:
    # Both hold the 32-token system prompt: no gain, so the least loaded one is picked.
    d = choose_cache_aware(views((1, 32), (0, 32)), prompt_len=200, cfg=CFG)
    assert (d.index, d.reason) == (1, MOST_FREE_CACHE)


def test_small_gain_goes_to_least_loaded_worker() -> None:
    # Worker 0 has 32 more tokens of a 200-token prompt (16% < 30%): balance instead.
    d = choose_cache_aware(views((1, 64), (0, 32)), prompt_len=200, cfg=CFG)
    assert d.index == 1


def test_least_loaded_worker_with_enough_cache_is_a_cache_hit() -> None:
    d = choose_cache_aware(views((1, 100), (0, 90)), prompt_len=120, cfg=CFG)
    assert (d.index, d.reason) == (1, CACHE_HIT)


def test_no_match_picks_fewest_in_flight() -> None:
    d = choose_cache_aware(views((3, 0), (1, 0), (2, 0)), prompt_len=50, cfg=CFG)
    assert (d.index, d.reason) == (1, MOST_FREE_CACHE)


def test_no_match_ties_go_to_most_free_cache() -> None:
    vs = [
        WorkerView(0, 0, 0, cached_blocks=50, total_blocks=100),
        WorkerView(1, 0, 0, cached_blocks=10, total_blocks=100),
    ]
    assert choose_cache_aware(vs, prompt_len=50, cfg=CFG).index == 1


def test_uneven_load_routes_by_load_first() -> None:
    d = choose_cache_aware(views((10, 190), (2, 0)), prompt_len=200, cfg=CFG)
    assert (d.index, d.reason) == (1, LOAD_IMBALANCE)


def test_load_imbalance_prefers_cache_among_least_loaded() -> None:
    d = choose_cache_aware(views((10, 190), (1, 0), (1, 150)), prompt_len=200, cfg=CFG)
    assert (d.index, d.reason) == (2, LOAD_IMBALANCE)


def test_imbalance_needs_both_thresholds() -> None:
    assert not is_imbalanced([6, 2], CFG)  # difference 4 is not > 4
    assert not is_imbalanced([20, 15], CFG)  # 20 is not > 1.5 * 15
    assert is_imbalanced([20, 10], CFG)
    assert is_imbalanced([5, 0], CFG)


def test_empty_prompt_routes_by_load() -> None:
    d = choose_cache_aware(views((2, 0), (1, 0)), prompt_len=0, cfg=CFG)
    assert (d.index, d.reason) == (1, MOST_FREE_CACHE)


def test_single_worker_always_chosen() -> None:
    assert choose_cache_aware(views((9, 0)), prompt_len=10, cfg=CFG).index == 0


def test_no_worker_raises() -> None:
    with pytest.raises(NoWorkerError):
        choose_cache_aware([], prompt_len=10, cfg=CFG)
    with pytest.raises(NoWorkerError):
        choose_round_robin([], 0)


def test_round_robin_cycles_over_given_workers() -> None:
    vs = [WorkerView(0, 5), WorkerView(2, 0), WorkerView(3, 0)]
    assert [choose_round_robin(vs, c).index for c in range(4)] == [0, 2, 3, 0]


def test_least_load_breaks_ties_cyclically() -> None:
    vs = views((1, 0), (0, 0), (0, 0))
    assert [choose_least_load(vs, c).index for c in range(3)] == [1, 2, 1]


def test_least_load_policy_gives_least_load_as_its_reason() -> None:
    assert choose_least_load(views((1, 0), (0, 0))).reason == LEAST_LOAD


def test_random_policy_only_picks_given_workers() -> None:
    vs = [WorkerView(3, 0), WorkerView(5, 0)]
    rng = random.Random(0)
    picks = {choose("random", vs, 0, 0, rng).index for _ in range(50)}
    assert picks == {3, 5}


def test_unknown_policy_is_rejected() -> None:
    with pytest.raises(ValueError):
        choose("fastest", views((0, 0)), 0, 0, random.Random(0))


def test_rank_starts_with_the_cache_aware_pick_and_lists_every_worker_once() -> None:
    views = [
        WorkerView(0, in_flight=0, matched_tokens=0),
        WorkerView(1, in_flight=1, matched_tokens=96),
        WorkerView(2, in_flight=0, matched_tokens=32),
    ]
    ranked = rank_cache_aware(views, prompt_len=100)
    assert ranked[0] == choose_cache_aware(views, 100)
    assert [d.index for d in ranked] == [1, 2, 0]
    assert ranked[0].reason == CACHE_HIT


def test_no_match_goes_to_the_most_free_cache_before_the_fewest_in_flight() -> None:
    # A faster worker has fewer requests in flight; its cache, not its load, says whether a
    # new conversation still fits there.
    vs = [
        WorkerView(0, in_flight=0, cached_blocks=90, total_blocks=100),
        WorkerView(1, in_flight=2, cached_blocks=20, total_blocks=100),
    ]
    d = choose_cache_aware(vs, prompt_len=50, cfg=CFG)
    assert (d.index, d.reason) == (1, MOST_FREE_CACHE)


def test_a_prefix_only_one_worker_holds_does_not_pin_new_conversations() -> None:
    # Worker 0 holds the system prompt (160 of 200 tokens) as the start of another
    # conversation's path: the new conversation goes where there is room, which then caches
    # the system prompt too.
    vs = [
        WorkerView(0, 0, 160, continues=False, cached_blocks=30, total_blocks=100),
        WorkerView(1, 0, 0, cached_blocks=5, total_blocks=100),
    ]
    d = choose_cache_aware(vs, prompt_len=200, cfg=CFG)
    assert (d.index, d.reason) == (1, MOST_FREE_CACHE)


def test_a_conversations_next_turn_stays_where_its_history_is() -> None:
    vs = [
        WorkerView(0, 0, 160, continues=True, cached_blocks=90, total_blocks=100),
        WorkerView(1, 0, 32, continues=False, cached_blocks=5, total_blocks=100),
    ]
    d = choose_cache_aware(vs, prompt_len=200, cfg=CFG)
    assert (d.index, d.reason, d.matched_tokens) == (0, CACHE_HIT, 160)


def test_free_cache_is_compared_in_tokens_across_block_sizes() -> None:
    # A worker with 16-token blocks reports twice the blocks of one with 32-token blocks.
    vs = [
        WorkerView(0, 0, cached_blocks=20, total_blocks=100, block_size=32),  # 2,560 free
        WorkerView(1, 0, cached_blocks=60, total_blocks=200, block_size=16),  # 2,240 free
    ]
    assert choose_cache_aware(vs, prompt_len=50, cfg=CFG).index == 0
