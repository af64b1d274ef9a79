"""The offline API: `LLM(...).generate(prompts, params)` and `.chat(messages, params)`."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from radixserve.engine.config import EngineConfig
from radixserve.engine.engine import LLMEngine
from radixserve.engine.outputs import RequestOutput
from radixserve.engine.params import SamplingParams

Prompt = str | Sequence[int]


class LLM:
    """Load a model once and complete batches of prompts with the prefix cache."""

    def __init__(self, model: str | None = None, **options: Any) -> None:
        """Load `model` (default: the default model) with any `EngineConfig` field as a
        keyword (dtype, device, kv_cache_memory, block_size, enable_prefix_cache, ...; see
        docs/options.md); an unknown keyword is a TypeError naming it."""
        self.engine = LLMEngine(EngineConfig(model=model, **options))
        self.engine.start()
        self.tokenizer = self.engine.tokenizer

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """Wrap an existing engine (started here if it is not running)."""
        self = cls.__new__(cls)
        self.engine = engine
        self.tokenizer = engine.tokenizer
        engine.start()
        return self

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        namespace: Hashable = None,
    ) -> list[RequestOutput]:
        """Complete every prompt (text or token ids) with `params`, or with one SamplingParams
        per prompt as vLLM's LLM.generate takes them; outputs come back in prompt order."""
        batch: Sequence[Prompt]
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            batch = [prompts]  # type: ignore[list-item]
        else:
            batch = prompts  # type: ignore[assignment]
        token_lists = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in batch]
        return self._run(token_lists, params, namespace)

    def chat(
        self,
        messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        namespace: Hashable = None,
    ) -> list[RequestOutput]:
        """Answer one conversation (a list of messages) or several, via the chat template;
        `params` as for `generate`."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        token_lists = [self.tokenizer.apply_chat_template(c) for c in convs]  # type: ignore[arg-type]
        return self._run(token_lists, params, namespace)

    def _run(
        self,
        token_lists: list[list[int]],
        params: SamplingParams | Sequence[SamplingParams] | None,
        namespace: Hashable,
    ) -> list[RequestOutput]:
        """Outputs in prompt order; with n > 1, the n choices of each prompt in a row."""
        if params is None or isinstance(params, SamplingParams):
            per_prompt = [params or SamplingParams()] * len(token_lists)
        else:
            per_prompt = list(params)
            if len(per_prompt) != len(token_lists):
                raise ValueError(
                    f"{len(per_prompt)} SamplingParams for {len(token_lists)} prompts: give "
                    "one for all, or one per prompt"
                )
        first = list(itertools.accumulate((p.n for p in per_prompt), initial=0))
        results: list[RequestOutput | None] = [None] * first[-1]
        done = threading.Semaphore(0)

        def callback(i: int) -> Callable[[RequestOutput], None]:
            def on_output(out: RequestOutput) -> None:
                if out.finished:
                    results[first[i] + out.index] = out
                    done.release()

            return on_output

        ids = []
        try:
            for i, (toks, p) in enumerate(zip(token_lists, per_prompt, strict=True)):
                ids.append(
                    self.engine.add_request(toks, p, namespace=namespace, on_output=callback(i))
                )
            for _ in range(len(results)):
                done.acquire()
        except BaseException:
            for rid in ids:
                self.engine.abort(rid)
            raise
        return [r for r in results if r is not None]

    def shutdown(self) -> None:
        """Stop the engine's loop and wait for it (idempotent). The interpreter also does this
        at exit for engines still running, so scripts may skip it."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
