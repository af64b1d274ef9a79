"""The engine: a step loop (schedule -> run the model -> post-process) in its own thread."""

from __future__ import annotations

import logging
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from radixserve.cache import CacheEvent, TreeSnapshot
from radixserve.engine.builder import EngineParts, assemble, load_parts
from radixserve.engine.closing import JsonCloser, closing_starts
from radixserve.engine.config import EngineConfig
from radixserve.engine.handoff import FirstToken, KVHandoff, export_blocks, import_handoff
from radixserve.engine.output import append_token, deliver
from radixserve.engine.params import SamplingParams
from radixserve.engine.request import OutputCallback, Request, check_prompt
from radixserve.engine.sampler import make_generator, sampling_row, score_rows
from radixserve.engine.scheduler import ScheduledChunk, SchedulerOutput
from radixserve.engine.spec_config import parse_speculative_config
from radixserve.engine.speculative import Speculator
from radixserve.engine.startup import phase
from radixserve.engine.stats import EngineCounters, EngineStats, cache_stats, collect_stats
from radixserve.engine.structured import GrammarCompiler
from radixserve.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from radixserve.errors import EngineDeadError, InvalidRequestError, QueueFullError
from radixserve.model import kernels
from radixserve.model.decoder import DecoderModel
from radixserve.model.runner import StepRow
from radixserve.model.sampling import SamplingRow, TokenLogprobs

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
        vocab = self.runner.model.config.vocab_size
        self.grammars = GrammarCompiler(self.tokenizer.hf, vocab, sorted(parts.eos_ids))
        # One grammar bitmask row per sampled sequence of a step, refilled in place.
        self._bitmask = torch.zeros(0, self.grammars.bitmask_words, dtype=torch.int32)
        # Built by prepare_structured_outputs, else when a JSON-constrained row first nears
        # max_tokens; under its lock, which a build in the background holds until it is done.
        self._closer: JsonCloser | None = None
        self._closer_lock = threading.Lock()
        self._tables: threading.Thread | None = None  # a background build of those tables
        self._counters = EngineCounters()
        spec = self.config.speculative_config
        self._speculator = (
            Speculator(
                parse_speculative_config(spec), self.kv.cache,
                self.num_blocks * self.block_size, self._counters,
            )
            if spec
            else None
        )  # fmt: skip
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._inbox: list[Request] = []
        self._aborts: list[str] = []
        # Calls waiting for the loop thread (`_on_loop`: reset_prefix_cache, import_handoff)
        self._calls: list[_LoopCall] = []
        self._requests: dict[str, Request] = {}
        self._groups: dict[str, list[Request]] = {}  # a request's choices, by its id
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

    def prepare_structured_outputs(self, background: bool = False) -> None:
        """Build structured outputs' per-vocabulary tables now (about 0.8 s for the default
        model), so that the first request that needs them does not build them: llguidance's
        view of the tokenizer, which the first grammar compile would build, and the JSON
        closing token sets, which the engine loop would build mid-step (stalling every running
        request) once a JSON-constrained row first nears its max_tokens. With `background`,
        on a thread of their own, so the server listens meanwhile; each table is built under
        its lock, so a request that needs one in that time waits for it. A table that cannot
        be built is logged, and left to fail as before: in the requests that need it."""
        if background:
            # Not a daemon: a process that exits while the build is inside llguidance's or
            # tokenizers' native code aborts ("terminate called without an active exception");
            # shutdown() and the interpreter's exit wait for it (a second or two at most).
            name = "structured-outputs-tables"
            self._tables = threading.Thread(target=self._build_tables, name=name)
            self._tables.start()
        else:
            self._build_tables()

    def _build_tables(self) -> None:
        with phase("structured outputs' tables"):
            for build in (self.grammars.prepare, self._json_closer):
                try:
                    build()
                except Exception as e:  # the tokenizer's converters raise what they like
                    log.warning("a structured outputs' table was not built at start: %s", e)

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
        if self._tables is not None:
            self._tables.join(timeout)
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
        export_kv_from: int | None = None,
        first_token: FirstToken | None = None,
    ) -> str:
        """Validate and queue a request; returns its id. With `bounded` (the HTTP bridge), a
        full waiting queue (`max_waiting`) raises QueueFullError; the offline API queues
        everything it is given. See docs/INTERFACES.md.

        Prefill/decode disaggregation (docs/disaggregation.md): with `export_kv_from` (a
        multiple of the block size) the final output carries the K/V of the whole blocks the
        request computed, from that token on (`RequestOutput.kv_handoff`: a prefill worker's
        prompt, or what a decode worker adds to it); with `first_token` the request emits
        that token first instead of drawing one (a prefill worker drew it)."""
        if self._crashed is not None or self._stop:
            raise EngineDeadError("the engine has stopped")
        ids = list(prompt_token_ids)
        vocab = self.runner.model.config.vocab_size
        check_prompt(ids, params, vocab, self.max_model_len, self.num_blocks * self.block_size)
        rid = request_id or f"req-{uuid.uuid4().hex[:16]}"
        # Compiled here, on the caller's thread (the server has compiled it already, off the
        # event loop, so this is a cache hit); never on the engine thread.
        grammar = self.grammars.compile(params.structured) if params.structured else None
        # best_of > n ranks the choices by their cumulative log-prob: it needs them too.
        wants_logprobs = params.logprobs is not None or params.num_samples > params.n
        prompt_scores: list[TokenLogprobs] | None = (
            [] if params.prompt_logprobs is not None else None
        )
        if (export_kv_from is not None or first_token is not None) and params.num_samples > 1:
            raise InvalidRequestError("a K/V handoff carries one choice (n = best_of = 1)")
        group = [
            Request(
                request_id=rid if i == 0 else f"{rid}#{i}", prompt_token_ids=ids, params=params,
                on_output=on_output, detokenizer=IncrementalDetokenizer(self.tokenizer, ids),
                namespace=namespace, priority=priority, session_id=session_id,
                generator=make_generator(params, i), group_id=rid, index=i,
                logprobs=[] if wants_logprobs else None, prompt_logprobs=prompt_scores,
            )
            for i in range(params.num_samples)
        ]  # fmt: skip
        for follower in group[1:]:
            follower.leader = group[0]  # the prompt's logprobs (one list) are its to score
        for req in group:
            req.matcher = grammar.matcher() if grammar is not None else None
            req.export_kv_from, req.first_token = export_kv_from, first_token
        with self._lock:
            if rid in self._groups or any(r.group_id == rid for r in self._inbox):
                raise InvalidRequestError(f"request id {rid!r} is already in use")
            waiting = len(self._inbox) + len(self.scheduler.waiting)
            if bounded and waiting >= self.config.max_waiting:
                raise QueueFullError("too many requests are waiting; retry later")
            self._inbox.extend(group)
            self._wake.notify_all()
        return rid

    def abort(self, request_id: str) -> None:
        """Abort a request (every choice of it) at any stage; its blocks and locks are freed
        (thread-safe)."""
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

    def add_cache_listener(self, fn: Callable[[CacheEvent], None], detail: bool = False) -> None:
        """Call `fn(event)` on every insert/evict of the radix tree (on the engine thread);
        with `detail`, on tier moves and resets too (`PrefixCache.add_listener`)."""
        self.kv.cache.add_listener(fn, detail=detail)

    def reset_prefix_cache(self, timeout: float | None = 30.0) -> int:
        """Drop every cached prefix no running request pins (pool and offload tier), on the
        loop thread between steps; returns the pool blocks freed. Cache listeners hear of
        it (`PrefixCache.reset`). Raises EngineDeadError if the loop is not running, and
        TimeoutError if the loop took longer than `timeout` to get to it."""
        return self._on_loop(self._reset_cache, "the reset", timeout)

    def _on_loop(
        self, fn: Callable[[], int], what: str, timeout: float | None, contained: bool = False
    ) -> int:
        """`fn()` on the loop thread between steps (here if the loop was never started:
        tests that drive `step` themselves). Its exception reaches the caller; unless
        `contained`, it also ends the loop as a crash. Raises EngineDeadError if the loop is
        not running or stops first (naming `what`), TimeoutError past `timeout`."""
        if self._thread is None:
            return fn()
        call = _LoopCall(fn, what, contained)
        with self._lock:
            if self._stop or self._crashed is not None:
                raise EngineDeadError("the engine has stopped")
            self._calls.append(call)
            self._wake.notify_all()
        return call.done.result(timeout)

    def _reset_cache(self) -> int:
        """Drop every unpinned cached prefix, and the outputs kept for drafting with them."""
        if self._speculator is not None:
            self._speculator.reset()
        return self.kv.cache.reset()

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

    def import_handoff(
        self, handoff: KVHandoff, namespace: Hashable = None, timeout: float | None = 60.0
    ) -> int:
        """Put a prefill worker's K/V into this engine's pool and tree, on the loop thread
        between steps (handoff.import_handoff); returns the tokens added. Raises
        EngineDeadError if the loop is not running, TimeoutError past `timeout`."""
        return self._on_loop(
            lambda: import_handoff(self.kv.cache, self.kv_pool, handoff, namespace),
            "the handoff", timeout, contained=True,
        )  # fmt: skip

    def _idle(self) -> bool:
        """Nothing for the loop to do (call with the lock held)."""
        queued = (self._inbox, self._aborts, self._calls)
        busy = any(queued) or self.scheduler.has_work()
        return not (self._stop or busy)

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
            for r in inbox:
                self._track(r)
            for req in list(self._requests.values()):
                self._finish(req, "abort" if self._crashed is None else "error")
            with self._lock:
                calls, self._calls = self._calls, []
            for call in calls:
                call.done.set_exception(EngineDeadError(f"the engine stopped before {call.what}"))

    def step(self) -> None:
        """One step: take in new requests, aborts and resets, schedule, run the model over
        one row per scheduled chunk and per drafted token, then post-process the new tokens.
        The loop thread calls this; tests may call it on an engine that was not started."""
        self._take_inbox()
        scheduled = self.scheduler.schedule()
        self._note_scheduled(scheduled)
        chunks = scheduled.chunks
        if not chunks:
            if self.scheduler.waiting and not self.scheduler.running:
                time.sleep(0.001)  # blocks are pinned by running requests only; wait for them
            return
        if self._speculator is not None:
            budget = self.config.max_num_batched_tokens
            self._speculator.attach_drafts(chunks, self.kv, budget, self.max_model_len)
        rows = self._rows(chunks)
        self.runner.run([r for chunk_rows in rows for r in chunk_rows])
        self._postprocess(chunks, rows)

    @staticmethod
    def _note_scheduled(scheduled: SchedulerOutput) -> None:
        """On each request's metrics, what this schedule did to it: its first scheduling (the
        time, and the tokens its cache hit gave) and its preemption."""
        now = time.monotonic()
        for c in scheduled.chunks:
            m = c.req.metrics
            if m.first_scheduled_time is None:
                m.first_scheduled_time = now
                m.num_cached_tokens = c.req.num_computed  # nothing of it computed yet
                if c.req.first_token is not None:  # prefilled elsewhere: that worker's hit
                    m.num_cached_tokens = c.req.first_token.cached_tokens
        for req in scheduled.preempted:
            req.metrics.num_preemptions += 1

    def _commit(self, req: Request, num_tokens: int) -> None:
        """Record that the step computed `num_tokens` more of `req` (KVCacheManager.commit),
        and on its metrics how many of them were prompt tokens."""
        start = req.num_computed
        self.kv.commit(req, num_tokens)
        prompt = req.num_prompt_tokens
        req.metrics.num_computed_prompt_tokens += min(req.num_computed, prompt) - min(start, prompt)

    def _take_inbox(self) -> None:
        """Admit the requests, aborts and cache resets that arrived since the last step."""
        with self._lock:
            inbox, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
            calls, self._calls = self._calls, []
        for call in calls:
            call.run()
        for req in inbox:
            self._track(req)
            if req.index == 0:
                self._counters.prompt_tokens_total += req.num_prompt_tokens
            self.scheduler.add(req)
        for rid in aborts:
            for req in list(self._groups.get(rid, ())):
                self._finish(req, "abort")

    def _rows(self, chunks: list[ScheduledChunk]) -> list[list[StepRow]]:
        """Each chunk's rows: its own, then one per drafted token (each drawn as if the
        drafts before it had been accepted)."""
        self._size_bitmask(chunks)
        used = 0  # rows of the bitmask taken so far
        rows: list[list[StepRow]] = []
        for c in chunks:
            logits_from, score = score_rows(c.req, c.req.num_computed, c.num_tokens)
            sampling, used = self._sampling_of(c, used)
            keep = c.req.params.return_logits
            spans = [c.seq_chunk(logits_from), *c.draft_chunks()]
            drafts = [*c.drafts, None]
            rows.append([
                StepRow(span, how, keep, score if j == 0 else None, draft)
                for j, (span, how, draft) in enumerate(zip(spans, sampling, drafts, strict=True))
            ])  # fmt: skip
        return rows

    def _size_bitmask(self, chunks: list[ScheduledChunk]) -> None:
        """Grow the grammar bitmask buffer to the step's constrained rows."""
        constrained = sum(
            1 + len(c.drafts) for c in chunks if c.samples and c.req.matcher is not None
        )
        if constrained > self._bitmask.shape[0]:
            self._bitmask = torch.zeros(
                max(constrained, self.config.max_num_seqs), self.grammars.bitmask_words,
                dtype=torch.int32,
            )  # fmt: skip

    def _sampling_of(self, c: ScheduledChunk, used: int) -> tuple[list[SamplingRow | None], int]:
        """How each of `c`'s rows draws its token (None: it draws none), and how many rows
        of the bitmask are taken after them. A constrained request's row carries the bitmask
        of the tokens its grammar allows there (computed here, per step: tens of
        microseconds per row, so unconstrained rows of the step barely wait)."""
        if not c.samples:
            return [None] * (1 + len(c.drafts)), used
        matcher = c.req.matcher
        rows: list[SamplingRow | None] = []
        for j in range(1 + len(c.drafts)):
            allowed = None
            if matcher is not None:
                allowed = self._bitmask[used]
                matcher.fill_bitmask(allowed)
                used += 1
                if j == 0:
                    self._steer_to_close(c.req, allowed)
                if j < len(c.drafts):
                    matcher.accept(c.drafts[j])  # valid: attach_drafts kept what it accepts
            rows.append(sampling_row(c.req, self._parts.eos_ids, allowed, c.drafts[:j]))
        if matcher is not None and c.drafts:
            matcher.rollback(len(c.drafts))
        return rows, used

    def _steer_to_close(self, req: Request, allowed: torch.Tensor) -> None:
        """Near max_tokens, keep a JSON-constrained row to the tokens that close it."""
        spec = req.params.structured
        out = len(req.token_ids) - req.num_prompt_tokens
        if (
            spec is None
            or not spec.closes_as_json
            or not closing_starts(req.params.max_tokens, out)
        ):
            return
        self._json_closer().steer(allowed, req.text)

    def _json_closer(self) -> JsonCloser:
        """The vocabulary's JSON closing token sets, built on first use."""
        with self._closer_lock:
            if self._closer is None:
                vocab = self.grammars.vocab_size
                self._closer = JsonCloser(self.tokenizer.hf, vocab, self._parts.eos_ids)
            return self._closer

    def _postprocess(self, chunks: list[ScheduledChunk], rows: list[list[StepRow]]) -> None:
        """Record what the step computed, then each drawn token (a chunk's, then those its
        accepted drafts yielded, each as its own decode step would): its text, stop checks,
        and the request's output (or its end)."""
        now = time.monotonic()
        for c, (row, *draft_rows) in zip(chunks, rows, strict=True):
            req = c.req
            self._commit(req, c.num_tokens)
            if row.scores and req.prompt_logprobs is not None and req.leader is None:
                req.prompt_logprobs.extend(row.scores)
            if row.token_id is None:
                continue
            drawn = row.token_id
            reason = self._emit(req, row, now)
            # Drafts were checked against the drawn token: a handed-over first token that
            # differs from it leaves them unverified.
            verified = req.token_ids[-1] == drawn
            accepted = 0
            for draft_row in draft_rows:
                if reason is not None or draft_row.token_id is None or not verified:
                    break
                self._commit(req, 1)  # the accepted draft's K/V, computed at its row
                accepted += 1
                reason = self._emit(req, draft_row, now)
            if c.drafts:
                assert self._speculator is not None
                self._speculator.record(req, len(c.drafts), accepted)
                req.metrics.num_draft_tokens += len(c.drafts)
                req.metrics.num_accepted_tokens += accepted
            if reason is not None:
                self._finish(req, reason)
            elif not _ranks_choices(req):
                deliver(req, finished=False)

    def _emit(self, req: Request, row: StepRow, now: float) -> str | None:
        """Append `row`'s token to `req`; why `req` ends with it, if it does."""
        assert row.token_id is not None
        token, logprobs = row.token_id, row.logprobs
        if req.first_token is not None and not req.output_token_ids:  # drawn by a prefill worker
            token = req.first_token.token_id
            logprobs = req.first_token.logprobs if token != row.token_id else logprobs
        if row.logits is not None:
            req.logits.append(row.logits)
        if logprobs is not None and req.logprobs is not None:
            req.logprobs.append(logprobs)
            req.cumulative_logprob += logprobs.logprob
        self._counters.generation_tokens_total += 1
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        reason = append_token(req, token, self._parts.eos_ids, self.max_model_len)
        req.metrics.num_output_tokens += 1
        if req.matcher is not None:
            if not req.matcher.accept(token):
                req.error = f"the grammar rejected a token: {req.matcher.error}"
                reason = "error"
            elif reason is None and req.matcher.is_finished:
                reason = "stop"  # the grammar is complete: nothing else may follow
        return reason

    def _track(self, req: Request) -> None:
        self._requests[req.request_id] = req
        self._groups.setdefault(req.group_id, []).append(req)

    def _finish(self, req: Request, reason: str) -> None:
        """End `req`: out of the queues, its blocks released (cached unless it failed), and
        its last output delivered."""
        if req.is_finished:
            return
        req.finish_reason = reason
        if reason == "error" and req.error is None:
            req.error = "the engine failed while running this request"
        if self._speculator is not None:
            self._speculator.finish(req)
        if req.export_kv_from is not None and reason in ("stop", "length"):
            req.kv_export = export_blocks(
                self.kv_pool, self.kv.pool.window, req.block_table, req.token_ids,
                req.num_computed, req.export_kv_from,
            )  # fmt: skip
        self.scheduler.finish(req, cache_computed=reason != "error")
        req.metrics.finish_time = time.monotonic()
        self._requests.pop(req.request_id, None)
        group = self._groups.get(req.group_id, [req])
        done = all(r.is_finished for r in group)
        if done:  # a request is counted once, by its first choice's reason
            self._groups.pop(req.group_id, None)
            totals = self._counters.requests_total
            first = group[0].finish_reason or reason
            totals[first] = totals.get(first, 0) + 1
        if not _ranks_choices(req):
            deliver(req, finished=True)
        elif done:
            # best_of > n: the n choices with the highest cumulative log-prob, re-numbered.
            ranked = sorted(group, key=lambda r: -r.cumulative_logprob)[: req.params.n]
            for i, r in enumerate(ranked):
                r.index = i
                deliver(r, finished=True)

    # ------------------------------------------------------------------ capabilities

    @property
    def can_reset_prefix_cache(self) -> bool:
        """Whether `reset_prefix_cache` can be called here: always on an engine (the server
        asks before it offers POST /reset_prefix_cache)."""
        return True


@dataclass
class _LoopCall:
    """A call waiting for the loop thread (LLMEngine._on_loop)."""

    fn: Callable[[], int]
    what: str
    contained: bool  # its exception goes to the caller only, and the loop goes on
    done: Future[int] = field(default_factory=Future)

    def run(self) -> None:
        try:
            self.done.set_result(self.fn())
        except Exception as e:
            self.done.set_exception(e)
            if not self.contained:
                raise


def _ranks_choices(req: Request) -> bool:
    """Whether `req`'s group draws more choices than it returns (best_of > n): its outputs
    are held until every choice has finished."""
    return req.params.num_samples > req.params.n
