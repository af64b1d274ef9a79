"""Batched sampling on the logits' device: every row of a step at once, one id per row.

Per row: greedy (temperature 0 or top_k 1), else temperature, top-k, top-p, then a draw.
A row with its own generator (a seeded request) draws its noise from it, so its tokens do not
depend on what else shares the step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingRow:
    """How to draw one row's token."""

    temperature: float = 1.0
    top_k: int = -1  # <= 0: no cut
    top_p: float = 1.0
    generator: torch.Generator | None = None

    @property
    def greedy(self) -> bool:
        """True when the draw reduces to argmax."""
        return self.temperature == 0.0 or self.top_k == 1


def sample_rows(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Token ids [R] (long, on logits' device) for float32 logits [R, V], one row each."""
    ids = torch.argmax(logits, dim=-1)
    drawn = [i for i, r in enumerate(rows) if not r.greedy]
    if not drawn:
        return ids
    dev = logits.device
    sel = torch.tensor(drawn, device=dev)
    vocab = logits.shape[-1]
    temps = torch.tensor([rows[i].temperature for i in drawn], device=dev)
    scaled = logits[sel] / temps[:, None]
    ks = [rows[i].top_k if 0 < rows[i].top_k < vocab else vocab for i in drawn]
    if min(ks) < vocab:
        kth_rank = torch.tensor([k - 1 for k in ks], device=dev)
        top = torch.topk(scaled, max(ks), dim=-1).values
        kth = top.gather(1, kth_rank[:, None])
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    ps = [rows[i].top_p for i in drawn]
    if min(ps) < 1.0:
        sorted_p, idx = torch.sort(probs, dim=-1, descending=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        # Keep the smallest set reaching top_p (rows with top_p 1 keep everything).
        drop = cum - sorted_p > torch.tensor(ps, device=dev)[:, None]
        probs = torch.zeros_like(probs).scatter_(1, idx, sorted_p.masked_fill(drop, 0.0))
    # Exponential race: argmax(p / E), E ~ Exp(1), draws from p without the cumulative-sum
    # search torch.multinomial does (several times faster on a 49k vocabulary).
    noise = torch.empty_like(probs)
    shared = [j for j, i in enumerate(drawn) if rows[i].generator is None]
    if shared:
        noise[shared] = torch.empty(len(shared), vocab, device=dev).exponential_(1.0)
    for j, i in enumerate(drawn):
        gen = rows[i].generator
        if gen is not None and gen.device == noise.device:
            noise[j].exponential_(1.0, generator=gen)
        elif gen is not None:  # a host generator for a row on an accelerator
            noise[j] = torch.empty(vocab).exponential_(1.0, generator=gen).to(dev)
    ids[sel] = torch.argmax(probs / noise, dim=-1)
    return ids
