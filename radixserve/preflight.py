"""Start-up checks that need several flags or a look at the machine, run before weights load.

Each raises a typed error from radixserve.errors (`radixserve.cli` turns it into one line on
stderr). Flag values on their own are checked earlier, by the types in radixserve.options.
"""

from __future__ import annotations

import argparse
import errno
import socket
from typing import TYPE_CHECKING, NamedTuple
from urllib.parse import urlsplit

from radixserve.engine.tokenizer import load_chat_template
from radixserve.errors import ConfigError, DeviceError
from radixserve.model.config import ModelConfig
from radixserve.model.files import ModelFiles, resolve_model
from radixserve.options import from_args
from radixserve.router.main import RouteConfig, kv_event_sources
from radixserve.server.kv_events.config import KVEventsConfig, parse_endpoint

if TYPE_CHECKING:
    import torch

_LOOPBACK = {"127.0.0.1", "localhost", "::1", "0.0.0.0", "::"}


def check_engine_args(args: argparse.Namespace) -> None:
    """serve / generate / chat: model files, device, dtype, and the KV pool against free memory
    and --max-model-len. Converts a GGUF model on first use (once, under a file lock)."""
    if getattr(args, "api_key", None) == "":
        raise ConfigError("--api-key must not be empty (leave it out to serve without a key)")
    files = resolve_model(args.model)
    config = ModelConfig.from_dir(files.path)
    if getattr(args, "chat_template", None) is not None:
        load_chat_template(args.chat_template)
    # The first check that needs torch (a missing model is reported without waiting for it).
    from radixserve.model.kv_pool import check_model_fits_memory
    from radixserve.model.loader import load_memory

    _check_context(getattr(args, "max_model_len", None), config)
    device, quantization, dtype = _resolve_weights(args, files)
    _check_attention_backend(getattr(args, "attention_backend", "auto"), device, dtype)
    check_model_fits_memory(*load_memory(files, config, dtype, quantization), device)
    kv_dtype = _resolve_kv_dtype(args, device, dtype, quantization)
    _check_kv_pool(args, config, device, kv_dtype)


def _check_context(max_model_len: int | None, config: ModelConfig) -> None:
    """--max-model-len is within the model's context."""
    if max_model_len is not None and max_model_len > config.max_position_embeddings:
        raise ConfigError(
            f"--max-model-len {max_model_len} is more than the model's context of "
            f"{config.max_position_embeddings} tokens"
        )


class _Weights(NamedTuple):
    """Where and how the weights would load."""

    device: torch.device
    quantization: str
    dtype: torch.dtype


def _resolve_weights(args: argparse.Namespace, files: ModelFiles) -> _Weights:
    """The device, quantization and dtype the weights of `files` would load with; a flag
    this machine or model cannot honour is a typed error naming it."""
    from radixserve.model.loader import resolve_device, resolve_dtype, resolve_quantization

    try:
        device = resolve_device(args.device)
    except DeviceError as e:
        raise DeviceError(f"--device {args.device}: {e}") from None
    try:
        quantization = resolve_quantization(getattr(args, "quantization", None), files, device)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    dtype = resolve_dtype(args.dtype, device, quantized=quantization != "none")
    return _Weights(device, quantization, dtype)


def _check_attention_backend(backend: str, device: torch.device, dtype: torch.dtype) -> None:
    """--attention-backend cpu or triton can run on `device` with weights of `dtype`."""
    if backend == "cpu" and (
        device.type != "cpu" or dtype.is_floating_point and dtype.itemsize != 4
    ):
        raise ConfigError(
            "--attention-backend cpu runs float32 models on the CPU only; "
            "add --dtype float32 --device cpu, or use --attention-backend sdpa"
        )
    if backend == "triton":
        from radixserve.model.attention import triton_unavailable

        reason = triton_unavailable(device)
        if reason is not None:
            raise ConfigError(f"--attention-backend triton cannot run here: {reason}")


def _resolve_kv_dtype(
    args: argparse.Namespace, device: torch.device, dtype: torch.dtype, quantization: str
) -> torch.dtype:
    """The K/V cache's dtype under --kv-cache-dtype; one the attention backend cannot run
    is a ConfigError."""
    from radixserve.model.attention import kv_dtype_problem
    from radixserve.model.loader import resolve_kv_cache_dtype

    try:
        kv_dtype = resolve_kv_cache_dtype(
            getattr(args, "kv_cache_dtype", "auto"),
            dtype,
            dtype_name=args.dtype,
            device=device,
            quantization=quantization,
        )  # auto's 16 bits: bfloat16 or float16 by the prefill path, of the same size
    except ValueError as e:
        raise ConfigError(str(e)) from None
    problem = kv_dtype_problem(getattr(args, "attention_backend", "auto"), device, dtype, kv_dtype)
    if problem:
        raise ConfigError(problem)
    return kv_dtype


def _check_kv_pool(
    args: argparse.Namespace, config: ModelConfig, device: torch.device, kv_dtype: torch.dtype
) -> None:
    """The KV pool of --kv-cache-memory fits in free memory (once per --workers) and holds
    one request of --max-model-len."""
    from radixserve.engine.builder import window_pool
    from radixserve.engine.config import EngineConfig
    from radixserve.model.kv_pool import (
        bytes_per_token,
        check_pool_fits_memory,
        check_pool_holds_request,
        parse_memory,
    )

    workers = getattr(args, "workers", 1) or 1
    if getattr(args, "pd", None):
        workers = sum(args.pd)
    block_size = getattr(args, "block_size", None) or 16
    per_block = bytes_per_token(config, kv_dtype) * block_size
    num_blocks = max(1, parse_memory(args.kv_cache_memory) // per_block)
    check_pool_fits_memory(num_blocks * per_block, device, copies=workers)
    window = window_pool(from_args(EngineConfig, args), config, device, kv_dtype, quiet=True)
    if window is not None:  # the sliding-window layers' own pool: more tokens per byte
        num_blocks, per_block = window.num_blocks, window.block_bytes
    max_model_len = getattr(args, "max_model_len", None)
    if max_model_len is not None:
        check_pool_holds_request(num_blocks, block_size, max_model_len, per_block)


def check_serve_args(args: argparse.Namespace) -> None:
    """serve: the address must be free to bind (by the router, with --workers N), and so
    must the KV event endpoints; then the engine checks."""
    check_bindable(args.host, args.port)
    check_kv_event_endpoints(getattr(args, "kv_events_config", None))
    check_engine_args(args)


def check_kv_event_endpoints(values: dict[str, object] | None) -> None:
    """Raise ConfigError if a tcp endpoint `--kv-events-config` binds is taken now."""
    if not values:
        return
    config = KVEventsConfig.from_dict(values)
    if not config.enabled:
        return
    for key in ("endpoint", "replay_endpoint"):
        address = getattr(config, key)
        ep = parse_endpoint(address, key) if address else None
        if ep is None or not ep.bind or ep.port is None or ep.port == 0:
            continue
        host = "0.0.0.0" if ep.host == "*" else "localhost" if ep.host is None else ep.host
        try:
            check_bindable(host, ep.port)
        except ConfigError:
            raise ConfigError(
                f"--kv-events-config: cannot bind {key} {address}: the address is in use or "
                "not this machine's; pick another port"
            ) from None


def check_bindable(host: str, port: int) -> None:
    """Raise ConfigError if host:port cannot be bound now (in use, or no such address)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except socket.gaierror as e:
            raise ConfigError(f"--host {host}: cannot resolve it ({e.strerror})") from None
        except OSError as e:
            why = "the address is in use" if e.errno == errno.EADDRINUSE else e.strerror
            raise ConfigError(
                f"cannot bind {host}:{port}: {why}; pick another --host/--port"
            ) from None


def check_route_args(args: argparse.Namespace) -> None:
    """route: at least one well-formed worker URL (with --pd-disaggregation: a --prefill and
    a --decode one), none twice, none the router's own address."""
    if args.pd_disaggregation:
        if not args.prefill or not args.decode or args.worker or args.worker_kv_events:
            raise ConfigError(
                "--pd-disaggregation takes at least one --prefill URL and one --decode URL "
                "(and no --worker / --worker-kv-events)"
            )
        flagged = [("--prefill", u) for u in args.prefill] + [("--decode", u) for u in args.decode]
    elif args.prefill or args.decode:
        raise ConfigError("--prefill / --decode workers need --pd-disaggregation")
    elif not args.worker:
        raise ConfigError("give at least one --worker URL, e.g. --worker http://127.0.0.1:8001")
    else:
        flagged = [("--worker", u) for u in args.worker]
    seen: set[tuple[str, int]] = set()
    for flag, url in flagged:
        parts = urlsplit(url)
        try:
            port = parts.port
        except ValueError:
            port = None
        if parts.scheme not in ("http", "https") or not parts.hostname or port is None:
            raise ConfigError(f"{flag} {url!r} is not a URL like http://127.0.0.1:8001")
        key = (parts.hostname, port)
        if key in seen:
            raise ConfigError(f"{flag} {url} is given twice")
        seen.add(key)
        if port == args.port and parts.hostname in _LOOPBACK and args.host in _LOOPBACK:
            raise ConfigError(
                f"{flag} {url} is the router's own address (--port {args.port}): "
                "the router would send requests to itself; give the router another --port"
            )
    kv_event_sources(from_args(RouteConfig, args))  # one per --worker, each well formed
