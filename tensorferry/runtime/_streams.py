"""The stream pool: device streams that outlive the clients that use them.

Creating and destroying streams costs host time on every client cycle (on the GPU machine,
28 creates plus 28 destroys took 293 µs), and a client holds 14 per device. The pool keeps
released streams and hands them to the next client that asks for the same :class:`StreamKey`,
a device's streams as one set.

Before a stream is pooled it is *reset*: it must go idle within a bounded wait, and every
completion-pool item it owns must have finished (callbacks included) or been cancelled, so the
next owner never sees the last owner's work or callbacks. A stream that fails its reset is
destroyed and a fresh one takes its place in the pool.

Thread-safe: one lock guards the pool's maps; stream creation, reset and destruction run
outside it.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from tensorferry.errors import StreamResetError

if TYPE_CHECKING:
    from tensorferry.runtime._completion import CompletionPool

__all__ = ["StreamKey", "StreamFactory", "Stream", "StreamPool", "PRIORITIES"]

log = logging.getLogger(__name__)

PRIORITIES = ("normal", "high")


@dataclass(frozen=True, slots=True)
class StreamKey:
    """Everything that changes how a stream behaves; a lease never crosses keys."""

    device: int
    """CUDA device index."""
    priority: str = "normal"
    """``"normal"`` or ``"high"`` (the device's greatest stream priority)."""
    non_blocking: bool = True
    """Created with ``cudaStreamNonBlocking`` (no implicit sync with the legacy stream)."""

    def __post_init__(self) -> None:
        if self.priority not in PRIORITIES:
            raise ValueError(f"priority must be one of {PRIORITIES}, got {self.priority!r}")
        if self.device < 0:
            raise ValueError(f"device must be >= 0, got {self.device}")

    def __hash__(self) -> int:  # the pool hashes a key per lease; a tuple hash is cheapest
        return hash((self.device, self.priority, self.non_blocking))


class StreamFactory(Protocol):
    """Makes raw streams for the pool. Tests plug in fakes that fail on purpose."""

    def create(self, key: StreamKey) -> Any: ...

    def is_idle(self, handle: Any) -> bool: ...

    def destroy(self, handle: Any) -> None: ...

    def wrap(self, handle: Any, key: StreamKey) -> Any: ...


_ids = itertools.count(1)


class Stream:
    """One exclusive stream, leased from a :class:`StreamPool`.

    Work can reach a stream only through :attr:`handle` or :attr:`torch`; the stream remembers
    whether either was read since it was last reset, so the pool skips the idle query for streams
    a client held but never used (most of a client's 14).

    Attributes:
        key: what the stream was made for.
        uid: process-unique id; the stream's owner token in the completion pool.
    """

    __slots__ = ("_factory", "_handle", "_home", "_leased", "_torch", "_touched", "key", "uid")

    def __init__(self, key: StreamKey, handle: Any, factory: StreamFactory) -> None:
        self.key = key
        self.uid = next(_ids)
        self._handle = handle
        self._factory = factory
        self._torch: Any = None
        self._touched = False
        self._leased: Any = None  # the pool that leased it out; guarded by its lock
        self._home: _IdleSets | None = None  # where its pool keeps it while idle

    @property
    def handle(self) -> Any:
        """The raw stream handle from the factory."""
        self._touched = True
        return self._handle

    @property
    def torch(self) -> Any:
        """The stream as a ``torch.cuda.ExternalStream`` (made on first use)."""
        self._touched = True
        if self._torch is None:
            self._torch = self._factory.wrap(self._handle, self.key)
        return self._torch

    def __repr__(self) -> str:
        return f"Stream(uid={self.uid}, device={self.key.device}, priority={self.key.priority!r})"


class _IdleSets:
    """A key's idle streams, as the sets (tuples) they were released in, by set size.

    Not thread-safe: the pool's lock guards it."""

    __slots__ = ("by_size", "count")

    def __init__(self) -> None:
        self.by_size: dict[int, list[tuple[Stream, ...]]] = defaultdict(list)
        self.count = 0

    def take(self, count: int) -> list[Stream]:
        """Up to ``count`` streams: a set of exactly that size when there is one, else pieces
        of others (a split set's leftover stays pooled as a smaller set)."""
        exact = self.by_size.get(count)
        if exact:
            taken = list(exact.pop())
        else:
            taken = []
            for size in sorted(self.by_size, reverse=True):
                sets = self.by_size[size]
                while sets and len(taken) < count:
                    group = sets.pop()
                    need = count - len(taken)
                    taken.extend(group[:need])
                    if len(group) > need:
                        self.by_size[len(group) - need].append(group[need:])
                if len(taken) == count:
                    break
        self.count -= len(taken)
        return taken

    def put(self, group: list[Stream], limit: int) -> list[Stream]:
        """Pools ``group`` as one set, up to ``limit`` idle streams; returns what did not fit."""
        room = max(limit - self.count, 0)
        kept, surplus = group[:room], group[room:]
        if kept:
            self.by_size[len(kept)].append(tuple(kept))
            self.count += len(kept)
        return surplus

    def streams(self) -> list[Stream]:
        return [stream for sets in self.by_size.values() for group in sets for stream in group]

    def take_all(self) -> list[Stream]:
        streams = self.streams()
        self.by_size.clear()
        self.count = 0
        return streams


class StreamPool:
    """Process-level pool of exclusive streams, keyed by :class:`StreamKey`.

    Streams leased together (a client's streams for one device) go back together and are
    pooled as one *set*, so the next client asking for as many streams of that key takes the
    whole set in one step: a lease cycle costs a few dictionary operations per device, not per
    stream. Sets are split when a request needs fewer or more streams than any pooled set has.

    Args:
        factory: makes, checks and destroys raw streams.
        completions: completion pool whose items a released stream must drain.
        max_pooled_per_key: streams kept idle per key; more are destroyed on release.
        reset_timeout_s: how long a released stream may take to go idle.
    """

    def __init__(
        self,
        factory: StreamFactory,
        *,
        completions: CompletionPool | None = None,
        max_pooled_per_key: int = 256,
        reset_timeout_s: float = 5.0,
    ) -> None:
        if max_pooled_per_key < 0:
            raise ValueError(f"max_pooled_per_key must be >= 0, got {max_pooled_per_key}")
        self._factory = factory
        self._completions = completions
        self._max_pooled = max_pooled_per_key
        self._reset_timeout_s = reset_timeout_s
        self._lock = threading.Lock()
        self._idle: dict[StreamKey, _IdleSets] = {}
        self._leased_count = 0
        self._counters = dict.fromkeys(
            ("hits", "misses", "recreated", "destroyed", "reset_failures"), 0
        )

    # ------------------------------------------------------------------ leasing
    def acquire(self, key: StreamKey) -> Stream:
        """Leases a stream made for ``key``: a pooled one when there is one, else a new one."""
        return self.acquire_many(key, 1)[0]

    def acquire_many(self, key: StreamKey, count: int) -> list[Stream]:
        """Leases ``count`` distinct streams made for ``key`` (pooled first, then new ones).

        If creating a new stream fails, the streams already taken go back to the pool.
        """
        with self._lock:
            idle = self._idle.get(key)
            if idle is None:
                idle = self._idle[key] = _IdleSets()
            reused = idle.take(count)
            for stream in reused:
                stream._leased = self
            self._leased_count += len(reused)
            counters = self._counters
            counters["hits"] += len(reused)
            counters["misses"] += count - len(reused)
        streams = reused
        try:
            while len(streams) < count:
                stream = self._create(key, idle)
                stream._leased = self
                with self._lock:
                    self._leased_count += 1
                streams.append(stream)
        except BaseException:
            self.release_many(streams)
            raise
        return streams

    def release(self, stream: Stream) -> None:
        """Resets ``stream`` and pools it; a stream that fails its reset is replaced.

        Raises:
            ValueError: ``stream`` is not leased from this pool (e.g. released twice).
        """
        self.release_many([stream])

    def release_many(self, streams: list[Stream]) -> None:
        """Resets and pools each of ``streams``; each one that fails its reset is replaced.

        Streams of one key that all pass their reset are pooled as one set (see the class).

        Raises:
            ValueError: a stream is not leased from this pool (e.g. released twice); the
                others are still released.
        """
        in_flight = (
            self._completions.owners_in_flight([s.uid for s in streams])
            if self._completions is not None and self._completions.has_owners_in_flight()
            else ()
        )
        foreign: list[Stream] = []
        clean: list[Stream] = []  # never handed out, no completion in flight: clean as it is
        dirty: list[Stream] = []
        surplus: list[Stream] = []
        home = streams[0]._home if streams else None
        one_home = True
        with self._lock:
            for stream in streams:
                if stream._leased is not self:
                    foreign.append(stream)
                    continue
                stream._leased = None
                if stream._touched or stream.uid in in_flight:
                    dirty.append(stream)
                else:
                    clean.append(stream)
                if stream._home is not home:
                    one_home = False
            self._leased_count -= len(clean) + len(dirty)
            if clean and not dirty and one_home and home is not None:
                # The common case, one client device's untouched lease: pooled in one step.
                surplus = home.put(clean, self._max_pooled)
                clean = []
        if clean or dirty:
            surplus = self._pool_after_reset(clean, dirty, in_flight)
        for stream in surplus:
            self._destroy(stream)
        if foreign:
            raise ValueError(f"{foreign[0]!r} is not leased from this pool (released twice?)")

    def _pool_after_reset(
        self, clean: list[Stream], dirty: list[Stream], in_flight: Any
    ) -> list[Stream]:
        """Resets ``dirty`` streams (replacing those that fail), then pools them with ``clean``
        by key, each key's streams as one set. Returns the streams that did not fit."""
        for stream in dirty:
            if stream.uid not in in_flight and self._idle_now(stream):
                stream._touched = False  # the common case: its work is long done
                clean.append(stream)
                continue
            try:
                self._reset(stream)
            except Exception as exc:
                self._replace_failed(stream, exc)
                continue
            clean.append(stream)
        by_home: dict[int, list[Stream]] = {}
        for stream in clean:
            by_home.setdefault(id(stream._home), []).append(stream)
        surplus: list[Stream] = []
        with self._lock:
            for group in by_home.values():
                surplus.extend(group[0]._home.put(group, self._max_pooled))
        return surplus

    def create_unpooled(self, key: StreamKey) -> Stream:
        """A fresh stream that never enters the pool (the 'pooling off' baseline)."""
        return self._create(key, None)

    def destroy_unpooled(self, stream: Stream) -> None:
        """Destroys a stream made by :meth:`create_unpooled`."""
        self._destroy(stream)

    # ------------------------------------------------------------------ upkeep
    def clear(self) -> int:
        """Destroys every pooled (idle) stream; leased streams are untouched. Returns the count."""
        with self._lock:
            streams = [s for idle in self._idle.values() for s in idle.take_all()]
        for stream in streams:
            self._destroy(stream)
        return len(streams)

    def stats(self) -> dict[str, int]:
        """Counters: hits, misses, recreated, destroyed, reset_failures, live, pooled, leased."""
        with self._lock:
            pooled = sum(idle.count for idle in self._idle.values())
            leased = self._leased_count
            return {**self._counters, "live": pooled + leased, "pooled": pooled, "leased": leased}

    def is_leased(self, stream: Stream) -> bool:
        with self._lock:
            return stream._leased is self

    def pooled_streams(self) -> list[Stream]:
        """Every idle stream the pool holds (for inspection and tests)."""
        with self._lock:
            return [s for idle in self._idle.values() for s in idle.streams()]

    # ------------------------------------------------------------------ internals
    def _create(self, key: StreamKey, home: _IdleSets | None = None) -> Stream:
        handle = self._factory.create(key)
        log.debug("stream pool: created stream %r for %s", handle, key)
        stream = Stream(key, handle, self._factory)
        stream._home = home
        return stream

    def _destroy(self, stream: Stream) -> None:
        try:
            self._factory.destroy(stream._handle)
        except Exception:
            log.exception("stream pool: destroying %r failed", stream)
        with self._lock:
            self._counters["destroyed"] += 1

    def _idle_now(self, stream: Stream) -> bool:
        """One idle query; a failing query counts as busy (the full reset then deals with it)."""
        try:
            return bool(self._factory.is_idle(stream._handle))
        except Exception:
            return False

    def _reset(self, stream: Stream) -> None:
        """Raises :class:`StreamResetError` unless ``stream`` is idle and owns no completions."""
        deadline = time.monotonic() + self._reset_timeout_s
        if stream._touched:  # a stream never handed out cannot have work queued
            delay = 10e-6
            while not self._factory.is_idle(stream._handle):
                if time.monotonic() >= deadline:
                    raise StreamResetError(f"{stream!r} still busy after {self._reset_timeout_s} s")
                time.sleep(delay)
                delay = min(delay * 2, 1e-3)
        if self._completions is not None and self._completions.pending(stream.uid):
            left = max(0.0, deadline - time.monotonic())
            if not self._completions.drain(stream.uid, left):
                raise StreamResetError(f"{stream!r} has completion callbacks still running")
        stream._touched = False

    def _replace_failed(self, stream: Stream, exc: Exception) -> None:
        log.warning("stream pool: %r failed its reset (%s); destroying it", stream, exc)
        with self._lock:
            self._counters["reset_failures"] += 1
        self._destroy(stream)
        try:
            fresh = self._create(stream.key, stream._home)
        except Exception:
            log.exception("stream pool: could not recreate a stream for %s", stream.key)
            return
        with self._lock:
            self._counters["recreated"] += 1
            if not fresh._home.put([fresh], self._max_pooled):
                return
        self._destroy(fresh)
