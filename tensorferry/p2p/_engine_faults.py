"""Pair faults of the p2p issuing engine: failing units, moving a pair to its next epoch.

A mixin of :class:`._engine.Engine` (the module docstring there describes the fault protocol);
it uses the engine's state and helpers (``_units``, ``_issued``, ``_peer``, ``_send_frame``,
``_number``, ``_ensure_prepared``, ``_on_frame``, ``ctx``) and runs under the engine's lock.
"""

from __future__ import annotations

import logging
import time

from tensorferry.p2p._engine_state import ChannelState, Message, PeerState, Unit

__all__ = ["PairFaults", "mirrored"]

_FINISHING_GRACE_S = 0.2
"""How long a fault waits for transfers whose peer side already finished."""


def mirrored(counts: dict) -> dict[str, int]:
    """Per-channel counts as a peer's frame gives them (its "send" channel is our "recv"
    channel and vice versa), keyed by our channel kinds."""
    mirror = {"send": "recv", "recv": "send"}
    return {mirror[kind]: int(count) for kind, count in counts.items()}


def _error_fields(err: BaseException) -> dict:
    """How a fault frame carries ``err`` to the peer (``_engine._error_of`` reads it)."""
    return {"err": type(err).__name__, "field": getattr(err, "field", None), "msg": str(err)}


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
        self, unit: Unit, exc: BaseException, *, cascade: bool, skip_peer: int | None
    ) -> None:
        if unit.state in ("done", "failed"):
            return
        was_issued = unit.state == "issued"
        unit.state = "failed"
        unit.error = exc
        if unit in self._units:
            self._units.remove(unit)
        self._issued.discard(unit)
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

    def _cascade(
        self, unit: Unit, exc: BaseException, *, was_issued: bool, skip_peer: int | None
    ) -> None:
        # The peers of a failed unit may have issued their side (or will, on agreed headers):
        # fault those pairs so both sides start afresh. A lone symmetric mismatch needs none.
        for rank in sorted(unit.peers):
            if rank == skip_peer:
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
        matched: dict[str, int] | None = None,
        numbered: dict[str, int] | None = None,
        finished_there: dict[str, int] | None = None,
    ) -> None:
        """Moves the pair to its next epoch; see the module docstring."""
        old_epoch = peer.epoch
        self._settle_finished(peer, finished_there=finished_there)
        if notify:
            # Only messages both sides numbered (headers agreed, or static) count as matched
            # ("n"): the peer fails its counterparts of those and renumbers the rest. A message
            # the peer had not yet posted is simply dropped; if it posts it later, it becomes
            # the first message of the new epoch. "all" counts every message we numbered (and
            # fail): the peer's failures past it are ones we must match (see _on_fault_ack).
            channels = peer.channels
            counts = {kind: self._agreed_count(channels[kind]) for kind in ("send", "recv")}
            numbered = {kind: channels[kind].next_seq for kind in ("send", "recv")}
            done = self._finished_counts(peer)
            frame = {"k": "f", "e": old_epoch, "n": counts, "all": numbered, "done": done}
            self._send_frame(peer, {**frame, **_error_fields(err)})
        log.info(
            "p2p: pair with rank %d faulted in epoch %d (%s): %s",
            peer.rank,
            old_epoch,
            "ours" if matched is None else f"theirs, matched {matched}",
            err,
        )
        # Messages the faulting side numbered failed with it; ours after those are renumbered.
        keep: list[Message] = []
        doomed: list[Unit] = []
        for unit in self._all_units():
            for message in unit.messages:
                if message.op.peer != peer.rank:
                    continue
                limit = None if matched is None else matched[message.op.kind]
                if (
                    limit is not None
                    and unit.state == "waiting"
                    and message.seq >= limit
                    and unit not in doomed
                ):
                    keep.append(message)
                elif unit not in doomed:
                    doomed.append(unit)
        keep = [m for m in keep if self._unit_of(m) not in doomed]
        debts, skipped = {}, {}
        for kind in ("send", "recv") if matched is not None else ():
            owed = matched[kind] - peer.channels[kind].next_seq
            if owed > 0:  # only on static channels: see _agreed_count
                debts[kind] = (owed, err)
            # Ours past every message the peer numbered that fail all the same (issued ahead on
            # a static channel): the peer must fail that many of its next ones, or those would
            # meet our next messages.
            their_all = (numbered or matched)[kind]
            beyond = [
                m.seq
                for unit in doomed
                for m in unit.messages
                if m.op.peer == peer.rank and m.op.kind == kind and m.seq >= their_all
            ]
            if beyond:
                skipped[kind] = max(beyond) + 1 - their_all
        self._new_epoch(peer, abort=True, reason=str(err))
        peer.debts = debts
        peer.numbered_debts = {}
        if skipped:
            # The peer takes numbers 0..n-1 of the new epoch for the messages it fails: ours
            # start after them. Their kinds are the mirror of ours.
            for kind, count in skipped.items():
                channel = peer.channels[kind]
                channel.next_seq = channel.issue_next = channel.first_seq = count
            frame = {"k": "fa", "e": peer.epoch, "owe": mirrored(skipped)}
            self._send_frame(peer, {**frame, **_error_fields(err)})
        for unit in doomed:
            self._fail_unit(unit, err, cascade=True, skip_peer=peer.rank)
        for message in sorted(keep, key=lambda m: (m.op.kind, m.seq)):
            self._number(peer, message)
            self._ensure_prepared(peer, message.transport, message.op.kind)

    @staticmethod
    def _agreed_count(channel: ChannelState) -> int:
        """How many of the channel's messages the peer may count as matched: every numbered
        one before the oldest that still waits for the peer's header. On a static channel a
        message is matched one to one without negotiation (the peer promised to post it),
        except one that is not static where the transport keeps headers: it waits for the
        peer's header like any other, and a peer that never posted it owes nothing.

        A message whose header from the peer was compared already (``resolved``) is matched,
        even while it still waits here: one that did not agree fails its unit, and with it the
        pair, from inside that comparison. Counted as unmatched, the peer moved its side to the
        next epoch, where nothing would ever meet it (it waited for its timeout, while this
        side had raised ``MismatchError``)."""
        for message in channel.waiting:
            if message.resolved:
                continue
            if channel.static_desc is None or (message.header and not message.static):
                return message.seq
        return channel.next_seq

    def _settle_finished(
        self, peer: PeerState, *, finished_there: dict[str, int] | None = None
    ) -> None:
        """Completes issued units with ``peer`` whose work already finished but whose completion
        nobody has seen yet: a fault must not fail a transfer whose bytes are in place.

        ``finished_there`` (per our channel kind): how many leading messages the faulting peer
        saw finish. Our counterparts of those are finishing too (the bytes left the sender):
        they get a short while to do so, so that both sides report them alike."""
        deadline = time.monotonic() + _FINISHING_GRACE_S
        for unit in [u for u in self._issued if u.state == "issued" and peer.rank in u.peers]:
            mine = [m for m in unit.messages if m.op.peer == peer.rank]
            finishing = finished_there is not None and all(
                m.seq < finished_there[m.op.kind] for m in mine
            )
            while True:
                try:
                    finished = unit.ready is not None and unit.ready()
                except Exception:  # a failed transport: the fault fails it below
                    break
                if finished:
                    unit.settle()
                    break
                if not finishing or time.monotonic() > deadline:
                    break
                time.sleep(50e-6)

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
        new epoch fail — those posted already, now; the rest as they come."""
        for kind, count in frame["owe"].items():
            channel = peer.channels[kind]
            for message in [m for m in channel.waiting if m.seq < count]:
                channel.waiting.remove(message)
                if message.static:
                    channel.static_candidates -= 1
                self._retire(channel, message.seq)
                unit = self._unit_of(message)
                if unit is not None:
                    same_peer = [m for m in unit.messages if m.op.peer == peer.rank]
                    # A unit with more messages to this peer cannot fail half-way: fault again.
                    skip = peer.rank if len(same_peer) == 1 else None
                    self._fail_unit(unit, err, cascade=True, skip_peer=skip)
            left = count - channel.next_seq
            if left > 0:
                peer.numbered_debts[kind] = (left, err)

    def _new_epoch(self, peer: PeerState, *, abort: bool, reason: str) -> None:
        peer.epoch += 1
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
