"""How the p2p engine issues a unit whose messages may go, and how the unit completes.

A mixin of :class:`._engine.Engine`, like :mod:`._engine_faults`: it uses the engine's state
(``_peers``, ``_units``, ``_issued``, ``_stepped_at``, ``ctx``) and steps of the engine and its
other parts (``call``, ``drive``, ``_wake``, ``_peer``, ``_finish``, ``_fail_unit``), and runs
under the engine's lock,
except where a method says it runs on another thread (the completion pool's poller, a waiting
caller).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from tensorferry.errors import (
    CompletionPoolShutdownError,
    TensorFerryError,
    TransferTimeoutError,
    TransportError,
)
from tensorferry.p2p import _trace
from tensorferry.p2p._engine_state import ChannelState, Message, Unit
from tensorferry.runtime._events import is_done
from tensorferry.runtime._spin import spin_window_s

__all__ = ["Issuing", "Unwatched"]

# The engine's parts log as the engine: one logger to turn up for all of it.
log = logging.getLogger("tensorferry.p2p._engine")

# A transfer issued ahead of the peer's header, polled for completion, runs an engine step to
# read the peer's frames unless one ended this recently (seconds): polling many transfers in
# a row would otherwise run a step for each, and with them every frame read once is enough.
_RESTEP_S = 20e-6


# What dict.pop answers for a unit that is not (or no longer) unwatched.
_TAKEN = object()

# Kernels queued on one transfer stream (a process's sends share one, and its receives
# another) by units not yet seen to end, as _queued_work counts them: a unit that would queue
# more waits in the engine until some end. A stream takes about a thousand kernels behind one
# that waits for its peer (1021 on the H100, whose other streams launched on meanwhile:
# scripts/launch_queue_probe.py); the next launch then waits in the launching call for room,
# holding the engine's lock, which the thread that would see the peer die and abort the pair
# (ending that wait) needs. A burst of 1 MiB sends to a peer that received none and died hung
# its sender so, for good.
ROOM_ON_STREAM = 256


def _queued_work(unit: Unit) -> tuple[str, int] | None:
    """Where ``unit``'s CUDA work goes and how many kernels it queues there, about: the
    transfer stream (``"send"`` or ``"recv"``, as ``P2PContext.issue`` chooses it) and one per
    message, two for one of several tensors (their copies into or out of its packed buffer:
    a kernel per dtype); ``None`` where it has none. A group call of several peers' messages
    launches a kernel per communicator."""
    messages = unit.messages
    if len(messages) == 1:  # the commonest unit
        op = messages[0].op
        if not op.tensors[0].is_cuda:
            return None
        return op.kind, 1 if len(op.tensors) == 1 else 2
    kernels, sends = 0, False
    for m in messages:
        op = m.op
        if op.tensors[0].is_cuda:
            kernels += 1 if len(op.tensors) == 1 else 2
            sends = sends or op.kind == "send"
    if not kernels:
        return None
    return ("send" if sends else "recv"), kernels


def _nothing() -> None:
    """An engine command that only makes the engine thread take a step."""


class Unwatched:
    """Issued units whose completion is nobody's yet: their callers usually see them finish and
    complete them (``Issuing._settle_seen``), and handing each to the completion pool as it is
    issued was most of what its completion cost the call (on the CPU machine a lone
    ``tf.send`` took 13.3 µs without that against 15.8). The pool's poller sweeps what is
    left here (``CompletionPool.add_sweeper``): a unit nobody took for a turn of the sweep
    (``_TURN_S``, and at least the callers' polling window) goes to the pool, and a caller about
    to block on its transfer hands it over itself (``Transfer._hand_over``). Units in flight
    are left alone, so the poller takes the GIL only for a look every linger tick.

    Whoever takes a unit out of ``units`` owns its completion: ``dict.pop`` is atomic, so
    a sweep, its caller and a fault never both take it."""

    __slots__ = ("_active_until", "_next_turn", "_older", "_seen", "_watch", "added", "units")

    def __init__(self, watch: Any) -> None:
        self.units: dict[Unit, None] = {}
        # Counts the units added (the caller bumps it; no clock read on its call): the poller
        # keeps looking every tick while units keep coming, rather than sleep until told and be
        # woken for each (a notify per call).
        self.added = 0
        self._seen = 0
        self._active_until = 0.0
        self._watch = watch
        # The ids of the units there at the last turn: not the units, which would stay alive
        # (their tensors with them) for a turn after their callers completed them. An id
        # taken again by a new unit only hands that one over early.
        self._older: set[int] = set()
        self._next_turn = 0.0

    def held(self) -> int:
        return len(self.units)

    def has_work(self) -> bool:
        if self.units:
            return True
        now = time.monotonic()
        if self.added != self._seen:
            self._seen = self.added
            self._active_until = now + _ACTIVE_S
        return now < self._active_until

    def sweep(self) -> None:
        now = time.monotonic()
        if now < self._next_turn:
            return
        self._next_turn = now + max(_TURN_S, spin_window_s())
        older = self._older
        now_there = list(self.units)  # (list of a dict: one atomic step)
        self._older = {id(unit) for unit in now_there}
        for unit in now_there:
            if id(unit) in older:  # nobody took it for a whole turn
                self._watch(unit, 0.0)  # (unless somebody took it just now)


# A unit nobody took for this long (seconds; at least the callers' polling window) goes to
# the completion pool; the poller keeps looking every tick while units came within _ACTIVE_S.
_TURN_S = 2e-3
_ACTIVE_S = 0.2


class Issuing:
    """Issuing units (whole, or in parts) once they may go, and completing them."""

    def _issuable(self, unit: Unit) -> bool:
        if not (self._after_allows(unit) and self._may_go(unit.messages)):
            return False
        work = _queued_work(unit)
        return work is None or self._room_for(*work)

    def _room_for(self, stream: str, kernels: int) -> bool:
        """Whether a unit may queue ``kernels`` more on the transfer stream ``stream`` (see
        ``ROOM_ON_STREAM``; on an empty stream, any number). Where not, the next unit to end
        there wakes the engine."""
        queued = self._on_stream[stream]
        if not queued or len(queued) + kernels <= ROOM_ON_STREAM:
            return True
        # Said before the second look: a unit that ends in between sees it.
        self._awaiting_room = True
        return not queued or len(queued) + kernels <= ROOM_ON_STREAM

    def _on_stream_add(self, unit: Unit, work: tuple[str, int]) -> None:
        """``unit`` queued its work (under the engine's lock): ``unit`` itself stands for its
        first kernel in the stream's set, ``(unit, i)`` for the others."""
        stream, kernels = unit.on_stream, unit.kernels = work
        queued = self._on_stream[stream]
        queued.add(unit)
        for i in range(1, kernels):
            queued.add((unit, i))
        if len(queued) >= ROOM_ON_STREAM:
            self._full_streams.add(stream)

    def _off_stream(self, unit: Unit) -> None:
        """``unit`` ended: its room on its transfer stream is free (any thread)."""
        stream = unit.on_stream
        if stream is None:
            return
        unit.on_stream = None
        queued = self._on_stream[stream]
        queued.discard(unit)
        for i in range(1, unit.kernels):  # (set.discard: each one atomic)
            queued.discard((unit, i))
        if len(queued) < ROOM_ON_STREAM:
            # A stale answer here costs the short way a call (its look is a hint; the full
            # step counts), or lets it queue a unit or two beyond the room: both harmless.
            self._full_streams.discard(stream)
        if self._awaiting_room:
            self._awaiting_room = False
            # A command, not a bare wake-up: the engine thread looks for commands after it
            # said it sleeps, and takes a step for them (which issues what waited for room).
            self._commands.append(_nothing)
            self._wake()

    def _after_allows(self, unit: Unit) -> bool:
        """Whether the unit ``unit`` waits for (a ring's previous step) lets it go; fails
        ``unit`` when that one failed."""
        before = unit.after
        if before is None:
            return True
        if before.state == "failed":
            err = before.error or TransportError("an earlier step failed")
            self._fail_unit(unit, err, cascade=True, skip_peer=None)
            return False
        return before.state == "done" or (unit.after_issued_is_enough and before.state == "issued")

    def _may_go(self, messages: list[Message]) -> bool:
        """Whether ``messages`` (a unit's, or its part with one peer) are agreed, their
        transports prepared, and everything before them on their channels issued."""
        first_seq: dict[tuple[int, str], int] = {}
        for message in messages:
            peer = self._peers[message.op.peer]
            prepared = peer.prepared.get((message.transport, message.op.kind))
            if not message.resolved or prepared != "done":
                return False
            key = (message.op.peer, message.op.kind)
            first_seq[key] = min(first_seq.get(key, message.seq), message.seq)
        # A unit's messages on one channel are numbered consecutively: they may go once the
        # channel issued everything before the first of them.
        return all(
            self._peers[peer].channels[kind].issue_next == seq
            for (peer, kind), seq in first_seq.items()
        )

    def _issue(self, unit: Unit) -> None:
        self._units.remove(unit)
        for message in unit.messages:
            self._retire(self._peers[message.op.peer].channels[message.op.kind], message.seq)
        self._start(unit)

    def _goes_in_parts(self, unit: Unit) -> bool:
        """Whether ``unit`` is issued in parts, peer by peer or message by message (see
        ``Transport.issues_per_peer`` and ``issues_per_message``); worked out once per unit."""
        if unit.parts is None:
            unit.parts = self._parts(unit)
        return unit.parts is not False

    def _parts(self, unit: Unit) -> dict[tuple, list[Message]] | bool:
        """``unit``'s messages by the part they go in, or ``False`` when it goes whole: one
        part per message where every transport of the unit issues so, else one per peer. A
        message's key holds its place in the unit, not its number (which a fault may change):
        keys sort in each channel's order."""
        if len(unit.messages) == 1:  # a lone message (the commonest unit) goes whole
            return False
        transports = [self.ctx.transport(m.transport) for m in unit.messages]
        if not all(t.issues_per_peer for t in transports):
            return False
        per_message = all(t.issues_per_message for t in transports)
        if not per_message and len(unit.peers) == 1:
            return False
        parts: dict[tuple, list[Message]] = {}
        for index, m in enumerate(unit.messages):
            key = (m.op.peer, m.op.kind, index) if per_message else (m.op.peer,)
            parts.setdefault(key, []).append(m)
        return parts

    def _issue_parts(self, unit: Unit) -> None:
        """Issues every part of ``unit`` that may go now, in one start (see
        :meth:`_goes_in_parts`), and once every part went, hands the unit's completion to the
        completion pool."""
        if not self._after_allows(unit):
            return
        went = set(unit.issued_parts or ())
        parts = unit.parts
        ready: list[Message] = []
        for key in sorted(parts.keys() - went):  # a channel's earlier messages first
            part = parts[key]
            if not self._may_go(part):
                continue
            for message in part:
                self._retire(self._peers[message.op.peer].channels[message.op.kind], message.seq)
            went.add(key)
            ready.extend(part)
        if ready:
            unit.issued_parts = frozenset(went)
            if log.isEnabledFor(logging.DEBUG):
                what = unit.transfer.description
                log.debug("p2p: issuing %d message(s) of %s", len(ready), what)
            try:
                self.ctx.issue_on_host(unit, ready)
            except BaseException as exc:
                err = exc if isinstance(exc, TensorFerryError) else TransportError(str(exc))
                self._fail_unit(unit, err, cascade=True, skip_peer=None)
                return
        if len(went) == len(parts):
            self._units.remove(unit)
            self._start(unit, started=True)

    def _start(self, unit: Unit, *, started: bool = False) -> None:
        """Issues ``unit`` (its messages numbered, agreed and retired; with ``started``, issued
        already, in parts) and hands its completion to the completion pool."""
        if log.isEnabledFor(logging.DEBUG) and not started:
            log.debug("p2p: issuing %s", unit.transfer.description)
        unit.state = "issued"
        self._issued.add(unit)
        if _trace.ON:
            _trace.record("issued", None, unit.trace_text())
        try:
            # The transports' start(), on the p2p streams; host transports have no event.
            done_event = None if started else self.ctx.issue(unit)
        except BaseException as exc:
            err = exc if isinstance(exc, TensorFerryError) else TransportError(str(exc))
            self._fail_unit(unit, err, cascade=True, skip_peer=None)
            return
        if done_event is not None:  # CUDA work queued: it takes room on its stream
            self._on_stream_add(unit, _queued_work(unit))  # type: ignore[arg-type]
        pending = list(unit.pending)

        messages = unit.messages

        def confirmed() -> bool:
            for m in messages:  # loops, not all() of generators: polled while in flight
                if not m.confirmed:
                    break
            else:
                return True
            # Issued ahead of the peer's header (see _speculate): whoever polls reads the
            # peer's frames (a caller waiting, the completion pool), so the engine thread need
            # not be woken for them. One step reads them for every transfer in flight: those
            # polled right after it (a sweep of many) do not take another.
            if time.monotonic() - self._stepped_at > _RESTEP_S:
                self.drive()
            return all(m.confirmed for m in messages)

        def ready() -> bool:
            # Confirmation first: until the peer's header agreed with a message issued ahead of
            # it, a transport error may just be the pair fault on its way, and that fault's
            # error (a MismatchError, say) is the one to report.
            if not confirmed():
                return False
            for p in pending:
                if not p.ready():
                    return False
            return done_event is None or is_done(done_event)

        unit.ready, unit.settle = ready, lambda: self._settle_seen(unit)
        unit.claim = lambda: self._take_completion(unit)
        # A caller waiting on the transfer usually sees it finish within its polling window
        # and completes it itself: the completion pool gets it only if that does not happen
        # (Unwatched), off the caller's call.
        unwatched = self._unwatched
        unwatched.units[unit] = None
        unwatched.added += 1
        self.ctx.completions.nudge()  # (only where the poller sleeps until told)
        unit.transfer._mark_issued(
            done_event, ready, unit.settle, expedite=lambda: self._watch(unit, 0.0)
        )

    def _watch(self, unit: Unit, delay: float) -> None:
        """Hands ``unit``'s completion to the completion pool, which polls it from ``delay``
        seconds on (where the pool has it already, a zero ``delay`` makes it poll at once),
        unless its caller or a fault took it. On the pool's poller (a sweep of the unwatched
        units) or on a caller about to block on the transfer."""
        completions = self.ctx.completions
        if self._unwatched.units.pop(unit, _TAKEN) is _TAKEN:
            handle = unit.watched
            if handle is not None and delay <= 0:
                completions.expedite(handle)
            return
        ready = unit.ready
        if ready is None:  # done or failed meanwhile
            return
        try:
            # On the pool's poller thread: _on_completed is quick and hands user callbacks to
            # a worker. The deadline's timeout is reworded there, naming the unit.
            unit.watched = completions.call_when(
                ready,
                lambda exc: self._on_completed(unit, exc),
                deadline=unit.deadline,
                delay=delay,
            )
        except CompletionPoolShutdownError as exc:
            self._on_completed(unit, exc)
            return
        if unit.ready is None:  # completed by the pool already: no cycle with its handle left
            unit.watched = None

    def _take_completion(self, unit: Unit) -> bool:
        """Takes ``unit``'s completion for the calling thread: from the unwatched units, or
        from the completion pool. False where another thread took it first (the pool, a
        caller, a fault; or a sweep handing it to the pool right now: the pool then has it)."""
        if self._unwatched.units.pop(unit, _TAKEN) is not _TAKEN:
            return True
        handle = unit.watched
        return handle is not None and self.ctx.completions.discard(handle)

    def _settle_seen(self, unit: Unit) -> bool:
        # On the thread that waited and saw the work finish (Transfer._settled): complete the
        # transfer there, so no other thread has to wake up (and take the GIL) for it later.
        # False when another thread took its completion first (the pool, or a fault that
        # counted it unfinished): that thread's outcome is the transfer's.
        if self._take_completion(unit):
            self._succeed(unit)
            return True
        return False

    def _on_completed(self, unit: Unit, exc: BaseException | None) -> None:
        # On the completion pool's poller thread: quick, and no user code here.
        if exc is None:
            self._succeed(unit)
            return
        if isinstance(exc, TransferTimeoutError):
            exc = TransferTimeoutError(
                f"{unit.transfer.description}: timed out (peer never completed its side)"
            )
        elif not isinstance(exc, TensorFerryError):
            exc = TransportError(f"{unit.transfer.description}: {exc}")
        self.call(lambda: self._fail_unit(unit, exc, cascade=True, skip_peer=None))

    def _succeed(self, unit: Unit) -> None:
        # Any thread, no engine hop (a wake-up per transfer): the engine drops done units from
        # its issued set itself (_progress).
        unit.state = "done"
        if unit.on_stream is not None:
            self._off_stream(unit)
        if _trace.ON:
            _trace.record("done", None, unit.trace_text())
        if not unit.transfer._finish_if_no_callbacks():
            self._finish(unit, None)  # user callbacks: on a completion-pool worker
        unit.forget_completion()
        if unit.awaited:
            self._wake()  # a unit waits for this one (a ring's next step): issue it now

    def _retire(self, channel: ChannelState, seq: int) -> None:
        channel.retired.add(seq)
        while channel.issue_next in channel.retired:
            channel.retired.discard(channel.issue_next)
            channel.issue_next += 1

    def _expire(self, now: float) -> None:
        for unit in [u for u in self._units if u.deadline <= now]:
            if _trace.ON:
                self._trace_waiting(unit)
            err = TransferTimeoutError(
                f"{unit.transfer.description}: timed out waiting for the peer "
                f"(no matching call within the transfer timeout)"
            )
            self._fail_unit(unit, err, cascade=True, skip_peer=None)

    def _trace_waiting(self, unit: Unit) -> None:
        """Records what ``unit``'s messages still wait for, as it times out."""
        for m in unit.messages:
            peer = self._peer(m.op.peer)
            channel = peer.channels[m.op.kind]
            _trace.record(
                "timing out",
                peer.rank,
                f"{m.op.kind}/{m.seq}@{m.epoch} (pair in epoch {peer.epoch}, frozen {peer.frozen})",
                f"channel head {channel.waiting[0].seq if channel.waiting else None}",
                f"held {channel.held}, peer headers {sorted(channel.peer_headers)}",
                f"prepared {peer.prepared}, debts {dict(peer.debts)}, link {peer.link is not None}",
            )
