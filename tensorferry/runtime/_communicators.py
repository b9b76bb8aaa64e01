"""The communicator cache: one communicator per key (a device pair, a peer set), reused.

Creating an NCCL communicator costs 0.17–0.8 s; a transfer costs microseconds. Transfers that
make a communicator each time are hundreds of times slower than ones that reuse it, so the p2p
layer asks this cache for its communicators.

- Single flight: concurrent requests for one key create it once; the others wait for it.
  A creation that fails fails every waiter, and the next request tries again.
- A communicator that errored is evicted with ``abort()`` (it may hold a hung kernel) so the next
  request makes a fresh one; a clean eviction (size bound, ``clear()``) calls ``close()``.
- Communicators evicted together are aborted together, each on its own thread
  (:func:`abort_together`): NCCL's abort waits for the device, so aborting one while another
  still runs a kernel that never ends (a receive whose send never comes) blocks until that one
  is aborted too: one at a time, forever.
- Bounded: past ``max_size`` the least recently used communicator is closed.

Thread-safe: one lock guards the maps; creation, abort and close run outside it.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CommunicatorCache", "abort_together"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _InFlight:
    done: threading.Event = field(default_factory=threading.Event)
    value: Any = None
    error: BaseException | None = None


class CommunicatorCache:
    """Keyed cache of communicators with single-flight creation.

    Args:
        max_size: communicators kept at once; the least recently used is closed past it.
    """

    def __init__(self, *, max_size: int = 256) -> None:
        if max_size < 1:
            raise ValueError(f"max_size must be >= 1, got {max_size}")
        self._max_size = max_size
        self._lock = threading.Lock()
        self._live: OrderedDict[Hashable, Any] = OrderedDict()
        self._in_flight: dict[Hashable, _InFlight] = {}
        self._counters = dict.fromkeys(
            ("hits", "misses", "created", "failed", "eager", "evicted", "aborted"), 0
        )

    def get_or_create(self, key: Hashable, create: Callable[[], Any]) -> Any:
        """Returns the communicator for ``key``, calling ``create()`` once if there is none.

        Raises:
            Exception: whatever ``create()`` raised (to every concurrent waiter).
        """
        with self._lock:
            if key in self._live:
                self._live.move_to_end(key)
                self._counters["hits"] += 1
                return self._live[key]
            flight = self._in_flight.get(key)
            owner = flight is None
            if owner:
                flight = self._in_flight[key] = _InFlight()
                self._counters["misses"] += 1
            else:
                self._counters["hits"] += 1
        assert flight is not None
        if not owner:
            flight.done.wait()
            if flight.error is not None:
                raise flight.error
            return flight.value
        return self._create(key, create, flight)

    def prepare(self, key: Hashable, create: Callable[[], Any]) -> Any:
        """Creates the communicator for ``key`` now (if missing), counted as eager creation."""
        with self._lock:
            self._counters["eager"] += 1
        return self.get_or_create(key, create)

    def get(self, key: Hashable) -> Any | None:
        """The cached communicator for ``key``, or ``None`` (never creates)."""
        # One dict read, atomic as it is: no lock (asked on every NCCL issue). What the lock
        # keeps whole is a read with a change after it (get_or_create, evict).
        return self._live.get(key)

    def evict(self, key: Hashable, *, abort: bool, reason: str = "") -> bool:
        """Removes ``key``'s communicator: ``abort()`` after an error, else ``close()``.

        Returns true when there was one.
        """
        with self._lock:
            comm = self._live.pop(key, None)
            if comm is None:
                return False
            self._counters["evicted"] += 1
            if abort:
                self._counters["aborted"] += 1
        log.info("communicator cache: evicting %s (%s)", key, reason or "requested")
        _shut(comm, abort=abort)
        return True

    def evict_together(self, keys: list[Hashable], *, abort: bool, reason: str = "") -> int:
        """Like :meth:`evict` for several keys at once; with ``abort`` their communicators are
        aborted concurrently (see :func:`abort_together`). Returns how many there were."""
        with self._lock:
            comms = [comm for key in keys if (comm := self._live.pop(key, None)) is not None]
            self._counters["evicted"] += len(comms)
            if abort:
                self._counters["aborted"] += len(comms)
        if comms:
            log.info("communicator cache: evicting %s (%s)", keys, reason or "requested")
        if abort:
            abort_together(comms)
        else:
            for comm in comms:
                _shut(comm, abort=False)
        return len(comms)

    def clear(self) -> int:
        """Closes every cached communicator. Returns how many there were."""
        with self._lock:
            comms = list(self._live.values())
            self._live.clear()
        for comm in comms:
            _shut(comm, abort=False)
        return len(comms)

    def keys(self) -> list[Hashable]:
        with self._lock:
            return list(self._live)

    def stats(self) -> dict[str, int]:
        """Counters: hits, misses, created, failed, eager, evicted, aborted, live."""
        with self._lock:
            return {**self._counters, "live": len(self._live)}

    def _create(self, key: Hashable, create: Callable[[], Any], flight: _InFlight) -> Any:
        try:
            comm = create()
        except BaseException as exc:
            with self._lock:
                self._counters["failed"] += 1
                del self._in_flight[key]
            flight.error = exc
            flight.done.set()
            raise
        log.info("communicator cache: created %s for %s", type(comm).__name__, key)
        overflow = []
        with self._lock:
            self._counters["created"] += 1
            self._live[key] = comm
            del self._in_flight[key]
            while len(self._live) > self._max_size:
                overflow.append(self._live.popitem(last=False)[1])
                self._counters["evicted"] += 1
        flight.value = comm
        flight.done.set()
        for old in overflow:
            _shut(old, abort=False)
        return comm


def _shut(comm: Any, *, abort: bool) -> None:
    method = getattr(comm, "abort" if abort else "close", None)
    if method is None:
        return
    try:
        method()
    except Exception:
        log.exception("communicator cache: %s of %r failed", "abort" if abort else "close", comm)


def abort_together(comms: list[Any]) -> None:
    """Calls every ``comm.abort()`` at once, each on its own thread, and returns when all have
    returned. One after another would hang: an NCCL abort waits for the device, which another
    communicator's endless kernel keeps busy until that communicator is aborted as well (of
    two communicators with a pending receive each, the first abort returns only once the other
    is aborted too). Failures are logged, as :meth:`evict` does."""
    if len(comms) <= 1:
        for comm in comms:
            _shut(comm, abort=True)
        return
    threads = [
        threading.Thread(
            target=_shut, args=(comm,), kwargs={"abort": True}, name="tensorferry-abort"
        )
        for comm in comms
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
