"""Bounded busy-polling before a thread sleeps.

A thread that sleeps on a condition, a socket or ``time.sleep`` pays a wake-up when its event
comes: tens of microseconds on bare metal, hundreds on some virtual machines, and
``time.sleep(20e-6)`` itself sleeps at least the kernel's timer slack (~50 µs). The waits on a
transfer's critical path therefore poll for a short, bounded window first
(``TENSORFERRY_SPIN_US``) and only then fall back to sleeping. Between polls the thread yields
the core and the GIL with ``os.sched_yield()`` (under a microsecond), not ``time.sleep(0)``,
which sleeps for the kernel's timer slack (~50 µs on Linux).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from tensorferry import envs

__all__ = ["precise_sleeps", "spin_until", "spin_window_s"]

_PR_SET_TIMERSLACK = 29

_window_s: float | None = None


def spin_window_s() -> float:
    """The process's polling window in seconds (read once; see ``envs.spin_us``)."""
    global _window_s
    if _window_s is None:
        _window_s = envs.spin_us() * 1e-6
    return _window_s


def spin_until(
    ready: Callable[[], bool],
    window_s: float | None = None,
    *,
    idle: Callable[[], object] | None = None,
) -> bool:
    """Polls ``ready()`` for up to ``window_s`` (default: the process's window); returns whether
    it turned true. A zero window checks once. ``idle`` runs between polls (work the waiting
    thread can do meanwhile)."""
    if ready():
        return True
    window = spin_window_s() if window_s is None else window_s
    if window <= 0:
        return False
    end = time.perf_counter() + window
    while time.perf_counter() < end:
        if idle is not None:
            idle()
        os.sched_yield()
        if ready():
            return True
    return False


def precise_sleeps(slack_ns: int = 1000) -> bool:
    """Asks Linux to end this thread's sleeps within ``slack_ns`` of their time (the default
    timer slack is 50 µs, which ``time.sleep(20e-6)`` then overruns by). Only for threads the
    library owns (an actor process's threads); returns whether it took effect."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_TIMERSLACK, ctypes.c_ulong(slack_ns), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
