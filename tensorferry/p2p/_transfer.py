"""``Transfer``: the handle every p2p call returns at once.

A transfer goes through three stages: *submitted* (the call returned), *issued* (headers agreed,
the transport's device work enqueued; a completion event is recorded after it) and *done*
(completed by the runtime's completion pool, with a result or an exception). Its callbacks run
on a completion-pool worker thread, never on the caller's thread or the p2p engine's thread.

Thread-safe: every method may be called from any thread.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import InvalidStateError
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from tensorferry._seconds import checked_seconds
from tensorferry.errors import TransferTimeoutError
from tensorferry.runtime._events import current_stream_wait, recycle, stream_wait
from tensorferry.runtime._spin import spin_until, spin_window_s

__all__ = ["Transfer"]

log = logging.getLogger(__name__)


# Taken around what threads of a transfer must not interleave: an outcome set against a callback
# added, finishing on a library thread against a user's callback added (see Transfer), and the
# making of a latch's lock. Shared by every transfer: each holds it for a few lines that never
# block, and a lock made per transfer (there were four) cost more than all its holds.
_GUARD = threading.RLock()


class _Latch:
    """A one-way flag that threads can block on: ``threading.Event``'s ``set``/``is_set``/
    ``wait`` for a flag that is only ever set, at a fraction of its cost to make: its lock
    (held while unset) is made only when a thread must block on it. Most latches are set before
    anybody waits (every ``tf.send`` makes two), and a waiter polls a while before it blocks."""

    __slots__ = ("_flag", "_lock")

    def __init__(self) -> None:
        self._flag = False
        self._lock: threading.Lock | None = None

    def is_set(self) -> bool:
        return self._flag

    def set(self) -> None:
        if self._flag:
            return
        self._flag = True
        # After the flag: a waiter that made its lock before this read is released here; one
        # that made it after sees the flag when it looks again (Latch.wait).
        if self._lock is not None:
            self._release()

    def wait(self, timeout: float) -> bool:
        if self._flag:
            return True
        lock = self._lock
        if lock is None:
            with _GUARD:
                lock = self._lock
                if lock is None:
                    lock = threading.Lock()
                    lock.acquire()
                    self._lock = lock
        if self._flag:  # set before its setter could see the lock
            return True
        if lock.acquire(timeout=max(0.0, timeout)):
            self._release()  # let the next waiter through too
        return self._flag

    def _release(self) -> None:
        # Two setters, or a setter and a waiter passing it on, may both release: fine.
        # (try/except, not contextlib.suppress: that is an object and two calls per send.)
        try:  # noqa: SIM105
            self._lock.release()  # type: ignore[union-attr]
        except RuntimeError:
            pass


class _Outcome:
    """How a transfer ended (done, or failed with an exception), set once, that threads can
    wait for and be called back on: what :class:`Transfer` needs of
    ``concurrent.futures.Future``, without its condition variable (a :class:`_Latch` instead),
    since every ``tf.send`` makes one. Callbacks run on the thread that sets it, or at once on
    the adder's when it is already set; their exceptions are logged, as a future's are."""

    __slots__ = ("_callbacks", "_exception", "_latch")

    def __init__(self) -> None:
        self._latch = _Latch()
        self._exception: BaseException | None = None
        self._callbacks: list[Callable[[_Outcome], Any]] | None = None  # made by the first

    def done(self) -> bool:
        return self._latch.is_set()

    def set(self, exc: BaseException | None = None) -> None:
        """Done (``exc=None``) or failed with ``exc``.

        Raises:
            concurrent.futures.InvalidStateError: it was set already.
        """
        with _GUARD:  # against a callback being added
            if self._latch.is_set():
                raise InvalidStateError("the outcome is already set")
            self._exception = exc
            self._latch.set()
            callbacks, self._callbacks = self._callbacks, None
        if callbacks:
            for fn in callbacks:
                self._call(fn)

    def add_done_callback(self, fn: Callable[[_Outcome], Any]) -> None:
        with _GUARD:
            if not self._latch.is_set():
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(fn)
                return
        self._call(fn)

    def _call(self, fn: Callable[[_Outcome], Any]) -> None:
        try:
            fn(self)
        except Exception:
            log.exception("a transfer's done callback raised")

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The exception, or ``None``; waits up to ``timeout`` (``None``: for good).

        Raises:
            concurrent.futures.TimeoutError: not set within ``timeout``.
        """
        limit = threading.TIMEOUT_MAX if timeout is None else min(timeout, threading.TIMEOUT_MAX)
        if not self._latch.wait(limit):
            raise FutureTimeout()
        return self._exception


# A wait without its own timeout waits for the transfer's deadline plus this grace, so the
# transfer's own (more precise) error wins over a generic wait timeout.
_GRACE_S = 5.0


class Transfer:
    """A point-to-point transfer in flight (a send, a receive, a sendrecv or a whole batch).

    Stream ordering (CUDA):
        - the transfer's device work runs after all work that was queued on the caller's
          current stream when the call was made (sends read, and receives overwrite, tensors
          the caller may still have been producing or consuming);
        - received tensors are safe to use on *any* stream once :meth:`wait` (or
          :meth:`result`) returned: the data is in device memory;
        - :meth:`wait_stream` is the non-blocking alternative: it makes a stream (the current
          one by default) wait for the transfer on the device, without waiting on the host for
          the transfer itself (only, briefly, for it to be issued).
          Consumers on other streams can do the same, or ``tensor.record_stream(...)`` as usual.

    Attributes:
        description: what is transferred, for messages (``"send 2 tensor(s) to rank 1"``).
    """

    # Class-level defaults of what most transfers set later or never (every tf.send makes
    # one transfer, and each attribute set in __init__ is paid for by all of them):
    _has_callbacks = False
    """Are there user callbacks? Under ``_GUARD`` against finishing on a library thread that
    must not run them (see ``_finish_if_no_callbacks``)."""
    _done_event: Any = None
    """The ``torch.cuda.Event`` recorded after the device work."""
    _ready: Callable[[], bool] | None = None
    """Once issued: a non-blocking "all device/host work finished" predicate. A waiting caller
    polls it itself for a short window (``runtime._spin``) instead of sleeping until the
    completion pool tells it, which costs a thread wake-up or two."""
    _settle: Callable[[], bool] | None = None
    _expedite: Callable[[], None] | None = None
    """Hands the transfer's completion to the completion pool, to poll at once: called before
    a caller blocks on the future (the p2p engine's ``Issuing._watch``)."""
    _seen_ready = False
    _driver: Any = None
    """The p2p engine: a waiting caller drives it (reads the peers' headers, issues) rather than
    sleep until the engine's own thread wakes up to do it."""

    def __init__(
        self, description: str | Callable[[], str], *, deadline: float, value: Any = None
    ) -> None:
        # A function is called when the text is first needed: most transfers never show it.
        self._description = description
        self._deadline = deadline
        self._value = value
        self._outcome = _Outcome()
        self._issued = _Latch()

    @property
    def description(self) -> str:
        text = self._description
        if not isinstance(text, str):
            text = self._description = text()
        return text

    @description.setter
    def description(self, text: str | Callable[[], str]) -> None:
        self._description = text  # a function: called when first shown

    # ------------------------------------------------------------------ futures API
    def done(self) -> bool:
        """True once the transfer finished (successfully or not). Never blocks."""
        return self._outcome.done() or self._settled()

    def wait(self, timeout: float | None = None) -> Transfer:
        """Blocks until the transfer finished; returns ``self``.

        Args:
            timeout: seconds to wait; ``None`` waits until the transfer's own deadline (set by
                the ``timeout`` of the call, default ``TENSORFERRY_TRANSFER_TIMEOUT_S``).

        Raises:
            TransferTimeoutError: not finished within ``timeout`` (the transfer itself goes on
                until its own deadline), or its deadline passed.
            MismatchError, PeerLostError, TransportError: the transfer failed.
        """
        exc = self._wait_exception(timeout)
        if exc is not None:
            raise exc
        return self

    def result(self, timeout: float | None = None) -> Any:
        """Waits like :meth:`wait` and returns what was received: a tensor or a list of tensors
        for ``recv`` (mirroring what was passed), the received list for ``sendrecv``, one entry
        per ``b.recv`` for a batch, ``None`` for a plain ``send``."""
        self.wait(timeout)
        return self._value

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Waits like :meth:`wait` and returns the transfer's exception, or ``None``.

        Raises:
            TransferTimeoutError: not finished within ``timeout``.
        """
        return self._wait_exception(timeout)

    def add_done_callback(self, fn: Callable[[Transfer], Any]) -> None:
        """Calls ``fn(transfer)`` once done, on a completion-pool thread (at once, on this
        thread, if already done). Exceptions from ``fn`` are logged and ignored."""
        with _GUARD:
            self._has_callbacks = True
        # Outside the guard: on a transfer done already, fn runs here and now, and may wait on
        # another transfer, whose completion takes the guard. One that finishes in between
        # finishes as one with callbacks (on a worker): fn then runs here, as it would later.
        self._outcome.add_done_callback(lambda _f: fn(self))
        self._hand_over()  # nobody may poll it: the pool must, without its delay

    # ------------------------------------------------------------------ streams
    def wait_stream(self, stream: Any = None, *, timeout: float | None = None) -> None:
        """Makes ``stream`` (default: the caller's current stream of this rank's CUDA device)
        wait on the device for this transfer. Blocks the host only until the transfer is
        issued.

        For CPU transfers (and transfers that already failed) this is :meth:`wait`.

        Raises:
            TransferTimeoutError: not issued within ``timeout``.
        """
        if not self._wait_issued(self._timeout_left(timeout)):
            raise TransferTimeoutError(f"{self.description}: not issued within the timeout")
        if self._done_event is None or self._outcome.done():
            self.wait(timeout)
            return
        if stream is None:
            # Of the transfer's device, not the thread's current one: a thread the caller
            # started is on device 0 until it says otherwise.
            current_stream_wait(self._driver.ctx.device_index, self._done_event)
        else:
            stream_wait(stream, self._done_event)

    # ------------------------------------------------------------------ internals (p2p layer)
    def _mark_issued(
        self,
        done_event: Any = None,
        ready: Callable[[], bool] | None = None,
        settle: Callable[[], bool] | None = None,
        expedite: Callable[[], None] | None = None,
    ) -> None:
        """``ready``: see ``_ready``; ``settle``: completes the transfer on the thread that saw
        ``ready()`` true (called once, there); ``expedite``: see ``_expedite``."""
        self._done_event = done_event
        self._settle = settle
        self._ready = ready
        self._expedite = expedite
        self._issued.set()
        if self._has_callbacks:
            self._hand_over()

    def _hand_over(self) -> None:
        expedite = self._expedite
        if expedite is not None and not self._outcome.done():
            expedite()

    def _wait_issued(self, limit: float) -> bool:
        """Waits until issued: first driving the engine for a short window, then sleeping until
        another thread issues it. Returns whether it was issued in time."""
        if self._driver is not None and not self._issued.is_set():
            self._drive_while(self._issued.is_set, limit)
        return self._issued.wait(limit)

    def _drive_while(self, done: Callable[[], bool], limit: float) -> bool:
        """Polls ``done()`` for the spin window, or ``limit`` seconds if shorter, driving the
        engine between polls (at least once, even where the window is zero). Returns whether
        ``done()`` turned true."""
        driver = self._driver
        driver.begin_driving()
        try:
            driver.drive()
            return spin_until(done, min(spin_window_s(), limit), idle=driver.drive)
        finally:
            driver.end_driving()

    def _settled(self) -> bool:
        """Finished, or its work is seen finished here (the future follows from the pool)."""
        if self._seen_ready or self._outcome.done():
            return True
        ready = self._ready
        if ready is None:
            return False
        try:
            finished = bool(ready())
        except Exception:  # the completion pool reports the failure properly
            self._ready = None
            return False
        if not finished:
            return False
        settle, self._settle = self._settle, None
        if settle is not None and not settle():
            # Another thread took its completion first (a fault that counted it unfinished,
            # say): its outcome is the transfer's, whatever was seen here. Wait for it.
            self._ready = None
            return self._outcome.done()
        self._seen_ready = True
        return True

    def _finish(self, exc: BaseException | None = None) -> None:
        """Completes the transfer (first call wins). Runs the callbacks on this thread."""
        self._issued.set()
        if not self._outcome.done():
            with contextlib.suppress(InvalidStateError):  # completed by a racing finisher
                self._outcome.set(exc)
        # Done: the engine's closures (they hold its unit, which holds this transfer) are not
        # needed any more. Dropped, nothing of the message is left in a reference cycle for
        # the garbage collector: it is freed at once, and no collection pauses a later call.
        self._ready = self._settle = self._expedite = None

    def _finish_if_no_callbacks(self) -> bool:
        """Completes the transfer successfully here unless user callbacks are registered
        (those must run on a completion-pool worker); returns whether it did. A callback
        added afterwards runs at once on its adder's thread, as for any finished future."""
        with _GUARD:
            if self._has_callbacks:
                return False
            outcome = self._outcome
            if not outcome._latch._flag:
                outcome.set(None)  # runs no callback: none was added
        # The rest outside the guard, which every transfer shares: dropping the closures frees
        # the message (its tensors, objects of the caller's), and nothing of that may run
        # while other threads' transfers wait for the guard.
        self._finish(None)
        return True

    def _timeout_left(self, timeout: float | None) -> float:
        if timeout is not None:
            return checked_seconds(timeout, "timeout", zero_ok=True)
        return max(0.0, self._deadline - time.monotonic()) + _GRACE_S

    def _wait_exception(self, timeout: float | None) -> BaseException | None:
        limit = self._timeout_left(timeout)
        deadline = time.monotonic() + limit
        # Poll (driving the engine) for a short window (runtime._spin) rather than sleep until
        # another thread says so: until issued, then until the device work is seen finished.
        seen = self._driver is not None and self._drive_while(
            lambda: self._issued.is_set() and self._settled(), limit
        )
        if seen and not self._outcome.done():
            return None  # succeeded: seen here before the completion pool got to it
        left = max(0.0, deadline - time.monotonic())
        if (
            self._issued.wait(left)
            and spin_until(self._settled, min(spin_window_s(), left))
            and not self._outcome.done()
        ):
            return None
        self._hand_over()  # about to block on the future: the pool completes it
        try:
            return self._outcome.exception(max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            raise TransferTimeoutError(
                f"{self.description}: not finished within "
                f"{limit if timeout is not None else 'its deadline'}"
                f"{' s' if timeout is not None else ''}"
            ) from None

    def __del__(self) -> None:
        # Nothing can wait on or poll the completion event any more (whatever polls it holds
        # this transfer): it goes back to the pool, to be recorded again.
        event = self._done_event
        if event is not None and self._outcome._latch._flag:  # done (without two calls)
            driver = self._driver
            try:  # noqa: SIM105 (contextlib.suppress: an object and two calls, per message)
                # The device's index from the engine's context: event.device makes an object.
                recycle(event, driver.ctx.device_index if driver is not None else None)
            except Exception:  # at interpreter exit, say
                pass

    def __repr__(self) -> str:
        if not self._outcome.done():
            state = "issued" if self._issued.is_set() else "pending"
        else:
            state = "failed" if self._outcome.exception() is not None else "done"
        return f"Transfer({self.description!r}, {state})"
