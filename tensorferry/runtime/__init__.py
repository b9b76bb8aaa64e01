"""Process-level resources that outlive any one :class:`Client`.

- :func:`stream_pool` — exclusive device streams, reset before reuse, keyed by configuration.
- :func:`communicator_cache` — one communicator per key, single-flight creation, evicted on error.
- :func:`completion_pool` — futures fulfilled off the caller's thread when device work completes.
"""

from tensorferry.runtime._communicators import CommunicatorCache
from tensorferry.runtime._completion import CompletionPool
from tensorferry.runtime._registry import (
    clear,
    communicator_cache,
    completion_pool,
    stats,
    stream_pool,
)
from tensorferry.runtime._streams import Stream, StreamFactory, StreamKey, StreamPool
from tensorferry.runtime.client import STREAM_ROLES, Client, ClientConfig

__all__ = [
    "Client",
    "ClientConfig",
    "STREAM_ROLES",
    "stats",
    "clear",
    "stream_pool",
    "communicator_cache",
    "completion_pool",
    "Stream",
    "StreamKey",
    "StreamFactory",
    "StreamPool",
    "CommunicatorCache",
    "CompletionPool",
]
