"""``Transfer``: the handle every p2p call returns at once.

A transfer is one call's messages (a batch's: several, to several peers). It is done when every
message ended; it failed with the first error of one of them. Whoever waits does the work:
``wait()`` reads the pairs' frames, issues what can go and polls completion on the caller's
own thread, so no other thread stands between a message arriving and ``wait()`` returning.
Callbacks run on a completion-pool thread, which also drives a transfer nobody waits for.

Thread-safety: every method may be called from any thread.
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tensorferry._seconds import checked_seconds
from tensorferry.errors import TransferTimeoutError
from tensorferry.p2p._message import ENDED, ISSUED, WAITING
from tensorferry.runtime._events import recycle

if TYPE_CHECKING:
    from tensorferry.p2p._message import Message
    from tensorferry.p2p._pair import Pair

__all__ = ["Transfer"]

log = logging.getLogger(__name__)

# A waiter polls this long, yielding the core between polls, before it sleeps between polls:
# a small message is done in tens of microseconds, and a sleeping thread wakes late.
_SPIN_S = 2e-3
_SLEEP_MAX_S = 1e-3
# ... or, where what is left are one-sided copies, as long as their bytes take at this rate
# (bytes per second, below what one host's links give): the sleeps of the waiter of a 1 GiB
# copy (about 3 ms) spanned its end by up to 0.6 ms.
_ONE_SIDED_BYTES_PER_S = 300e9
# Spinning, a waiter for a frame looks again after at most this long without one (seconds) ...
_FRAME_WAIT_S = 100e-6
# ... and one spinning on a one-sided route's words alone, after this long.
_WORD_SPIN_S = 200e-6


class Transfer:
    """The handle of one ``send``/``recv``/``sendrecv``/``batch``.

    Attributes:
        deadline: monotonic time past which its messages fail with ``TransferTimeoutError``.
    """

    def __init__(self, deadline: float, value: Any = None) -> None:
        self.deadline = deadline
        self._value = value
        self._messages: list[Message] = []
        self._pairs: list[Pair] = []
        self._open = 0
        self._error: BaseException | None = None
        # Whether it ended: set once, read by any thread. Nothing blocks on it (waiters poll),
        # so it is a plain attribute, not a threading.Event.
        self._ended = False
        self._callbacks: list[Callable[[Transfer], Any]] = []
        self._lock = threading.Lock()
        self._watched = False
        self._caller_event: Any = None  # the caller's stream at the call (CUDA), pooled

    # ------------------------------------------------------------------ filling in
    def _add(self, message: Message, pair: Pair) -> None:
        self._messages.append(message)
        self._open += 1
        if pair not in self._pairs:
            self._pairs.append(pair)

    def _message_ended(self, message: Message) -> None:
        """Called by the message's pair, under its lock, once the message ended."""
        with self._lock:
            if message.error is not None and self._error is None:
                self._error = message.error
            self._open -= 1
            finished = self._open == 0
        if finished:
            self._finish()

    def _finish(self) -> None:
        event, self._caller_event = self._caller_event, None
        if event is not None:  # every message ended: no wait on it is still to be enqueued
            recycle(event)
        self._ended = True
        with self._lock:
            callbacks, self._callbacks = self._callbacks, []
        if callbacks:
            self._run_callbacks(callbacks)

    # ------------------------------------------------------------------ the user's calls
    def done(self) -> bool:
        """Whether it ended (done or failed); looks for progress first, without waiting."""
        if not self._ended:
            self._progress()
        return self._ended

    def wait(self, timeout: float | None = None) -> Transfer:
        """Waits until every message ended; returns ``self``.

        Raises:
            TransferTimeoutError: not done within ``timeout`` (the transfer goes on; its own
                deadline, the call's ``timeout``, ends it with this error too).
            MismatchError, PeerLostError, TransportError: how it failed.
        """
        seconds = self._seconds(timeout)  # checked done or not: a bad timeout is a bad call
        if not self._ended:
            now = time.monotonic()
            limit = now + seconds
            spin_until = now + _SPIN_S
            extended = blocked = False
            pause = 20e-6
            while True:
                if blocked:  # its works ended (or the limit came): their pairs' look ends them
                    for pair in self._pairs:
                        pair.settle()
                else:
                    self._progress(hand_off=False)
                if self._ended:
                    break
                now = time.monotonic()
                if now > limit:
                    within = "its timeout" if timeout is None else f"{timeout:.3g} s of waiting"
                    raise TransferTimeoutError(f"{self.description}: not done within {within}")
                blocked = self._block(limit)
                if blocked:
                    continue
                if now >= spin_until and not extended:
                    extended = True
                    spin_until = now + self._copying_seconds()
                if now < spin_until:
                    self._pause_briefly()
                else:
                    self._sleep(pause)
                    pause = min(pause * 2, _SLEEP_MAX_S)
        if self._error is not None:
            raise self._error
        return self

    def result(self, timeout: float | None = None) -> Any:
        """What was received (``None`` for a send) once done; raises as :meth:`wait`."""
        self.wait(timeout)
        return self._value

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """How it failed (``None`` if it did not); waits like :meth:`wait`, whose
        ``TransferTimeoutError`` it raises when not done within ``timeout``."""
        try:
            self.wait(timeout)
        except Exception:
            if not self._ended:  # not how it failed: not done in time, or not submitted
                raise
        return self._error

    def add_done_callback(self, fn: Callable[[Transfer], Any]) -> None:
        """Calls ``fn(transfer)`` once it ended, on a completion-pool thread (at once on this
        thread if it ended already). Exceptions of ``fn`` are logged."""
        with self._lock:
            if not self._ended:
                self._callbacks.append(fn)
                watch = not self._watched
                self._watched = True
                fn = None  # type: ignore[assignment]
        if fn is not None:  # done already: at once, on this thread
            try:
                fn(self)
            except Exception:
                log.exception("p2p: a done-callback of %s raised", self.description)
        elif watch:
            self._watch()

    def wait_stream(self, stream: Any = None, *, timeout: float | None = None) -> None:
        """Makes ``stream`` (default: the calling thread's current stream of this rank's
        device) wait for the received bytes on the device, without the host waiting for them.
        The host waits only until every message is issued (its peer's frame came). A transfer
        of CPU tensors has no stream to order: this waits until it is done.

        Raises:
            TransferTimeoutError: not issued within ``timeout``.
            MismatchError, PeerLostError, TransportError: how it failed.
        """
        import torch

        if not any(m.tensors and m.tensors[0].is_cuda for m in self._messages):
            self.wait(timeout)  # CPU tensors: no stream to order, the bytes must be there
            return
        limit = time.monotonic() + self._seconds(timeout)
        while any(m.state == WAITING for m in self._messages) and not self._ended:
            self._progress()
            if time.monotonic() > limit:
                raise TransferTimeoutError(f"{self.description}: not issued within {timeout} s")
            time.sleep(20e-6)
        if self._ended and self._error is not None:
            raise self._error
        for message in self._messages:
            if message.state == ENDED or not message.tensors or not message.tensors[0].is_cuda:
                continue
            pair = next(p for p in self._pairs if p.peer == message.peer)
            target = stream if stream is not None else torch.cuda.current_stream(pair.ctx.device)
            with pair.lock:
                if message.state != ENDED:
                    pair.ctx.route(message.route).order_stream(pair, message, target)

    @property
    def description(self) -> str:
        return "; ".join(m.describe() for m in self._messages) or "an empty transfer"

    def __repr__(self) -> str:
        state = "done" if self._ended else "pending"
        if self._ended and self._error is not None:
            state = f"failed: {type(self._error).__name__}"
        return f"<Transfer {self.description} ({state})>"

    # ------------------------------------------------------------------ driving
    def _progress(self, *, hand_off: bool = True) -> bool:
        """Moves every message on as far as it goes without waiting; with ``hand_off``, work
        only a blocking wait completes (a gloo receive) goes to a thread that waits for it."""
        for pair in self._pairs:
            pair.progress()
        if self._pairs:  # a receive posted with another peer may be what this one waits on
            for pair in self._pairs[0].ctx.busy_pairs(self._pairs):
                pair.progress()
        if hand_off and not self._ended:
            for message in self._messages:
                if message.state == ISSUED:
                    route = self._route_of(message)
                    if hasattr(route, "hand_off"):
                        route.hand_off(message, self.deadline)
        return self._ended

    def _copying_seconds(self) -> float:
        """How long the transfer's bytes take to move where every message left is issued on a
        one-sided route (its end is a word written once they moved), else 0."""
        left = [m for m in self._messages if m.state != ENDED]
        if not all(m.state == ISSUED and self._route_of(m).one_sided for m in left):
            return 0.0
        return sum(m.op.nbytes for m in left) / _ONE_SIDED_BYTES_PER_S

    def _pause_briefly(self) -> None:
        """Between two looks while spinning. A message still waiting for its peer's frame
        sleeps in ``select`` until a frame arrives (the kernel wakes it; spinning would take
        the core from the peer's side on a small host), unless the frame may come through
        memory instead (a one-sided route's ring of posts): then it looks again at once. When
        every message is issued and a one-sided route's device writes their end, it spins on
        those words (no call per look)."""
        waiting = [m for m in self._messages if m.state == WAITING]
        if waiting:
            if not all(self._route_of(m).one_sided for m in waiting):
                fds = self._incoming_fds()
                if fds:
                    select.select(fds, [], [], _FRAME_WAIT_S)
                    return
        else:
            words = [m for m in self._messages if m.state == ISSUED and self._route_of(m).one_sided]
            if words and len(words) == sum(m.state != ENDED for m in self._messages):
                until = time.monotonic() + _WORD_SPIN_S
                while time.monotonic() < until:
                    if all(m.pending.done() > m.seq for m in words):
                        return
        os.sched_yield()

    def _sleep(self, seconds: float) -> None:
        """Sleeps up to ``seconds``, waking when a frame arrives from one of the peers."""
        fds = self._incoming_fds()
        if fds:
            select.select(fds, [], [], seconds)
        else:
            time.sleep(seconds)

    def _incoming_fds(self) -> list[int]:
        """The descriptors the transfer's peers' frames arrive on."""
        return [fd for fd in {p.incoming_fd() for p in self._pairs} if fd is not None]

    def _block(self, limit: float) -> bool:
        """Waits on this thread in a route's blocking wait (a gloo work) until it ends or
        ``limit``, where nothing else needs this thread meanwhile; returns whether it did.

        Nothing may wait for a peer's frame meanwhile, in this transfer or another of this
        rank (a send left unwaited while its caller waits for the reply): only a thread that
        steps the pair issues it once the frame comes, and blocked here this one could not."""
        blocking = []
        for message in self._messages:
            if message.waits_for_peer():
                return False
            if message.state == ISSUED:
                route = self._route_of(message)
                if hasattr(route, "block"):
                    blocking.append((message, route))
        if not blocking or self._rank_waiting():
            return False
        return any(route.block(message, limit, self.deadline) for message, route in blocking)

    def _rank_waiting(self) -> bool:
        """Whether a message of this rank, of any transfer, waits for its peer's frame."""
        return any(pair.waiting() for pair in self._pairs[0].ctx.busy_pairs([]))

    def _route_of(self, message: Message) -> Any:
        return self._pairs[0].ctx.route(message.route)

    def _seconds(self, timeout: float | None) -> float:
        if timeout is None:
            return max(0.0, self.deadline - time.monotonic()) + 1.0
        return checked_seconds(timeout, "timeout", zero_ok=True)

    def _watch(self) -> None:
        """Hands the transfer to the completion pool's poller, which drives it until done."""
        from tensorferry.runtime import completion_pool

        completion_pool().watch(self._progress, inline=True, description=self.description)

    def _run_callbacks(self, callbacks: list[Callable[[Transfer], Any]]) -> None:
        from tensorferry.runtime import completion_pool

        def run() -> None:
            for fn in callbacks:
                try:
                    fn(self)
                except Exception:
                    log.exception("p2p: a done-callback of %s raised", self.description)

        completion_pool().watch(lambda: True, then=run, description="callbacks")
