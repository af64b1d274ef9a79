"""`radixserve serve --ray [--replicas N] [--ray-address ADDR]`: deploy on Ray Serve and wait."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
from typing import Any

from radixserve.server.config import WorkerOptions

log = logging.getLogger("radixserve.ray")


def layout_from_args(args: argparse.Namespace) -> Any:
    """The RayDeployment the serve flags describe."""
    from radixserve.ray.deployments import RayDeployment

    return RayDeployment(
        num_replicas=args.replicas,
        num_cpus=args.ray_num_cpus,
        router=args.ray_router,
        router_kwargs=dict(args.ray_router_kwargs or {}),
    )


def serve_ray(args: argparse.Namespace) -> int:
    """Start (or join) Ray, run the app on args.host:args.port until SIGINT/SIGTERM, clean up."""
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        import ray
        from ray import serve

        from radixserve.ray.deployments import APP_NAME, build_app
        from radixserve.ray.events import stop_following
    except ImportError as e:
        log.error("--ray needs Ray Serve: pip install 'radixserve[ray]' (%s)", e)
        return 2
    opts = WorkerOptions.from_namespace(args)
    layout = layout_from_args(args)
    started_here = args.ray_address is None
    if started_here:
        # Logical CPUs: enough for every replica's reservation even on a small machine.
        need = layout.num_replicas * (layout.num_cpus or opts.num_threads or 1)
        ray.init(num_cpus=max(os.cpu_count() or 1, int(need + 0.999)), include_dashboard=False)
    else:
        ray.init(address=args.ray_address)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(build_app(opts, layout), name=APP_NAME, route_prefix="/")
        log.info(
            "radixserve on Ray Serve: %d engine replica(s), router %s; listening on http://%s:%d",
            layout.num_replicas,
            layout.router,
            args.host,
            args.port,
        )
        stop.wait()
        return 0
    finally:
        log.info("shutting down the Ray Serve app")
        stop_following()
        if started_here:
            serve.shutdown()
            ray.shutdown()
        else:
            serve.delete(APP_NAME)
