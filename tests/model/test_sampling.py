"""Batched sampling: every row of a step at once, each as its own parameters say."""

from __future__ import annotations

import torch

from radixserve.model.sampling import SamplingRow, sample_rows


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
