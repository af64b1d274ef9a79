"""Starting the KV event publisher of a server from its `--kv-events-config`."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from radixserve.server.kv_events.config import KVEventsConfig
from radixserve.server.kv_events.publisher import KVEventPublisher
from radixserve.server.kv_events.translate import EventTranslator, media

if TYPE_CHECKING:
    from radixserve.engine.engine import LLMEngine

log = logging.getLogger(__name__)


def start_kv_events(engine: LLMEngine, values: dict[str, Any] | None) -> KVEventPublisher | None:
    """A started publisher of `engine`'s cache events, or None when the config does not
    enable one (a config that names zmq without `enable_kv_cache_events` says so in the
    log, as vLLM publishes nothing then). Raises ConfigError if an endpoint is unusable."""
    if not values:
        return None
    config = KVEventsConfig.from_dict(values)
    if not config.enabled:
        if config.publisher == "zmq":
            log.warning("kv events: publisher zmq given but enable_kv_cache_events is false")
        return None
    if not engine.config.enable_prefix_cache:
        log.warning("kv events: the prefix cache is off, so no block will ever be stored")
    pool, tier = media(engine.device, bool(engine.config.kv_offload_dir))
    translator = EventTranslator(engine.block_size, pool, tier)
    publisher = KVEventPublisher(engine.kv.cache, config, translator).start()
    log.info(
        "kv events: publishing on %s%s (topic %r, media %s / %s)",
        publisher.endpoint,
        f", replay on {publisher.replay_endpoint}" if publisher.replay_endpoint else "",
        config.topic,
        pool,
        tier,
    )
    return publisher
