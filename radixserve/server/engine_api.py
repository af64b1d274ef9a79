"""`ServedEngine`: everything the server reads from or calls on an engine, in one place.

The app, the serving code, the in-process bridge, metrics, the dashboard and the cache-event
stream talk to an engine only through this protocol. `LLMEngine` satisfies it in process;
the Ray ingress's `RemoteEngine` (radixserve/ray/bridge.py) subclasses it and answers
explicitly for what an ingress without an engine of its own cannot do. The engine package
may not import the server (docs/architecture.md), so `LLMEngine` conforms structurally:
mypy checks that below, and tests/server/test_engine_api.py checks both at run time.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from radixserve.cache import CacheEvent, TreeSnapshot
    from radixserve.engine.engine import LLMEngine
    from radixserve.engine.handoff import FirstToken
    from radixserve.engine.params import SamplingParams
    from radixserve.engine.request import OutputCallback
    from radixserve.engine.stats import EngineStats
    from radixserve.engine.structured import GrammarCompiler
    from radixserve.engine.tokenizer import Tokenizer


class ServedEngine(Protocol):
    """What the server needs from an engine (docs/INTERFACES.md describes each member)."""

    model_name: str
    max_model_len: int  # prompt + max_tokens must fit
    tokenizer: Tokenizer

    @property
    def grammars(self) -> GrammarCompiler | None:
        """Compiles structured-output grammars, which the server does off the event loop
        before it submits; None where the engine compiles them when a request arrives."""

    @property
    def can_reset_prefix_cache(self) -> bool:
        """Whether `reset_prefix_cache` can be served here; POST /reset_prefix_cache exists
        only then."""

    def is_alive(self) -> bool:
        """Whether requests can be served (GET /health)."""

    def stats(self) -> EngineStats:
        """Monotonic counters and gauges (/metrics, the dashboard)."""

    def cache_stats(self) -> dict[str, object]:
        """The prefix cache's statistics and pool counts, JSON-ready (/v1/cache/stats)."""

    def cache_tree(self) -> TreeSnapshot | None:
        """A copy of the radix tree (/v1/cache/tree); None with the cache off."""

    def cache_snapshot(self) -> list[tuple[Hashable, tuple[int, ...]]]:
        """Every cached leaf path as (namespace, token ids from the root)."""

    def add_cache_listener(self, fn: Callable[[CacheEvent], None]) -> None:
        """Call `fn(event)` on every insert/evict of the tree (on the engine's thread)."""

    def remove_cache_listener(self, fn: Callable[[CacheEvent], None]) -> None:
        """Stop calling `fn`."""

    def reset_prefix_cache(self) -> int:
        """Drop every cached prefix no running request pins; returns the blocks freed.
        Blocks the caller until the engine has done it."""

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        namespace: Hashable = None,
        priority: int = 0,
        on_output: OutputCallback | None = None,
        bounded: bool = False,
        session_id: str | None = None,
        first_token: FirstToken | None = None,
        export_kv_from: int | None = None,
    ) -> str:
        """Validate and queue a request (the in-process bridge); returns its id. With
        `first_token`, drawn by a prefill worker whose K/V this engine took in; with
        `export_kv_from`, its finished output carries its K/V from that token on."""

    def abort(self, request_id: str) -> None:
        """Abort a request at any stage (thread-safe)."""


if TYPE_CHECKING:

    def _llm_engine_is_served(engine: LLMEngine) -> ServedEngine:
        return engine  # mypy checks here that LLMEngine satisfies the protocol
