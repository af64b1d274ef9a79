"""Sampling parameters of one request, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from radixserve.engine.structured import StructuredOutput
from radixserve.errors import InvalidRequestError

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 512
MAX_LOGPROBS = 20  # top log-probs per token, as OpenAI's top_logprobs and vLLM's default
MAX_N = 16  # choices per request (n and best_of)
MAX_LOGIT_BIAS = 300  # entries of logit_bias (OpenAI documents no limit; this bounds a step)


@dataclass
class SamplingParams:
    """How to sample a completion; raises InvalidRequestError on impossible values."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no top-k cut
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # Keep the full logits row of every sampled token on the output (tests, debugging).
    return_logits: bool = False
    presence_penalty: float = 0.0  # [-2, 2], subtracted once from every token generated
    frequency_penalty: float = 0.0  # [-2, 2], times how often the token was generated
    repetition_penalty: float = 1.0  # (0, 2], HF's: seen tokens' logits / it (x it if < 0)
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> [-100, 100]
    min_tokens: int = 0  # EOS and stop_token_ids cannot end the output before this many
    logprobs: int | None = None  # each output token's log-prob and this many top ones
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    n: int = 1  # choices returned
    best_of: int | None = None  # choices drawn (>= n); the n most likely are returned
    structured: StructuredOutput | None = None  # the output must match this (a grammar)

    def __post_init__(self) -> None:
        self._check_basic()
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_number(name, value)
            if not -2.0 <= value <= 2.0:
                raise InvalidRequestError(f"{name} must be in [-2, 2]", name)
        _check_number("repetition_penalty", self.repetition_penalty)
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise InvalidRequestError("repetition_penalty must be in (0, 2]", "repetition_penalty")
        self.logit_bias = dict(self.logit_bias)
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequestError(f"at most {MAX_LOGIT_BIAS} logit_bias entries", "logit_bias")
        for tok, bias in self.logit_bias.items():
            _check_int("logit_bias", tok, minimum=0)
            _check_number("logit_bias", bias)
            if not -100.0 <= bias <= 100.0:
                raise InvalidRequestError("logit_bias values must be in [-100, 100]", "logit_bias")
        _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.min_tokens > self.max_tokens:
            raise InvalidRequestError("min_tokens must not exceed max_tokens", "min_tokens")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value, minimum=0)
                if value > MAX_LOGPROBS:
                    raise InvalidRequestError(f"{name} must be at most {MAX_LOGPROBS}", name)
        _check_int("n", self.n, minimum=1)
        if self.best_of is not None:
            _check_int("best_of", self.best_of, minimum=1)
            if self.best_of < self.n:
                raise InvalidRequestError("best_of must be >= n", "best_of")
        if self.num_samples > MAX_N:
            raise InvalidRequestError(f"n and best_of must be at most {MAX_N}", "n")

    @property
    def num_samples(self) -> int:
        """Choices drawn: best_of when set, else n."""
        return self.best_of if self.best_of is not None else self.n

    def _check_basic(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_number("temperature", self.temperature)
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidRequestError("temperature must be in [0, 100]", "temperature")
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError("top_p must be in (0, 1]", "top_p")
        _check_int("top_k", self.top_k, minimum=-1)
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=-(2**63))
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError(f"at most {MAX_STOP_STRINGS} stop strings", "stop")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidRequestError("stop strings must be non-empty strings", "stop")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise InvalidRequestError(
                    f"stop strings are at most {MAX_STOP_STRING_CHARS} characters", "stop"
                )
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, minimum=0)

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature == 0.0 or self.top_k == 1


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{name} must be an integer", name)
    if value < minimum:
        raise InvalidRequestError(f"{name} must be >= {minimum}", name)


def _check_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequestError(f"{name} must be a number", name)
    if value != value:  # NaN
        raise InvalidRequestError(f"{name} must not be NaN", name)
