"""One description of a worker: its engine configuration plus its server options.

`radixserve serve` parses it from flags, the `serve --workers N` launcher turns it back into a
worker's command line (`to_argv`), and the Ray Serve deployment receives it as a plain dict
(`to_dict` / `from_dict`, also the shape of a Serve config file's `args`). The flags, their
defaults and their help live in one table here, so the three can never disagree.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from radixserve import options as types
from radixserve.cache import DEFAULT_POLICY, POLICIES
from radixserve.options import LOG_LEVELS

if TYPE_CHECKING:
    from radixserve.engine.engine import EngineConfig

# Engine fields left unset (None) keep the engine's own defaults.
_ENGINE_OPTIONAL = (
    "max_num_batched_tokens",
    "max_num_seqs",
    "max_model_len",
    "max_waiting",
    "schedule_policy",
    "num_threads",
    "eviction_policy",
    "session_ttl",
    "namespace_quota",
    "refetch_window",
    "kv_offload_memory",
    "kv_offload_dir",
    "kv_persist_dir",
)


@dataclass
class WorkerOptions:
    """Everything one engine worker needs: engine config and the options of its HTTP server."""

    # engine
    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    kv_cache_memory: str = "2GiB"
    block_size: int = 16
    enable_prefix_cache: bool = True
    quantization: str | None = None
    attention_backend: str = "auto"
    kv_cache_dtype: str = "auto"
    enforce_eager: bool = False
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    max_waiting: int | None = None
    schedule_policy: str | None = None
    num_threads: int | None = None
    # eviction (docs/eviction.md); None keeps the engine's defaults
    eviction_policy: str | None = None
    session_ttl: float | None = None
    namespace_quota: float | None = None
    refetch_window: float | None = None
    # KV offload tier and warm restart (docs/kv-offload.md); None: off
    kv_offload_memory: str | None = None
    kv_offload_dir: str | None = None
    kv_persist_dir: str | None = None
    # server
    served_model_name: str | None = None
    api_key: str | None = None
    default_max_tokens: int = 256
    shutdown_timeout: float = 30.0
    dashboard_show_text: bool = False
    api_key_tiers: str | None = None
    log_level: str = "info"

    def engine_config(self) -> EngineConfig:
        """The EngineConfig these options describe (unset options keep the engine's defaults)."""
        from radixserve.engine.engine import EngineConfig

        kwargs: dict[str, Any] = {
            "model": self.model,
            "dtype": self.dtype,
            "device": self.device,
            "kv_cache_memory": self.kv_cache_memory,
            "block_size": self.block_size,
            "enable_prefix_cache": self.enable_prefix_cache,
            "quantization": self.quantization,
            "attention_backend": self.attention_backend,
            "kv_cache_dtype": self.kv_cache_dtype,
            "enforce_eager": self.enforce_eager,
        }
        for name in _ENGINE_OPTIONAL:
            value = getattr(self, name)
            if value is not None:
                kwargs[name] = value
        return EngineConfig(**kwargs)

    def to_argv(self, exclude: tuple[str, ...] = ("api_key",)) -> list[str]:
        """Serve flags for every option that differs from its default (the key goes by env)."""
        argv: list[str] = []
        defaults = WorkerOptions()
        for opt in OPTIONS:
            value = getattr(self, opt.name)
            if opt.name in exclude or value == getattr(defaults, opt.name):
                continue
            if opt.negate or opt.switch:
                if value != opt.negate:
                    argv.append(opt.flag)
            else:
                argv += [opt.flag, str(value)]
        return argv

    def to_dict(self) -> dict[str, Any]:
        """The options as a JSON-able dict (only those that differ from the defaults)."""
        defaults = WorkerOptions()
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if getattr(self, f.name) != getattr(defaults, f.name)
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> WorkerOptions:
        """Options from a dict such as `to_dict()`'s or a config file's; unknown keys raise."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(
                f"unknown worker option(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        return cls(**d)

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> WorkerOptions:
        """Options from parsed serve flags (flags a parser lacks keep their defaults)."""
        out = cls()
        for opt in OPTIONS:
            if hasattr(args, opt.dest):
                value = getattr(args, opt.dest)
                setattr(out, opt.name, not value if opt.negate else value)
        return out

    def replace(self, **changes: Any) -> WorkerOptions:
        """A copy with `changes` applied."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class _Option:
    name: str  # WorkerOptions field
    flag: str
    help: str
    type: Any = str
    choices: tuple[str, ...] | None = None
    negate: bool = False  # a store_true flag that sets the field to False
    switch: bool = False  # a store_true flag that sets the field to True

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")


OPTIONS: tuple[_Option, ...] = (
    _Option("model", "--model", "HF directory or .gguf file (default: SmolLM2-135M-Instruct)"),
    _Option(
        "served_model_name",
        "--served-model-name",
        "model name of the API (default: from --model)",
    ),
    _Option(
        "api_key",
        "--api-key",
        "require 'Authorization: Bearer KEY' on /v1 routes (default: $RADIXSERVE_API_KEY)",
    ),
    _Option(
        "dtype", "--dtype", "weights' dtype", choices=("auto", "float32", "float16", "bfloat16")
    ),
    _Option("device", "--device", "auto | cpu | cuda | cuda:N", types.device),
    _Option(
        "kv_cache_memory",
        "--kv-cache-memory",
        "size of the KV-cache pool (default: 2GiB)",
        types.memory_size,
    ),
    _Option("block_size", "--block-size", "tokens per KV block (default: 16)", types.block_size),
    _Option(
        "enable_prefix_cache", "--no-prefix-cache", "disable the radix prefix cache", negate=True
    ),
    _Option(
        "quantization",
        "--quantization",
        "weight-only quantization of the projections (default: a GGUF's own 4-bit weights "
        "on CPU, none elsewhere)",
        choices=("none", "int8", "int4"),
    ),
    _Option(
        "attention_backend",
        "--attention-backend",
        "attention kernels (default auto: triton on CUDA, cpu for float32 on the CPU, else "
        "sdpa; cpu: radixserve's paged kernel reading K/V in place; sdpa: gathered blocks + "
        "torch SDPA; triton: radixserve's paged Triton kernels, CUDA)",
        choices=types.ATTENTION_BACKENDS,
    ),
    _Option(
        "kv_cache_dtype",
        "--kv-cache-dtype",
        "K/V storage dtype (default auto: the model's; bfloat16 or float16 halve a float32 "
        "model's KV bytes: twice the cached tokens per --kv-cache-memory, and decode steps "
        "read half as much)",
        types.kv_cache_dtype,
    ),
    _Option(
        "enforce_eager",
        "--enforce-eager",
        "no CUDA graphs for decode steps (as vLLM's); CPU steps always run eagerly",
        switch=True,
    ),
    _Option(
        "max_num_batched_tokens",
        "--max-num-batched-tokens",
        "tokens per engine step",
        types.positive_int,
    ),
    _Option("max_num_seqs", "--max-num-seqs", "requests running at once", types.positive_int),
    _Option(
        "max_model_len",
        "--max-model-len",
        "context length (default: the model's)",
        types.positive_int,
    ),
    _Option(
        "max_waiting",
        "--max-waiting",
        "waiting-queue limit; requests beyond it get 503 + Retry-After",
        types.non_negative_int,
    ),
    _Option(
        "schedule_policy",
        "--schedule-policy",
        "engine scheduling policy (default: the engine's)",
        choices=("lpm", "fcfs"),
    ),
    _Option("num_threads", "--num-threads", "torch CPU threads", types.positive_int),
    _Option(
        "default_max_tokens",
        "--default-max-tokens",
        "max_tokens of requests that set none, capped by the context (default: 256)",
        types.positive_int,
    ),
    _Option(
        "shutdown_timeout",
        "--shutdown-timeout",
        "seconds in-flight requests may take to finish on SIGTERM/SIGINT (default: 30)",
        types.non_negative_float,
    ),
    _Option(
        "eviction_policy",
        "--eviction-policy",
        f"which cached prefixes go first when the pool is full (default: {DEFAULT_POLICY})",
        choices=tuple(POLICIES),
    ),
    _Option(
        "session_ttl",
        "--session-ttl",
        "keep the path of requests with a session id ('user' or an x-session-id header) warm "
        "this many seconds after each turn (default: 0, off)",
        types.non_negative_float,
    ),
    _Option(
        "namespace_quota",
        "--namespace-quota",
        "share of the pool one namespace (cache_salt) may keep in unlocked blocks before it is "
        "evicted from first (default: no quota)",
        types.float_in(0.0, 1.0, lo_open=True),
    ),
    _Option(
        "api_key_tiers",
        "--api-key-tiers",
        'JSON {"api key": tier}: those keys are accepted, and a request\'s eviction tier (for '
        "--eviction-policy priority) is its key's",
    ),
    _Option(
        "refetch_window",
        "--refetch-window",
        "a block prefilled again this soon after its eviction counts in "
        "radixserve_cache_refetch_blocks_total (default: 60; 0: off)",
        types.non_negative_float,
    ),
    _Option(
        "kv_offload_memory",
        "--kv-offload-memory",
        "second KV tier under the prefix cache: evicted blocks move there instead of being "
        "dropped (host memory, or the file of --kv-offload-dir), e.g. 8GiB",
        types.memory_size,
    ),
    _Option(
        "kv_offload_dir",
        "--kv-offload-dir",
        "put the offload tier in a memory-mapped file in this directory "
        "(size: --kv-offload-memory, default 4x the pool)",
    ),
    _Option(
        "kv_persist_dir",
        "--kv-persist-dir",
        "warm restart: save the prefix cache here on graceful shutdown, load it at start",
    ),
    _Option(
        "dashboard_show_text",
        "--dashboard-show-text",
        "with --api-key, /dashboard and /v1/cache/tree show cached text, not only counts",
        switch=True,
    ),
    _Option("log_level", "--log-level", "log level", choices=LOG_LEVELS),
)


def add_worker_args(parser: argparse.ArgumentParser) -> None:
    """Add one flag per worker option to `parser` (defaults from `WorkerOptions`)."""
    defaults = WorkerOptions()
    for opt in OPTIONS:
        if opt.negate or opt.switch:
            parser.add_argument(opt.flag, action="store_true", help=opt.help)
            continue
        default = getattr(defaults, opt.name)
        if opt.name == "api_key":
            default = os.environ.get("RADIXSERVE_API_KEY")
        parser.add_argument(
            opt.flag, type=opt.type, default=default, choices=opt.choices, help=opt.help
        )
