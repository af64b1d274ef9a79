"""One request's state as it moves through the engine."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from radixserve.engine.handoff import Export, FirstToken
from radixserve.engine.outputs import RequestMetrics, RequestOutput
from radixserve.engine.params import SamplingParams
from radixserve.engine.structured import GrammarMatcher
from radixserve.engine.tokenizer import IncrementalDetokenizer
from radixserve.errors import InvalidRequestError, PromptTooLongError, RequestTooLargeError
from radixserve.model.sampling import TokenLogprobs


class RequestState(enum.Enum):
    """Where a request is: waiting -> running (prefill, then decode) -> finished."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


OutputCallback = Callable[[RequestOutput], None]


@dataclass(eq=False)
class Request:
    """A prompt being completed.

    `token_ids` is the prompt followed by every token generated so far. The KV of the first
    `num_computed` tokens is in the pool, in the blocks of `block_table`; the first
    `num_shared_blocks` of those belong to the radix tree (pinned through `lock_node`), the
    rest are the request's own. Prefill and decode are one thing: each step computes
    token_ids[num_computed:...], and when that reaches the end, samples the next token.

    Each group of fields has one owner that changes it: the scheduler the queue state
    (`state`, `admitted_seq`), the KVCacheManager the blocks (`num_computed`, `block_table`,
    `num_shared_blocks`, `lock_node`), radixserve.engine.output the output (new
    `token_ids`, `text`, `emitted_*`, the log-probs), and the engine the ending
    (`finish_reason`, `error`) and `metrics`, which the request creates with its arrival
    time and prompt length and the engine alone writes after.

    A request with n > 1 choices is one Request per choice, sharing `group_id` (the id the
    caller knows); choice i > 0 follows choice 0 (`leader`): it is admitted once the
    leader's prompt is computed and starts from the leader's blocks (see KVCacheManager).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    on_output: OutputCallback | None
    detokenizer: IncrementalDetokenizer
    namespace: Hashable = None
    priority: int = 0
    session_id: str | None = None  # an agent loop / chat session: its path is kept warm
    token_ids: list[int] = field(default_factory=list)
    state: RequestState = RequestState.WAITING
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    num_shared_blocks: int = 0
    lock_node: Any = None
    window_pinned_from: int = 0  # block_table[this:] pinned in the window pool (if any)
    admitted_seq: int = 0  # admission order, for choosing whom to preempt
    generator: torch.Generator | None = None
    finish_reason: str | None = None
    error: str | None = None
    text: str = ""  # output text with stop strings cut
    emitted_chars: int = 0  # how much of `text` callers have been given
    emitted_tokens: int = 0
    logits: list[torch.Tensor] = field(default_factory=list)  # with params.return_logits
    group_id: str = ""  # the caller's request id ("" means request_id)
    index: int = 0  # which choice of the group
    leader: Request | None = None  # choice 0, for choices i > 0
    logprobs: list[TokenLogprobs] | None = None  # per output token, with params.logprobs
    prompt_logprobs: list[TokenLogprobs] | None = None  # prompt tokens 1.., params.prompt_*
    cumulative_logprob: float = 0.0  # of the output tokens, when log-probs are computed
    stop_reason: int | str | None = None  # the stop token id or string that ended it
    matcher: GrammarMatcher | None = None  # with params.structured: where the output is
    # Prefill/decode disaggregation (engine/handoff.py): export the prompt's K/V from this
    # token when the request ends (a prefill worker's), and what that export gave; or the
    # first token, drawn by a prefill worker, to emit instead of drawing one.
    export_kv_from: int | None = None
    kv_export: Export | None = None
    first_token: FirstToken | None = None
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.monotonic()))

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        self.group_id = self.group_id or self.request_id
        self.metrics.num_prompt_tokens = len(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        """Length of the prompt."""
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """Tokens generated so far."""
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_remaining(self) -> int:
        """Tokens still to compute before the next token can be sampled."""
        return len(self.token_ids) - self.num_computed

    @property
    def cacheable_prefix(self) -> int | None:
        """How many leading tokens admission may take from the cache (None: any). A prompt
        being scored needs the logits of every row it has not scored yet, so those rows
        are computed, not served from the cache."""
        scores = self.prompt_logprobs
        if scores is None or len(scores) >= self.num_prompt_tokens - 1:
            return None
        return len(scores)

    @property
    def is_finished(self) -> bool:
        """True once the request has ended, for any reason."""
        return self.state is RequestState.FINISHED


def check_prompt(
    ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int, pool_tokens: int
) -> None:
    """Raise InvalidRequestError (or its PromptTooLongError / RequestTooLargeError) unless
    `ids` is a prompt this engine can complete: token ids in the vocabulary, at least one
    token of context left to generate, and prompt + max_tokens within the whole KV pool
    (`pool_tokens`)."""
    if not ids:
        raise InvalidRequestError("the prompt is empty", "prompt")
    # The distinct types first, then min/max: C loops over a long prompt, not a Python one.
    types = set(map(type, ids))
    if (
        any(not issubclass(tp, int) or issubclass(tp, bool) for tp in types)
        or min(ids) < 0
        or max(ids) >= vocab_size
    ):
        raise InvalidRequestError(f"token ids must be integers in [0, {vocab_size})", "prompt")
    if len(ids) >= max_model_len:
        raise PromptTooLongError(
            f"the prompt has {len(ids)} tokens; this model's context is {max_model_len} "
            "tokens, and at least one must be left to generate",
            "prompt",
        )
    for tok in (*params.logit_bias, *params.stop_token_ids):
        if tok >= vocab_size:
            name = "logit_bias" if tok in params.logit_bias else "stop_token_ids"
            raise InvalidRequestError(f"{name}: token id {tok} is not below {vocab_size}", name)
    total = min(len(ids) + params.max_tokens, max_model_len)
    if total > pool_tokens:
        raise RequestTooLargeError(
            f"prompt ({len(ids)}) + max_tokens needs {total} tokens of KV cache, more than the "
            f"whole pool ({pool_tokens} tokens)",
            "max_tokens",
        )
