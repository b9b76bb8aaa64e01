"""Pair faults of the p2p issuing engine: failing units, moving a pair to its next epoch.

A mixin of :class:`._engine.Engine` (the module docstring there describes the fault protocol);
it uses the engine's state and helpers (``_units``, ``_issued``, ``_peer``, ``_send_frame``,
``_number``, ``_ensure_prepared``, ``_on_frame``, ``_succeed``, ``ctx``) and runs under the
engine's lock.
"""

from __future__ import annotations

import logging
import time

from tensorferry.errors import TransferTimeoutError
from tensorferry.p2p import _trace
from tensorferry.p2p._engine_state import ChannelState, Message, PeerState, Unit

__all__ = ["PairFaults", "mirrored"]

_KINDS = ("send", "recv")

_FINISHING_GRACE_S = 0.2
"""How long a fault waits for transfers whose peer side already finished."""


def mirrored(counts: dict) -> dict[str, int]:
    """Per-channel counts as a peer's frame gives them (its "send" channel is our "recv"
    channel and vice versa), keyed by our channel kinds."""
    mirror = {"send": "recv", "recv": "send"}
    return {mirror[kind]: int(count) for kind, count in counts.items()}


def _error_fields(err: BaseException) -> dict:
    """How a fault frame carries ``err`` to the peer (``_engine_links._error_of`` reads it)."""
    return {"err": type(err).__name__, "field": getattr(err, "field", None), "msg": str(err)}


# The engine's parts log as the engine: one logger to turn up for all of it.
log = logging.getLogger("tensorferry.p2p._engine")


class PairFaults:
    """Failing units and faulting pairs (mixed into the engine)."""

    def _all_units(self) -> list[Unit]:
        return [*self._units, *(u for u in self._issued if u.state != "done")]

    def _unit_of(self, message: Message) -> Unit | None:
        for unit in self._all_units():
            if any(m is message for m in unit.messages):
                return unit
        return None

    def _finish(self, unit: Unit, exc: BaseException | None) -> None:
        # Never run user callbacks on this thread: hand completion to the pool.
        transfer = unit.transfer
        self.ctx.completions.watch(lambda: True, then=lambda: transfer._finish(exc))

    def _fail_unit(
        self,
        unit: Unit,
        exc: BaseException,
        *,
        cascade: bool,
        skip_peer: int | frozenset[int] | None,
    ) -> None:
        if unit.state in ("done", "failed"):
            return
        if _trace.ON:
            _trace.record("failed", None, unit.trace_text(), unit.state, exc)
        was_issued = unit.state == "issued"
        unit.state = "failed"
        unit.error = exc
        if unit in self._units:
            self._units.remove(unit)
        self._issued.discard(unit)
        self._off_stream(unit)
        self._unwatched.units.pop(unit, None)  # failed here: nothing to hand the pool
        for rank in unit.peers:  # messages deferred until a peer answers our fault
            peer = self._peer(rank)
            if peer.frozen is not None and any(u is unit for _m, u in peer.deferred):
                self._tombstone_deferred(peer, exc)
        for pending in unit.pending:
            try:
                pending.abort()
            except Exception:
                log.exception("p2p: abort of pending ops failed")
        if cascade:
            self._cascade(unit, exc, was_issued=was_issued, skip_peer=skip_peer)
        # Last: the caller learns of the failure only once the peers were told (its next call
        # must not meet the peer still in the old epoch).
        self._finish(unit, exc)
        unit.forget_completion()

    def _cascade(
        self,
        unit: Unit,
        exc: BaseException,
        *,
        was_issued: bool,
        skip_peer: int | frozenset[int] | None,
    ) -> None:
        # The peers of a failed unit may have issued their side (or will, on agreed headers):
        # fault those pairs so both sides start afresh. A lone symmetric mismatch needs none,
        # nor a peer that failed its side already (``skip_peer``: one rank, or a set of them).
        skipped = skip_peer if isinstance(skip_peer, frozenset) else {skip_peer}
        for rank in sorted(unit.peers):
            if rank in skipped:
                continue
            only_mismatch = (
                rank in unit.symmetric_error_peers
                and all(m.resolved for m in unit.messages if m.op.peer == rank)
                and not was_issued
                and len([m for m in unit.messages if m.op.peer == rank]) == 1
            )
            if only_mismatch:
                continue
            peer = self._peer(rank)
            if peer.lost is None:
                self._fault_pair(peer, exc, notify=True)

    def _fault_pair(
        self,
        peer: PeerState,
        err: BaseException,
        *,
        notify: bool,
        numbered: dict[str, int] | None = None,
        finished_there: dict[str, int] | None = None,
    ) -> None:
        """Moves the pair to its next epoch; see the module docstring. ``numbered`` (per our
        channel kind): how many messages the faulting peer had numbered in this epoch, every
        one of which it failed; ``None`` when the fault is ours."""
        if peer.frozen is not None and numbered is None:
            # The peer has not answered our last fault yet: nothing is numbered with it in this
            # epoch, and what waits to be fails and is counted (see _unfreeze).
            self._tombstone_deferred(peer, err)
            return
        peer.faulting += 1
        try:
            self._move_on(peer, err, notify, numbered, finished_there)
        finally:
            peer.faulting -= 1
        if peer.reset_waiter is not None and not peer.faulting:
            # A reset asked for before the fault came: the peer drops our notice of it for the
            # epoch the fault ended, so it is given again for this one (see Engine.reset_pair).
            self._send_frame(peer, {"k": "rs", "e": peer.epoch})
            self._maybe_reset(peer)

    def _move_on(
        self,
        peer: PeerState,
        err: BaseException,
        notify: bool,
        numbered: dict[str, int] | None,
        finished_there: dict[str, int] | None,
    ) -> None:
        """:meth:`_fault_pair`'s work: the notice, the new epoch, what fails and what goes on."""
        old_epoch = peer.epoch
        if _trace.ON:
            ours = numbered is None
            _trace.record("fault", peer.rank, "epoch", old_epoch, "ours" if ours else numbered, err)
        self._settle_finished(peer, finished_there=finished_there)
        counts = {kind: peer.channels[kind].next_seq for kind in _KINDS}
        if notify:
            # Every message we numbered fails with the fault, so the peer fails its side of
            # each: now if it posted it, as it comes if not. Counting only the messages whose
            # headers had agreed split a message whose peer header was on its way: it failed
            # here and was carried into the next epoch there, to meet our next message.
            done = self._finished_counts(peer)
            frame = {"k": "f", "e": old_epoch, "all": counts, "done": done}
            self._send_frame(peer, {**frame, **_error_fields(err)})
        log.info(
            "p2p: pair with rank %d faulted in epoch %d (%s): %s",
            peer.rank,
            old_epoch,
            "ours" if numbered is None else f"theirs, numbered {numbered}",
            err,
        )
        keep, doomed, skipped = self._split_at_fault(peer, numbered)
        # Debts left from an earlier fault stay: they are for messages before these.
        debts = dict(peer.debts)
        for kind in _KINDS if numbered is not None else ():
            owed = numbered[kind] - peer.channels[kind].next_seq
            if owed > 0:  # the peer failed messages we have not posted: they fail as they come
                debts[kind] = (debts.get(kind, (0, err))[0] + owed, err)
        self._new_epoch(peer, abort=True, reason=str(err))
        peer.debts = debts
        # Numbers the peer skipped in this epoch are below its count (now debts, above).
        peer.numbered_debts = {}
        if numbered is None:
            # Until the peer answers (its fault acknowledgement, or its own notice of this
            # epoch if ours crossed it), we cannot know how its next messages are numbered.
            peer.frozen, peer.numbered_at_fault = old_epoch, counts
        else:
            # The answer: the peer takes numbers 0..n-1 of the new epoch for the messages it
            # fails (ours start after them); their kinds are the mirror of ours.
            for kind, count in skipped.items():
                channel = peer.channels[kind]
                channel.next_seq = channel.issue_next = channel.first_seq = count
            frame = {"k": "fa", "e": peer.epoch, "owe": mirrored(skipped)}
            self._send_frame(peer, {**frame, **_error_fields(err)})
        # The messages going on are numbered into the new epoch before the doomed units fail:
        # a failure can fault this pair again (a kept unit failing with another peer's part),
        # and that fault's notice must count them, or the peer would carry its side of them
        # into a further epoch to meet a message of ours that never comes.
        for message in sorted(keep, key=lambda m: (m.op.kind, m.seq)):
            self._number(peer, message)
            self._ensure_prepared(peer, message.transport, message.op.kind)
        for unit in doomed:
            self._fail_unit(unit, err, cascade=True, skip_peer=peer.rank)

    def _split_at_fault(
        self, peer: PeerState, numbered: dict[str, int] | None
    ) -> tuple[list[Message], list[Unit], dict[str, int]]:
        """Which of our messages with ``peer`` a fault fails and which go on into the next
        epoch, renumbered; and per channel how many of the peer's next messages must fail with
        ours (``skipped``). Returns ``(kept messages, doomed units, skipped)``.

        Our own fault fails them all. The peer's fails every message we numbered below its
        count and keeps the waiting ones past it: their counterparts are the peer's next
        messages. One past it that cannot wait (issued ahead on a static channel, or ended
        already) fails, so the peer fails as many of its next messages, a prefix of its new
        epoch: every message of ours below the last such one fails too, and with it its unit,
        which may fail more on the other channel. Repeated until nothing more fails."""
        units = [u for u in self._all_units() if peer.rank in u.peers]
        if numbered is None:
            return [], units, {}
        doomed = [u for u in units if u.state != "waiting" or u.issued_parts]
        while True:
            skipped = {}
            for kind in _KINDS:
                cut = numbered[kind]
                live = {
                    m.seq
                    for u in units
                    if u not in doomed
                    for m in u.messages
                    if m.op.peer == peer.rank and m.op.kind == kind
                }
                last = peer.channels[kind].next_seq - 1
                while last >= cut and last in live:
                    last -= 1
                if last >= cut:
                    skipped[kind] = last + 1 - cut
            grow = [
                u
                for u in units
                if u not in doomed
                and any(
                    m.op.peer == peer.rank
                    and m.seq < numbered[m.op.kind] + skipped.get(m.op.kind, 0)
                    for m in u.messages
                )
            ]
            if not grow:
                break
            doomed.extend(grow)
        keep = [m for u in units if u not in doomed for m in u.messages if m.op.peer == peer.rank]
        return keep, doomed, skipped

    def _settle_finished(
        self, peer: PeerState, *, finished_there: dict[str, int] | None = None
    ) -> None:
        """Completes issued units with ``peer`` whose work already finished but whose completion
        nobody has seen yet: a fault must not fail a transfer whose bytes are in place.

        ``finished_there`` (per our channel kind): how many leading messages the faulting peer
        saw finish. Our counterparts of those are finishing too (the bytes left the sender):
        they get a short while to do so, so that both sides report them alike.

        Polled as in an engine step, whichever thread handles the fault: a poll that drove the
        engine would handle other frames, faults among them, in the middle of this pair's move
        to its next epoch (see ``ShortWay._issue_short``)."""
        stepping = getattr(self._stepping, "on", False)
        self._stepping.on = True
        try:
            self._settle_each(peer, finished_there)
        finally:
            self._stepping.on = stepping

    def _settle_each(self, peer: PeerState, finished_there: dict[str, int] | None) -> None:
        deadline = time.monotonic() + _FINISHING_GRACE_S
        for unit in [u for u in self._issued if u.state == "issued" and peer.rank in u.peers]:
            mine = [m for m in unit.messages if m.op.peer == peer.rank]
            finishing = finished_there is not None and all(
                m.seq < finished_there[m.op.kind] for m in mine
            )
            while True:
                # Read once: a caller that completes the unit meanwhile drops them.
                ready, settle = unit.ready, unit.settle
                try:
                    finished = ready is not None and ready()
                except Exception:  # a failed transport: the fault fails it below
                    break
                if finished:
                    if settle is not None:
                        settle()
                    if unit.state == "issued":
                        # Its caller saw it finish first and took its completion (settle did
                        # nothing here), but has not marked it done yet: done it is, or the
                        # fault would fail a transfer whose caller was told it succeeded.
                        self._succeed(unit)
                    break
                if not finishing or time.monotonic() > deadline:
                    self._claim_unfinished(unit)
                    break
                time.sleep(50e-6)

    def _claim_unfinished(self, unit: Unit) -> None:
        """Takes the completion of ``unit``, unfinished when the fault looked: the fault counts
        it failed and fails it, and its caller, should it see the work finish meanwhile, must
        not report success. Where another thread took the completion first (its caller saw the
        work finish in between), the unit is done, and counts so."""
        claim, ready = unit.claim, unit.ready  # read once: completing the unit drops them
        if claim is None or claim():
            return
        try:
            finished = ready is not None and ready()
        except Exception:  # a failed transport: the fault fails it
            return
        if finished and unit.state == "issued":
            self._succeed(unit)

    def _finished_counts(self, peer: PeerState) -> dict[str, int]:
        """Per channel: how many leading messages with ``peer`` finished (the first unfinished
        one's number, or every numbered one)."""
        counts = {}
        unfinished = [m for u in self._all_units() for m in u.messages if m.op.peer == peer.rank]
        for kind in ("send", "recv"):
            seqs = [m.seq for m in unfinished if m.op.kind == kind and m.epoch == peer.epoch]
            counts[kind] = min(seqs, default=peer.channels[kind].next_seq)
        return counts

    def _on_fault_ack(self, peer: PeerState, frame: dict, err: BaseException) -> None:
        """The peer, told of a fault we started, also failed messages of its own past our
        counts (``frame["owe"]``, per our channel kind): our messages with those numbers of the
        new epoch fail — those posted already, now; the rest as they come.

        Every count is taken before any unit fails: a failing unit may fault the pair again
        (one with a message to this peer past the owed ones cannot fail half-way), which
        moves it to a further epoch whose channels the owed numbers are not about, and whose
        own fault waits for the peer's own answer."""
        epoch, owe = peer.epoch, frame["owe"]
        failing: dict[Unit, None] = {}
        for kind, count in owe.items():
            channel = peer.channels[kind]
            for message in [m for m in channel.waiting if m.seq < count]:
                channel.waiting.remove(message)
                if message.static:
                    channel.static_candidates -= 1
                self._retire(channel, message.seq)
                unit = self._unit_of(message)
                if unit is not None:
                    failing[unit] = None
            left = count - channel.next_seq
            if left > 0:
                peer.numbered_debts[kind] = (left, err)
        for unit in failing:
            owed = all(
                m.epoch == epoch and m.seq < owe.get(m.op.kind, 0)
                for m in unit.messages
                if m.op.peer == peer.rank
            )
            self._fail_unit(unit, err, cascade=True, skip_peer=peer.rank if owed else None)
        if peer.frozen is not None and peer.epoch == epoch:  # the peer's answer to our fault
            self._unfreeze(peer, {})

    def _tombstone_deferred(self, peer: PeerState, err: BaseException) -> None:
        """Fails every unit with a message waiting for ``peer``'s answer to our fault, and
        counts those messages per channel. All of them, not just the one whose unit failed:
        the peer is told of failed ones only as a count, the first of our next messages
        (:meth:`_unfreeze`), so they must come before every message still waiting."""
        deferred, peer.deferred = peer.deferred, []
        if deferred and peer.tombstone_error is None:
            peer.tombstone_error = err
        for message, _unit in deferred:
            kind = message.op.kind
            peer.tombstones[kind] = peer.tombstones.get(kind, 0) + 1
        for unit in dict.fromkeys(unit for _message, unit in deferred):
            self._fail_unit(unit, err, cascade=True, skip_peer=peer.rank)

    def _on_crossed_fault(self, peer: PeerState, frame: dict, err: BaseException) -> None:
        """The peer's notice of a fault in the epoch ours ended: both were started at once, and
        each side failed every message it had numbered. Ours past the peer's counts fail as
        they come, as the peer's past ours do there; each notice is the other's answer."""
        theirs = mirrored(frame["all"])
        debts = {
            kind: (theirs[kind] - peer.numbered_at_fault[kind], err)
            for kind in _KINDS
            if theirs[kind] > peer.numbered_at_fault[kind]
        }
        log.info("p2p: pair with rank %d: faults crossed, we owe %s", peer.rank, debts)
        self._unfreeze(peer, debts)

    def _unfreeze(self, peer: PeerState, debts: dict) -> None:
        """The peer answered our fault: number what waited for that, in order. First the
        messages that failed meanwhile; where they outnumber the messages the peer failed
        ahead of them, the peer fails as many (a fault acknowledgement from us). Then the
        messages still waiting, each paying a debt first if one is left."""
        peer.frozen = None
        if _trace.ON:
            _trace.record("unfrozen", peer.rank, "debts", {k: c for k, (c, _e) in debts.items()})
        for kind, (count, err) in debts.items():
            peer.debts[kind] = (peer.debts.get(kind, (0, err))[0] + count, err)
        tombstones, peer.tombstones = peer.tombstones, {}
        owe = {}
        for kind, count in tombstones.items():
            channel = peer.channels[kind]
            for _ in range(count):
                if self._pay_debt(peer, kind) is None:
                    channel.next_seq += 1
                    self._retire(channel, channel.next_seq - 1)
                    owe[kind] = channel.next_seq
            if kind in owe:  # the peer's headers of those numbers are of failed messages
                channel.first_seq = channel.next_seq
                for seq in [q for q in channel.peer_headers if q < channel.first_seq]:
                    del channel.peer_headers[seq]
        tombstone_error, peer.tombstone_error = peer.tombstone_error, None
        if owe:
            # The peer's side fails as ours did (a mismatch elsewhere in a batch, say), not
            # as a timeout: nothing waited that long.
            err = tombstone_error or TransferTimeoutError(
                f"rank {self.rank} gave up on this message while its pair with rank "
                f"{peer.rank} recovered from a fault"
            )
            frame = {"k": "fa", "e": peer.epoch, "owe": mirrored(owe)}
            self._send_frame(peer, {**frame, **_error_fields(err)})
        deferred, peer.deferred = peer.deferred, []
        failed: dict[Unit, BaseException] = {}
        paid: list[Message] = []
        for message, unit in deferred:
            err = self._pay_debt(peer, message.op.kind)
            if err is not None:
                failed.setdefault(unit, err)
                paid.append(message)
                continue
            self._number(peer, message)
            self._ensure_prepared(peer, message.transport, message.op.kind)
        for unit, err in failed.items():
            # No fault with the peer if all of the unit's messages with it paid debts.
            numbered = any(m.op.peer == peer.rank and m not in paid for m in unit.messages)
            self._fail_unit(unit, err, cascade=True, skip_peer=None if numbered else peer.rank)
        self._maybe_reset(peer)  # one asked for while we waited for the answer

    def _new_epoch(self, peer: PeerState, *, abort: bool, reason: str) -> None:
        peer.epoch += 1
        if _trace.ON:
            _trace.record("new epoch", peer.rank, peer.epoch, reason[:60])
        peer.channels = {"send": ChannelState(), "recv": ChannelState()}
        self._evict_transports(peer, abort=abort, reason=reason)
        replay, peer.future_frames = peer.future_frames, []
        for frame in replay:
            if peer.link is not None:
                self._on_frame(peer.link, frame)

    def _evict_transports(self, peer: PeerState, *, abort: bool, reason: str) -> None:
        names = list(dict.fromkeys(name for name, _kind in peer.prepared))
        peer.prepared = {}
        for name in names:
            try:
                self.ctx.transport(name).evict(peer.rank, abort=abort, reason=reason)
            except Exception:
                log.exception("p2p: evicting %s for rank %d failed", name, peer.rank)
