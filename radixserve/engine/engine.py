"""The engine: a step loop (schedule -> run the model -> post-process) in its own thread."""

from __future__ import annotations

import logging
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Hashable

from radixserve.cache import CacheEvent, TreeSnapshot
from radixserve.engine.builder import EngineParts, assemble, load_parts
from radixserve.engine.config import EngineConfig
from radixserve.engine.output import append_token, deliver
from radixserve.engine.params import SamplingParams
from radixserve.engine.request import OutputCallback, Request, check_prompt
from radixserve.engine.sampler import make_generator, sampling_row
from radixserve.engine.scheduler import ScheduledChunk
from radixserve.engine.stats import EngineCounters, EngineStats, cache_stats, collect_stats
from radixserve.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from radixserve.errors import EngineDeadError, InvalidRequestError, QueueFullError
from radixserve.model import kernels
from radixserve.model.decoder import DecoderModel
from radixserve.model.runner import StepResult

log = logging.getLogger(__name__)

# Engines whose loop thread runs. The interpreter stops and joins them before it waits for
# other threads and finalises (threading's own exit hook, which runs before `atexit`), so a
# script that never calls shutdown() exits cleanly instead of tearing torch down under a
# loop thread still inside native code.
_running_engines: weakref.WeakSet[LLMEngine] = weakref.WeakSet()


def _shutdown_running_engines() -> None:
    for engine in list(_running_engines):
        engine.shutdown(timeout=None)


threading._register_atexit(_shutdown_running_engines)  # type: ignore[attr-defined]


class LLMEngine:
    """Runs requests to completion in a thread over the parts `config` describes (the model
    runner, the prefix cache, the scheduler); see docs/INTERFACES.md."""

    def __init__(self, config: EngineConfig | None = None) -> None:
        self._adopt(load_parts(config or EngineConfig()))

    @classmethod
    def from_parts(
        cls,
        config: EngineConfig,
        model: DecoderModel,
        tokenizer: Tokenizer,
        model_name: str = "model",
    ) -> LLMEngine:
        """An engine over an already-built model (tests, embedding in other programs)."""
        self = cls.__new__(cls)
        self._adopt(assemble(config, model, tokenizer, model_name))
        return self

    def _adopt(self, parts: EngineParts) -> None:
        self.config, self._parts = parts.config, parts
        self.model_name, self.tokenizer = parts.model_name, parts.tokenizer
        self.runner, self.kv_pool, self.kv = parts.runner, parts.runner.kv_pool, parts.kv
        self.max_model_len = parts.max_model_len
        # What the engine serves, as the logs and the API show it.
        self.block_size, self.num_blocks = self.kv.block_size, self.kv.num_blocks
        self.dtype = str(self.runner.dtype).removeprefix("torch.")
        self.device = str(self.runner.device)
        self.kv_cache_dtype = str(self.runner.kv_dtype).removeprefix("torch.")
        self.quantization = str(getattr(self.runner.model, "quantization", "none"))
        self.scheduler = parts.scheduler
        self._counters = EngineCounters()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._inbox: list[Request] = []
        self._aborts: list[str] = []
        self._requests: dict[str, Request] = {}
        self._thread: threading.Thread | None = None
        self._stop = False
        self._crashed: BaseException | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the step loop thread (idempotent)."""
        with self._lock:
            if self._thread is not None:
                return
            if self._stop:
                raise EngineDeadError("the engine has been shut down")
            # From here on the loop thread does the device work: the OpenMP workers this
            # thread kept from loading the model would slow each of its parallel regions.
            kernels.release_thread_pool()
            # Not a daemon: nothing may kill the loop mid-step; exit hooks stop it instead.
            self._thread = threading.Thread(target=self._loop, name="radixserve-engine")
            self._thread.start()
            _running_engines.add(self)

    def is_alive(self) -> bool:
        """True while the loop thread runs and has not crashed."""
        return self._thread is not None and self._thread.is_alive() and self._crashed is None

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the loop after its current step and wait for it (at most `timeout` seconds;
        None waits for the step to end). Requests still waiting or running finish with
        reason "abort"; with kv_persist_dir the cache is then saved for a warm restart.
        Idempotent; safe from any thread but the loop's own."""
        with self._lock:
            self._stop = True
            self._wake.notify_all()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        if thread is None or not thread.is_alive():
            _running_engines.discard(self)
        if self._crashed is not None or (thread is not None and thread.is_alive()):
            if self._parts.persistence is not None:
                log.warning("not saving the KV cache: the engine loop did not stop cleanly")
            return
        self._parts.save_cache()

    # ------------------------------------------------------------------ requests

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
    ) -> str:
        """Validate and queue a request; returns its id. With `bounded` (the HTTP bridge), a
        full waiting queue (`max_waiting`) raises QueueFullError; the offline API queues
        everything it is given. See docs/INTERFACES.md."""
        if self._crashed is not None or self._stop:
            raise EngineDeadError("the engine has stopped")
        ids = list(prompt_token_ids)
        vocab = self.runner.model.config.vocab_size
        check_prompt(ids, params, vocab, self.max_model_len, self.num_blocks * self.block_size)
        rid = request_id or f"req-{uuid.uuid4().hex[:16]}"
        req = Request(
            request_id=rid, prompt_token_ids=ids, params=params, on_output=on_output,
            detokenizer=IncrementalDetokenizer(self.tokenizer, ids), namespace=namespace,
            priority=priority, session_id=session_id, generator=make_generator(params),
        )  # fmt: skip
        with self._lock:
            if rid in self._requests or any(r.request_id == rid for r in self._inbox):
                raise InvalidRequestError(f"request id {rid!r} is already in use")
            waiting = len(self._inbox) + len(self.scheduler.waiting)
            if bounded and waiting >= self.config.max_waiting:
                raise QueueFullError("too many requests are waiting; retry later")
            self._inbox.append(req)
            self._wake.notify_all()
        return rid

    def abort(self, request_id: str) -> None:
        """Abort a request at any stage; its blocks and locks are freed (thread-safe)."""
        with self._lock:
            self._aborts.append(request_id)
            self._wake.notify_all()

    # ------------------------------------------------------------------ observers

    def stats(self) -> EngineStats:
        """A copy of the counters and gauges, safe to call from any thread."""
        return collect_stats(self._counters, self.kv, self.scheduler, len(self._inbox))

    def cache_stats(self) -> dict[str, object]:
        """The prefix cache's statistics plus pool counts, as JSON-ready values."""
        return cache_stats(self.kv)

    def add_cache_listener(self, fn: Callable[[CacheEvent], None]) -> None:
        """Call `fn(event)` on every insert/evict of the radix tree (on the engine thread)."""
        self.kv.cache.add_listener(fn)

    def remove_cache_listener(self, fn: Callable[[CacheEvent], None]) -> None:
        """Stop calling `fn`."""
        self.kv.cache.remove_listener(fn)

    def cache_snapshot(self) -> list[tuple[Hashable, tuple[int, ...]]]:
        """Every cached leaf path as (namespace, token ids from the root)."""
        return self.kv.cache.leaf_paths()

    def cache_tree(self, head_tokens: int = 32) -> TreeSnapshot | None:
        """A copy of the radix tree's nodes and counters (None with the cache off), taken
        under the cache's own lock from any thread (the loop waits at most one pass)."""
        return self.kv.cache.snapshot(head_tokens) if self.kv.cache.enabled else None

    # ------------------------------------------------------------------ the loop

    def _idle(self) -> bool:
        """Nothing for the loop to do (call with the lock held)."""
        return not (self._stop or self._inbox or self._aborts or self.scheduler.has_work())

    def _loop(self) -> None:
        try:
            while True:
                with self._lock:
                    if self._idle():
                        # Free this thread's OpenMP workers, so that another thread's device
                        # work meanwhile (another engine in this process, a caller's own
                        # torch code) does not run with more threads than CPUs.
                        kernels.release_thread_pool()
                    while self._idle():
                        self._wake.wait()
                    if self._stop:
                        break
                self.step()
        except BaseException as e:  # keep the server alive enough to report the failure
            log.exception("engine loop crashed")
            self._crashed = e
        finally:
            with self._lock:
                inbox, self._inbox = self._inbox, []
            self._requests.update((r.request_id, r) for r in inbox)
            for req in list(self._requests.values()):
                self._finish(req, "abort" if self._crashed is None else "error")

    def step(self) -> None:
        """One step: take in new requests and aborts, schedule, run the model over every
        chunk (sampling where a chunk ends its tokens), then post-process the new tokens.
        The loop thread calls this; tests may call it on an engine that was not started."""
        with self._lock:
            inbox, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
        for req in inbox:
            self._requests[req.request_id] = req
            self._counters.prompt_tokens_total += req.num_prompt_tokens
            self.scheduler.add(req)
        for rid in aborts:
            if rid in self._requests:
                self._finish(self._requests[rid], "abort")
        chunks = self.scheduler.schedule().chunks
        if not chunks:
            if self.scheduler.waiting and not self.scheduler.running:
                time.sleep(0.001)  # blocks are pinned by running requests only; wait for them
            return
        result = self.runner.run(
            [c.seq_chunk() for c in chunks],
            [sampling_row(c.req) if c.samples else None for c in chunks],
            [c.req.params.return_logits for c in chunks],
        )
        self._postprocess(chunks, result)

    def _postprocess(self, chunks: list[ScheduledChunk], result: StepResult) -> None:
        """Record what the step computed, then each sampled token: its text, stop checks,
        and the request's output (or its end)."""
        now = time.monotonic()
        tokens = result.token_ids
        for i, c in enumerate(chunks):
            req = c.req
            self.kv.commit(req, c.num_tokens)
            if i not in tokens:
                continue
            if i in result.logits:
                req.logits.append(result.logits[i])
            self._counters.generation_tokens_total += 1
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            reason = append_token(req, tokens[i], self._parts.eos_ids, self.max_model_len)
            if reason is not None:
                self._finish(req, reason)
            else:
                deliver(req, finished=False)

    def _finish(self, req: Request, reason: str) -> None:
        """End `req`: out of the queues, its blocks released (cached unless it failed), and
        its last output delivered."""
        if req.is_finished:
            return
        req.finish_reason = reason
        if reason == "error":
            req.error = "the engine failed while running this request"
        self.scheduler.remove(req, cache_computed=reason != "error")
        req.metrics.finish_time = time.monotonic()
        self._requests.pop(req.request_id, None)
        totals = self._counters.requests_total
        totals[reason] = totals.get(reason, 0) + 1
        deliver(req, finished=True)
