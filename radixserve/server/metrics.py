"""Prometheus metrics: engine counters read live from `engine.stats()`, server-side histograms.

Engine-side numbers come from a custom collector that reads the engine's own monotonic
counters at scrape time, so they are exact and never double counted. Latency histograms are
observed by the server from each request's outputs. Each app has its own registry.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from radixserve.engine.outputs import RequestOutput

if TYPE_CHECKING:
    from radixserve.server.engine_api import ServedEngine

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class EngineCollector(Collector):
    """Engine counters and gauges, read from `engine.stats()` at every scrape."""

    def __init__(self, engine: ServedEngine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        """Yield one metric family per engine statistic."""
        s = self.engine.stats()
        requests = CounterMetricFamily(
            "radixserve_requests",
            "Requests finished by the engine, by finish reason (stop, length, abort, error).",
            labels=["finish_reason"],
        )
        for reason, n in sorted(s.requests_total.items()):
            requests.add_metric([reason], n)
        yield requests
        counters = (
            ("prompt_tokens", s.prompt_tokens_total, "Prompt tokens of admitted requests."),
            ("generation_tokens", s.generation_tokens_total, "Tokens generated."),
            (
                "prefix_cache_queries",
                s.prefix_cache_queries_total,
                "Prompt tokens looked up in the prefix cache.",
            ),
            (
                "prefix_cache_hits",
                s.prefix_cache_hits_total,
                "Prompt tokens served from the prefix cache (not prefilled).",
            ),
            (
                "prefix_cache_offload_hits",
                s.prefix_cache_offload_hits_total,
                "Prompt tokens of prefix-cache hits promoted back from the KV offload tier.",
            ),
            ("evicted_blocks", s.evicted_blocks_total, "KV blocks evicted from the prefix cache."),
            (
                "cache_refetch_blocks",
                s.refetch_blocks_total,
                "KV blocks prefilled again within the refetch window of their eviction "
                "(thrashing).",
            ),
            ("preemptions", s.preemptions_total, "Running requests preempted for lack of blocks."),
            (
                "spec_decode_num_drafts",
                s.spec_decode_num_drafts,
                "Speculative decoding: verifications of drafted tokens (vLLM's num_drafts).",
            ),
            (
                "spec_decode_num_draft_tokens",
                s.spec_decode_num_draft_tokens,
                "Speculative decoding: tokens drafted and verified.",
            ),
            (
                "spec_decode_num_accepted_tokens",
                s.spec_decode_num_accepted_tokens,
                "Speculative decoding: drafted tokens accepted (kept as output).",
            ),
        )
        for name, value, doc in counters:
            yield CounterMetricFamily(f"radixserve_{name}", doc, value=value)
        gauges = (
            ("num_requests_waiting", s.num_waiting, "Requests in the waiting queue."),
            ("num_requests_running", s.num_running, "Requests being prefilled or decoded."),
            ("cache_blocks_total", s.blocks_total, "KV blocks in the pool."),
        )
        for name, value, doc in gauges:
            yield GaugeMetricFamily(f"radixserve_{name}", doc, value=value)
        blocks = GaugeMetricFamily(
            "radixserve_cache_blocks",
            "KV blocks by state: free, cached (in the prefix tree), locked (pinned by requests).",
            labels=["state"],
        )
        blocks.add_metric(["free"], s.blocks_free)
        blocks.add_metric(["cached"], s.blocks_cached)
        blocks.add_metric(["locked"], s.blocks_locked)
        yield blocks
        offload = GaugeMetricFamily(
            "radixserve_cache_offload_blocks",
            "KV blocks of the offload tier: used (demoted prefixes) and total (0: no tier).",
            labels=["state"],
        )
        offload.add_metric(["used"], s.blocks_offloaded)
        offload.add_metric(["total"], s.offload_blocks_total)
        yield offload


class ServerMetrics:
    """The app's registry: the engine collector plus latency histograms and HTTP responses."""

    def __init__(self, engine: ServedEngine) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine))
        self.ttft = Histogram(
            "radixserve_time_to_first_token_seconds",
            "Time from arrival to the first generated token.",
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "radixserve_inter_token_latency_seconds",
            "Time between consecutive generated tokens of a request.",
            buckets=ITL_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "radixserve_e2e_request_latency_seconds",
            "Time from arrival to the last token of requests that finished normally.",
            buckets=E2E_BUCKETS,
            registry=self.registry,
        )
        self.responses = Counter(
            "radixserve_http_responses",
            "HTTP responses by route and status code (rejected requests included).",
            ["route", "status"],
            registry=self.registry,
        )

    def observe(self, output: RequestOutput, stamp: float, prev_stamp: float | None) -> None:
        """Record latencies from one output; `stamp` is when the engine handed it over."""
        m = output.metrics
        n_new = len(output.new_token_ids)
        if n_new and prev_stamp is None:
            first = m.first_token_time if m.first_token_time is not None else stamp
            self.ttft.observe(max(0.0, first - m.arrival_time))
        elif n_new and prev_stamp is not None:
            # Tokens delivered together share the gap since the previous delivery.
            gap = max(0.0, stamp - prev_stamp) / n_new
            for _ in range(n_new):
                self.itl.observe(gap)
        if output.finished and output.finish_reason in ("stop", "length"):
            end = m.finish_time if m.finish_time is not None else stamp
            self.e2e.observe(max(0.0, end - m.arrival_time))

    def render(self) -> bytes:
        """The registry in Prometheus text format."""
        return generate_latest(self.registry)


class ResponseCounter:
    """ASGI middleware counting HTTP responses by matched route and status code."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass the request through, noting the status the app answers with."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = getattr(scope.get("route"), "path", None) or "other"
            self.metrics.responses.labels(route, str(status)).inc()
