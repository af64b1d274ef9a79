"""CPU tensors on huge pages: advised, packed side by side, and a model's weights packed
without changing what it computes."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from radixserve.model import kernels
from radixserve.model.attention import select_backend
from radixserve.model.batch import SeqChunk, build_batch
from radixserve.model.config import ModelConfig
from radixserve.model.hugepages import (
    WeightArena,
    advise_huge_pages,
    pack_on_huge_pages,
    return_freed_memory_at_once,
    reuse_freed_memory,
    zeros_on_huge_pages,
)
from radixserve.model.kv_pool import KVPool
from radixserve.model.quant import QuantLinear
from radixserve.model.weights import pack_model_weights, quantize_model

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
needs_thp = pytest.mark.skipif(
    not THP.exists() or "[never]" in THP.read_text(), reason="no transparent huge pages here"
)


def _thp_eligible(address: int) -> bool:
    """Whether the mapping holding `address` may be backed by transparent huge pages."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("THPeligible:"):
            return line.split()[1] == "1"
    return False


@needs_thp
def test_large_cpu_tensors_are_advised_onto_huge_pages() -> None:
    big = torch.empty(8 << 20, dtype=torch.uint8)
    assert advise_huge_pages(big)
    assert _thp_eligible(big.data_ptr() + (4 << 20))
    assert not advise_huge_pages(torch.empty(1024))  # under one huge page: left alone


@needs_thp
def test_the_kv_pool_is_on_huge_pages() -> None:
    config = ModelConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=8, max_position_embeddings=128,
    )  # fmt: skip
    pool = KVPool(config, 4000, 16, torch.float32)  # K and V 8 MB each
    assert _thp_eligible(pool.k.data_ptr() + pool.k.nbytes // 2)


def _mapping_of(address: int) -> str:
    """The name /proc/self/maps gives the mapping holding `address` ("" for an anonymous one)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if lo <= address < hi:
            return fields[5] if len(fields) > 5 else ""
    raise AssertionError(f"{address:#x} is not mapped")


def test_kv_zeros_are_pages_of_their_own_while_freed_memory_is_reused() -> None:
    """With glibc keeping freed memory for reuse (as after a model's load), the pool's zeros
    are still a mapping of their own, fresh pages resident only once written, not a block
    of glibc's heap that calloc would first have to clear."""
    reuse_freed_memory()
    try:
        torch.full((64 << 20,), 7, dtype=torch.uint8).sum()  # freed at once, kept by glibc
        zeros = zeros_on_huge_pages((16, 4 << 20), torch.uint8, torch.device("cpu"))
        assert _mapping_of(zeros.data_ptr()) != "[heap]"
        zeros[3, -1] = 5
        assert int(zeros.sum()) == 5
    finally:
        return_freed_memory_at_once()


def test_packed_tensors_are_equal_copies_side_by_side_in_the_order_given() -> None:
    torch.manual_seed(0)
    tensors = [
        torch.randn(3, 5),
        torch.randint(0, 255, (7,), dtype=torch.uint8),
        torch.randn(4, 6).t(),  # not contiguous: packed contiguous
        torch.randn(2, 3).to(torch.bfloat16),
        torch.tensor(2.5),
    ]
    before = [t.clone() for t in tensors]
    packed = pack_on_huge_pages(tensors)
    storage = packed[0].untyped_storage().data_ptr()
    end = 0
    for t, p, old in zip(tensors, packed, before, strict=True):
        assert torch.equal(p, t) and torch.equal(t, old)  # a copy; the original untouched
        assert p.dtype == t.dtype and p.shape == t.shape and p.is_contiguous()
        assert p.untyped_storage().data_ptr() == storage  # one buffer
        assert p.data_ptr() % 64 == 0 and p.data_ptr() >= end  # in order, cache-line aligned
        end = p.data_ptr() + p.nbytes
    assert pack_on_huge_pages([]) == []


@needs_thp
def test_a_large_pack_is_on_huge_pages() -> None:
    packed = pack_on_huge_pages([torch.ones(1 << 20), torch.ones(1 << 20)])  # 8 MB in all
    assert _thp_eligible(packed[1].data_ptr())


def test_an_arena_hands_out_aligned_tensors_in_order_that_outlive_it() -> None:
    arena = WeightArena(4 << 20)
    a = arena.empty((1000,), torch.float32)
    b = arena.empty((3, 7), torch.int8)
    c = arena.empty((5,), torch.uint8)
    assert all(arena.holds(t) for t in (a, b, c)) and not arena.holds(torch.ones(4))
    assert a.data_ptr() % 64 == 0 and b.data_ptr() == a.data_ptr() + 4032  # 4000 -> 4032
    assert c.data_ptr() == b.data_ptr() + 64 and b.shape == (3, 7) and b.dtype == torch.int8
    a.fill_(3.0)
    full = arena.empty((1 << 20,), torch.float32)  # 4 MiB more than is left: torch's own
    assert not arena.holds(full) and full.shape == (1 << 20,)
    del arena
    assert a.sum().item() == 3000.0  # the region lives with its tensors


@needs_thp
def test_an_arena_is_on_huge_pages() -> None:
    arena = WeightArena(8 << 20)
    t = arena.empty((2 << 20,), torch.float32)
    assert _thp_eligible(t.data_ptr() + (4 << 20))


@pytest.mark.slow
def test_a_gguf_models_codes_are_written_into_one_region_in_step_order(
    default_model_files,
) -> None:
    """Loading the default model leaves each projection's codes one after another in the
    order a step reads them, in one mapping on huge pages."""
    from radixserve.model.loader import load_model

    model = load_model(default_model_files, torch.float32, torch.device("cpu"), None)
    reads = [r for r in model.step_weights() if isinstance(r, QuantLinear)]
    assert len(reads) == 4 * model.config.num_layers + 1
    starts = [t.data_ptr() for r in reads for t in r.weight.tensors()]
    assert starts == sorted(starts)
    ends = [t.data_ptr() + t.nbytes for r in reads for t in r.weight.tensors()]
    assert all(nxt - end < 64 for end, nxt in zip(ends, starts[1:], strict=False))  # packed
    if THP.exists() and "[never]" not in THP.read_text():
        assert _thp_eligible(starts[len(starts) // 2])


def _logits(model, ids: list[int]) -> list[torch.Tensor]:
    """Prefill `ids`, then one decode step, on a fresh pool: both steps' logits."""
    attn = select_backend("cpu", torch.device("cpu"), torch.float32)
    pool = KVPool(model.config, 10, 4, torch.float32)
    table = list(range(10))
    prefill = model(build_batch([SeqChunk(ids, 0, table)], 4), pool, attn)
    decode = model(build_batch([SeqChunk([7], len(ids), table)], 4), pool, attn)
    return [prefill, decode]


@pytest.mark.parametrize("kind", ["none", "int4"])
def test_packing_a_models_weights_changes_none_of_its_logits(tiny_pair_factory, kind) -> None:
    _, model = tiny_pair_factory(intermediate_size=128)
    if kind != "none":
        assert kernels.load()
        quantize_model(model, kind)
    ids = [random.Random(0).randrange(101) for _ in range(30)]
    before = _logits(model, ids)
    pack_model_weights(model)
    after = _logits(model, ids)
    for a, b in zip(before, after, strict=True):
        assert torch.equal(a, b)
    # Every matrix the step reads now lies in one buffer.
    layer = model.decoder_layers()[1]
    lin = layer.down_lin
    head = model.head_lin
    ptrs = {layer.input_norm.untyped_storage().data_ptr(), model.norm.untyped_storage().data_ptr()}
    if kind == "none":
        ptrs |= {layer.down.untyped_storage().data_ptr()}
    else:
        assert isinstance(lin, QuantLinear) and isinstance(head, QuantLinear)
        ptrs |= {lin.weight.qs.untyped_storage().data_ptr()}
        ptrs |= {head.weight.scale.untyped_storage().data_ptr()}
    assert len(ptrs) == 1
