"""vLLM's KV event format: the reader takes both encodings, block hashes are the documented
function, and a cache's history sent through the format rebuilds the same cache tree."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import hypothesis.strategies as st
import msgspec
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from radixserve.cache import BlockPool, CacheEvent, RadixCache, TieredRadixCache
from radixserve.router.kv_mirror import BlockMirror
from radixserve.router.trie import WorkerTrie
from radixserve.server.kv_events.config import KVEventsConfig, parse_endpoint
from radixserve.server.kv_events.hashing import block_hash, path_hashes
from radixserve.server.kv_events.translate import EventTranslator, media
from radixserve.server.kv_events.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    WireError,
    decode_batch,
    encode_batch,
)

BS = 4


def stored(hashes: list[int], parent: int | None, tokens: list[int]) -> BlockStored:
    return BlockStored(hashes, parent, tokens, BS, None, "GPU", None)  # type: ignore[arg-type]


def test_events_as_maps_and_as_tagged_arrays_decode_to_the_same_batch() -> None:
    as_maps = msgspec.msgpack.encode(
        [
            1.5,
            [
                {"type": "BlockStored", "block_hashes": [7], "parent_block_hash": None,
                 "token_ids": [1, 2, 3, 4], "block_size": 4, "lora_id": None, "medium": "GPU"},
                {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"},
                {"type": "AllBlocksCleared"},
            ],
            0,
        ]
    )  # fmt: skip
    as_arrays = msgspec.msgpack.encode(
        [
            1.5,
            [
                ["BlockStored", [7], None, [1, 2, 3, 4], 4, None, "GPU"],
                ["BlockRemoved", [7], "GPU"],
                ["AllBlocksCleared"],
            ],
            0,
        ]
    )
    expected = KVEventBatch(
        1.5, [stored([7], None, [1, 2, 3, 4]), BlockRemoved([7], "GPU"), AllBlocksCleared()], 0
    )
    assert decode_batch(as_maps) == expected
    assert decode_batch(as_arrays) == expected


def test_encoded_batch_decodes_field_for_field() -> None:
    ev = BlockStored([1, b"\x02" * 32], None, list(range(8)), BS, None, "CPU", None,
                     extra_keys=[("salt",), None], group_idx=0)  # fmt: skip
    batch = KVEventBatch(2.0, [ev, BlockRemoved([3], "CPU_OFFLOAD", group_idx=0)], 0)
    assert decode_batch(encode_batch(batch)) == batch


def test_events_of_unknown_types_are_skipped() -> None:
    payload = msgspec.msgpack.encode([1.0, [{"type": "Future"}, ["AllBlocksCleared"]]])
    assert decode_batch(payload).events == [AllBlocksCleared()]


@pytest.mark.parametrize("payload", [b"\xc1", msgspec.msgpack.encode({"x": 1}), b"\x93\x01"])
def test_malformed_payload_is_a_wire_error(payload: bytes) -> None:
    with pytest.raises(WireError):
        decode_batch(payload)


def test_block_hash_is_the_documented_function() -> None:
    def doc(parent: int | None, tokens: list[int], salt: str | None) -> int:
        data = b"radixserve-kv-block-v1\0"
        data += b"\x00" + bytes(8) if parent is None else b"\x01" + parent.to_bytes(8, "big")
        if salt is None or parent is not None:
            data += b"\x00"
        else:
            data += b"\x01" + len(salt.encode()).to_bytes(4, "big") + salt.encode()
        data += b"".join(t.to_bytes(4, "little") for t in tokens)
        return int.from_bytes(hashlib.sha256(data).digest()[-8:], "big")

    first = doc(None, [1, 2, 3, 70000], "tenant")
    assert block_hash(None, [1, 2, 3, 70000], "tenant") == first
    assert block_hash(first, [5, 6, 7, 8], "tenant") == doc(first, [5, 6, 7, 8], None)
    assert path_hashes([1, 2, 3, 70000, 5, 6, 7, 8, 9], BS, "tenant") == [
        first,
        doc(first, [5, 6, 7, 8], None),
    ]


def test_block_hashes_are_the_same_in_another_process() -> None:
    code = (
        "from radixserve.server.kv_events.hashing import path_hashes;"
        "print(path_hashes(list(range(64)), 16, 'salt'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "12345", "PATH": ""},
        cwd=".",
    ).stdout
    assert out.strip() == str(path_hashes(list(range(64)), 16, "salt"))


def test_salt_changes_every_hash_of_the_path() -> None:
    tokens = list(range(12))
    plain, salted = path_hashes(tokens, BS), path_hashes(tokens, BS, "a")
    assert all(a != b for a, b in zip(plain, salted, strict=True))


@pytest.mark.parametrize(
    ("address", "bind"),
    [
        ("tcp://127.0.0.1:5557", True),
        ("tcp://localhost:5557", True),
        ("tcp://[::1]:5557", True),
        ("tcp://*:5557", True),
        ("tcp://0.0.0.0:5557", True),
        ("ipc:///tmp/kv", True),
        ("tcp://10.1.2.3:5557", False),
        ("tcp://indexer.svc:5557", False),
    ],
)
def test_endpoint_binds_wildcards_and_loopback_and_connects_elsewhere(
    address: str, bind: bool
) -> None:
    assert parse_endpoint(address).bind is bind


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"enable_kv_cache_events": True, "endpiont": "tcp://*:1"}, "endpiont"),
        ({"enable_kv_cache_events": True, "publisher": "kafka"}, "kafka"),
        ({"enable_kv_cache_events": True, "endpoint": "http://x:1"}, "tcp, ipc or inproc"),
        ({"enable_kv_cache_events": True, "endpoint": "tcp://host"}, "needs a host and a port"),
        ({"enable_kv_cache_events": True, "hwm": 0}, "hwm"),
        ({"enable_kv_cache_events": True, "replay_endpoint": "tcp://10.0.0.1:2"}, "bind"),
    ],
)
def test_bad_config_names_what_is_wrong(values: dict[str, object], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        KVEventsConfig.from_dict(values)


def test_config_defaults_to_a_loopback_endpoint_and_follows_vllm_on_enabling() -> None:
    assert KVEventsConfig.from_dict({"enable_kv_cache_events": True}).endpoint.startswith(
        "tcp://127.0.0.1:"
    )
    assert KVEventsConfig.from_dict({"enable_kv_cache_events": True}).enabled
    assert not KVEventsConfig.from_dict({"publisher": "zmq"}).enabled  # as vLLM: off


def test_media_name_pool_and_tier_apart() -> None:
    assert media("cpu", offload_file=False) == ("CPU", "CPU_OFFLOAD")
    assert media("cuda:0", offload_file=False) == ("GPU", "CPU")
    assert media("cpu", offload_file=True) == ("CPU", "STORAGE")


def test_demotion_is_stored_in_the_tier_then_removed_from_the_pool() -> None:
    t = EventTranslator(BS, "CPU", "CPU_OFFLOAD")
    path = tuple(range(8))
    events = t.translate(CacheEvent("demote", None, path, 4, True))
    h = path_hashes(path, BS)
    assert events == [
        BlockStored([h[1]], h[0], [4, 5, 6, 7], BS, None, "CPU_OFFLOAD", None, group_idx=0),
        BlockRemoved([h[1]], "CPU", group_idx=0),
    ]


def test_salted_path_carries_the_salt_in_its_first_block_extra_keys() -> None:
    t = EventTranslator(BS, "CPU", "CPU_OFFLOAD")
    (ev,) = t.translate(CacheEvent("insert", "tenant", tuple(range(8)), 8))
    assert isinstance(ev, BlockStored)
    assert ev.extra_keys == [("tenant",), None]
    (later,) = t.translate(CacheEvent("insert", "tenant", tuple(range(12)), 4))
    assert isinstance(later, BlockStored) and later.extra_keys == [None]


class NoBytes:
    def demote(self, pool_blocks: list[int], tier_blocks: list[int]) -> None:
        pass

    def promote(self, tier_blocks: list[int], pool_blocks: list[int]) -> None:
        pass


class Channel:
    """A cache's detailed events, through the wire format, into a mirror."""

    def __init__(self, cache: RadixCache) -> None:
        self.translator = EventTranslator(BS, "CPU", "CPU_OFFLOAD")
        self.mirror = BlockMirror(WorkerTrie(BS, 4096))
        self.pending: list[CacheEvent] = []
        cache.add_listener(self.pending.append, detail=True)

    def flush(self) -> None:
        events = [w for e in self.pending for w in self.translator.translate(e)]
        self.pending.clear()
        for event in decode_batch(encode_batch(KVEventBatch(0.0, events, 0))).events:
            self.mirror.apply(event)


class CacheThroughEvents(RuleBasedStateMachine):
    """Random inserts, lookups (promotions), locks, evictions and resets of a tiered cache;
    the mirror fed by its vLLM-format events always holds exactly the cache's paths."""

    def __init__(self) -> None:
        super().__init__()
        self.cache = TieredRadixCache(BlockPool(10), BS, None, BlockPool(8), NoBytes())
        self.channel = Channel(self.cache)
        self.locked: list[object] = []

    @rule(
        head=st.integers(0, 2),
        body=st.lists(st.integers(0, 3), min_size=1, max_size=12),
        ns=st.sampled_from([None, "a"]),
    )
    def insert(self, head: int, body: list[int], ns: str | None) -> None:
        tokens = [head] * BS + body
        n = len(tokens) // BS
        match = self.cache.match_prefix(tokens, ns)
        self.cache.lock(match.node)
        try:
            fresh = self.cache.allocate(n - len(match.blocks))
        except Exception:
            self.cache.unlock(match.node)
            return
        res = self.cache.insert(tokens[: n * BS], match.blocks + fresh, ns)
        self.cache.pool.free(res.duplicate_blocks)
        self.cache.unlock(match.node)

    @rule(head=st.integers(0, 2), body=st.lists(st.integers(0, 3), max_size=12))
    def lookup_and_lock(self, head: int, body: list[int]) -> None:
        match = self.cache.match_prefix([head] * BS + body)
        if match.num_tokens and len(self.locked) < 2:
            self.cache.lock(match.node)
            self.locked.append(match.node)

    @rule()
    def unlock_one(self) -> None:
        if self.locked:
            self.cache.unlock(self.locked.pop())  # type: ignore[arg-type]

    @rule(n=st.integers(1, 6))
    def evict(self, n: int) -> None:
        self.cache.evict(n)

    @rule()
    def reset(self) -> None:
        self.cache.reset()

    @invariant()
    def mirror_holds_the_cache_paths(self) -> None:
        self.channel.flush()
        assert set(self.channel.mirror.trie.paths()) == set(self.cache.leaf_paths())


TestCacheThroughEvents = CacheThroughEvents.TestCase
TestCacheThroughEvents.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)  # fmt: skip


def test_snapshot_of_a_tree_rebuilds_it_in_a_fresh_mirror() -> None:
    cache = TieredRadixCache(BlockPool(4), BS, None, BlockPool(8), NoBytes())
    for tokens, ns in (([1] * 8, None), ([1] * 4 + [2] * 8, None), ([3] * 8, "s")):
        cache.insert(tokens, cache.allocate(len(tokens) // BS), ns)
    mirror = BlockMirror(WorkerTrie(BS, 4096))
    for event in EventTranslator(BS, "CPU", "CPU_OFFLOAD").snapshot(cache.export_nodes()):
        mirror.apply(event)
    assert set(mirror.trie.paths()) == set(cache.leaf_paths())
