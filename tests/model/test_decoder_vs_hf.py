"""The paged forward pass computes what transformers computes, for every architecture: tiny
random configs of each (windows, q/k norms, sandwich norms, biases, fused checkpoints, two RoPE
bases), prompts longer than their windows, on both CPU attention backends."""

from __future__ import annotations

import random

import pytest
import torch

from radixserve.model.attention import AttentionBackend, select_backend
from radixserve.model.batch import SeqChunk, build_batch
from radixserve.model.kv_pool import KVPool
from radixserve.model.layers import Rotary
from tests.support.models import ARCHITECTURES

BS = 4
TOL = 1e-4


@pytest.fixture(scope="module", params=ARCHITECTURES)
def tiny_pair(request: pytest.FixtureRequest, tiny_pair_factory) -> tuple:
    """(transformers model, radixserve DecoderModel) of each architecture, same weights."""
    return tiny_pair_factory(arch=request.param)


@pytest.fixture(params=["sdpa", "cpu"])
def attn(request: pytest.FixtureRequest) -> AttentionBackend:
    """Every test runs with torch SDPA and with radixserve's paged CPU kernel."""
    return select_backend(request.param, torch.device("cpu"), torch.float32)


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def scattered_table(num_tokens: int, pool_blocks: int, rng: random.Random) -> list[int]:
    n = (num_tokens + BS - 1) // BS
    return rng.sample(range(pool_blocks), n)


def run_chunks(model, pool, ids, table, cuts, attn) -> list[torch.Tensor]:
    """Prefill ids in chunks ending at each cut; returns each chunk's last-token logits."""
    out, start = [], 0
    for end in cuts:
        batch = build_batch([SeqChunk(ids[start:end], start, table)], BS)
        out.append(model(batch, pool, attn)[0])
        start = end
    return out


def new_pool(model, blocks: int = 64) -> KVPool:
    return KVPool(model.config, blocks, BS, torch.float32)


def test_full_prefill_matches_hf(tiny_pair, attn) -> None:
    hf, ours = tiny_pair
    rng = random.Random(1)
    ids = [rng.randrange(101) for _ in range(37)]
    pool = new_pool(ours)
    table = scattered_table(len(ids), 64, rng)
    (got,) = run_chunks(ours, pool, ids, table, [len(ids)], attn)
    assert (got - hf_logits(hf, ids)[-1]).abs().max() <= TOL


def test_chunked_prefill_at_unaligned_boundaries_matches_hf(tiny_pair, attn) -> None:
    hf, ours = tiny_pair
    rng = random.Random(2)
    ids = [rng.randrange(101) for _ in range(41)]
    cuts = [3, 10, 11, 29, 41]
    pool = new_pool(ours)
    got = run_chunks(ours, pool, ids, scattered_table(len(ids), 64, rng), cuts, attn)
    ref = hf_logits(hf, ids)
    for logits, end in zip(got, cuts, strict=True):
        assert (logits - ref[end - 1]).abs().max() <= TOL


def test_suffix_after_prefix_in_pool_matches_hf(tiny_pair, attn) -> None:
    hf, ours = tiny_pair
    rng = random.Random(3)
    prefix = [rng.randrange(101) for _ in range(24)]
    suffix = [rng.randrange(101) for _ in range(9)]
    pool = new_pool(ours)
    table = scattered_table(len(prefix) + len(suffix), 64, rng)
    run_chunks(ours, pool, prefix, table, [len(prefix)], attn)
    batch = build_batch([SeqChunk(suffix, len(prefix), table)], BS)
    got = ours(batch, pool, attn)[0]
    assert (got - hf_logits(hf, prefix + suffix)[-1]).abs().max() <= TOL


def test_batched_decode_over_scattered_tables_matches_hf(tiny_pair, attn) -> None:
    hf, ours = tiny_pair
    rng = random.Random(4)
    pool = new_pool(ours, blocks=96)
    free = list(range(96))
    rng.shuffle(free)  # non-contiguous, non-monotonic block ids
    lengths = [5, 17, 1, 30]
    seqs, tables = [], []
    for n in lengths:
        seqs.append([rng.randrange(101) for _ in range(n)])
        nb = (n + 6 + BS - 1) // BS
        tables.append([free.pop() for _ in range(nb)])
    for s, t in zip(seqs, tables, strict=True):
        run_chunks(ours, pool, s, t, [len(s)], attn)
    for _ in range(5):  # five decode steps of the whole batch
        nxt = [rng.randrange(101) for _ in seqs]
        chunks = [SeqChunk([tok], len(s), t) for s, t, tok in zip(seqs, tables, nxt, strict=True)]
        got = ours(build_batch(chunks, BS), pool, attn)
        for row, (s, tok) in enumerate(zip(seqs, nxt, strict=True)):
            s.append(tok)
            assert (got[row] - hf_logits(hf, s)[-1]).abs().max() <= TOL


def test_mixed_prefill_and_decode_batch_matches_hf(tiny_pair, attn) -> None:
    hf, ours = tiny_pair
    rng = random.Random(5)
    pool = new_pool(ours)
    a = [rng.randrange(101) for _ in range(13)]
    b = [rng.randrange(101) for _ in range(22)]
    ta, tb = scattered_table(14, 32, rng), [b_ + 32 for b_ in scattered_table(22, 32, rng)]
    run_chunks(ours, pool, a, ta, [13], attn)
    run_chunks(ours, pool, b, tb, [8], attn)  # b's first 8 tokens are in the pool
    tok = rng.randrange(101)
    chunks = [SeqChunk(b[8:], 8, tb), SeqChunk([tok], 13, ta)]
    got = ours(build_batch(chunks, BS), pool, attn)
    batch = build_batch(chunks, BS)
    by_chunk = dict(zip(batch.logits_chunk_index, got, strict=True))
    assert (by_chunk[0] - hf_logits(hf, b)[-1]).abs().max() <= TOL
    assert (by_chunk[1] - hf_logits(hf, a + [tok])[-1]).abs().max() <= TOL


def test_rows_without_logits_still_write_the_last_layers_kv(tiny_pair, attn) -> None:
    """The last layer runs attention and the MLP only for rows whose output is used, but
    writes every row's K/V: a batch with prefill chunks and a one-token chunk that return no
    logits, beside ones that do; the sequences then continue and still match transformers."""
    hf, ours = tiny_pair
    rng = random.Random(6)
    pool = new_pool(ours)
    seqs = [[rng.randrange(101) for _ in range(n)] for n in (11, 9, 6, 5)]
    tables, free = [], list(range(64))
    rng.shuffle(free)
    for _ in seqs:
        tables.append([free.pop() for _ in range(8)])
    run_chunks(ours, pool, seqs[3], tables[3], [4], attn)  # 4 tokens cached: row 3 decodes one
    chunks = [
        SeqChunk(seqs[0], 0, tables[0]),  # prefill, logits
        SeqChunk(seqs[1][:7], 0, tables[1], need_logits=False),  # prefill, no logits
        SeqChunk(seqs[2][:1], 0, tables[2], need_logits=False),  # one token, no logits
        SeqChunk(seqs[3][4:5], 4, tables[3]),  # decode, logits
    ]
    batch = build_batch(chunks, BS)
    got = dict(zip(batch.logits_chunk_index, ours(batch, pool, attn), strict=True))
    assert sorted(got) == [0, 3]
    assert (got[0] - hf_logits(hf, seqs[0])[-1]).abs().max() <= TOL
    assert (got[3] - hf_logits(hf, seqs[3])[-1]).abs().max() <= TOL
    # Continuing the chunks that returned nothing reads the K/V they wrote, last layer too.
    b = ours(build_batch([SeqChunk(seqs[1][7:], 7, tables[1])], BS), pool, attn)[0]
    c = ours(build_batch([SeqChunk(seqs[2][1:], 1, tables[2])], BS), pool, attn)[0]
    assert (b - hf_logits(hf, seqs[1])[-1]).abs().max() <= TOL
    assert (c - hf_logits(hf, seqs[2])[-1]).abs().max() <= TOL


def test_a_served_context_builds_the_first_rows_of_the_rope_tables(tiny_pair) -> None:
    """Built for a context shorter than the model's, the cos/sin tables (both bases where two)
    are the full ones' first rows, and no more; a longer one gets the model's own."""
    config = tiny_pair[1].config
    full = Rotary(config, torch.float32)
    assert full.cos.shape[1] == config.max_position_embeddings
    short = Rotary(config, torch.float32, positions=7)
    assert short.cos.shape[1] == short.sin.shape[1] == 7
    assert torch.equal(short.cos, full.cos[:, :7]) and torch.equal(short.sin, full.sin[:, :7])
    longer = Rotary(config, torch.float32, positions=config.max_position_embeddings + 5)
    assert torch.equal(longer.cos, full.cos)
