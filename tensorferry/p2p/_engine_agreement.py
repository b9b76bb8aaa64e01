"""How the p2p engine agrees each message with the peer's: headers compared, static channels
agreed and kept, messages of agreed channels issued ahead of the peer's header and confirmed
when it comes.

A mixin of :class:`._engine.Engine`, like :mod:`._engine_faults`: it uses the engine's state
(``ctx``, ``rank``) and steps of the engine and its other parts (``_send_header``,
``_retire``, ``_unit_of``, ``_fail_unit``, ``_fault_pair``), and runs under the engine's lock.
"""

from __future__ import annotations

from tensorferry.errors import MismatchError
from tensorferry.p2p._engine_state import ChannelState, Message, PeerState
from tensorferry.p2p._spec import Descriptor, compare, descriptor_from_text, descriptor_text

__all__ = ["HeaderAgreement"]


class HeaderAgreement:
    """Resolving a channel's waiting messages against the peer's headers and the channel's
    static agreement."""

    def _resolve(self, peer: PeerState, kind: str) -> None:
        channel: ChannelState = peer.channels[kind]
        while channel.waiting and not channel.held:
            message: Message = channel.waiting[0]
            if message.header is None:  # only where static agreements skip headers
                if channel.static_desc is not None:
                    message.header = False
                else:
                    message.header = True
                    self._send_header(peer, message)
            if message.header:
                frame = channel.peer_headers.pop(message.seq, None)
                if frame is not None:
                    self._agree(peer, channel, message, frame)
                elif self._may_speculate(channel, message):
                    self._speculate(peer, channel, message)
                else:
                    return
            else:
                self._check_static(peer, channel, message)
            if peer.channels[kind] is not channel:
                return  # a fault moved the pair to a new epoch meanwhile
            if channel.waiting and channel.waiting[0] is message:
                channel.waiting.popleft()
                if message.static:
                    channel.static_candidates -= 1

    def _may_speculate(self, channel: ChannelState, message: Message) -> bool:
        return (
            message.static
            and channel.static_desc is not None
            and self.ctx.transport(message.transport).static_speculates
        )

    def _speculate(self, peer: PeerState, channel: ChannelState, message: Message) -> None:
        """Resolves a message of an agreed static channel before the peer's header arrived (see
        ``Transport.static_speculates``): checked against the agreement now (a change faults the
        pair before anything moves), issued without waiting, and done only once the peer's
        header confirmed it (:meth:`_confirm`)."""
        self._check_static(peer, channel, message)
        if peer.channels[message.op.kind] is channel:  # no fault: it kept the promise
            message.confirmed = False
            channel.unconfirmed[message.seq] = message

    def _confirm(self, peer: PeerState, kind: str) -> None:
        """Checks the peer's headers of messages issued before they arrived."""
        channel: ChannelState = peer.channels[kind]
        for seq in [q for q in channel.unconfirmed if q in channel.peer_headers]:
            message = channel.unconfirmed.pop(seq)
            try:
                self._compare_header(peer, message, channel.peer_headers.pop(seq))
            except MismatchError as exc:
                # The peer broke the promise: our side is issued, so only a pair fault (which
                # aborts the communicator) ends it: ours, or the sender's (_static_broken).
                err = MismatchError(f"static channel changed: {exc}", field=exc.field)
                self._static_broken(peer, channel, message, err)
                return
            message.confirmed = True

    def _compare_header(self, peer: PeerState, message: Message, frame: dict) -> None:
        """Raises :class:`MismatchError` naming the first field where ``message`` and the peer's
        header ``frame`` for it differ (both sides compare the same pair, so both raise it)."""
        ours = message.desc
        if frame["t"] == message.transport and frame["d"] == descriptor_text(ours):
            return  # the common case: one string comparison
        theirs: Descriptor = descriptor_from_text(frame["d"])
        send_desc, recv_desc = (ours, theirs) if message.op.kind == "send" else (theirs, ours)
        src, dst = (self.rank, peer.rank) if message.op.kind == "send" else (peer.rank, self.rank)
        if frame["t"] != message.transport:
            raise MismatchError(
                f"rank {src} -> rank {dst}: transports differ: rank {self.rank} uses "
                f"{message.transport!r}, rank {peer.rank} uses {frame['t']!r}",
                field="transport",
            )
        compare(send_desc, recv_desc, src=src, dst=dst)

    def _agree(self, peer: PeerState, channel: ChannelState, message: Message, frame: dict) -> None:
        message.resolved = True
        try:
            self._compare_header(peer, message, frame)
        except MismatchError as exc:
            if channel.static_desc is not None and frame.get("st") and self._speculates(frame):
                # The peer may have issued its side ahead: not a lone mismatch.
                err = MismatchError(f"static channel changed: {exc}", field=exc.field)
                self._static_broken(peer, channel, message, err)
                return
            unit = self._unit_of(message)
            if unit is not None:
                unit.symmetric_error_peers = {*unit.symmetric_error_peers, peer.rank}
                self._fail_unit(unit, exc, cascade=True, skip_peer=None)
            self._retire(channel, message.seq)
            return
        self._note_agreement(channel, message, frame)

    def _note_agreement(self, channel: ChannelState, message: Message, frame: dict) -> None:
        """After ``message`` agreed with the peer's header ``frame``: where both promised a
        static channel, on a transport that takes advantage of one, that is now its agreed
        layout."""
        if not (message.static and frame["st"] and channel.static_desc is None):
            return
        transport = self.ctx.transport(message.transport)
        if transport.static_skips_headers or transport.static_speculates:
            channel.static_desc = message.desc
            channel.static_transport = message.transport

    def _check_static(self, peer: PeerState, channel: ChannelState, message: Message) -> None:
        message.resolved = True
        agreed = channel.static_desc
        assert agreed is not None
        src, dst = (self.rank, peer.rank) if message.op.kind == "send" else (peer.rank, self.rank)
        try:
            if message.transport != channel.static_transport:
                raise MismatchError(
                    f"rank {src} -> rank {dst}: transport changed on a static channel",
                    field="transport",
                )
            compare(
                agreed,
                message.desc,
                src=src,
                dst=dst,
                names=("the channel's agreed layout", f"this {message.op.kind}"),
            )
        except MismatchError as exc:
            err = MismatchError(
                f"static channel changed: {exc} (once agreed, a channel keeps its layout for "
                "every later message, static=False ones included: pass static=True only for a "
                "layout that never changes between these two ranks)",
                field=exc.field,
            )
            channel.waiting.popleft()
            if message.static:
                channel.static_candidates -= 1
            if self.ctx.transport(message.transport).static_speculates:
                self._static_broken(peer, channel, message, err)
            else:  # no headers go out on this channel: the peer learns only from our fault
                self._fault_pair(peer, err, notify=True)

    def _speculates(self, frame: dict) -> bool:
        try:
            return bool(self.ctx.transport(frame["t"]).static_speculates)
        except Exception:  # a transport this rank does not have: it issues nothing ahead here
            return False

    def _static_broken(
        self, peer: PeerState, channel: ChannelState, message: Message, err: BaseException
    ) -> None:
        """A broken static promise on a channel whose messages may be issued ahead of the peer's
        header. Its SENDER faults the pair; the receiver fails its message and holds the channel
        until that fault arrives. Were both to fault at once, each would see the other's notice
        as stale and their counts would never meet; were the receiver to go on, its next receive
        could take the sender's message already in flight."""
        if message.op.kind == "send":
            self._fault_pair(peer, err, notify=True)
            return
        channel.held = True
        unit = self._unit_of(message)
        if unit is not None and unit.state == "waiting":
            self._fail_unit(unit, err, cascade=True, skip_peer=peer.rank)
        # An issued one (received ahead) ends with the sender's fault, which aborts the pair.
