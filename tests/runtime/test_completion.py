"""Completion pool: futures fulfilled off the caller's thread."""

from __future__ import annotations

import threading
import time
from concurrent.futures import CancelledError

import pytest

import tensorferry as tf
from tensorferry.runtime import CompletionPool


@pytest.fixture
def pool():
    pool = CompletionPool(threads=2)
    yield pool
    pool.shutdown(wait=False)


class Flag:
    """A readiness predicate the test flips, like a device event firing."""

    def __init__(self) -> None:
        self.value = False

    def __call__(self) -> bool:
        return self.value


def test_result_arrives_when_ready(pool):
    flag = Flag()
    future = pool.watch(flag, then=lambda: 42)
    time.sleep(0.02)
    assert not future.done(), "not ready, not done"
    flag.value = True
    assert future.result(timeout=5) == 42
    assert future.exception() is None


def test_callbacks_run_on_a_pool_thread(pool):
    caller = threading.get_ident()
    seen: list[int] = []
    done = threading.Event()
    flag = Flag()
    future = pool.watch(flag)
    future.add_done_callback(lambda _f: (seen.append(threading.get_ident()), done.set()))
    flag.value = True
    assert done.wait(5)
    assert seen and seen[0] != caller


def test_watch_returns_without_blocking(pool):
    start = time.perf_counter()
    for _ in range(100):
        pool.watch(lambda: False, timeout=5)
    assert time.perf_counter() - start < 1.0


def test_errors_propagate_from_predicate_and_result(pool):
    def broken() -> bool:
        raise RuntimeError("device fault")

    with pytest.raises(RuntimeError, match="device fault"):
        pool.watch(broken).result(timeout=5)

    def bad_result() -> None:
        raise ValueError("unpack failed")

    future = pool.watch(lambda: True, then=bad_result)
    assert isinstance(future.exception(timeout=5), ValueError)


def test_timeout_is_a_named_error(pool):
    future = pool.watch(lambda: False, timeout=0.05, description="recv from rank 1")
    with pytest.raises(tf.TransferTimeoutError, match="recv from rank 1"):
        future.result(timeout=5)


def test_timeouts_and_delays_that_could_never_end_are_refused(pool):
    # NaN never compared past a deadline: its item stayed pending for good.
    for bad, error in ((float("nan"), ValueError), (float("inf"), ValueError), ("1", TypeError)):
        with pytest.raises(error, match="timeout must be"):
            pool.watch(lambda: False, timeout=bad)
        with pytest.raises(error, match="delay must be"):
            pool.watch(lambda: False, delay=bad)
    assert pool.pending() == 0
    assert pool.watch(lambda: True, timeout=1).result(5) is None
    assert pool.watch(lambda: True, timeout=2, delay=0).result(5) is None  # ints are seconds too


def test_a_raising_callback_does_not_stop_the_pool(pool):
    first = pool.watch(lambda: True)
    first.add_done_callback(lambda _f: 1 / 0)
    first.result(timeout=5)
    assert pool.watch(lambda: True, then=lambda: "still working").result(timeout=5) == (
        "still working"
    )


def test_user_cancel_drops_the_item(pool):
    future = pool.watch(lambda: False)
    assert future.cancel()
    with pytest.raises(CancelledError):
        future.result(timeout=1)
    deadline = time.monotonic() + 5
    while pool.pending() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.pending() == 0


def test_drain_waits_for_owner_only(pool):
    gate = threading.Event()
    mine = pool.watch(lambda: True, then=lambda: gate.wait(5), owner="stream-a")
    other = pool.watch(lambda: False, owner="stream-b")
    threading.Timer(0.05, gate.set).start()
    assert pool.drain("stream-a", timeout=5)
    assert mine.done()
    assert not other.done()
    assert pool.pending("stream-b") == 1


def test_shutdown_fails_pending_with_a_clear_error():
    pool = CompletionPool(threads=1)
    ready_soon = Flag()
    drained = pool.watch(ready_soon, then=lambda: "drained")
    threading.Timer(0.05, setattr, (ready_soon, "value", True)).start()
    never = pool.watch(lambda: False)
    pool.shutdown(wait=True, timeout=0.5)
    assert drained.result(timeout=1) == "drained"
    with pytest.raises(tf.CompletionPoolShutdownError, match="shut down"):
        never.result(timeout=1)
    with pytest.raises(tf.CompletionPoolShutdownError):
        pool.watch(lambda: True)
    pool.shutdown()  # idempotent


def test_shutdown_without_wait_cancels_everything():
    pool = CompletionPool(threads=1)
    futures = [pool.watch(lambda: False) for _ in range(10)]
    pool.shutdown(wait=False)
    for future in futures:
        assert isinstance(future.exception(timeout=1), tf.CompletionPoolShutdownError)


def test_many_concurrent_items(pool):
    flags = [Flag() for _ in range(500)]
    futures = [pool.watch(f, then=lambda i=i: i) for i, f in enumerate(flags)]
    for f in reversed(flags):
        f.value = True
    assert [f.result(timeout=10) for f in futures] == list(range(500))


def test_bad_thread_count():
    with pytest.raises(ValueError, match="threads"):
        CompletionPool(threads=0)


def test_inline_completion_runs_its_callbacks_on_the_poller(pool):
    flag = Flag()
    ran_on = []
    future = pool.watch(flag, inline=True, owner="stream-x")
    future.add_done_callback(lambda _f: ran_on.append(threading.current_thread().name))
    flag.value = True
    assert future.result(timeout=5) is None
    assert pool.drain("stream-x", 5), "an inline item still counts for its owner until done"
    assert ran_on == [f"{pool._poller.name}"]
    failing = pool.watch(lambda: 1 / 0, inline=True)
    with pytest.raises(ZeroDivisionError):
        failing.result(timeout=5)
    with pytest.raises(ValueError, match="inline"):
        pool.watch(flag, inline=True, then=lambda: 1)


def test_discard_takes_an_item_back_before_the_pool_completes_it(pool):
    flag = Flag()
    future = pool.watch(flag, owner="stream-y")
    assert pool.discard(future), "still pending: the caller may take it back"
    assert pool.pending("stream-y") == 0 and pool.drain("stream-y", 0.1)
    flag.value = True
    time.sleep(0.05)
    assert not future.done(), "discarded: the pool never completes it"
    assert not pool.discard(future), "a second discard finds nothing"
    done = pool.watch(lambda: True)
    assert done.result(timeout=5) is None
    assert not pool.discard(done), "too late once the pool completed it"
    from concurrent.futures import Future

    assert not pool.discard(Future()), "a future the pool never made"


def test_delayed_item_is_not_polled_before_it_is_due(pool):
    polls: list[float] = []

    def ready() -> bool:
        polls.append(time.monotonic())
        return True

    start = time.monotonic()
    future = pool.watch(ready, delay=0.2)
    other = pool.watch(lambda: True)  # an undelayed item still completes at once
    assert other.result(timeout=5) is None
    assert not future.done() and not polls, "polled before it was due"
    assert future.result(timeout=5) is None
    assert polls and polls[0] - start >= 0.2
    # The poller went idle in between: a delayed item still wakes it when due.
    time.sleep(0.05)
    late = pool.watch(lambda: True, delay=0.05)
    assert late.result(timeout=5) is None


def _count_wake_ups(pool: CompletionPool) -> list[int]:
    """Counts the poller's wake-up calls from now on."""
    calls = [0]
    notify_all = pool._lock.notify_all

    def counting() -> None:
        calls[0] += 1
        notify_all()

    pool._lock.notify_all = counting
    return calls


def _wait_until(predicate, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(1e-3)
    return False


def test_a_lingering_poller_takes_delayed_items_without_being_woken(pool):
    # The first delayed item finds the poller asleep until told: it wakes it.
    assert pool.watch(lambda: True, delay=1e-3, inline=True).result(timeout=5) is None
    assert _wait_until(lambda: pool._lingering), "after a delayed item the poller lingers"
    wake_ups = _count_wake_ups(pool)
    flag = Flag()
    future = pool.watch(flag, delay=1e-4, inline=True)
    assert wake_ups[0] == 0, "a lingering poller is not woken for a delayed item"
    flag.value = True
    assert future.result(timeout=5) is None, "it is polled at the next tick"


def test_expedite_hands_a_delayed_item_to_the_poller_now(pool, monkeypatch):
    from tensorferry.runtime import _completion

    monkeypatch.setattr(_completion, "_LINGER_TICK_S", 30.0)  # ticks too slow to matter
    assert pool.watch(lambda: True, delay=1e-3, inline=True).result(timeout=5) is None
    assert _wait_until(lambda: pool._lingering)
    flag = Flag()
    flag.value = True
    future = pool.watch(flag, delay=1e-4, inline=True)
    time.sleep(0.05)
    assert not future.done(), "without a hand-over the poller would look only at its tick"
    pool.expedite(future)
    assert future.result(timeout=5) is None
    pool.expedite(future)  # done already: nothing happens


def test_the_poller_stops_lingering_when_delayed_items_stop(pool, monkeypatch):
    from tensorferry.runtime import _completion

    monkeypatch.setattr(_completion, "_LINGER_S", 0.05)
    assert pool.watch(lambda: True, delay=1e-3).result(timeout=5) is None
    assert _wait_until(lambda: pool._poller_wakes_at == float("inf")), (
        "once the linger is over the poller sleeps until an item tells it"
    )
    assert not pool._lingering
    assert pool.watch(lambda: True, delay=1e-3).result(timeout=5) is None  # and still wakes


class Outcomes:
    """``call_when``'s function: records what it was called with, and on which thread."""

    def __init__(self) -> None:
        self.calls: list[tuple[BaseException | None, str]] = []
        self.called = threading.Event()

    def __call__(self, exc: BaseException | None) -> None:
        self.calls.append((exc, threading.current_thread().name))
        self.called.set()

    def only(self) -> BaseException | None:
        assert self.called.wait(5), "never called"
        time.sleep(0.02)  # a second call would show up by now
        assert len(self.calls) == 1, self.calls
        return self.calls[0][0]


def _call_when(pool, ready, *, deadline_s: float = 30.0, delay: float = 0.0):
    outcomes = Outcomes()
    handle = pool.call_when(ready, outcomes, deadline=time.monotonic() + deadline_s, delay=delay)
    return handle, outcomes


def test_a_call_runs_once_on_the_poller_when_ready(pool):
    flag = Flag()
    _, outcomes = _call_when(pool, flag)
    time.sleep(0.05)
    assert not outcomes.calls, "called before its predicate said ready"
    flag.value = True
    assert outcomes.only() is None
    assert outcomes.calls[0][1] == pool._poller.name


def test_a_call_is_told_why_it_failed(pool):
    _, raised = _call_when(pool, lambda: 1 / 0)
    assert isinstance(raised.only(), ZeroDivisionError)
    _, late = _call_when(pool, lambda: False, deadline_s=0.05)
    exc = late.only()
    assert isinstance(exc, tf.TransferTimeoutError) and "timed out" in str(exc)


def test_a_call_taken_back_is_never_made(pool):
    flag = Flag()
    handle, outcomes = _call_when(pool, flag)
    assert pool.discard(handle), "still pending: the caller may take it back"
    assert not pool.discard(handle), "a second discard finds nothing"
    flag.value = True
    time.sleep(0.05)
    assert not outcomes.calls and pool.pending() == 0
    done, made = _call_when(pool, lambda: True)
    assert made.only() is None
    assert not pool.discard(done), "too late once the pool made it"


def test_an_expedited_call_is_polled_before_its_delay(pool, monkeypatch):
    from tensorferry.runtime import _completion

    monkeypatch.setattr(_completion, "_LINGER_TICK_S", 30.0)  # ticks too slow to matter
    assert pool.watch(lambda: True, delay=1e-3, inline=True).result(timeout=5) is None
    assert _wait_until(lambda: pool._lingering)
    handle, outcomes = _call_when(pool, lambda: True, delay=30.0)
    time.sleep(0.05)
    assert not outcomes.calls, "polled before it was due"
    pool.expedite(handle)
    assert outcomes.only() is None


def test_a_call_still_pending_at_shutdown_is_told(pool):
    _, outcomes = _call_when(pool, lambda: False)
    pool.shutdown(wait=False)
    assert isinstance(outcomes.only(), tf.CompletionPoolShutdownError)
    with pytest.raises(tf.CompletionPoolShutdownError):
        _call_when(pool, lambda: True)


class _Sweeper:
    """Work the poller takes at its turns (CompletionPool.add_sweeper): counts its sweeps."""

    def __init__(self) -> None:
        self.work: list[int] = []
        self.taken: list[int] = []
        self.sweeps = 0
        self.holds = False  # leaves its work where it is

    def held(self) -> int:
        return len(self.work)

    def has_work(self) -> bool:
        return bool(self.work)

    def sweep(self) -> None:
        self.sweeps += 1
        while self.work and not self.holds:
            self.taken.append(self.work.pop())


def test_a_sweeper_is_asked_at_the_pollers_turns_and_a_nudge_wakes_it_from_its_sleep(
    pool, monkeypatch
):
    from tensorferry.runtime import _completion

    monkeypatch.setattr(_completion, "_LINGER_S", 0.05)
    sweeper = _Sweeper()
    pool.add_sweeper(sweeper)
    # Nothing pending, no work: the poller sleeps until told.
    assert _wait_until(lambda: pool._poller_wakes_at == float("inf"))
    time.sleep(0.05)  # (it marks its sleep so a moment before it asks the sweepers)
    sweeps = sweeper.sweeps
    sweeper.work.append(1)
    time.sleep(0.1)
    assert sweeper.taken == [] and sweeper.sweeps == sweeps  # not told: still asleep
    pool.nudge()
    assert _wait_until(lambda: sweeper.taken == [1])
    # While a sweeper has work, the poller asks it again every tick, told or not.
    sweeper.holds = True
    sweeper.work.append(2)
    pool.nudge()
    sweeps = sweeper.sweeps
    assert _wait_until(lambda: sweeper.sweeps >= sweeps + 5)
    sweeper.holds = False
    assert _wait_until(lambda: sweeper.taken == [1, 2])
    pool.remove_sweeper(sweeper)
    sweeper.work.append(99)
    pool.nudge()
    time.sleep(0.05)
    assert 99 not in sweeper.taken  # removed: never asked again


def test_the_waiting_hint_counts_what_the_sweepers_hold_back(pool):
    # What a sweeper keeps from the pool is in flight all the same: the hint is how the p2p
    # layer judges whether a launch may find the device's queue full (few_in_flight).
    _call_when(pool, lambda: False)
    assert pool.waiting_hint() == 1
    sweeper = _Sweeper()
    sweeper.holds = True
    sweeper.work.extend(range(5))
    pool.add_sweeper(sweeper)
    assert pool.waiting_hint() == 6
    other = _Sweeper()
    other.holds = True
    other.work.append(7)
    pool.add_sweeper(other)
    assert pool.waiting_hint() == 7
    pool.remove_sweeper(sweeper)
    assert pool.waiting_hint() == 2


def test_a_sweeper_that_fails_is_logged_and_the_pool_goes_on(pool, caplog):
    class Broken:
        def held(self) -> int:
            return 0

        def has_work(self) -> bool:
            return False

        def sweep(self) -> None:
            raise RuntimeError("a sweeper that fails (on purpose)")

    pool.add_sweeper(Broken())
    _, outcomes = _call_when(pool, lambda: True)
    assert outcomes.only() is None
    assert "a sweeper failed" in caplog.text
