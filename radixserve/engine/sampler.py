"""A request's sampling state: its seeded generator and the row the runner samples with."""

from __future__ import annotations

import torch

from radixserve.engine.params import SamplingParams
from radixserve.engine.request import Request
from radixserve.model.sampling import SamplingRow


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """A generator seeded from params.seed, or None to use the global RNG."""
    if params.seed is None or params.greedy:
        return None
    g = torch.Generator()
    g.manual_seed(params.seed & 0xFFFF_FFFF_FFFF_FFFF)
    return g


def sampling_row(req: Request) -> SamplingRow:
    """How the runner draws `req`'s next token."""
    p = req.params
    return SamplingRow(p.temperature, p.top_k, p.top_p, req.generator)
