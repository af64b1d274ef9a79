"""Turning a logits row into the next token: greedy, temperature, top-k, top-p, seeded."""

from __future__ import annotations

import torch

from radixserve.engine.params import SamplingParams


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """A generator seeded from params.seed, or None to use the global RNG."""
    if params.seed is None or params.greedy:
        return None
    g = torch.Generator()
    g.manual_seed(params.seed & 0xFFFF_FFFF_FFFF_FFFF)
    return g


def sample(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
    """Sample one token id from a float32 logits row [vocab]."""
    if params.greedy:
        return int(torch.argmax(logits).item())
    scaled = logits / params.temperature
    if params.top_k > 0 and params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        drop = cum - sorted_p > params.top_p  # keep the smallest set reaching top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
    # Exponential-race sampling: argmax(p / E), E ~ Exp(1), draws from p without the
    # cumulative-sum search torch.multinomial does (several times faster on a 49k vocab).
    noise = torch.empty_like(probs).exponential_(1.0, generator=gen)
    return int(torch.argmax(probs / noise).item())
