"""Bounded busy-polling (runtime._spin)."""

from __future__ import annotations

import threading
import time

from tensorferry.runtime._spin import spin_until


def test_zero_window_checks_once():
    calls = []
    assert not spin_until(lambda: calls.append(1) and False, 0.0)
    assert len(calls) == 1
    assert spin_until(lambda: True, 0.0)


def test_polls_until_ready_within_the_window_and_runs_idle():
    flag = threading.Event()
    threading.Timer(0.01, flag.set).start()
    idle = []
    start = time.perf_counter()
    assert spin_until(flag.is_set, 2.0, idle=lambda: idle.append(1))
    assert time.perf_counter() - start < 1.0
    assert idle, "idle work runs between polls"


def test_gives_up_after_the_window():
    start = time.perf_counter()
    assert not spin_until(lambda: False, 0.02)
    assert 0.02 <= time.perf_counter() - start < 1.0


def test_precise_sleeps_shortens_short_sleeps_on_linux():
    import sys
    import threading

    import pytest

    from tensorferry.runtime._spin import precise_sleeps

    if not sys.platform.startswith("linux"):
        pytest.skip("timer slack is a Linux setting")
    result = {}

    def in_a_thread() -> None:  # timer slack is per thread: keep the test runner's as it is
        result["ok"] = precise_sleeps(1000)
        import ctypes

        libc = ctypes.CDLL(None)
        result["slack"] = libc.prctl(30, 0, 0, 0, 0)  # PR_GET_TIMERSLACK

    thread = threading.Thread(target=in_a_thread)
    thread.start()
    thread.join()
    assert result == {"ok": True, "slack": 1000}
