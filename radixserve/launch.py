"""`radixserve serve`: one worker, N workers behind the cache-aware router, or a Ray Serve app.

All three take the same worker options (`radixserve.server.config.WorkerOptions`); this module
only adds the flags that choose how many workers run and where (`LaunchConfig`), and
dispatches.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from radixserve.options import add_options, option, types

_RAY = "Ray Serve (pip install 'radixserve[ray]'; see docs/ray.md)"


def pd_counts(text: str) -> tuple[int, int]:
    """--pd's P:D: two whole numbers of at least 1."""
    p, sep, d = text.partition(":")
    if not sep or not p.strip().isdigit() or not d.strip().isdigit() or min(int(p), int(d)) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not P:D, e.g. 1:1 (each at least 1)")
    return int(p), int(d)


@dataclass(frozen=True)
class LaunchConfig:
    """How many workers `serve` runs and where: one, N behind the router, or on Ray Serve."""

    workers: int = option(
        1, "N>1: N engine workers behind the cache-aware router", type=types.positive_int
    )
    pd: tuple[int, int] | None = option(
        None,
        "P:D: P prefill and D decode workers (--disaggregation-mode) behind the router's "
        "--pd-disaggregation, as one command (docs/disaggregation.md)",
        type=pd_counts,
        metavar="P:D",
    )
    ray: bool = option(
        False,
        "deploy on Ray Serve: engine replicas behind an OpenAI ingress, routed by the "
        "cache-aware RadixRequestRouter",
        group=_RAY,
    )
    replicas: int = option(1, "engine replicas (with --ray)", type=types.positive_int, group=_RAY)
    ray_address: str | None = option(
        None,
        "join this Ray cluster (e.g. auto, ray://head:10001)",
        default_text="start a local one",
        group=_RAY,
    )
    ray_num_cpus: float | None = option(
        None,
        "CPUs each engine replica reserves",
        type=types.positive_float,
        default_text="its --num-threads, else 1",
        group=_RAY,
    )
    ray_router: str = option(
        "radix",
        "request router of the engine deployment: radix (ours), pow2 (Ray's default) or "
        "prefix (Ray's PrefixCacheAffinityRouter); for comparisons",
        choices=("radix", "pow2", "prefix"),
        group=_RAY,
    )
    ray_router_kwargs: dict[str, object] = option(
        {},
        "keyword arguments of the request router, e.g. '{\"cache_threshold\": 0.5}'",
        type=types.json_value,
        metavar="JSON",
        group=_RAY,
    )


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """The `serve` command's flags: one worker's, plus --workers and the Ray flags."""
    from radixserve.server.main import add_serve_args as add_one

    add_one(parser)
    add_options(parser, LaunchConfig, "serve")


def run_serve(args: argparse.Namespace) -> int:
    """Dispatch to Ray Serve, the worker launcher or a single server."""
    if args.ray:
        from radixserve.ray.cli import serve_ray

        code: int = serve_ray(args)  # radixserve.ray is not type-checked (pyproject.toml)
        return code
    if args.pd is not None and args.workers > 1:
        raise ValueError("--pd P:D and --workers N are two ways to say how many workers: give one")
    if args.workers > 1 or args.pd is not None:
        from radixserve.router.launcher import serve_workers

        if getattr(args, "kv_offload_dir", None) or getattr(args, "kv_persist_dir", None):
            raise ValueError(
                "--kv-offload-dir and --kv-persist-dir take one worker (one engine a directory)"
            )

        return int(serve_workers(args) or 0)
    from radixserve.server.main import run_serve as run_one

    return run_one(args)
