"""`--kv-events-config`: vLLM's KVEventsConfig keys and meanings, and where the sockets go.

Keys (JSON): `enable_kv_cache_events` (false: nothing is published, whatever else is set),
`publisher` ("zmq", or "null" for none; default "zmq" when enabled), `endpoint` (the PUB
socket), `replay_endpoint` (the ROUTER socket answering replay requests; none by default),
`buffer_steps` (batches kept for replay), `hwm` (the PUB socket's high-water mark: messages
queued for a slow subscriber beyond it are dropped), `max_queue_size` (cache events waiting
to be published; more are dropped and the next batch starts with a resync) and `topic`.

One difference from vLLM, for safety: the default endpoint is tcp://127.0.0.1:5557 (vLLM's
is tcp://*:5557, every interface). As in vLLM, an endpoint with a wildcard host (`*`,
0.0.0.0, ::) or an ipc:// / inproc:// address is bound; so is one on a loopback host
(127.0.0.0/8, localhost, ::1), which vLLM would connect to; any other host is connected to
(a consumer there binds, as llm-d's indexer does). The replay endpoint is always bound.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import json
from dataclasses import dataclass
from typing import Any, NamedTuple

DEFAULT_ENDPOINT = "tcp://127.0.0.1:5557"
_WILDCARDS = {"*", "0.0.0.0", "::", "[::]"}


class Endpoint(NamedTuple):
    """A ZMQ address and whether this side binds it (else connects to it)."""

    address: str
    bind: bool
    host: str | None  # of a tcp:// address
    port: int | None


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's `KVEventsConfig` (vllm/config/kv_events.py), with a loopback default endpoint."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # None: "zmq" if enabled, else "null"
    endpoint: str = DEFAULT_ENDPOINT
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def enabled(self) -> bool:
        """Whether events are published (vLLM: enabled and a publisher other than null)."""
        return self.enable_kv_cache_events and self.publisher != "null"

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> KVEventsConfig:
        """Validate vLLM-style keys and values; raises ValueError naming the bad one."""
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ValueError(f"unknown key(s) {', '.join(unknown)}; known: {', '.join(known)}")
        cfg = cls(**values)
        if not isinstance(cfg.enable_kv_cache_events, bool):
            raise ValueError("enable_kv_cache_events must be true or false")
        if cfg.publisher not in (None, "zmq", "null"):
            raise ValueError(f"publisher {cfg.publisher!r} is not one of: zmq, null")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(cfg, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
        if not isinstance(cfg.topic, str):
            raise ValueError("topic must be a string")
        parse_endpoint(cfg.endpoint, "endpoint")
        if cfg.replay_endpoint is not None:
            if not parse_endpoint(cfg.replay_endpoint, "replay_endpoint").bind:
                raise ValueError(
                    f"replay_endpoint {cfg.replay_endpoint!r} must be an address to bind "
                    "(a loopback or wildcard host, ipc:// or inproc://)"
                )
            if cfg.replay_endpoint == cfg.endpoint:
                raise ValueError("endpoint and replay_endpoint must differ")
        return cfg

    def as_dict(self) -> dict[str, Any]:
        """The config as vLLM's JSON keys."""
        return dataclasses.asdict(self)


def parse_endpoint(address: Any, key: str = "endpoint") -> Endpoint:
    """Split a ZMQ address and decide bind or connect (see the module's docstring); raises
    ValueError for anything but tcp://HOST:PORT, ipc://PATH and inproc://NAME."""
    if not isinstance(address, str):
        raise ValueError(f"{key} must be a string like tcp://127.0.0.1:5557")
    scheme, sep, rest = address.partition("://")
    if not sep or not rest:
        raise ValueError(f"{key} {address!r} is not a ZMQ address like tcp://127.0.0.1:5557")
    if scheme in ("ipc", "inproc"):
        return Endpoint(address, True, None, None)
    if scheme != "tcp":
        raise ValueError(f"{key} {address!r}: the transport must be tcp, ipc or inproc")
    host, colon, port_text = rest.rpartition(":")
    if not colon or not host or not port_text.isdigit() or int(port_text) > 65535:
        raise ValueError(f"{key} {address!r} needs a host and a port, e.g. tcp://127.0.0.1:5557")
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    return Endpoint(address, host in _WILDCARDS or _is_loopback(bare), bare, int(port_text))


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_kv_events_config(text: str) -> dict[str, Any]:
    """argparse type of `--kv-events-config`: the JSON object, validated (vLLM's keys)."""
    try:
        values = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e})") from None
    if not isinstance(values, dict):
        raise argparse.ArgumentTypeError("must be a JSON object of vLLM's KVEventsConfig keys")
    try:
        KVEventsConfig.from_dict(values)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return values
