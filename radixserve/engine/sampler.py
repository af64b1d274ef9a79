"""A request's sampling state: its seeded generator and the row the runner samples with."""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from radixserve.engine.params import SamplingParams
from radixserve.engine.request import Request
from radixserve.model.runner import ScoreRows
from radixserve.model.sampling import SamplingRow

_MASK64 = 0xFFFF_FFFF_FFFF_FFFF


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request seeded with `seed`: choice 0 keeps the seed
    (n=1 and the first of n draw alike), the others get well-mixed distinct ones (splitmix64),
    so each choice is reproducible on its own."""
    if index == 0:
        return seed & _MASK64
    z = (seed + index * 0x9E37_79B9_7F4A_7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58_476D_1CE4_E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D0_49BB_1331_11EB) & _MASK64
    return z ^ (z >> 31)


def make_generator(params: SamplingParams, index: int = 0) -> torch.Generator | None:
    """A generator seeded from params.seed (for choice `index`), or None to use the global
    RNG."""
    if params.seed is None or params.greedy:
        return None
    g = torch.Generator()
    g.manual_seed(choice_seed(params.seed, index))
    return g


def sampling_row(
    req: Request,
    eos_ids: Collection[int],
    allowed: torch.Tensor | None = None,
    drafted: Sequence[int] = (),
) -> SamplingRow:
    """How the runner draws `req`'s next token, or with `drafted` the token after those
    drafted tokens (as if they had been accepted); `allowed` is its grammar's bitmask row."""
    p = req.params
    out: Sequence[int] = ()
    if _needs_output(p):
        out = [*req.output_token_ids, *drafted] if drafted else req.output_token_ids
    banned: tuple[int, ...] = ()
    early = len(req.token_ids) + len(drafted) - req.num_prompt_tokens < p.min_tokens
    if early and allowed is None:  # a grammar decides itself when the output may end
        banned = (*p.stop_token_ids, *(() if p.ignore_eos else eos_ids))
    return SamplingRow(
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p,
        generator=req.generator,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty,
        logit_bias=tuple(p.logit_bias.items()),
        output_ids=out,
        prompt_ids=req.prompt_token_ids if p.repetition_penalty != 1.0 else (),
        banned_ids=banned,
        allowed=allowed,
        logprobs=_num_top(p.logprobs) if req.logprobs is not None else None,
    )


def score_rows(req: Request, start: int, num_tokens: int) -> tuple[int | None, ScoreRows | None]:
    """For a chunk computing `req.token_ids[start:start + num_tokens]`: the offset in the
    chunk from which its rows are scored, and what they are scored against (None, None when
    no row of it needs a prompt log-prob)."""
    scores = req.prompt_logprobs
    last_row = req.num_prompt_tokens - 1  # its target is the first output token: sampled
    if scores is None:
        return None, None
    first = max(start, len(scores))
    stop = min(start + num_tokens, last_row)
    if first >= stop:
        return None, None
    targets = req.token_ids[first + 1 : stop + 1]
    return first - start, ScoreRows(targets, _num_top(req.params.prompt_logprobs))


def _needs_output(p: SamplingParams) -> bool:
    return bool(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0)


def _num_top(n: int | None) -> int:
    return n or 0
