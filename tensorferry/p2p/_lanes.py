"""Lanes: the repeated call of an agreed static channel, with its choices made once.

A program that passes ``static=True`` sends (or receives) one tensor of one layout to one peer
over and over: an activation each pipeline step, a KV block each decode step. Once both ranks
agreed on the channel's layout and transport, every later call of the general way works out
again what cannot have changed: the transport (ranked by size and peer), the descriptor and
its header text, the transfer's description. A *lane* remembers them for one channel (one
direction with one peer), so the call checks only what can differ — the tensor itself, in one
call of the compiled loop — and hands the engine a unit that says which lane it came by.

A lane decides nothing about the message: the engine's short way still checks, under its lock,
that the channel keeps its agreement (a fault replaces the channel, and the lane with it) and
that nothing waits before the message; only then does the lane's header text go out. Whatever
the lane does not cover (another layout, a tensor that needs the detailed check, a timeout,
another requested transport, a registry change) takes the general way, which raises what it
raises and may open or renew the lane.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from tensorferry.p2p._engine_short import set_agreed_header
from tensorferry.p2p._engine_state import Message, Unit
from tensorferry.p2p._spec import Descriptor, descriptor_text, lone_of_layout
from tensorferry.p2p._transfer import Transfer
from tensorferry.p2p._transport import P2POp, Transport, registry_version
from tensorferry.runtime._events import to_record_on_current_stream

if TYPE_CHECKING:
    from tensorferry.p2p._engine import Engine
    from tensorferry.p2p._engine_state import ChannelState, PeerState

__all__ = ["Lane", "Lanes"]


class Lane:
    """One agreed static channel's lone messages of one layout: what their calls share.

    The attributes a caller reads without the engine's lock (everything but ``channel``,
    ``epoch`` and ``_header``) never change; those three change under it."""

    __slots__ = (
        "_header",
        "channel",
        "cuda",
        "desc",
        "description",
        "device",
        "epoch",
        "kind",
        "name",
        "peer",
        "requested",
        "speculates",
        "text",
        "transport",
        "version",
    )

    def __init__(
        self, message: Message, requested: str, transport: Transport, device: torch.device
    ) -> None:
        self.kind = message.op.kind
        self.peer = message.op.peer
        self.requested = requested
        self.name = message.transport
        self.transport = transport
        self.desc: Descriptor = message.desc
        self.text = descriptor_text(message.desc)
        self.device = device
        self.cuda = device.type == "cuda"
        self.version = registry_version()
        arrow = "to" if self.kind == "send" else "from"
        self.description = f"{self.kind} 1 tensor(s) {arrow} rank {self.peer}"
        # Both kinds of agreement the short way takes: headers issued ahead of the peer's
        # (checked when it comes), or none at all.
        self.speculates = transport.static_speculates
        self.channel: ChannelState | None = None
        self.epoch = -1
        self._header = b""

    def holds(self, peer: PeerState, channel: ChannelState) -> bool:
        """Whether the lane's layout and transport are ``channel``'s agreement (taking on a
        channel that a fault renewed when its new agreement is the same). Under the engine's
        lock."""
        if channel is self.channel and peer.epoch == self.epoch:
            return True
        if channel.static_desc != self.desc or channel.static_transport != self.name:
            return False
        self.channel, self.epoch = channel, peer.epoch
        # The header as Engine._send_header writes it, all but the sequence number.
        self._header = _header_format(self.epoch, self.kind, self.text, self.name)
        return True

    def lets_go(self, message: Message, frame: dict | None) -> bool:
        """What ``ShortWay._agreed`` decides for a message of this lane's held channel, whose
        agreement it keeps by construction: whether it may go (not when the peer's header
        ``frame`` for it differs: the full step reports that), its header's fate set on it."""
        if frame is not None and (frame["t"] != self.name or frame["d"] != self.text):
            return False
        set_agreed_header(message, speculates=self.speculates, frame_came=frame is not None)
        return True

    def header(self, seq: int) -> bytes:
        """The encoded header of this lane's message number ``seq``."""
        return self._header % seq


def _header_format(epoch: int, kind: str, text: str, name: str) -> bytes:
    from tensorferry.p2p._engine import _HEADER  # the engine imports this module

    # Descriptor texts and transport names hold no "%"; escaped all the same.
    fields = (epoch, "s" if kind == "send" else "r", 0, text, "true", name)
    head, _, tail = (_HEADER % fields).partition('"q":0,')
    return (head.replace("%", "%%") + '"q":%d,' + tail.replace("%", "%%")).encode()


class Lanes:
    """A process's lanes, by ``(kind, peer)``: opened and renewed by the general way's calls,
    taken by later ones. Callers read the table without a lock (one dict lookup); the engine
    changes lanes' channel state under its own."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._lanes: dict[tuple[str, int], Lane] = {}

    def call(self, kind: str, item: Any, peer: int, requested: str) -> Transfer | None:
        """A lone static message's call (``tf.send`` / ``tf.recv`` of one tensor to or from
        ``peer``, without a timeout of its own) by the channel's lane: its transfer, submitted;
        or ``None``, having done nothing, where the lane does not cover it."""
        lane = self._lanes.get((kind, peer))
        if lane is None or lane.requested != requested or lane.version != registry_version():
            return None
        tensor = lone_of_layout(item, lane.desc, lane.device)
        if tensor is None:
            return None
        tensors = (tensor,)
        if lane.transport.unsupported_reason(peer=peer, tensors=tensors) is not None:
            return None  # the general way's choice raises it
        engine = self._engine
        deadline = time.monotonic() + engine.ctx.timeout_s
        transfer = Transfer(
            lane.description, deadline=deadline, value=tensor if kind == "recv" else None
        )
        transfer._driver = engine
        message = Message(P2POp(kind, peer, tensors, lane.desc), lane.name, lane.desc, True)
        if lane.cuda:  # recorded as it is issued (Unit.caller_stream)
            event, raw = to_record_on_current_stream(lane.device.index)
            unit = Unit([message], transfer, deadline, caller_event=event, caller_stream=raw)
        else:
            unit = Unit([message], transfer, deadline)
        unit.lane = lane
        engine.submit(unit)
        return transfer

    def offer(self, message: Message, requested: str) -> None:
        """After the general way's call of a lone static message (a bare tensor): opens its
        channel's lane, or renews one of another layout or requested transport, once the
        channel's agreement is this message's."""
        kind, peer = message.op.kind, message.op.peer
        lane = self._lanes.get((kind, peer))
        if (
            lane is not None
            and lane.desc is message.desc
            and lane.requested == requested
            and lane.version == registry_version()
        ):
            return
        # Read without the engine's lock (one more lock per call of the general way, where no
        # lane opens): a lane is only a cache of what those calls work out, and the engine
        # checks under its lock that the channel it goes on keeps the agreement (Lane.holds).
        engine = self._engine
        state = engine._peers.get(peer)
        if state is None or engine._stopping:
            return
        channel = state.channels[kind]
        if channel.static_desc != message.desc or channel.static_transport != message.transport:
            return  # not agreed yet (the peer's header has not come), or another layout
        transport = engine.ctx.transport(message.transport)
        if not (transport.static_speculates or transport.static_skips_headers):
            return  # the short way never takes this transport's messages
        device = message.op.tensors[0].device
        self._lanes[(kind, peer)] = Lane(message, requested, transport, device)

    def close(self) -> None:
        self._lanes.clear()
