"""Values the engine hands back to its callers (the offline API and the server)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from radixserve.model.sampling import TokenLogprobs


@dataclass
class RequestMetrics:
    """Timestamps (time.monotonic seconds) and token counts of one request."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_computed_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_preemptions: int = 0
    num_draft_tokens: int = 0  # speculative decoding: tokens drafted for this request
    num_accepted_tokens: int = 0  # of those, accepted


@dataclass
class RequestOutput:
    """State of a request after an engine step: everything so far plus the delta."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    num_cached_tokens: int
    metrics: RequestMetrics
    error: str | None = None
    # One float32 row per generated token, only when SamplingParams.return_logits.
    logits: list[Any] = field(default_factory=list)
    index: int = 0  # which choice of the request (SamplingParams.n / best_of)
    # With SamplingParams.logprobs (or best_of > n): one entry per token of token_ids.
    logprobs: list[TokenLogprobs] | None = None
    # With SamplingParams.prompt_logprobs: one entry per prompt token after the first.
    prompt_logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float | None = None  # sum of `logprobs`
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # A prefill worker's request (add_request's export_kv_from), finished: its prompt's K/V
    # and first token for a decode worker (an engine.handoff.KVHandoff).
    kv_handoff: Any = None
