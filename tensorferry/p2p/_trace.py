"""The p2p engine's flight recorder: a process's last events with its peers, kept in memory.

A transfer that times out says only that the peer never did its part. Why is in the history of
the pair on both sides: which message each side numbered in which epoch, which headers and
fault notices crossed, when each side moved to a new epoch and when it made the pair's
transport resources. With ``TENSORFERRY_P2P_TRACE=N`` each process keeps its last ``N`` such
events (a bounded ring: old ones fall off) and :func:`recent_events` prints them, oldest first,
with the time and the thread of each. The times are the host's monotonic clock (seconds), the
same in every process of a host: merged and sorted, two ranks' lists show where they parted.

Off by default: each recording site then costs one module attribute read (``ON``).
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

__all__ = ["ON", "configure", "record", "recent_events"]

ON = False
_ring: collections.deque = collections.deque(maxlen=1)


def configure(capacity: int) -> None:
    """Keeps the last ``capacity`` events from now on (0: none, recording stops)."""
    global ON, _ring
    _ring = collections.deque(maxlen=max(1, capacity))
    ON = capacity > 0


def record(event: str, peer: int | None, *details: Any) -> None:
    """Keeps one event (call only where ``ON``): what happened, with which peer rank (``None``
    for several or none), and what identifies it (kinds, numbers, epochs, an error's class)."""
    _ring.append((time.monotonic(), threading.current_thread().name, event, peer, details))


def recent_events(peer: int | None = None) -> list[str]:
    """The kept events, oldest first, one line each (``[monotonic seconds] thread: event rank N:
    details``); with ``peer``, only those with that rank or with no single peer. Empty when
    tracing is off (``TENSORFERRY_P2P_TRACE``)."""
    lines = []
    for when, thread, event, rank, details in list(_ring) if ON else ():
        if peer is not None and rank is not None and rank != peer:
            continue
        who = "" if rank is None else f" rank {rank}"
        text = " ".join(_show(d) for d in details)
        lines.append(f"[{when:.6f}] {thread}: {event}{who}: {text}")
    return lines


def _show(value: Any) -> str:
    if isinstance(value, BaseException):
        return f"{type(value).__name__}({str(value)[:120]!r})"
    return str(value)
