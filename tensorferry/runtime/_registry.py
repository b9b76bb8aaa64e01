"""Process-level singletons: the stream pool, the communicator cache and the completion pool.

They are made on first use and outlive every :class:`~tensorferry.Client`. A forked child gets
fresh ones (threads and CUDA state do not survive ``fork``).

Thread-safe: one lock guards creation.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from tensorferry import envs
from tensorferry.runtime._communicators import CommunicatorCache
from tensorferry.runtime._completion import CompletionPool
from tensorferry.runtime._streams import StreamFactory, StreamPool

__all__ = ["stream_pool", "communicator_cache", "completion_pool", "stats", "clear"]

_lock = threading.Lock()
_streams: StreamPool | None = None
_communicators: CommunicatorCache | None = None
_completions: CompletionPool | None = None


def completion_pool() -> CompletionPool:
    """The process's completion pool (a new one if the last was shut down)."""
    global _completions
    pool = _completions  # read without the lock: every p2p call asks, and it rarely changes
    if pool is not None and not pool.is_shutdown:
        return pool
    with _lock:
        if _completions is None or _completions.is_shutdown:
            _completions = CompletionPool(threads=envs.completion_threads())
        return _completions


def stream_pool() -> StreamPool:
    """The process's stream pool of exclusive CUDA streams."""
    global _streams
    completions = completion_pool()
    with _lock:
        if _streams is None:
            _streams = StreamPool(
                _default_factory(),
                completions=completions,
                reset_timeout_s=envs.stream_reset_timeout_s(),
            )
        return _streams


def communicator_cache() -> CommunicatorCache:
    """The process's communicator cache."""
    global _communicators
    cache = _communicators  # made once; read without the lock (asked on every NCCL issue)
    if cache is not None:
        return cache
    with _lock:
        if _communicators is None:
            _communicators = CommunicatorCache()
        return _communicators


def stats() -> dict[str, dict[str, Any]]:
    """Counters of every process-level cache.

    Returns:
        ``{"streams": {"hits", "misses", "recreated", "live", "pooled", …},
        "communicators": {"hits", "misses", "created", "live", …},
        "completions": {"pending"}}``
    """
    return {
        "streams": stream_pool().stats(),
        "communicators": communicator_cache().stats(),
        "completions": {"pending": completion_pool().pending()},
    }


def clear() -> None:
    """Empties the caches: pooled streams destroyed, communicators closed.

    Streams still leased by open clients stay theirs and are pooled again when released.
    """
    with _lock:
        streams, communicators = _streams, _communicators
    if streams is not None:
        streams.clear()
    if communicators is not None:
        communicators.clear()


def _default_factory() -> StreamFactory:
    from tensorferry.runtime._cuda_streams import CudaStreamFactory

    return CudaStreamFactory()


def _forget_after_fork() -> None:
    global _streams, _communicators, _completions, _lock
    _lock = threading.Lock()
    _streams = _communicators = _completions = None


os.register_at_fork(after_in_child=_forget_after_fork)
