"""The options of a serving process, each declared once (radixserve.options): the HTTP side
(`HttpConfig`, shared with the router), the server's own (`ServerConfig`), and a worker's
whole description (`WorkerOptions`: engine + server).

`radixserve serve` parses a WorkerOptions from flags; `serve --workers N` turns it back into
each worker's command line (`to_argv`); the Ray Serve deployment receives it as a plain dict
(`to_dict` / `from_dict`, also the shape of a Serve config file's `args`).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from radixserve.engine.config import EngineConfig
from radixserve.options import from_args, from_dict, option, to_argv, to_dict, types
from radixserve.server.kv_events.config import parse_kv_events_config
from radixserve.values import LOG_LEVELS


@dataclass(frozen=True)
class HttpConfig:
    """Where an HTTP process (a server or the router) listens, its key and its log level."""

    host: str = option("127.0.0.1", "address to bind")
    port: int = option(8000, "port to bind", type=types.port)
    api_key: str | None = option(
        None, "require 'Authorization: Bearer KEY' on /v1 routes", env="RADIXSERVE_API_KEY"
    )
    log_level: str = option("info", "log level", choices=LOG_LEVELS)


@dataclass(frozen=True)
class ServerConfig(HttpConfig):
    """The OpenAI-compatible server's own options."""

    served_model_name: str | None = option(
        None, "model name of the API", default_text="from --model"
    )
    default_max_tokens: int = option(
        256, "max_tokens of requests that set none, capped by the context", type=types.positive_int
    )
    shutdown_timeout: float = option(
        30.0,
        "seconds in-flight requests may take to finish on SIGTERM/SIGINT",
        type=types.non_negative_float,
    )
    dashboard_show_text: bool = option(
        False, "with --api-key, /dashboard and /v1/cache/tree show cached text, not only counts"
    )
    kv_events_config: dict[str, Any] | None = option(
        None,
        "publish the prefix cache's events in vLLM's format, with vLLM's KVEventsConfig keys, "
        'e.g. \'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": '
        '"tcp://127.0.0.1:5557", "replay_endpoint": "tcp://127.0.0.1:5558"}\' (the default '
        "endpoint is loopback; docs/kv-events.md)",
        type=parse_kv_events_config,
        metavar="JSON",
    )
    api_key_tiers: str | None = option(
        None,
        'JSON file {"api key": tier}: those keys are accepted, and a request\'s eviction tier '
        "(for --eviction-policy priority) is its key's",
    )
    disaggregation_mode: str = option(
        "null",
        "prefill/decode disaggregation (SGLang's flag): 'prefill' also answers "
        "/v1/disaggregation/prefill (a request's first token and its prompt's K/V); 'decode' "
        "continues requests whose kv_transfer_params name a prefill worker, as `radixserve "
        "route --pd-disaggregation` sends them; 'null': neither (docs/disaggregation.md)",
        choices=("null", "prefill", "decode"),
    )
    disaggregation_transfer_backend: str = option(
        "auto",
        "how a decode worker takes K/V from a prefill worker: 'http' (in the answer, over "
        "TCP), 'shm' (a file in /dev/shm the prefill worker writes: both on one host), "
        "'auto' (shm where the prefill worker's URL is this host's loopback, else http)",
        choices=("auto", "http", "shm"),
    )


# Fields a worker does not take from the command line it is given: the launcher picks each
# worker's address, and the key travels by environment (`ps` would show an argv).
_NOT_IN_WORKER_ARGV = ("host", "port", "api_key")


@dataclass(frozen=True)
class WorkerOptions(ServerConfig, EngineConfig):
    """Everything one engine worker needs: its engine config and its server's options."""

    def engine_config(self) -> EngineConfig:
        """The EngineConfig part."""
        return EngineConfig(**_fields_of(self, EngineConfig))

    def server_config(self) -> ServerConfig:
        """The ServerConfig part."""
        return ServerConfig(**_fields_of(self, ServerConfig))

    def replace(self, **changes: Any) -> WorkerOptions:
        """A copy with `changes` applied (an unknown field is a TypeError)."""
        return dataclasses.replace(self, **changes)

    def to_argv(self, exclude: Iterable[str] = _NOT_IN_WORKER_ARGV) -> list[str]:
        """`radixserve serve` flags for every option that differs from its default, except
        the address and the key."""
        return to_argv(self, exclude)

    def to_dict(self) -> dict[str, Any]:
        """The options that differ from the defaults, as a JSON-able dict."""
        return to_dict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> WorkerOptions:
        """Options from a dict such as `to_dict()`'s or a config file's; unknown keys raise."""
        return from_dict(cls, values, what="worker option")

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> WorkerOptions:
        """Options from parsed serve flags (fields the namespace lacks keep their defaults)."""
        return from_args(cls, args)


def _fields_of(config: Any, cls: type) -> dict[str, Any]:
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(cls)}
