"""The completion pool: futures fulfilled off the caller's thread when device work finishes.

A caller hands over a readiness predicate (``event.query``, ``work.is_completed``) and gets a
``concurrent.futures.Future`` back at once. One poller thread checks the predicates; when one
turns true the result function and the future's callbacks run on a worker thread, never on the
thread that asked and never on the poller, so a slow callback cannot delay other completions.

Each item may name an *owner* (a stream). ``drain(owner)`` waits until every item of that owner
has completed and its callbacks have returned, and cancels what is left after the timeout: the
stream pool calls it before a stream changes hands, so no callback of the last owner can run
while the next owner holds the stream.

Delayed items (``watch(delay=...)``): work whose caller usually sees it finish first and
discards it. The poller must not wake up for each of them: on a busy host that wake-up takes the
GIL in the middle of the caller's next call (two per transfer, at ``watch`` and at ``due``,
were most of what other threads did during a ping-pong). So after its last item the poller
*lingers*: it looks again every ``_LINGER_TICK_S`` for a while instead of sleeping until told,
and a delayed item that arrives meanwhile wakes nobody; it is polled at the next tick. A caller
that stops waiting for its item itself hands it over with :meth:`expedite`. Only after
``_LINGER_S`` without delayed items does the poller sleep until the next item tells it.

Sweepers (:meth:`add_sweeper`): a user of the pool whose work usually finishes under its
caller's own eyes may keep it to itself and hand the pool only what is still unfinished a
moment later. The poller asks each sweeper at every turn (``sweep()``, without the pool's
lock), lingers while any has work (``has_work()``), and is woken by :meth:`nudge` from a sleep
with no end. The p2p engine keeps its issued transfers so: adding each to the pool was most of
what completing it cost the caller's call.

Thread-safe: every method may be called from any thread.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from tensorferry._seconds import checked_seconds
from tensorferry.errors import CompletionPoolShutdownError, TransferTimeoutError

__all__ = ["CompletionPool"]

log = logging.getLogger(__name__)

# Poll back-off: start fine so short transfers complete with little added latency, grow coarse so
# a long wait costs (almost) no CPU. Numbers are seconds.
_POLL_MIN_S = 20e-6
_POLL_MAX_S = 2e-4
# While delayed items keep coming, the idle poller looks every tick, for this long after the
# last one (see the module docstring).
_LINGER_TICK_S = 2e-3
_LINGER_S = 0.2
# When a poller that sleeps until told wakes (its _poller_wakes_at).
_UNTIL_TOLD = float("inf")


class _Item:
    """One watched predicate. A plain class rather than a dataclass: every ``tf.send`` makes
    one, and the generated ``__init__`` with keyword defaults cost a third more."""

    __slots__ = (
        "deadline",
        "description",
        "due",
        "future",
        "inline",
        "on_done",
        "owner",
        "ready",
        "seq",
        "then",
    )

    def __init__(
        self,
        future: Future | None,  # None for a call (see CompletionPool.call_when)
        ready: Callable[[], bool],
        then: Callable[[], Any] | None,
        owner: Hashable | None,
        description: str,
        deadline: float | None,
        inline: bool = False,
        on_done: Callable[[BaseException | None], Any] | None = None,  # a call's function
    ) -> None:
        self.future = future
        self.ready = ready
        self.then = then
        self.owner = owner
        self.description = description
        self.deadline = deadline
        self.seq = 0
        self.inline = inline
        self.due = 0.0  # monotonic time of the first poll
        self.on_done = on_done


class CompletionPool:
    """Fulfils futures when their readiness predicate turns true.

    Args:
        threads: worker threads that run result functions and future callbacks.
        name: thread-name prefix (shows in stack dumps).
    """

    def __init__(self, *, threads: int = 4, name: str = "tensorferry-completion") -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self._name = name
        # The condition's own lock, also taken bare where nobody is notified or waited for
        # (adding and discarding items: a Condition's Python-level enter and exit cost a
        # tenth of what adding one does).
        self._mutex = threading.RLock()  # what Condition() makes by default
        self._lock = threading.Condition(self._mutex)
        self._pending: dict[int, _Item] = {}
        self._running_per_owner: dict[Hashable, int] = {}
        self._seq = itertools.count()
        self._shutdown = False
        # When the poller looks at its items next at the latest (inf: only when told); a new
        # item due before then wakes it.
        self._poller_wakes_at = 0.0
        # Monotonic time of the last delayed item; the poller lingers until _LINGER_S after it.
        self._last_delayed = float("-inf")
        # True while the poller sleeps one linger tick with nothing pending.
        self._lingering = False
        # Asked by the poller at every turn (see add_sweeper); replaced, never changed in place,
        # so the poller reads it without the lock.
        self._sweepers: tuple[Any, ...] = ()
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name)
        self._poller = threading.Thread(target=self._poll_loop, name=f"{name}-poller", daemon=True)
        self._poller.start()

    # ------------------------------------------------------------------ submitting
    def watch(
        self,
        ready: Callable[[], bool],
        *,
        then: Callable[[], Any] | None = None,
        owner: Hashable | None = None,
        timeout: float | None = None,
        description: str = "",
        inline: bool = False,
        delay: float = 0.0,
    ) -> Future:
        """Returns a future completed once ``ready()`` returns true.

        Args:
            ready: cheap, non-blocking predicate, polled from the pool's poller thread. If it
                raises, the future fails with that exception.
            then: computes the future's result once ready (runs on a worker thread); the
                result is ``None`` without it. Its exception becomes the future's.
            owner: the resource the work runs on (a stream); see :meth:`drain`.
            timeout: seconds until the future fails with :class:`TransferTimeoutError`.
            description: what is awaited, used in timeout messages.
            inline: complete the future on the poller thread itself, saving a worker's
                wake-up. Only for futures whose callbacks are the library's own: quick, never
                blocking, never user code (they delay every other completion while they run).
                Not with ``then``.
            delay: seconds before the first poll: for work whose caller usually sees it finish
                first (and :meth:`discard` s it), so the poller thread neither polls it nor
                wakes up for it, and takes no turn at the GIL meanwhile. A lingering poller
                (see the module docstring) polls it at its next tick, up to
                ``_LINGER_TICK_S`` after ``delay``; a caller that gives up waiting for it
                calls :meth:`expedite`.

        Raises:
            CompletionPoolShutdownError: the pool was shut down.
        """
        if inline and then is not None:
            raise ValueError("inline completion takes no `then` (it would run on the poller)")
        # NaN would never time out, infinity overflows a wait: both refused (quick for floats).
        if timeout is not None:
            timeout = checked_seconds(timeout, "timeout", zero_ok=True)
        delay = checked_seconds(delay, "delay", zero_ok=True)
        future: Future = Future()
        deadline = None if timeout is None else time.monotonic() + timeout
        item = _Item(future, ready, then, owner, description, deadline, inline=inline)
        future._tensorferry_seq = self._add(item, delay)  # type: ignore[attr-defined]  # discard()
        return future

    def call_when(
        self,
        ready: Callable[[], bool],
        on_done: Callable[[BaseException | None], Any],
        *,
        deadline: float,
        delay: float,
    ) -> Any:
        """:meth:`watch` with ``inline=True`` for the library's own per-transfer work, without
        a future: ``on_done(None)`` once ``ready()`` is true, or ``on_done(exc)`` when it
        raised, the monotonic ``deadline`` passed (:class:`TransferTimeoutError`) or the pool
        shut down. Called once, on the poller thread: quick, never blocking, never user code.
        Returns a handle for :meth:`discard` and :meth:`expedite`.

        A ``Future`` and its condition variable are most of what a watch costs the caller, and
        every ``tf.send`` makes one; its callers give ``deadline`` and ``delay`` (seconds)
        already checked.

        Raises:
            CompletionPoolShutdownError: the pool was shut down.
        """
        item = _Item(None, ready, None, None, "", deadline, True, on_done)
        self._add(item, delay)
        return item

    def _add(self, item: _Item, delay: float) -> int:
        """Numbers ``item``, makes it due in ``delay`` seconds and hands it to the poller, waking
        it only where it must; returns its number.

        Raises:
            CompletionPoolShutdownError: the pool was shut down.
        """
        with self._mutex:  # the condition's lock (notify_all below needs it held)
            if self._shutdown:
                raise CompletionPoolShutdownError("the completion pool is shut down")
            item.seq = seq = next(self._seq)
            item.due = due = time.monotonic() + delay
            self._pending[seq] = item
            if item.owner is not None:
                self._running_per_owner[item.owner] = self._running_per_owner.get(item.owner, 0) + 1
            if delay > 0:
                self._last_delayed = due - delay
                if self._lingering:
                    return seq  # polled at the poller's next tick
            if due < self._poller_wakes_at:
                self._lock.notify_all()
        return seq

    def _pending_item(self, handle: Any) -> _Item | None:
        """The pending item of ``handle`` (a future :meth:`watch` returned, or a handle of
        :meth:`call_when`), or ``None``; under the lock."""
        if type(handle) is _Item:
            return handle if self._pending.get(handle.seq) is handle else None
        seq = getattr(handle, "_tensorferry_seq", None)
        item = self._pending.get(seq) if seq is not None else None
        return item if item is not None and item.future is handle else None

    def expedite(self, future: Any) -> None:
        """Polls the item of ``future`` (or of a :meth:`call_when` handle) from now on, as if it
        had been watched without a delay: for a caller that stops polling it itself and will
        block on it."""
        with self._lock:
            item = self._pending_item(future)
            if item is None:
                return
            now = time.monotonic()
            if item.due > now:
                item.due = now
            if item.due < self._poller_wakes_at:
                self._lock.notify_all()

    def after_event(
        self,
        event: Any,
        *,
        then: Callable[[], Any] | None = None,
        owner: Hashable | None = None,
        timeout: float | None = None,
        description: str = "",
    ) -> Future:
        """Returns a future completed when a recorded device event (``event.query()``) fires."""
        return self.watch(
            event.query, then=then, owner=owner, timeout=timeout, description=description
        )

    # ------------------------------------------------------------------ sweepers
    def add_sweeper(self, sweeper: Any) -> None:
        """Asks ``sweeper`` at every turn of the poller: ``sweeper.sweep()`` (without the pool's
        lock; it may watch items), and ``sweeper.has_work()`` (under it: quick, taking no other
        lock) to keep the poller looking every ``_LINGER_TICK_S`` while it has work. Whoever
        gives a sweeper work calls :meth:`nudge` after. ``sweeper.held()``: how many unfinished
        items it keeps from the pool now (quick, no lock), counted by :meth:`waiting_hint`."""
        with self._lock:
            self._sweepers = (*self._sweepers, sweeper)
            self._lock.notify_all()

    def remove_sweeper(self, sweeper: Any) -> None:
        with self._lock:
            self._sweepers = tuple(s for s in self._sweepers if s is not sweeper)

    def nudge(self) -> None:
        """Wakes the poller where it sleeps until told: a sweeper has work (see
        :meth:`add_sweeper`). Called after the work was added: the poller marks its sleep with
        no end before it asks the sweepers whether they have any, so one of the two sees the
        other."""
        if self._poller_wakes_at == _UNTIL_TOLD:
            with self._lock:
                self._lock.notify_all()

    def _sweep(self) -> None:
        for sweeper in self._sweepers:
            try:
                sweeper.sweep()
            except Exception:
                log.exception("completion pool: a sweeper failed")

    def _sweepers_have_work(self) -> bool:
        for sweeper in self._sweepers:  # noqa: SIM110 (a loop: polled every turn)
            if sweeper.has_work():
                return True
        return False

    # ------------------------------------------------------------------ owners
    def pending(self, owner: Hashable | None = None) -> int:
        """Items of ``owner`` not yet finished (callbacks included), or all items still waiting."""
        with self._lock:
            if owner is None:
                return len(self._pending)
            return self._running_per_owner.get(owner, 0)

    def waiting_hint(self) -> int:
        """How many items wait to finish, read without the lock: a hint, stale by the items
        added or finished meanwhile on other threads. Counts those the sweepers keep to
        themselves for now (``sweeper.held()``): a burst of sends nobody waits for is
        hundreds of them before the first sweep."""
        count = len(self._pending)
        for sweeper in self._sweepers:
            count += sweeper.held()
        return count

    def has_owners_in_flight(self) -> bool:
        """Whether any owned item is in flight (a lock-free hint: a false answer may be stale
        only for items submitted concurrently, which their owner cannot be releasing)."""
        return bool(self._running_per_owner)

    def owners_in_flight(self, owners: list[Hashable]) -> set[Hashable]:
        """Those of ``owners`` that still have items in flight (one lock for all of them)."""
        with self._lock:
            running = self._running_per_owner
            return {owner for owner in owners if owner in running} if running else set()

    def discard(self, future: Any) -> bool:
        """Stops watching ``future`` (or a :meth:`call_when` handle) before the pool completes
        it: the caller saw the work finish and completes it itself. Returns false when it is
        too late (the pool already took it, or it was never this pool's); the pool then
        completes it as usual."""
        with self._mutex:  # the condition's lock (as in _add)
            item = self._pending_item(future)
            if item is None:
                return False
            del self._pending[item.seq]
            self._finish_locked(item)
            return True

    def drain(self, owner: Hashable, timeout: float) -> bool:
        """Waits until every item of ``owner`` finished and its callbacks returned.

        Items still waiting for their device work after ``timeout`` are cancelled (their futures
        raise ``CancelledError``). Returns true when nothing of ``owner`` is left in flight; false
        when a result function or callback is still running (the caller must then not hand the
        owner to anyone else).
        """
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._running_per_owner.get(owner, 0) > 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._lock.wait(left)
            if self._running_per_owner.get(owner, 0) == 0:
                return True
            # Cancel what has not started; what is running we cannot stop. (Calls have no
            # owner: call_when takes none.)
            for seq, item in list(self._pending.items()):
                if item.owner == owner:
                    del self._pending[seq]
                    item.future.cancel()  # type: ignore[union-attr]
                    self._finish_locked(item)
            return self._running_per_owner.get(owner, 0) == 0

    # ------------------------------------------------------------------ shutdown
    def shutdown(self, *, wait: bool = True, timeout: float = 10.0) -> None:
        """Stops the pool. Idempotent.

        Args:
            wait: let pending items complete (up to ``timeout``) before stopping; items still
                pending after that, or all of them with ``wait=False``, fail with
                :class:`CompletionPoolShutdownError`.
            timeout: seconds to wait for pending items.
        """
        deadline = time.monotonic() + timeout
        with self._lock:
            if self._shutdown and not self._pending:
                return
            if wait:
                while self._pending and time.monotonic() < deadline:
                    self._lock.wait(max(0.0, min(0.01, deadline - time.monotonic())))
            self._shutdown = True
            leftovers = list(self._pending.values())
            self._pending.clear()
            self._lock.notify_all()
        for item in leftovers:
            self._complete(
                item,
                CompletionPoolShutdownError(
                    f"completion pool shut down before {item.description or 'the work'} completed"
                ),
            )
        self._executor.shutdown(wait=wait)
        self._poller.join(timeout=1.0)

    @property
    def is_shutdown(self) -> bool:
        return self._shutdown

    # ------------------------------------------------------------------ internals
    def _finish_locked(self, item: _Item) -> None:
        if item.owner is None:
            return
        count = self._running_per_owner.get(item.owner, 0) - 1
        if count <= 0:
            self._running_per_owner.pop(item.owner, None)
        else:
            self._running_per_owner[item.owner] = count
        self._lock.notify_all()

    def _poll_loop(self) -> None:
        sleep_s = _POLL_MIN_S
        while True:
            if self._sweepers:
                self._sweep()
            with self._lock:
                if self._shutdown:
                    return
                if not self._pending:
                    self._idle_wait_locked()
                    sleep_s = _POLL_MIN_S
                    continue  # the sweepers first, then look again
                now = time.monotonic()
                items = [item for item in self._pending.values() if item.due <= now]
                if not items:  # all delayed: sleep until the first is due (or a new item)
                    first = min(i.due for i in self._pending.values()) - now
                    # With sweepers, no longer than a tick: a nudge wakes only a sleep with no
                    # end, and their work must not wait for a distant item's time.
                    self._wait_locked(min(first, _LINGER_TICK_S) if self._sweepers else first)
                    continue
                self._poller_wakes_at = now + sleep_s  # told only about items due before that
            progressed = False
            for item in items:
                outcome = self._check(item, now)
                if outcome is None:
                    continue
                with self._lock:
                    if self._pending.pop(item.seq, None) is None:
                        continue  # cancelled by drain() or shutdown() meanwhile
                progressed = True
                if item.inline:
                    self._complete(item, outcome)
                    continue
                try:
                    self._executor.submit(self._complete, item, outcome)
                except RuntimeError:  # executor shut down under us
                    self._complete(item, outcome)
            if progressed:
                sleep_s = _POLL_MIN_S
            else:
                time.sleep(sleep_s)
                sleep_s = min(sleep_s * 2, _POLL_MAX_S)

    def _idle_wait_locked(self) -> None:
        """One sleep with nothing pending: a linger tick while delayed items keep coming or a
        sweeper has work, else until told."""
        # Marked a sleep with no end before the sweepers are asked: work given to one after
        # this is seen by nudge(), and work given before by has_work(). (Called by the poll
        # loop with nothing pending and no shutdown, under the lock it has held since.)
        self._poller_wakes_at = _UNTIL_TOLD
        if self._sweepers_have_work() or time.monotonic() < self._last_delayed + _LINGER_S:
            self._lingering = True
            try:
                self._wait_locked(_LINGER_TICK_S)
            finally:
                self._lingering = False
        else:
            self._wait_locked(None)

    def _wait_locked(self, timeout: float | None) -> None:
        self._poller_wakes_at = _UNTIL_TOLD if timeout is None else time.monotonic() + timeout
        self._lock.wait(timeout)
        self._poller_wakes_at = 0.0

    def _check(self, item: _Item, now: float) -> BaseException | bool | None:
        """``True`` when ready, an exception when failed or timed out, ``None`` to keep waiting."""
        if item.future is not None and item.future.cancelled():
            return True
        try:
            if item.ready():
                return True
        except BaseException as exc:  # the predicate's failure is the future's failure
            return exc
        if item.deadline is not None and now >= item.deadline:
            what = item.description or "device work"
            return TransferTimeoutError(f"timed out waiting for {what}")
        return None

    def _complete(self, item: _Item, outcome: BaseException | bool) -> None:
        future = item.future
        try:
            if future is None:  # a call (call_when)
                item.on_done(outcome if isinstance(outcome, BaseException) else None)  # type: ignore[misc]
                return
            if not future.set_running_or_notify_cancel():
                return
            if isinstance(outcome, BaseException):
                future.set_exception(outcome)
                return
            try:
                result = item.then() if item.then is not None else None
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(result)  # runs the future's callbacks on this thread
        except BaseException:  # a callback's error must not kill the worker
            log.exception("completion callback failed")
        finally:
            with self._lock:
                self._finish_locked(item)
