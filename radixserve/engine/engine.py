"""The engine: a step loop over the scheduler, the model and the radix cache, in a thread."""

from __future__ import annotations

import logging
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from radixserve.cache import CacheEvent, TreeSnapshot, make_prefix_cache
from radixserve.engine.config import EngineConfig
from radixserve.engine.kv_manager import KVCacheManager
from radixserve.engine.kv_persist import KVPersistence
from radixserve.engine.outputs import RequestMetrics
from radixserve.engine.params import SamplingParams
from radixserve.engine.postprocess import check_stop
from radixserve.engine.request import OutputCallback, Request
from radixserve.engine.sampler import make_generator, sampling_row
from radixserve.engine.scheduler import Scheduler
from radixserve.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from radixserve.errors import (
    EngineDeadError,
    InvalidRequestError,
    PromptTooLongError,
    QueueFullError,
    RequestTooLargeError,
)
from radixserve.model import kernels
from radixserve.model.batch import SeqChunk
from radixserve.model.config import ModelConfig
from radixserve.model.kv_pool import KVPool, bytes_per_token, check_pool_holds_request
from radixserve.model.kv_tier import KVTierMover, open_kv_tier
from radixserve.model.llama import LlamaModel
from radixserve.model.loader import resolve_kv_cache_dtype
from radixserve.model.runner import ModelRunner

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


@dataclass
class EngineStats:
    """Monotonic counters and current gauges of an engine."""

    requests_total: dict[str, int] = field(default_factory=dict)
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    evicted_blocks_total: int = 0
    refetch_blocks_total: int = 0
    preemptions_total: int = 0
    num_waiting: int = 0
    num_running: int = 0
    blocks_total: int = 0
    blocks_free: int = 0
    blocks_cached: int = 0
    blocks_locked: int = 0
    prefix_cache_offload_hits_total: int = 0
    blocks_offloaded: int = 0
    offload_blocks_total: int = 0


class LLMEngine:
    """Owns the model, the KV pool and the cache; runs requests to completion in a thread."""

    def __init__(self, config: EngineConfig | None = None) -> None:
        from radixserve.model.loader import (
            load_model,
            resolve_device,
            resolve_dtype,
            resolve_model,
            resolve_quantization,
        )

        config = config or EngineConfig()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        files = resolve_model(config.model, Path(config.cache_dir) if config.cache_dir else None)
        device = resolve_device(config.device)
        quantization = resolve_quantization(config.quantization, files, device)
        dtype = resolve_dtype(config.dtype, device, quantized=quantization != "none")
        model = load_model(files, dtype, device, quantization)
        tokenizer = Tokenizer.from_dir(files.path)
        self._setup(config, model, tokenizer, files.name, device, dtype)

    @classmethod
    def from_parts(
        cls,
        config: EngineConfig,
        model: LlamaModel,
        tokenizer: Tokenizer,
        model_name: str = "model",
    ) -> LLMEngine:
        """An engine over an already-built model (tests, embedding in other programs)."""
        self = cls.__new__(cls)
        p = next(model.parameters())
        self._setup(config, model, tokenizer, model_name, p.device, p.dtype)
        return self

    def _setup(
        self,
        config: EngineConfig,
        model: LlamaModel,
        tokenizer: Tokenizer,
        model_name: str,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.config = config
        self.model = model
        self.model_config: ModelConfig = model.config
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.device_t, self.dtype_t = device, dtype
        self.device, self.dtype = str(device), str(dtype).removeprefix("torch.")
        self.block_size = config.block_size
        mc = self.model_config
        kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, dtype)
        self.kv_cache_dtype = str(kv_dtype).removeprefix("torch.")
        if config.num_blocks:
            num_blocks = config.num_blocks
        else:
            num_blocks = KVPool.blocks_for_memory(
                mc, config.kv_cache_memory or "2GiB", config.block_size, kv_dtype
            )
        self.num_blocks = num_blocks
        if config.max_model_len:  # a pool that cannot hold one request is a start-up error
            per_block = bytes_per_token(mc, kv_dtype) * config.block_size
            mml = min(config.max_model_len, mc.max_position_embeddings)
            check_pool_holds_request(num_blocks, config.block_size, mml, per_block)
        self.max_model_len = min(
            config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings
        )
        self.runner = ModelRunner(
            model,
            num_blocks,
            config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            attention_backend=config.attention_backend,
            enforce_eager=config.enforce_eager,
            kv_cache_dtype=kv_dtype,
        )
        if self.runner.decode_mode != "eager":
            took = self.runner.warmup()
            log.info("decode steps: %s, captured in %.1f s", self.runner.decode_mode, took)
        self.kv_pool: KVPool = self.runner.kv_pool
        self.quantization = getattr(model, "quantization", "none")
        # KV offload tier and warm restart (docs/kv-offload.md): the cache tracks the tier's
        # block ids, the mover copies bytes, and a save under kv_persist_dir is loaded now.
        self.kv_tier = (
            open_kv_tier(mc, self.kv_pool, config.kv_offload_memory, config.kv_offload_dir)
            if config.enable_prefix_cache
            else None
        )
        mover = KVTierMover(self.kv_pool, self.kv_tier) if self.kv_tier is not None else None
        tier_blocks = self.kv_tier.num_blocks if self.kv_tier is not None else 0

        def new_kv() -> KVCacheManager:
            cache = make_prefix_cache(
                num_blocks=num_blocks,
                block_size=config.block_size,
                enabled=config.enable_prefix_cache,
                eviction_policy=config.eviction_policy,
                session_ttl=config.session_ttl,
                namespace_quota=config.namespace_quota,
                refetch_window=config.refetch_window,
                tier_blocks=tier_blocks,
                mover=mover,
            )
            return KVCacheManager(cache, self.runner.copy_block)

        self.kv = new_kv()
        self.kv_persist: KVPersistence | None = None
        if config.kv_persist_dir and self.kv.cache.enabled:
            self.kv_persist = KVPersistence(
                config.kv_persist_dir, model, mc, self.block_size, kv_dtype
            )
            try:
                loaded = self.kv_persist.load(self.kv.cache, self.kv_pool, self.kv_tier)
            except Exception:
                log.exception("loading the KV cache save failed; starting cold")
                self.kv, loaded = new_kv(), None
            if loaded is not None:
                log.info(
                    "warm start: loaded %d cached blocks (%d nodes, %.0f MiB) in %.2f s",
                    loaded.blocks, loaded.nodes, loaded.nbytes / 2**20, loaded.seconds,
                )  # fmt: skip
        self.scheduler = Scheduler(
            self.kv, config.max_num_batched_tokens, config.max_num_seqs, config.schedule_policy
        )
        self.eos_ids = set(mc.eos_token_ids)
        if tokenizer.eos_token_id is not None:
            self.eos_ids.add(tokenizer.eos_token_id)
        self._stats = EngineStats(blocks_total=num_blocks)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._inbox: list[Request] = []
        self._aborts: list[str] = []
        self._requests: dict[str, Request] = {}
        self._thread: threading.Thread | None = None
        self._stop = False
        self._crashed: BaseException | None = None

    # ------------------------------------------------------------------ public API

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
        reason "abort". Idempotent; safe from any thread but the loop's own."""
        with self._lock:
            self._stop = True
            self._wake.notify_all()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        if thread is None or not thread.is_alive():
            _running_engines.discard(self)
        self._save_kv_cache()

    def _save_kv_cache(self) -> None:
        """Write the cache for a warm restart (with kv_persist_dir), once the loop is idle."""
        if self.kv_persist is None or not self.kv.cache.enabled:
            return
        if self._crashed is not None or (self._thread is not None and self._thread.is_alive()):
            log.warning("not saving the KV cache: the engine loop did not stop cleanly")
            return
        persist, self.kv_persist = self.kv_persist, None  # save once
        try:
            saved = persist.save(self.kv.cache, self.kv_pool, self.kv_tier)
        except OSError:
            log.exception("saving the KV cache for a warm restart failed")
            return
        log.info(
            "saved %d cached blocks (%d nodes, %.0f MiB) for a warm restart in %.2f s",
            saved.blocks, saved.nodes, saved.nbytes / 2**20, saved.seconds,
        )  # fmt: skip

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
        if not ids:
            raise InvalidRequestError("the prompt is empty", "prompt")
        vocab = self.model_config.vocab_size
        # The distinct types first, then min/max: C loops over a long prompt, not a Python one.
        types = set(map(type, ids))
        if (
            any(not issubclass(tp, int) or issubclass(tp, bool) for tp in types)
            or min(ids) < 0
            or max(ids) >= vocab
        ):
            raise InvalidRequestError(f"token ids must be integers in [0, {vocab})", "prompt")
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {len(ids)} tokens; this model's context is "
                f"{self.max_model_len} tokens, and at least one must be left to generate",
                "prompt",
            )
        total = min(len(ids) + params.max_tokens, self.max_model_len)
        if -(-total // self.block_size) > self.num_blocks:
            raise RequestTooLargeError(
                f"prompt ({len(ids)}) + max_tokens needs {total} tokens of KV cache, more "
                f"than the whole pool ({self.num_blocks * self.block_size} tokens)",
                "max_tokens",
            )
        rid = request_id or f"req-{uuid.uuid4().hex[:16]}"
        req = Request(
            request_id=rid,
            prompt_token_ids=ids,
            params=params,
            on_output=on_output,
            detokenizer=IncrementalDetokenizer(self.tokenizer, ids),
            namespace=namespace,
            priority=priority,
            session_id=session_id,
            generator=make_generator(params),
            metrics=RequestMetrics(arrival_time=time.monotonic()),
        )
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

    def stats(self) -> EngineStats:
        """A copy of the counters and gauges, safe to call from any thread."""
        s = self._stats
        kv = self.kv
        cache_stats = kv.cache.stats() if kv.cache.enabled else None
        return EngineStats(
            requests_total=dict(s.requests_total),
            prompt_tokens_total=s.prompt_tokens_total,
            generation_tokens_total=s.generation_tokens_total,
            prefix_cache_queries_total=kv.query_tokens,
            prefix_cache_hits_total=kv.hit_tokens,
            evicted_blocks_total=cache_stats.evicted_blocks if cache_stats else 0,
            refetch_blocks_total=cache_stats.refetch_blocks if cache_stats else 0,
            preemptions_total=self.scheduler.num_preemptions,
            num_waiting=len(self.scheduler.waiting) + len(self._inbox),
            num_running=len(self.scheduler.running),
            blocks_total=self.num_blocks,
            blocks_free=kv.pool.num_free,
            blocks_cached=cache_stats.cached_blocks if cache_stats else 0,
            blocks_locked=cache_stats.locked_blocks if cache_stats else 0,
            prefix_cache_offload_hits_total=cache_stats.offload_hit_tokens if cache_stats else 0,
            blocks_offloaded=cache_stats.offloaded_blocks if cache_stats else 0,
            offload_blocks_total=cache_stats.offload_total_blocks if cache_stats else 0,
        )

    def cache_stats(self) -> dict[str, object]:
        """The radix cache's statistics plus pool counts, as JSON-ready values."""
        out: dict[str, object] = {}
        if self.kv.cache.enabled:
            out.update(self.kv.cache.stats().as_dict())
        else:
            out.update(cached_blocks=0, evictable_blocks=0, locked_blocks=0, num_nodes=0)
        out.update(
            enabled=self.kv.cache.enabled,
            block_size=self.block_size,
            total_blocks=self.num_blocks,
            free_blocks=self.kv.pool.num_free,
            private_blocks=self.kv.num_private_blocks,
            **self.kv.policy_info(),
        )
        return out

    def add_cache_listener(self, fn: Callable[[CacheEvent], None]) -> None:
        """Call `fn(event)` on every insert/evict of the radix tree (on the engine thread)."""
        self.kv.add_listener(fn)

    def remove_cache_listener(self, fn: Callable[[CacheEvent], None]) -> None:
        """Stop calling `fn`."""
        self.kv.remove_listener(fn)

    def cache_snapshot(self) -> list[tuple[Hashable, tuple[int, ...]]]:
        """Every cached leaf path as (namespace, token ids from the root)."""
        if not self.kv.cache.enabled:
            return []
        return self.kv.cache.leaf_paths()

    def cache_tree(self, head_tokens: int = 32) -> TreeSnapshot | None:
        """A copy of the radix tree's nodes and counters (None with the cache off).

        Safe from any thread: it is taken under the cache's own lock, which the engine
        thread holds only inside single cache calls, so the step loop waits at most for
        one pass over the tree.
        """
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
            self._abort_all("abort" if self._crashed is None else "error")

    def _abort_all(self, reason: str) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
        for req in inbox:
            self._requests[req.request_id] = req
        for req in list(self._requests.values()):
            self._finish(req, reason)

    def _drain_inbox(self) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
        for req in inbox:
            self._requests[req.request_id] = req
            self._stats.prompt_tokens_total += req.num_prompt_tokens
            self.scheduler.add(req)
        for rid in aborts:
            self._finish_by_id(rid, "abort")

    def step(self) -> None:
        """Take in new requests and aborts, then run one scheduled step: the model over all
        chunks, sampling, and outputs. The loop thread calls this; tests may call it directly
        on an engine that was not started."""
        self._drain_inbox()
        out = self.scheduler.schedule()
        if not out.chunks:
            if self.scheduler.running or not self.scheduler.waiting:
                return
            time.sleep(0.001)  # blocks are pinned by running requests only; wait for them
            return
        chunks = out.chunks
        result = self.runner.run(
            [
                SeqChunk(
                    c.req.token_ids[c.req.num_computed : c.req.num_computed + c.num_tokens],
                    c.req.num_computed,
                    c.req.block_table,
                    need_logits=c.samples,
                )
                for c in chunks
            ],
            [sampling_row(c.req) if c.samples else None for c in chunks],
            [c.req.params.return_logits for c in chunks],
        )
        now = time.monotonic()
        for i, c in enumerate(chunks):
            self.kv.commit(c.req, c.num_tokens)
            token = result.token_ids.get(i)
            if token is not None:
                self._append_token(c.req, token, result.logits.get(i), now)

    def _append_token(
        self, req: Request, token: int, logits: torch.Tensor | None, now: float
    ) -> None:
        if logits is not None:
            req.logits.append(logits)
        req.token_ids.append(token)
        self._stats.generation_tokens_total += 1
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        reason = check_stop(req, token, self.eos_ids, self.max_model_len)
        if reason is not None:
            self._finish(req, reason)
        elif req.on_output is not None:
            self._emit(req, finished=False)

    def _finish_by_id(self, rid: str, reason: str) -> None:
        req = self._requests.get(rid)
        if req is not None:
            self._finish(req, reason)

    def _finish(self, req: Request, reason: str) -> None:
        if req.is_finished:
            return
        req.finish_reason = reason
        if reason == "error":
            req.error = "the engine failed while running this request"
        self.scheduler.remove(req, cache_computed=reason != "error")
        req.metrics.finish_time = time.monotonic()
        self._requests.pop(req.request_id, None)
        self._stats.requests_total[reason] = self._stats.requests_total.get(reason, 0) + 1
        self._emit(req, finished=True)

    def _emit(self, req: Request, finished: bool) -> None:
        if req.on_output is None:
            return
        try:
            req.on_output(req.snapshot(finished))
        except Exception:
            log.exception("output callback of %s raised", req.request_id)
