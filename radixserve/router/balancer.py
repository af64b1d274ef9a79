"""The router's core: its workers, the policy, and the prompt's tokens -> one worker per attempt."""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass
from typing import Any

from radixserve.router.metrics import RouterMetrics
from radixserve.router.policy import Decision, NoWorkerError, PolicyConfig, choose
from radixserve.router.prompt import PromptTokenizer, namespace_of, prompt_token_ids
from radixserve.router.worker import Worker

log = logging.getLogger(__name__)


@dataclass
class Prompt:
    """What routing needs from a request body (tokens only under cache_aware)."""

    token_ids: list[int] | None
    namespace: str | None


@dataclass
class Route:
    """Where one attempt of a request goes, and what the router expects there."""

    worker: Worker
    decision: Decision
    prompt: Prompt

    def begin(self) -> int:
        """The attempt is sent: the worker counts it in flight and its prompt as pending."""
        ids = self.prompt.token_ids
        return self.worker.begin(len(ids) if ids else 0, self.decision.matched_tokens)


class Balancer:
    """Picks a worker for each attempt of a request and keeps the per-worker books."""

    def __init__(
        self,
        workers: list[Worker],
        policy: str,
        metrics: RouterMetrics,
        tokenizer: PromptTokenizer | None = None,
        cfg: PolicyConfig | None = None,
        seed: int | None = None,
    ) -> None:
        if policy == "cache_aware" and tokenizer is None:
            raise ValueError("the cache_aware policy needs the model's tokenizer")
        self.workers = workers
        self.policy = policy
        self.metrics = metrics
        self.tokenizer = tokenizer
        self.cfg = cfg or PolicyConfig()
        self.rng = random.Random(seed)
        self._counter = 0

    async def start(self) -> None:
        """Probe every worker once (concurrently) and start their background loops."""
        await asyncio.gather(*(w.start() for w in self.workers))

    async def stop(self) -> None:
        """Stop every worker's background loops."""
        await asyncio.gather(*(w.stop() for w in self.workers))

    def healthy(self) -> list[Worker]:
        """Workers in rotation."""
        return [w for w in self.workers if w.healthy]

    async def prompt_of(self, body: dict[str, Any], chat: bool) -> Prompt:
        """Tokenize the request off the event loop (only when the policy uses tokens)."""
        ns = namespace_of(body)
        if self.policy != "cache_aware" or self.tokenizer is None:
            return Prompt(None, ns)
        try:
            ids = await asyncio.to_thread(prompt_token_ids, body, chat, self.tokenizer)
        except Exception as e:  # malformed body: route by load, the worker answers the 400
            log.debug("cannot tokenize a request for routing: %r", e)
            return Prompt(None, ns)
        return Prompt(ids, ns)

    def pick(
        self, prompt: Prompt, exclude: frozenset[int] = frozenset(), record: bool = True
    ) -> Route:
        """Choose a healthy worker not in `exclude`; raises NoWorkerError if there is none.

        With `record`, the decision counts in the metrics and, without a live event stream,
        the prompt is recorded in the chosen worker's trie.
        """
        candidates = [w for w in self.workers if w.healthy and w.index not in exclude]
        if not candidates:
            raise NoWorkerError("no healthy worker is available")
        views = [w.view(prompt.token_ids, prompt.namespace) for w in candidates]
        n_tokens = len(prompt.token_ids or ())
        decision = choose(self.policy, views, n_tokens, self._counter, self.rng, self.cfg)
        self._counter += 1
        worker = self.workers[decision.index]
        if not record:
            return Route(worker, decision, prompt)
        self.metrics.decisions.labels(decision.reason).inc()
        if prompt.token_ids is not None:
            self.metrics.prompt_tokens.labels(worker.name).inc(n_tokens)
            self.metrics.matched_tokens.labels(worker.name).inc(decision.matched_tokens)
            worker.record_routed(prompt.token_ids, prompt.namespace)
        return Route(worker, decision, prompt)
