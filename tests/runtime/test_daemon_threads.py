"""DaemonThreads: calls that may block on another process, never holding up exit."""

from __future__ import annotations

import logging
import threading

import pytest

from tensorferry.runtime._daemon_threads import DaemonThreads


def test_calls_run_on_at_most_max_workers_daemon_threads():
    pool = DaemonThreads(2, "test-daemons")
    release, started, seen = threading.Event(), threading.Semaphore(0), []
    lock = threading.Lock()

    def blocked(i: int) -> None:
        with lock:
            seen.append((i, threading.current_thread().name, threading.current_thread().daemon))
        started.release()
        release.wait(10)

    for i in range(5):
        pool.submit(lambda i=i: blocked(i))
    for _ in range(2):
        assert started.acquire(timeout=10)
    assert not started.acquire(timeout=0.2), "a third call ran while two threads were busy"
    release.set()
    for _ in range(3):
        assert started.acquire(timeout=10)
    assert sorted(i for i, _, _ in seen) == [0, 1, 2, 3, 4]
    assert {name for _, name, _ in seen} <= {"test-daemons_0", "test-daemons_1"}
    assert all(daemon for _, _, daemon in seen)
    pool.shutdown()


def test_an_idle_thread_takes_the_next_call_and_initializer_runs_once_per_thread():
    inits, done = [], threading.Semaphore(0)
    pool = DaemonThreads(4, "test-idle", initializer=lambda: inits.append(1))
    for _ in range(5):  # one at a time: the first thread, idle again, takes each
        pool.submit(done.release)
        assert done.acquire(timeout=10)
    assert len(inits) == 1
    pool.shutdown()


def test_a_failing_call_is_logged_and_the_thread_goes_on(caplog):
    pool = DaemonThreads(1, "test-fail")
    done = threading.Event()

    def fail() -> None:
        raise RuntimeError("boom")

    with caplog.at_level(logging.ERROR, logger="tensorferry.runtime._daemon_threads"):
        pool.submit(fail)
        pool.submit(done.set)
        assert done.wait(10)
    assert any("a call failed" in r.getMessage() for r in caplog.records)
    pool.shutdown()


def test_shutdown_drops_calls_not_started_and_refuses_new_ones():
    pool = DaemonThreads(1, "test-shutdown")
    release, ran = threading.Event(), []
    pool.submit(lambda: release.wait(10))
    pool.submit(lambda: ran.append("dropped"))
    pool.shutdown()
    release.set()
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(lambda: None)
    for thread in threading.enumerate():
        if thread.name.startswith("test-shutdown"):
            thread.join(10)
            assert not thread.is_alive()
    assert ran == []
