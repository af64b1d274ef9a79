"""The router's Prometheus metrics, in a registry of its own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from radixserve.router.policy import REASONS


class RouterMetrics:
    """Per-worker requests, in-flight, matched-prefix tokens and routing decisions by reason."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        p = "radixserve_router_"
        self.requests = Counter(
            p + "requests",
            "Requests sent to each worker, by outcome",
            ["worker", "status"],
            registry=r,
        )
        self.in_flight = Gauge(
            p + "in_flight", "Requests in flight per worker", ["worker"], registry=r
        )
        self.prompt_tokens = Counter(
            p + "prompt_tokens",
            "Prompt tokens routed to each worker (router's count)",
            ["worker"],
            registry=r,
        )
        self.matched_tokens = Counter(
            p + "matched_prefix_tokens",
            "Prompt tokens the router expected cached on the chosen worker",
            ["worker"],
            registry=r,
        )
        self.cached_tokens = Counter(
            p + "cached_tokens",
            "Prompt tokens the worker reported served from its cache (usage.cached_tokens)",
            ["worker"],
            registry=r,
        )
        self.decisions = Counter(
            p + "decisions", "Routing decisions by reason", ["reason"], registry=r
        )
        self.retries = Counter(p + "retries", "Requests retried on another worker", registry=r)
        self.upstream_errors = Counter(
            p + "upstream_errors",
            "Failed attempts per worker, by kind",
            ["worker", "kind"],
            registry=r,
        )
        self.worker_up = Gauge(
            p + "worker_up", "1 if the worker is in rotation", ["worker"], registry=r
        )
        self.events_live = Gauge(
            p + "cache_events_live",
            "1 if the worker's cache event stream is connected",
            ["worker"],
            registry=r,
        )
        self.mirror_resyncs = Counter(
            p + "mirror_resyncs",
            "Times a worker's mirror drifted from its cache and was reloaded from a snapshot",
            ["worker"],
            registry=r,
        )
        self.tree_blocks = Gauge(
            p + "tree_blocks",
            "Blocks in the router's mirror of each worker's cache",
            ["worker"],
            registry=r,
        )
        for reason in REASONS:
            self.decisions.labels(reason)

    def add_worker(self, name: str) -> None:
        """Create a worker's series at zero so they show before its first request."""
        for s in ("ok", "error"):
            self.requests.labels(name, s)
        for m in (
            self.in_flight,
            self.prompt_tokens,
            self.matched_tokens,
            self.cached_tokens,
            self.worker_up,
            self.events_live,
            self.mirror_resyncs,
            self.tree_blocks,
        ):
            m.labels(name)

    def render(self) -> bytes:
        """The Prometheus text exposition of every router metric."""
        return generate_latest(self.registry)
