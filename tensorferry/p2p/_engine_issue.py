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

from tensorferry.errors import TensorFerryError, TransferTimeoutError, TransportError
from tensorferry.p2p import _trace
from tensorferry.p2p._engine_state import ChannelState, Message, Unit
from tensorferry.runtime._events import is_done
from tensorferry.runtime._spin import spin_window_s

__all__ = ["Issuing"]

# The engine's parts log as the engine: one logger to turn up for all of it.
log = logging.getLogger("tensorferry.p2p._engine")

# A transfer issued ahead of the peer's header, polled for completion, runs an engine step to
# read the peer's frames unless one ended this recently (seconds): polling many transfers in
# a row would otherwise run a step for each, and with them every frame read once is enough.
_RESTEP_S = 20e-6


class Issuing:
    """Issuing units (whole, or in parts) once they may go, and completing them."""

    def _issuable(self, unit: Unit) -> bool:
        return self._after_allows(unit) and self._may_go(unit.messages)

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

        completions = self.ctx.completions
        # On the pool's poller thread: _on_completed is quick and hands user callbacks to a
        # worker. The deadline's timeout is reworded there, naming the unit.
        handle = completions.call_when(
            ready,
            lambda exc: self._on_completed(unit, exc),
            deadline=unit.deadline,
            # A caller waiting on the transfer usually sees it finish within its polling window
            # and completes it itself: the pool's thread stays out of its way until then.
            delay=spin_window_s(),
        )
        unit.ready, unit.settle = ready, lambda: self._settle_seen(unit, handle)
        unit.claim = lambda: completions.discard(handle)
        unit.transfer._mark_issued(
            done_event, ready, unit.settle, expedite=lambda: completions.expedite(handle)
        )

    def _settle_seen(self, unit: Unit, handle: Any) -> bool:
        # On the thread that waited and saw the work finish (Transfer._settled): complete the
        # transfer there, so no other thread has to wake up (and take the GIL) for it later.
        # False when another thread took its completion first (the pool, or a fault that
        # counted it unfinished): that thread's outcome is the transfer's.
        if self.ctx.completions.discard(handle):
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
