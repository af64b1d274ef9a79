"""What each eviction policy keeps under pressure, namespace quotas, and refetch counting."""

from __future__ import annotations

import pytest

from radixserve.cache import RadixCache, RadixNode, make_policy

from .helpers import BS, make_cache, seq

HOT = seq((1, 4 * BS))  # a 4-block shared preamble


def serve(
    cache: RadixCache, tokens: list[int], namespace: object = None, **kw: object
) -> RadixNode:
    """One request as the engine runs it: match, pin, allocate the rest, insert, unpin.
    Returns the node the request's path ends at."""
    m = cache.match_prefix(tokens, namespace)
    cache.lock(m.node)
    new = cache.allocate(len(tokens) // BS - len(m.blocks))
    res = cache.insert(tokens, m.blocks + new, namespace, **kw)  # type: ignore[arg-type]
    cache.pool.free(res.duplicate_blocks)
    cache.unlock(m.node)
    return res.node


def burst(cache: RadixCache, n: int, blocks: int = 4, start: int = 100) -> None:
    """n one-off prompts of `blocks` blocks each, sharing nothing."""
    for i in range(n):
        serve(cache, seq((start + i, blocks * BS)))


def hot_traffic_then_burst(policy: str, **kw: object) -> RadixCache:
    cache = make_cache(num_blocks=24, policy=make_policy(policy), **kw)  # type: ignore[arg-type]
    for q in range(4):  # the preamble, reused by four requests with their own question
        serve(cache, HOT + seq((50 + q, BS)))
    burst(cache, 6)  # 24 blocks of one-off prompts: the whole pool
    return cache


def test_lru_loses_a_hot_preamble_to_a_burst() -> None:
    cache = hot_traffic_then_burst("lru")
    assert cache.peek_prefix(HOT) == 0


@pytest.mark.parametrize("policy", ["fanout", "slru"])
def test_hot_preamble_survives_a_burst_of_one_off_prompts(policy: str) -> None:
    cache = hot_traffic_then_burst(policy)
    assert cache.peek_prefix(HOT) == len(HOT)
    cache.check_invariants(num_private_blocks=0)


def test_fanout_protection_decays_with_time() -> None:
    cache = make_cache(num_blocks=24, policy=make_policy("fanout"))
    cache.policy.decay_ticks = 4.0  # type: ignore[attr-defined]
    for q in range(3):
        serve(cache, HOT + seq((50 + q, BS)))
    burst(cache, 12)  # long after its last use, the preamble is worth less than a new prompt
    assert cache.peek_prefix(HOT) == 0


def test_slru_protected_segment_is_capped_and_demotes_its_oldest() -> None:
    policy = make_policy("slru")
    cache = make_cache(num_blocks=20, policy=policy)  # protected cap: 16 blocks
    nodes = []
    for i in range(5):
        serve(cache, seq((10 + i, 4 * BS)))
        nodes.append(serve(cache, seq((10 + i, 4 * BS))))  # second use: promoted
    assert policy.protected_blocks == 16  # type: ignore[attr-defined]
    assert not nodes[0].protected  # the oldest was demoted
    assert all(n.protected for n in nodes[1:])


def test_priority_evicts_lower_tiers_first_then_lru() -> None:
    cache = make_cache(num_blocks=12, policy=make_policy("priority"))
    gold, free_old, free_new = seq((1, 4 * BS)), seq((2, 4 * BS)), seq((3, 4 * BS))
    serve(cache, gold, priority=2)
    serve(cache, free_old)
    serve(cache, free_new)
    serve(cache, seq((4, 4 * BS)))  # needs 4 blocks: the oldest free-tier path goes
    assert cache.peek_prefix(free_old) == 0
    assert cache.peek_prefix(gold) == len(gold) and cache.peek_prefix(free_new) == len(free_new)
    burst(cache, 2)  # then the rest of the free tier, before any gold block
    assert cache.peek_prefix(gold) == len(gold)


def test_session_path_stays_warm_until_its_ttl_runs_out() -> None:
    now = [0.0]
    policy = make_policy("lru", session_ttl=10.0, clock=lambda: now[0])
    cache = make_cache(num_blocks=16, policy=policy, clock=lambda: now[0])
    agent = seq((7, 4 * BS))
    serve(cache, agent, session=True)
    burst(cache, 6)  # 24 blocks of newer one-off prompts through a 16-block pool
    assert cache.peek_prefix(agent) == len(agent)
    now[0] = 11.0  # the session went quiet for longer than the TTL
    burst(cache, 3, start=200)
    assert cache.peek_prefix(agent) == 0
    cache.check_invariants(num_private_blocks=0)


def test_namespace_over_quota_evicts_itself_before_others() -> None:
    cache = make_cache(num_blocks=24, policy=make_policy("lru"), namespace_quota=0.5)
    quiet = seq((9, 4 * BS))
    serve(cache, quiet, "a")
    for i in range(8):  # tenant b's spike: 32 blocks, newer than tenant a's path
        serve(cache, seq((100 + i, 4 * BS)), "b")
    assert cache.peek_prefix(quiet, "a") == len(quiet)
    cache.check_invariants(num_private_blocks=0)


def test_without_quota_a_spike_flushes_the_quiet_tenant() -> None:
    cache = make_cache(num_blocks=24, policy=make_policy("lru"))
    quiet = seq((9, 4 * BS))
    serve(cache, quiet, "a")
    for i in range(8):
        serve(cache, seq((100 + i, 4 * BS)), "b")
    assert cache.peek_prefix(quiet, "a") == 0


def test_blocks_cached_again_soon_after_eviction_count_as_refetched() -> None:
    now = [0.0]
    cache = make_cache(num_blocks=8, refetch_window_s=30.0, clock=lambda: now[0])
    first = seq((1, 4 * BS))
    serve(cache, first)
    burst(cache, 2, start=20)  # evicts `first`
    serve(cache, first)  # 4 blocks prefilled again, within the window
    assert cache.stats().refetch_blocks == 4
    burst(cache, 2, start=40)
    now[0] = 100.0  # past the window: a re-insert is not a refetch
    serve(cache, first)
    assert cache.stats().refetch_blocks == 4


def test_refetch_counting_can_be_turned_off() -> None:
    cache = make_cache(num_blocks=8, refetch_window_s=0)
    serve(cache, seq((1, 8 * BS)))
    burst(cache, 2)
    serve(cache, seq((1, 8 * BS)))
    assert cache.stats().refetch_blocks == 0


def test_unknown_policy_and_bad_options_raise() -> None:
    with pytest.raises(ValueError, match="choose from lru, fanout, slru, priority"):
        make_policy("mru")
    with pytest.raises(ValueError):
        make_policy("lru", session_ttl=-1)
    with pytest.raises(ValueError):
        make_cache(namespace_quota=1.5)
