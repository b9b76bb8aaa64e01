"""On a hang, what every thread of this process is doing in the kernel: ``/proc`` only, no
CUDA call (a hung driver call must not hang the dump too). Complements ``faulthandler``, which
shows Python frames but not whether a native call waits on a lock (futex) or on the driver
(ioctl)."""

from __future__ import annotations

import os
import sys
import threading

# x86-64 syscall numbers worth naming in a hang.
_SYSCALLS = {
    0: "read",
    7: "poll",
    16: "ioctl",
    23: "select",
    202: "futex",
    232: "epoll_wait",
    270: "pselect6",
    271: "ppoll",
    281: "epoll_pwait",
    35: "nanosleep",
    230: "clock_nanosleep",
}


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError as exc:
        return f"<{exc.strerror}>"


def dump(out=sys.stderr) -> None:
    """Writes one line per thread: id, name, kernel wait channel and the syscall it is in."""
    lines = [f"--- native threads of pid {os.getpid()}"]
    for tid in sorted(os.listdir("/proc/self/task"), key=int):
        base = f"/proc/self/task/{tid}"
        call = _read(f"{base}/syscall").split()
        name = (
            _SYSCALLS.get(int(call[0]), call[0]) if call and call[0].isdigit() else " ".join(call)
        )
        lines.append(
            f"  {tid:>8} {_read(base + '/comm'):16s} wchan={_read(base + '/wchan'):24s} {name}"
        )
    print("\n".join(lines), file=out, flush=True)


def dump_later(after_s: float) -> threading.Timer:
    """Dumps once after ``after_s`` seconds (a daemon timer; cancel it when done)."""
    timer = threading.Timer(after_s, dump)
    timer.daemon = True
    timer.start()
    return timer
