"""The p2p engine's short way for agreed static messages (see :meth:`ShortWay._issue_agreed`).

A mixin of :class:`._engine.Engine`, like :mod:`._engine_faults`: it uses the engine's state
and helpers (``_peers``, ``_units``, ``_read_link``, ``_confirm``, ``_compare_header``,
``_send_header``, ``_start``, ``ctx``) and runs under the engine's lock, on the caller's thread
(``Engine.submit``). ``TENSORFERRY_P2P_SHORT_PATH=0`` turns it off.
"""

from __future__ import annotations

from tensorferry.errors import MismatchError
from tensorferry.p2p import _trace
from tensorferry.p2p._engine_state import ChannelState, PeerState, Unit

__all__ = ["ShortWay"]


class ShortWay:
    """Issuing a lone message of an agreed static channel without a full engine step."""

    def _issue_agreed(self, unit: Unit) -> bool:
        """The short way for the common case of a static channel: a lone message that keeps its
        channel's agreement, with nothing of the channel still waiting, is numbered, announced
        and issued at once, without a full engine step (reading every link, scanning every
        channel and unit). Returns false when anything is unusual, having changed nothing but
        handled the frames it read; the full step then handles it (a broken promise, a fault,
        a peer still being set up).

        Like that step it first reads what the peer sent (on the caller's thread: otherwise
        the engine thread wakes for it and takes turns at the GIL with the caller); a fault
        among it is handled before the checks. Other peers' frames wait for the next step."""
        if len(unit.messages) != 1 or unit.after is not None or self._stopping:
            return False
        message = unit.messages[0]
        if not message.static:
            return False
        peer = self._peers.get(message.op.peer)
        if peer is None or peer.link is None:
            return False
        # What the frames set off (a fault, the peer's answer to one) runs as in a step: a
        # transfer polled meanwhile (a fault settles those that finished) must not start a
        # step of its own, which would handle other frames, faults with other peers among
        # them, in the middle of this pair's move to its next epoch.
        stepping = getattr(self._stepping, "on", False)
        self._stepping.on = True
        try:
            read = self._read_link(peer.link)
            usable = not read or self._on_frames_read(peer)
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
            channel.static_desc is None
            or channel.waiting
            or channel.held
            or channel.issue_next != seq
            or message.transport != channel.static_transport
            or message.desc != channel.static_desc
            or peer.numbered_debts.get(kind, (0, None))[0]
            or peer.prepared.get((message.transport, kind)) != "done"
        ):
            return False
        transport = self.ctx.transport(message.transport)
        speculates = transport.static_speculates
        if not (speculates or transport.static_skips_headers):
            return False
        frame = channel.peer_headers.get(seq)
        if frame is not None:
            try:
                self._compare_header(peer, message, frame)
            except MismatchError:
                return False  # the full step reports it (and faults the pair)
            del channel.peer_headers[seq]
        message.seq, message.epoch = seq, peer.epoch
        message.resolved = True
        channel.next_seq = channel.issue_next = seq + 1
        if speculates:  # the peer checks every message against its own (see _confirm)
            message.header = True
            if frame is None:
                message.confirmed = False
                channel.unconfirmed[seq] = message
            self._send_header(peer, message, now=True)
        else:
            message.header = False
        if _trace.ON:
            _trace.record("short way", peer.rank, kind, seq, "epoch", peer.epoch)
        self._start(unit)
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
