"""Batched sampling: every row of a step at once, each as its own parameters say."""

from __future__ import annotations

import torch

from radixserve.model.sampling import (
    SamplingRow,
    process_logits,
    sample_rows,
    token_logprobs,
    unpack_bitmask,
)


def _logits(rows: int = 4, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * 3


def test_greedy_rows_take_the_argmax() -> None:
    logits = _logits()
    rows = [SamplingRow(temperature=0.0), SamplingRow(top_k=1)] * 2
    assert sample_rows(logits, rows).tolist() == logits.argmax(-1).tolist()


def test_seeded_row_draws_the_same_token_whatever_shares_the_step() -> None:
    logits = _logits(3)

    def seeded() -> SamplingRow:
        return SamplingRow(temperature=1.0, generator=torch.Generator().manual_seed(42))

    alone = sample_rows(logits[1:2], [seeded()])
    mixed = sample_rows(
        logits, [SamplingRow(temperature=0.7), seeded(), SamplingRow(temperature=0.0)]
    )
    assert mixed[1] == alone[0]
    assert mixed[2] == logits[2].argmax()


def test_top_k_keeps_draws_inside_the_k_most_likely() -> None:
    logits = _logits(2, seed=3)
    top3 = [set(torch.topk(row, 3).indices.tolist()) for row in logits]
    rows = [SamplingRow(temperature=2.0, top_k=3), SamplingRow(temperature=2.0, top_k=-1)]
    seen_outside = False
    for _ in range(200):
        ids = sample_rows(logits, rows).tolist()
        assert ids[0] in top3[0]
        seen_outside |= ids[1] not in top3[1]
    assert seen_outside  # the row without a cut does draw outside its top 3


def test_top_p_below_the_top_probability_is_greedy() -> None:
    logits = _logits(2, seed=5)
    logits[:, 7] += 20  # one token holds nearly all the mass
    rows = [SamplingRow(temperature=1.0, top_p=0.5)] * 2
    for _ in range(20):
        assert sample_rows(logits, rows).tolist() == [7, 7]


def test_presence_and_frequency_penalties_follow_the_output_counts() -> None:
    logits = _logits(1, vocab=10)
    row = SamplingRow(presence_penalty=0.5, frequency_penalty=0.25, output_ids=(3, 3, 3, 7))
    out = process_logits(logits, [row])
    want = logits.clone()
    want[0, 3] -= 0.5 + 3 * 0.25
    want[0, 7] -= 0.5 + 1 * 0.25
    assert torch.allclose(out, want)


def test_repetition_penalty_shrinks_seen_logits_toward_zero_in_prompt_and_output() -> None:
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 1.0]])
    row = SamplingRow(repetition_penalty=2.0, prompt_ids=(0, 1), output_ids=(3,))
    out = process_logits(logits, [row])
    assert out.tolist() == [[1.0, -4.0, 2.0, -4.0, 1.0]]


def test_logit_bias_is_added_and_banned_tokens_cannot_be_drawn() -> None:
    logits = _logits(2, vocab=20)
    rows = [
        SamplingRow(temperature=0.0, logit_bias=((5, 100.0),)),
        SamplingRow(temperature=0.0, banned_ids=(int(logits[1].argmax()),)),
    ]
    ids = sample_rows(logits, rows).tolist()
    assert ids[0] == 5
    second = logits[1].clone()
    second[logits[1].argmax()] = float("-inf")
    assert ids[1] == int(second.argmax())


def test_processing_leaves_the_raw_logits_untouched() -> None:
    logits = _logits(1)
    before = logits.clone()
    sample_rows(logits, [SamplingRow(temperature=0.0, logit_bias=((1, 5.0),))])
    assert torch.equal(logits, before)


def test_a_bitmask_allows_exactly_its_set_bits() -> None:
    vocab = 70  # three 32-bit words, the last one partly past the vocabulary
    allowed = {0, 31, 32, 45, 69}
    bits = torch.zeros(3, dtype=torch.int64)
    for t in allowed:
        bits[t // 32] |= 1 << (t % 32)
    mask = _to_int32(bits)
    unpacked = unpack_bitmask(mask[None, :], vocab)
    assert unpacked.shape == (1, vocab)
    assert set(torch.nonzero(unpacked[0]).flatten().tolist()) == allowed


def test_a_masked_row_draws_only_allowed_tokens_and_its_neighbour_is_free() -> None:
    logits = _logits(2, vocab=64, seed=9)
    bits = _to_int32(torch.tensor([1 << 7, 0], dtype=torch.int64))  # only token 7
    rows = [SamplingRow(temperature=1.5, allowed=bits), SamplingRow(temperature=0.0)]
    for _ in range(20):
        ids = sample_rows(logits, rows).tolist()
        assert ids == [7, int(logits[1].argmax())]


def test_random_bitmasks_unpack_bit_for_bit_sign_bits_included() -> None:
    g = torch.Generator().manual_seed(3)
    mask = torch.randint(-(2**31), 2**31 - 1, (3, 4), dtype=torch.int32, generator=g)
    unpacked = unpack_bitmask(mask, 4 * 32 - 5)
    for r in range(3):
        for t in range(4 * 32 - 5):
            word = int(mask[r, t // 32]) & 0xFFFFFFFF
            assert bool(unpacked[r, t]) == bool((word >> (t % 32)) & 1)


def test_when_every_row_is_masked_each_keeps_only_its_allowed_tokens() -> None:
    logits = _logits(2, vocab=64, seed=5)
    before = logits.clone()
    allowed = [{3, 40}, {63}]
    rows = []
    for toks in allowed:
        bits = torch.zeros(2, dtype=torch.int64)
        for t in toks:
            bits[t // 32] |= 1 << (t % 32)
        rows.append(SamplingRow(temperature=0.0, allowed=_to_int32(bits)))
    out = process_logits(logits, rows)
    for r, toks in enumerate(allowed):
        finite = set(torch.nonzero(torch.isfinite(out[r])).flatten().tolist())
        assert finite == toks
        assert torch.equal(out[r, sorted(toks)], logits[r, sorted(toks)])
    assert sample_rows(logits, rows).tolist() == [
        max(allowed[0], key=lambda t: float(logits[0, t])),
        63,
    ]
    assert torch.equal(logits, before)


def test_token_logprobs_equal_a_float32_log_softmax_with_the_top_tokens_best_first() -> None:
    logits = _logits(3, vocab=40, seed=11)
    scored = token_logprobs(logits, [0, 2], [5, 9], [3, 0])
    ref = torch.log_softmax(logits, dim=-1)
    assert abs(scored[0].logprob - ref[0, 5].item()) < 1e-6
    assert abs(scored[1].logprob - ref[2, 9].item()) < 1e-6
    top = torch.topk(ref[0], 3)
    assert [t for t, _ in scored[0].top] == top.indices.tolist()
    values = [v for _, v in scored[0].top]
    assert torch.allclose(torch.tensor(values), top.values, atol=1e-6)
    assert scored[1].top == []


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words holding 32 bits each -> the same bits as int32 (two's complement)."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
