"""Worker threads for calls that may block on another process, which never hold up its exit.

Making a pair's communicator, or connecting to a peer, is a rendezvous: the call returns once
the peer takes part too, or at its timeout. ``concurrent.futures.ThreadPoolExecutor`` joins its
threads when the interpreter exits, so a process whose peer never came (it stopped sending, or
never reached the transfer) waited at exit for the rendezvous's timeout, minutes by default,
even after ``tf.shutdown()``. These threads are daemons: the process exits at once, and a
rendezvous still waiting ends with it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

__all__ = ["DaemonThreads"]

log = logging.getLogger(__name__)


class DaemonThreads:
    """Up to ``max_workers`` daemon threads running submitted calls, started as needed.

    Args:
        max_workers: most threads at once (calls beyond wait in a queue).
        name: thread-name prefix (shows in stack dumps).
        initializer: run once in each thread before its first call.
    """

    def __init__(
        self, max_workers: int, name: str, initializer: Callable[[], None] | None = None
    ) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self._max = max_workers
        self._name = name
        self._initializer = initializer
        self._calls: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)  # one count per thread waiting for a call
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn: Callable[[], None]) -> None:
        """Runs ``fn()`` on one of the threads; an exception it raises is logged.

        Raises:
            RuntimeError: after :meth:`shutdown`.
        """
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self._name}: shut down")
            self._calls.put(fn)
            if self._idle.acquire(blocking=False) or len(self._threads) >= self._max:
                return  # an idle thread, or the next one to finish, takes it
            thread = threading.Thread(
                target=self._work, name=f"{self._name}_{len(self._threads)}", daemon=True
            )
            self._threads.append(thread)
        thread.start()

    def shutdown(self, wait_s: float = 0.0) -> None:
        """Takes no more calls, drops those not started, and lets idle threads end. Calls
        running go on (they may be waiting for a peer) and end with their rendezvous.

        ``wait_s``: how long to wait, at most, for the threads to end. A call that ends soon
        (a store request, a wait told to stop) then returns before the process may exit: a
        daemon thread still inside native code when the interpreter finalizes aborts the
        process ("terminate called without an active exception")."""
        with self._lock:
            self._closed = True
            while True:
                try:
                    self._calls.get_nowait()
                except queue.Empty:
                    break
            for _ in self._threads:
                self._calls.put(None)
            threads = list(self._threads)
        deadline = time.monotonic() + wait_s
        for thread in threads:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if thread is not threading.current_thread():
                thread.join(left)

    def _work(self) -> None:
        if self._initializer is not None:
            try:
                self._initializer()
            except Exception:
                log.exception("%s: the thread initializer failed", self._name)
        while True:
            fn = self._calls.get()
            if fn is None:
                return
            try:
                fn()
            except BaseException:
                log.exception("%s: a call failed", self._name)
            del fn  # nothing of the call stays alive while the thread waits
            self._idle.release()
