"""Error types that cross part boundaries; the server maps each to one HTTP status."""

from __future__ import annotations


class RadixServeError(Exception):
    """Base class of every error radixserve raises on purpose."""


class InvalidRequestError(RadixServeError, ValueError):
    """A request or parameter is malformed or out of range (HTTP 400)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus requested output) does not fit the model's context (HTTP 400)."""


class RequestTooLargeError(InvalidRequestError):
    """The request could never fit in the KV pool, even with an empty cache (HTTP 400)."""


class ModelNotFoundError(RadixServeError):
    """A model path or name does not resolve to loadable weights (HTTP 404)."""


class QueueFullError(RadixServeError):
    """The waiting queue is over its limit; retry later (HTTP 503)."""


class EngineDeadError(RadixServeError):
    """The engine loop has stopped and cannot take requests (HTTP 503)."""


class ConfigError(RadixServeError, ValueError):
    """A start-up option is malformed, out of range, or contradicts another (exit status 2)."""


class DeviceError(ConfigError):
    """The asked-for device does not exist here, or cannot compute in the asked-for dtype."""


class ModelTooLargeError(ConfigError):
    """The model's weights do not fit in the memory free on the device."""


class KVPoolSizeError(ConfigError):
    """The KV pool does not fit in the free memory, or cannot hold one request."""
