"""One request's state as it moves through the engine."""

from __future__ import annotations

import enum
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from radixserve.engine.outputs import RequestMetrics, RequestOutput
from radixserve.engine.params import SamplingParams
from radixserve.engine.tokenizer import IncrementalDetokenizer


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
    num_cached_tokens: int = 0  # tokens served from the cache at first admission
    admitted_seq: int = 0  # admission order, for choosing whom to preempt
    generator: torch.Generator | None = None
    finish_reason: str | None = None
    error: str | None = None
    text: str = ""  # output text with stop strings cut
    emitted_chars: int = 0  # how much of `text` callers have been given
    emitted_tokens: int = 0
    logits: list[torch.Tensor] = field(default_factory=list)
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(0.0))

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
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
    def is_finished(self) -> bool:
        """True once the request has ended, for any reason."""
        return self.state is RequestState.FINISHED

    def snapshot(self, finished: bool = False) -> RequestOutput:
        """The output callers see now, with the delta since the last snapshot."""
        out_ids = self.output_token_ids
        new_ids = out_ids[self.emitted_tokens :]
        visible = len(self.text) if finished else self._stable_text_len()
        new_text = self.text[self.emitted_chars : visible]
        self.emitted_tokens = len(out_ids)
        self.emitted_chars = max(self.emitted_chars, visible)
        self.metrics.num_output_tokens = len(out_ids)
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            token_ids=list(out_ids),
            text=self.text[:visible] if not finished else self.text,
            new_token_ids=new_ids,
            new_text=new_text,
            finished=finished,
            finish_reason=self.finish_reason,
            num_cached_tokens=self.num_cached_tokens,
            metrics=self.metrics,
            error=self.error,
            logits=list(self.logits) if finished else [],
        )

    def _stable_text_len(self) -> int:
        # Hold back a tail that could still grow into a stop string.
        if not self.params.stop:
            return len(self.text)
        hold = max(len(s) for s in self.params.stop) - 1
        return max(self.emitted_chars, len(self.text) - hold)
