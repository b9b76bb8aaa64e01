"""Communicator cache: single flight, eviction with abort, bounds, counters."""

from __future__ import annotations

import threading
import time

import pytest

from tensorferry.runtime import CommunicatorCache
from tensorferry.runtime._communicators import abort_together


class FakeComm:
    def __init__(self, name: str) -> None:
        self.name = name
        self.aborted = False
        self.closed = False

    def abort(self) -> None:
        self.aborted = True

    def close(self) -> None:
        self.closed = True


def test_concurrent_requests_create_once():
    cache = CommunicatorCache()
    calls = []
    barrier = threading.Barrier(16)

    def create() -> FakeComm:
        calls.append(1)
        time.sleep(0.1)  # slow, like a real communicator
        return FakeComm("pair-0-1")

    results: list[FakeComm] = []

    def ask() -> None:
        barrier.wait(5)
        results.append(cache.get_or_create(("nccl", 0, 1), create))

    threads = [threading.Thread(target=ask) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(calls) == 1
    assert len(results) == 16 and all(r is results[0] for r in results)
    stats = cache.stats()
    assert (stats["created"], stats["misses"], stats["hits"], stats["live"]) == (1, 1, 15, 1)


def test_failed_creation_fails_all_waiters_then_retries():
    cache = CommunicatorCache()
    started = threading.Event()
    attempts = []

    def flaky() -> FakeComm:
        attempts.append(1)
        if len(attempts) == 1:
            started.set()
            time.sleep(0.1)
            raise ConnectionError("peer not up")
        return FakeComm("second")

    errors: list[BaseException] = []

    def waiter() -> None:
        started.wait(5)
        try:
            cache.get_or_create("k", flaky)
        except ConnectionError as exc:
            errors.append(exc)

    t = threading.Thread(target=waiter)
    t.start()
    with pytest.raises(ConnectionError, match="peer not up"):
        cache.get_or_create("k", flaky)
    t.join(5)
    assert len(errors) == 1, "the concurrent waiter saw the same failure"
    assert cache.get_or_create("k", flaky).name == "second"
    assert cache.stats()["failed"] == 1


def test_error_eviction_aborts_and_next_request_recreates():
    cache = CommunicatorCache()
    first = cache.get_or_create("k", lambda: FakeComm("first"))
    assert cache.evict("k", abort=True, reason="NCCL error")
    assert first.aborted and not first.closed
    second = cache.get_or_create("k", lambda: FakeComm("second"))
    assert second is not first
    assert not cache.evict("missing", abort=True)
    stats = cache.stats()
    assert (stats["evicted"], stats["aborted"], stats["created"]) == (1, 1, 2)


def test_bounded_size_closes_least_recently_used():
    cache = CommunicatorCache(max_size=2)
    a = cache.get_or_create("a", lambda: FakeComm("a"))
    b = cache.get_or_create("b", lambda: FakeComm("b"))
    cache.get_or_create("a", lambda: FakeComm("a2"))  # touch a: b is now oldest
    cache.get_or_create("c", lambda: FakeComm("c"))
    assert b.closed and not a.closed
    assert set(cache.keys()) == {"a", "c"}


def test_prepare_counts_eager_creation_and_clear_closes():
    cache = CommunicatorCache()
    comm = cache.prepare("k", lambda: FakeComm("eager"))
    assert cache.get("k") is comm
    assert cache.stats()["eager"] == 1
    assert cache.clear() == 1
    assert comm.closed
    assert cache.get("k") is None


def test_bad_size():
    with pytest.raises(ValueError, match="max_size"):
        CommunicatorCache(max_size=0)


class _WaitsForTheOthers:
    """An NCCL communicator whose abort returns only once every other one is being aborted too
    (as NCCL's abort waits for a device that another communicator's endless kernel keeps
    busy)."""

    def __init__(self, everyone: threading.Barrier) -> None:
        self._everyone = everyone
        self.aborted = False
        self.closed = False

    def abort(self) -> None:
        self._everyone.wait()  # BrokenBarrierError after its timeout: aborted one at a time
        self.aborted = True

    def close(self) -> None:
        self.closed = True


def test_communicators_evicted_together_are_aborted_together():
    everyone = threading.Barrier(3, timeout=5.0)
    comms = [_WaitsForTheOthers(everyone) for _ in range(3)]
    cache = CommunicatorCache()
    for i, comm in enumerate(comms):
        cache.get_or_create(("pair", i), lambda c=comm: c)
    assert cache.evict_together([("pair", 0), ("pair", 1), ("pair", 2), "absent"], abort=True) == 3
    assert all(c.aborted for c in comms)
    assert cache.stats()["aborted"] == 3 and cache.stats()["live"] == 0


def test_abort_together_one_by_one_would_not_return():
    # What the concurrent abort avoids: the same fakes aborted in a loop never get past the
    # first (its barrier breaks after the timeout instead of hanging the test).
    everyone = threading.Barrier(2, timeout=0.2)
    first, second = _WaitsForTheOthers(everyone), _WaitsForTheOthers(everyone)
    with pytest.raises(threading.BrokenBarrierError):
        first.abort()
    everyone.reset()
    abort_together([first, second])
    assert first.aborted and second.aborted


def test_evict_together_closes_cleanly_without_abort():
    comms = [_WaitsForTheOthers(threading.Barrier(1)) for _ in range(2)]
    cache = CommunicatorCache()
    for i, comm in enumerate(comms):
        cache.get_or_create(i, lambda c=comm: c)
    assert cache.evict_together([0, 1], abort=False) == 2
    assert all(c.closed and not c.aborted for c in comms)
