"""The p2p engine's short way for lone messages (see :meth:`ShortWay._issue_short`).

A mixin of :class:`._engine.Engine`, like :mod:`._engine_faults`: it uses the engine's state
and helpers (``_peers``, ``_units``, ``_handle_frames``, ``_confirm``, ``_compare_header``,
``_send_header``, ``_start``, ``ctx``) and runs under the engine's lock, on the caller's thread
(``Engine.submit``). ``TENSORFERRY_P2P_SHORT_PATH=0`` turns it off.
"""

from __future__ import annotations

import time

from tensorferry.errors import MismatchError
from tensorferry.p2p import _trace
from tensorferry.p2p._engine_state import ChannelState, Message, PeerState, Unit

__all__ = ["ShortWay", "set_agreed_header"]

# How recently (seconds) the link to the peer must have been read for a lane's message to skip
# its own read (see ShortWay._issue_short).
_FRESH_READ_S = 1e-3


def set_agreed_header(message: Message, *, speculates: bool, frame_came: bool) -> None:
    """The header's fate of a message of an agreed static channel that may go: on a transport
    that issues such messages ahead, it keeps its header (the peer checks every message
    against its own, see ``_confirm``) and is confirmed only if the peer's header came; on one
    that skips headers, it has none."""
    message.header = speculates
    message.confirmed = frame_came or not speculates


class ShortWay:
    """Issuing a lone message without a full engine step, where nothing about it is unusual."""

    def _issue_short(self, unit: Unit) -> bool:
        """The short way for the common cases of a lone message, with nothing of its channel
        still waiting: it is numbered, announced and issued at once, without a full engine
        step (reading every link, scanning every channel and unit). Two cases:

        - *agreed*: the message keeps its static channel's agreement, on a transport that
          issues such messages without waiting for the peer's header (or skips headers);
        - *answered*: the peer's header for it came already (the peer called first), and the
          channel has no agreement: the header is compared here, and may set one.

        Returns false when anything is unusual, having changed nothing but handled the frames
        it read; the full step then handles it (a broken promise, a mismatch, a fault, a peer
        still being set up, a header not yet there).

        Like that step it first reads what the peer sent (on the caller's thread: otherwise
        the engine thread wakes for it and takes turns at the GIL with the caller); a fault
        among it is handled before the checks. Other peers' frames wait for the next step. A
        message that is not static reads nothing here unless a header of the peer's was read
        already: the full step, which it then takes, would read the link again. Nor does a
        message that came by its channel's lane where the link was read a moment ago."""
        if len(unit.messages) != 1 or unit.after is not None or self._stopping:
            return False
        message = unit.messages[0]
        if self._full_streams and message.op.kind in self._full_streams:
            return False  # the full step holds it until there is room (Issuing._room_for)
        peer = self._peers.get(message.op.peer)
        if peer is None or peer.link is None:
            return False
        if not message.static and not peer.channels[message.op.kind].peer_headers:
            return False
        # A lane's message reads nothing where the link was read within _FRESH_READ_S (the
        # caller's wait for its last transfer, in a ping-pong): the system call was a tenth of
        # the call's host time, and what came since could as well still be on its way (the
        # peer's headers of messages issued ahead, which whoever waits for them reads; a fault
        # notice, which then fails this message too, as it would had it come a moment later).
        link = peer.link
        if unit.lane is not None and time.monotonic() - link.read_at < _FRESH_READ_S:
            frames = []
        else:
            frames = link.receive()
        if frames is None or frames:  # most reads find nothing: no step to mark then
            # What the frames set off (a fault, the peer's answer to one) runs as in a step: a
            # transfer polled meanwhile (a fault settles those that finished) must not start a
            # step of its own, which would handle other frames, faults with other peers among
            # them, in the middle of this pair's move to its next epoch.
            stepping = getattr(self._stepping, "on", False)
            self._stepping.on = True
            try:
                usable = self._handle_frames(link, frames) > 0 and self._on_frames_read(peer)
            finally:
                self._stepping.on = stepping
            if not usable:
                return False
        if peer.lost is not None or peer.link is None or peer.debts:
            return False
        kind = message.op.kind
        channel: ChannelState = peer.channels[kind]
        seq = channel.next_seq
        if (
            channel.waiting
            or channel.held
            or channel.issue_next != seq
            or peer.numbered_debts.get(kind, (0, None))[0]
            or peer.prepared.get((message.transport, kind)) != "done"
        ):
            return False
        frame = channel.peer_headers.get(seq)
        lane = unit.lane
        if lane is not None and not lane.holds(peer, channel):
            lane = None
        if lane is not None:
            goes = lane.lets_go(message, frame)
        elif channel.static_desc is not None:
            goes = self._agreed(peer, channel, message, frame)
        else:
            goes = self._answered(peer, channel, message, frame)
        if not goes:
            return False
        if frame is not None:
            del channel.peer_headers[seq]
        message.seq, message.epoch = seq, peer.epoch
        message.resolved = True
        channel.next_seq = channel.issue_next = seq + 1
        if message.header:
            if not message.confirmed:  # issued ahead: the peer's header confirms it later
                channel.unconfirmed[seq] = message
            self._send_header(peer, message, now=True, data=lane.header(seq) if lane else None)
        if _trace.ON:
            _trace.record("short way", peer.rank, kind, seq, "epoch", peer.epoch)
        self._start(unit)
        return True

    def _agreed(
        self, peer: PeerState, channel: ChannelState, message: Message, frame: dict | None
    ) -> bool:
        """The agreed case: whether ``message`` may go, its header's fate set on it. Changes
        nothing else."""
        if (
            not message.static
            or message.transport != channel.static_transport
            or message.desc != channel.static_desc
        ):
            return False
        transport = self.ctx.transport(message.transport)
        speculates = transport.static_speculates
        if not (speculates or transport.static_skips_headers):
            return False
        if frame is not None:
            try:
                self._compare_header(peer, message, frame)
            except MismatchError:
                return False  # the full step reports it (and faults the pair)
        set_agreed_header(message, speculates=speculates, frame_came=frame is not None)
        return True

    def _answered(
        self, peer: PeerState, channel: ChannelState, message: Message, frame: dict | None
    ) -> bool:
        """The answered case: whether ``message`` may go, having agreed with the peer's header
        ``frame`` (which may set the channel's static agreement). Not while a fault with the
        peer waits for its answer or a reset is under way: those number messages their own
        way. Changes nothing where it may not go."""
        if frame is None or peer.frozen is not None or peer.reset_waiter is not None:
            return False
        try:
            self._compare_header(peer, message, frame)
        except MismatchError:
            return False  # the full step reports it on both sides
        self._note_agreement(channel, message, frame)
        message.header = True
        return True

    def _on_frames_read(self, peer: PeerState) -> bool:
        """After the short way read ``peer``'s frames: confirms the messages they confirm, and
        returns false when other units wait (what the frames let go is for a full step)."""
        if self._units:
            return False
        for kind in ("send", "recv"):
            if peer.channels[kind].unconfirmed:
                self._confirm(peer, kind)
        return True
