"""`radixserve serve`: one worker, N workers behind the cache-aware router, or a Ray Serve app.

All three take the same worker options (`radixserve.worker_options`); this module only adds
the flags that choose how many workers run and where, and dispatches. It is the one place that
knows both the server and the router, so neither of those imports the other.
"""

from __future__ import annotations

import argparse
import json

from radixserve import options


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """The `serve` command's flags: one worker's, plus --workers and the Ray flags."""
    from radixserve.server.main import add_serve_args as add_one

    add_one(parser)
    parser.add_argument(
        "--workers",
        type=options.positive_int,
        default=1,
        help="N>1: N engine workers behind the cache-aware router",
    )
    ray = parser.add_argument_group("Ray Serve (pip install 'radixserve[ray]'; see docs/ray.md)")
    ray.add_argument(
        "--ray",
        action="store_true",
        help="deploy on Ray Serve: engine replicas behind an OpenAI ingress, routed by the "
        "cache-aware RadixRequestRouter",
    )
    ray.add_argument(
        "--replicas", type=options.positive_int, default=1, help="engine replicas (with --ray)"
    )
    ray.add_argument(
        "--ray-address",
        default=None,
        help="join this Ray cluster (e.g. auto, ray://head:10001); default: start a local one",
    )
    ray.add_argument(
        "--ray-num-cpus",
        type=float,
        default=None,
        help="CPUs each engine replica reserves (default: its --num-threads, else 1)",
    )
    ray.add_argument(
        "--ray-router",
        default="radix",
        choices=("radix", "pow2", "prefix"),
        help="request router of the engine deployment: radix (ours), pow2 (Ray's default) or "
        "prefix (Ray's PrefixCacheAffinityRouter); for comparisons",
    )
    ray.add_argument(
        "--ray-router-kwargs",
        type=json.loads,
        default={},
        metavar="JSON",
        help="keyword arguments of the request router, e.g. '{\"cache_threshold\": 0.5}'",
    )


def run_serve(args: argparse.Namespace) -> int:
    """Dispatch to Ray Serve, the worker launcher or a single server."""
    if args.ray:
        from radixserve.ray.cli import serve_ray

        code: int = serve_ray(args)  # radixserve.ray is not type-checked (pyproject.toml)
        return code
    if args.workers > 1:
        from radixserve.router.launcher import serve_workers

        if getattr(args, "kv_offload_dir", None) or getattr(args, "kv_persist_dir", None):
            raise ValueError(
                "--kv-offload-dir and --kv-persist-dir take one worker (one engine a directory)"
            )

        return int(serve_workers(args) or 0)
    from radixserve.server.main import run_serve as run_one

    return run_one(args)
