"""Waking a thread that sleeps in ``select`` without handing it the GIL.

``socket.send`` releases the GIL around its syscall. When the write wakes a thread that then
wants the GIL, that thread usually takes it during the syscall and the writer waits until it
lets go: a caller that only meant to queue work pays for the woken thread's whole turn (on the
GPU machine, about half of a ``tf.send`` call's host time). Writing the wake-up byte through
``ctypes.PyDLL`` (which keeps the GIL for the call) lets the caller finish first; the woken
thread runs when the caller next blocks or after the interpreter's switch interval.
"""

from __future__ import annotations

import contextlib
import ctypes
import socket

__all__ = ["write_wakeup"]

try:
    _write = ctypes.PyDLL(None).write  # libc's write(2), called with the GIL held
    _write.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t)
    _write.restype = ctypes.c_ssize_t
except (OSError, AttributeError):  # no libc symbols in this process: fall back
    _write = None


def write_wakeup(sock: socket.socket) -> None:
    """Writes one byte to a non-blocking wake-up socket; a full buffer (a wake-up already
    pending) and a closed socket (shutdown) are fine."""
    if _write is not None:
        fd = sock.fileno()
        if fd >= 0:
            _write(fd, b"x", 1)  # -1 with EAGAIN when full: a wake-up is pending anyway
        return
    with contextlib.suppress(BlockingIOError, OSError):
        sock.send(b"x")
