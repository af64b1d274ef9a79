"""The per-worker mirror trie: matching, events, snapshots, and the bounded fallback."""

from __future__ import annotations

from radixserve.router.trie import WorkerTrie

BS = 4


def seq(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def test_match_counts_whole_cached_blocks() -> None:
    t = WorkerTrie(BS, 64)
    t.insert(seq(0, 10))  # 2 whole blocks cached
    assert t.match(seq(0, 12)) == 8
    assert t.match(seq(0, 5)) == 4
    assert t.match(seq(1, 12)) == 0
    assert t.num_blocks == 2


def test_namespaces_are_isolated() -> None:
    t = WorkerTrie(BS, 64)
    t.insert(seq(0, 8), "alice")
    assert t.match(seq(0, 8), "alice") == 8
    assert t.match(seq(0, 8), None) == 0
    assert t.match(seq(0, 8), "bob") == 0


def test_evict_with_num_tokens_removes_only_that_run() -> None:
    t = WorkerTrie(BS, 64)
    t.insert(seq(0, 16))
    t.remove(seq(0, 16), None, num_tokens=8)
    assert t.match(seq(0, 16)) == 8
    assert t.paths() == [(None, tuple(seq(0, 8)))]


def test_evict_without_num_tokens_drops_the_last_block() -> None:
    t = WorkerTrie(BS, 64)
    t.insert(seq(0, 16))
    t.remove(seq(0, 16))
    assert t.match(seq(0, 16)) == 12


def test_evict_of_unknown_path_and_insert_of_known_path_are_no_ops() -> None:
    t = WorkerTrie(BS, 64)
    t.insert(seq(0, 8))
    t.remove(seq(100, 8), None, num_tokens=8)
    t.insert(seq(0, 8))
    assert t.num_blocks == 2


def test_load_replaces_contents_with_the_snapshot() -> None:
    t = WorkerTrie(BS, 64)
    t.insert(seq(50, 8))
    t.load([(None, seq(0, 8)), (None, seq(0, 4) + seq(9, 4)), ("s", seq(0, 4))])
    got = sorted(t.paths(), key=repr)
    want = sorted(
        [(None, tuple(seq(0, 8))), (None, tuple(seq(0, 4) + seq(9, 4))), ("s", tuple(seq(0, 4)))],
        key=repr,
    )
    assert got == want
    assert t.num_blocks == 4  # the shared first block is stored once


def test_fallback_is_bounded_and_evicts_least_recently_used() -> None:
    t = WorkerTrie(BS, 4)
    t.insert(seq(0, 8))  # A: 2 blocks
    t.insert(seq(100, 8))  # B: 2 blocks, full now
    t.insert(seq(0, 8))  # touch A
    t.insert(seq(200, 8))  # C needs 2: B (least recent) goes
    assert t.num_blocks == 4
    assert t.match(seq(0, 8)) == 8
    assert t.match(seq(100, 8)) == 0
    assert t.match(seq(200, 8)) == 8


def test_insert_longer_than_capacity_is_cut() -> None:
    t = WorkerTrie(BS, 2)
    t.insert(seq(0, 40))
    assert t.match(seq(0, 40)) == 8


def test_clear_forgets_everything() -> None:
    t = WorkerTrie(BS, 8)
    t.insert(seq(0, 8))
    t.clear()
    assert t.num_blocks == 0 and t.paths() == []


def test_continues_tells_a_next_turn_from_a_branch_off_a_shared_prefix() -> None:
    t = WorkerTrie(BS, 64)
    system, first = seq(0, 12), seq(100, 10)
    t.insert(system + first)  # one conversation so far: 5 whole blocks
    matched = t.match(system + first + seq(200, 6))
    assert matched == 20
    # Its next turn follows the cached path to the end, partial last block aside.
    assert t.continues(system + first + seq(200, 6), None, matched)
    # An exact repeat of the cached prompt is on the path too.
    assert t.continues(system + first, None, t.match(system + first))
    # A new conversation only shares the system prompt: the path goes on for 8 more tokens.
    other = system + seq(300, 10)
    assert t.match(other) == 12
    assert not t.continues(other, None, 12)
    # Leaving the path less than a block before its end is a next turn (a template that
    # renders the last answer's end differently from how it was generated).
    assert t.continues(system + first[:8] + seq(400, 9), None, 20)
    assert not t.continues(seq(500, 8), None, 0)
