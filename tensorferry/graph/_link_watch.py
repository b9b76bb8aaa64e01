"""Aborting a GPU actor's NCCL links when its own thread cannot: the link watch.

With overlap, an actor's compute stream waits on the device for a receive and the actor's
thread goes on into the method that uses it. A stream takes about a thousand kernels behind
one that waits (1021 on an H100); the next launch waits for room inside the launching
call. When the receive never ends (its sender was killed with the
send still queued behind its own compute), a method that launches more than that keeps the
actor's thread inside a launch for good: it never reaches a wait that would see the graph end,
nor closes its links, and aborting the links is what ends the receive. Teardown then had to
kill the actor, even with ``kill_actors=False``.

The watch looks at the graph's control block from a thread of its own. When an actor died it
aborts the links at once (the actor's thread would not wait for its GPU work then either);
when teardown asked every loop to end, or the driver is gone, it gives the actor's thread
``drain_s`` to close the links itself first, as closing gives the GPU work that long. The
actor's thread gets its launch back, its next transfer finds the links closed, and its loop
ends as the graph's end would have ended it (see ``ScheduleRunner.run``).

Only links whose ``close`` may run on any thread take part: ``DirectNcclLink`` (NCCL's abort
is made for a communicator an operation hangs on) and ``TorchNcclLink``, the fallback through
``ProcessGroupNCCL`` (aborting the group aborts its communicators; the aborted group is kept
alive so that its destructor, which waits for torch's watchdog thread, does not run here). The
``ce``/``nvlink`` links of the p2p layer see a lost peer and fail its transfers themselves.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["LinkWatch"]

log = logging.getLogger(__name__)

# How often (seconds) the watch reads the control block: a read of shared memory.
_LOOK_S = 0.05


class LinkWatch:
    """Watches ``control`` (``dead_index()``, ``stopped``, ``driver_gone``) and calls
    ``abort`` once, from its own thread, when the graph ends and the actor's thread has not
    called :meth:`finish` (after ``drain_s`` for a stop; at once for a death)."""

    def __init__(
        self, control: Any, abort: Callable[[], None], *, drain_s: float, what: str
    ) -> None:
        self._control = control
        self._abort = abort
        self._drain_s = drain_s
        self._what = what
        self._finished = threading.Event()
        self.fired = False
        """Whether the watch aborted the links (read by the actor's thread afterwards)."""
        self._thread = threading.Thread(target=self._run, name="tf-link-watch", daemon=True)
        self._thread.start()

    def finish(self) -> None:
        """The actor's thread closes the links itself: the watch ends (after its abort, if it
        is aborting now)."""
        self._finished.set()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        ending_since = None
        while not self._finished.wait(_LOOK_S):
            control = self._control
            if control.dead_index() is not None:
                # As the actor's thread would, were it free: no wait for the GPU work.
                log.info("%s: an actor of the graph died: aborting the NCCL links", self._what)
            elif control.stopped or control.driver_gone:
                now = time.monotonic()
                if ending_since is None:
                    ending_since = now
                if now - ending_since < self._drain_s:
                    continue
                log.warning(
                    "%s: the graph ends and the actor's loop has not closed its NCCL links "
                    "within %.1f s (a method held up behind a receive that never ends?): "
                    "aborting them from the link watch",
                    self._what,
                    self._drain_s,
                )
            else:
                continue
            self.fired = True
            try:
                self._abort()
            except Exception:
                log.warning("%s: the link watch's abort failed", self._what, exc_info=True)
            return
