"""Build what an engine runs on from an EngineConfig: the model and tokenizer, the runner with
its KV pool, the offload tier, the prefix cache and who owns each block, and a warm restart's
saved cache loaded into them."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from radixserve.cache import make_prefix_cache
from radixserve.cache.window import WindowSlots
from radixserve.engine.config import EngineConfig
from radixserve.engine.kv_manager import KVCacheManager
from radixserve.engine.kv_persist import KVPersistence
from radixserve.engine.scheduler import Scheduler
from radixserve.engine.startup import phase
from radixserve.engine.tokenizer import Tokenizer
from radixserve.model.config import ModelConfig
from radixserve.model.decoder import DecoderModel
from radixserve.model.files import resolve_model
from radixserve.model.kv_pool import (
    KVPool,
    bytes_per_token,
    check_pool_holds_request,
    parse_memory,
)
from radixserve.model.kv_tier import KVTier, KVTierMover, open_kv_tier
from radixserve.model.loader import (
    load_model,
    resolve_device,
    resolve_dtype,
    resolve_kv_cache_dtype,
    resolve_prefill_path,
    resolve_quantization,
)
from radixserve.model.runner import ModelRunner
from radixserve.options import default_of
from radixserve.values import ceil_div

log = logging.getLogger(__name__)


@dataclass
class EngineParts:
    """Everything an engine runs on. The runner owns the model and the KV pool; `kv` owns
    the blocks (its `cache` is the prefix cache, on or off) and the scheduler the queues;
    `tier` is the offload tier's storage and `persistence` writes the cache for a warm
    restart, when configured."""

    config: EngineConfig
    model_name: str
    tokenizer: Tokenizer
    runner: ModelRunner
    kv: KVCacheManager
    scheduler: Scheduler
    tier: KVTier | None
    persistence: KVPersistence | None
    max_model_len: int
    eos_ids: frozenset[int]

    def save_cache(self) -> None:
        """Write the cache for a warm restart (once; only with kv_persist_dir). Call it when
        the loop has stopped: nothing may change the cache meanwhile."""
        persist, self.persistence = self.persistence, None
        if persist is None:
            return
        try:
            saved = persist.save(self.kv.cache, self.runner.kv_pool, self.tier)
        except OSError:
            log.exception("saving the KV cache for a warm restart failed")
            return
        log.info(
            "saved %d cached blocks (%d nodes, %.0f MiB) for a warm restart in %.2f s",
            saved.blocks, saved.nodes, saved.nbytes / 2**20, saved.seconds,
        )  # fmt: skip


def load_parts(config: EngineConfig) -> EngineParts:
    """Find and load the model `config` names (weights, tokenizer), then `assemble` the rest."""
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    with phase("model files"):
        cache_dir = Path(config.cache_dir) if config.cache_dir else None
        files = resolve_model(config.model, cache_dir)
    device = resolve_device(config.device)
    with phase("kernels and prefill path"):
        quantization = resolve_quantization(config.quantization, files, device)
        dtype = resolve_dtype(config.dtype, device, quantized=quantization != "none")
        prefill = resolve_prefill_path(config.dtype, dtype, device, quantization)
    # The tokenizer loads beside the weights: it is Python (importing transformers, reading
    # the vocabulary) while the weights' time goes to kernels and page faults that leave the
    # interpreter free. Its phase's time is what the weights left to wait for.
    with ThreadPoolExecutor(1, thread_name_prefix="tokenizer") as pool:
        tokenizer_job = pool.submit(
            Tokenizer.from_dir, files.path, chat_template=config.chat_template
        )
        with phase("weights"):
            # no position reaches max_model_len (request.check_prompt)
            model = load_model(files, dtype, device, quantization, prefill, config.max_model_len)
        with phase("tokenizer"):
            tokenizer = tokenizer_job.result()
    with phase("KV pool, runner and cache"):
        return assemble(config, model, tokenizer, files.name)


def assemble(
    config: EngineConfig, model: DecoderModel, tokenizer: Tokenizer, model_name: str
) -> EngineParts:
    """The parts of an engine over an already-built `model`: the KV pool sized by `config`
    (a pool that cannot hold one request of max_model_len is a start-up error), the runner,
    the offload tier, the cache, and the saved cache of a warm restart loaded into them."""
    mc = model.config
    kv_dtype = _kv_dtype(config, model)
    device = next(model.parameters()).device
    pool = _pool_shape(config, mc, device, kv_dtype)
    max_model_len = min(
        config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings
    )
    if config.max_model_len:
        check_pool_holds_request(
            pool.num_blocks, config.block_size, max_model_len, pool.block_bytes
        )
    runner = _start_runner(config, model, pool, max_model_len, kv_dtype)
    # The offload tier and warm restart (docs/kv-offload.md): the cache tracks the tier's
    # block ids, the mover copies their bytes.
    tier = None
    if config.enable_prefix_cache:
        tier = open_kv_tier(mc, runner.kv_pool, config.kv_offload_memory, config.kv_offload_dir)
    mover = KVTierMover(runner.kv_pool, tier) if tier is not None else None

    def new_kv() -> KVCacheManager:
        cache = make_prefix_cache(
            num_blocks=pool.num_blocks,
            block_size=config.block_size,
            enabled=config.enable_prefix_cache,
            eviction_policy=config.eviction_policy,
            session_ttl=config.session_ttl,
            namespace_quota=config.namespace_quota,
            refetch_window=config.refetch_window,
            tier_blocks=tier.num_blocks if tier is not None else 0,
            mover=mover,
            window=pool.slots,
        )
        return KVCacheManager(cache, runner.copy_block)

    kv = new_kv()
    persistence = None
    if config.kv_persist_dir and kv.cache.enabled:
        persistence = KVPersistence(config.kv_persist_dir, model, mc, config.block_size, kv_dtype)
        kv = _warm_start(persistence, kv, new_kv, runner, tier)
    scheduler = Scheduler(
        kv, config.max_num_batched_tokens, config.max_num_seqs, config.schedule_policy
    )
    return EngineParts(
        config, model_name, tokenizer, runner, kv, scheduler, tier, persistence, max_model_len,
        _eos_ids(mc, tokenizer),
    )  # fmt: skip


def _kv_dtype(config: EngineConfig, model: DecoderModel) -> torch.dtype:
    """The K/V cache's dtype for `model` under --kv-cache-dtype."""
    dtype = next(model.parameters()).dtype
    return resolve_kv_cache_dtype(
        config.kv_cache_dtype,
        dtype,
        dtype_name=config.dtype,
        device=next(model.parameters()).device,
        quantization=model.quantization,
        prefill_path=model.prefill_path,
    )


class PoolShape(NamedTuple):
    """The KV pool's size: its blocks, the memory of one, and the window pool's slots (None
    without a window pool)."""

    num_blocks: int
    block_bytes: int
    slots: WindowSlots | None


def _pool_shape(
    config: EngineConfig, mc: ModelConfig, device: torch.device, kv_dtype: torch.dtype
) -> PoolShape:
    """The pool's size: the window pool's split, --num-blocks, or as many blocks as the
    K/V memory holds."""
    window = window_pool(config, mc, device, kv_dtype)
    if window is not None:
        slots = WindowSlots(window.num_blocks, window.num_slots, window.window, config.block_size)
        return PoolShape(window.num_blocks, window.block_bytes, slots)
    per_block = bytes_per_token(mc, kv_dtype) * config.block_size
    if config.num_blocks:
        return PoolShape(config.num_blocks, per_block, None)
    memory = kv_cache_bytes(config)
    num_blocks = KVPool.blocks_for_memory(mc, memory, config.block_size, kv_dtype)
    return PoolShape(num_blocks, per_block, None)


def _start_runner(
    config: EngineConfig,
    model: DecoderModel,
    pool: PoolShape,
    max_model_len: int,
    kv_dtype: torch.dtype,
) -> ModelRunner:
    """The runner over `model` with a KV pool of `pool`'s size; its decode steps captured
    (warmed up) unless they run eagerly."""
    runner = ModelRunner(
        model,
        pool.num_blocks,
        config.block_size,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=max_model_len,
        attention_backend=config.attention_backend,
        enforce_eager=config.enforce_eager,
        kv_cache_dtype=kv_dtype,
        window=pool.slots,
    )
    if runner.decode_mode != "eager":
        took = runner.warmup()
        log.info("decode steps: %s, captured in %.1f s", runner.decode_mode, took)
    return runner


def _warm_start(
    persistence: KVPersistence,
    kv: KVCacheManager,
    new_kv: Callable[[], KVCacheManager],
    runner: ModelRunner,
    tier: KVTier | None,
) -> KVCacheManager:
    """`kv` with the saved cache of a warm restart loaded into it, or a fresh one from
    `new_kv` (a cold start) if loading the save failed."""
    try:
        loaded = persistence.load(kv.cache, runner.kv_pool, tier)
    except Exception:
        log.exception("loading the KV cache save failed; starting cold")
        return new_kv()
    if loaded is not None:
        log.info(
            "warm start: loaded %d cached blocks (%d nodes, %.0f MiB) in %.2f s",
            loaded.blocks, loaded.nodes, loaded.nbytes / 2**20, loaded.seconds,
        )  # fmt: skip
    return kv


def _eos_ids(mc: ModelConfig, tokenizer: Tokenizer) -> frozenset[int]:
    """The token ids that end a sequence: the model's and the tokenizer's."""
    eos_ids = set(mc.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        eos_ids.add(tokenizer.eos_token_id)
    return frozenset(eos_ids)


def kv_cache_bytes(config: EngineConfig) -> int:
    """The K/V pool's memory: --kv-cache-memory, or its declared default."""
    return parse_memory(config.kv_cache_memory or default_of(EngineConfig, "kv_cache_memory"))


@dataclass(frozen=True)
class WindowPool:
    """How the KV memory is split when sliding-window layers keep their K/V in a pool of
    their own (kv_pool.KVPool): blocks for every layer's block ids, slots for the window's."""

    num_blocks: int
    num_slots: int
    window: int  # the widest sliding window: what a request's pins must cover
    full_block_bytes: int  # one block of the full-attention layers' K/V
    slot_bytes: int  # one block of the sliding-window layers' K/V

    @property
    def block_bytes(self) -> int:
        """Memory per block, its share of the window pool included."""
        return self.full_block_bytes + ceil_div(self.slot_bytes * self.num_slots, self.num_blocks)


def window_pool(
    config: EngineConfig,
    mc: ModelConfig,
    device: torch.device,
    kv_dtype: torch.dtype,
    quiet: bool = False,
) -> WindowPool | None:
    """The window pool's size for a model of `mc` on `device` under `config` (logged unless
    `quiet`), or None where its sliding-window layers keep their K/V in the one pool (no such
    layers, or why it logs)."""
    windows = [w for w in (mc.layer_window(i) for i in range(mc.num_layers)) if w]
    if not windows:
        return None
    why = None
    if config.disable_hybrid_swa_memory:
        why = "--disable-hybrid-swa-memory"
    elif device.type != "cpu":
        why = "a window pool is built for CPU steps only"
    elif config.kv_offload_memory or config.kv_offload_dir or config.kv_persist_dir:
        why = "the offload tier and warm restart copy blocks of the one pool only"
    if why is not None:
        if not quiet:
            log.info("sliding-window layers keep K/V for every token of the context: %s", why)
        return None
    bs, windowed = config.block_size, len(windows)
    layer_block = bytes_per_token(mc, kv_dtype) // mc.num_layers * bs
    full_bytes, slot_bytes = layer_block * (mc.num_layers - windowed), layer_block * windowed
    window = max(windows)
    # Enough for one request's window plus a full step of new tokens: slots never stop a
    # request that has the pool to itself.
    least = ceil_div(window + config.max_num_batched_tokens, bs) + 2
    ratio = config.swa_full_tokens_ratio
    if config.num_blocks:
        num_blocks = config.num_blocks
        slots = config.window_slots or max(least, int(ratio * num_blocks))
    else:
        memory = kv_cache_bytes(config)
        num_blocks = max(1, int(memory / (full_bytes + ratio * slot_bytes)))
        slots = config.window_slots or int(ratio * num_blocks)
        if slots < least:
            slots = least
            if full_bytes:
                num_blocks = max(1, (memory - slots * slot_bytes) // full_bytes)
            else:  # every layer windowed: a block id holds nothing without its slot
                num_blocks = int(slots / ratio)
    slots = min(slots, num_blocks)
    if not quiet:
        whole = (full_bytes + slot_bytes) / bs
        log.info(
            "sliding-window layers (%d of %d, window %d) keep K/V in a pool of %d slots (%d "
            "tokens) beside %d blocks (%d tokens) of the full-attention layers: %.0f KiB per "
            "token of context at 8k instead of %.0f",
            windowed, mc.num_layers, window, slots, slots * bs, num_blocks, num_blocks * bs,
            window_bytes_per_token(full_bytes, slot_bytes, bs, window, 8192) / 1024, whole / 1024,
        )  # fmt: skip
    return WindowPool(num_blocks, slots, window, full_bytes, slot_bytes)


def window_bytes_per_token(
    full_block_bytes: int, slot_bytes: int, block_size: int, window: int, context: int
) -> float:
    """K/V bytes per token of a `context`-token request whose window layers keep only the
    blocks their window reads (the window and one partial block)."""
    kept = min(context, ceil_div(window, block_size) * block_size + block_size)
    return (full_block_bytes * context + slot_bytes * kept) / block_size / context
