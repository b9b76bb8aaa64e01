"""The plain state the p2p issuing engine keeps: units, messages, channels and peers.

Touched only under the engine's lock (see :mod:`._engine`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from tensorferry.p2p import _link
from tensorferry.p2p._spec import Descriptor
from tensorferry.p2p._transfer import Transfer
from tensorferry.p2p._transport import P2POp, PendingOps

__all__ = ["Message", "Unit", "ChannelState", "PeerState"]


@dataclass(eq=False, slots=True)
class Message:
    """One message of a unit: its op, chosen transport and descriptor."""

    op: P2POp
    transport: str
    desc: Descriptor
    static: bool
    seq: int = -1
    epoch: int = -1
    header: bool | None = None  # None: decided when the message reaches its channel's head
    header_sent: bool = False
    resolved: bool = False
    confirmed: bool = True  # False while issued ahead of the peer's header (Engine._speculate)


class Unit:
    """One call or batch: issued as one group (per transport) or failed as a whole.

    A plain class whose rarely set attributes are class-level defaults: every ``tf.send`` makes
    one, and a dataclass's ``__init__`` set all sixteen (and made an empty set) each time."""

    state: str = "new"  # new → waiting → issued → done
    error: BaseException | None = None
    symmetric_error_peers: frozenset[int] | set[int] = frozenset()
    """Peers whose header disagreed with this unit's message in a way both sides see alike
    (a set of its own once one is added: see ``HeaderAgreement._agree``)."""
    after_issued_is_enough: bool = False
    """``after`` only needs to be issued: both units run on one CUDA stream, in order."""
    awaited: bool = False
    """A later unit waits for this one to finish (its ``after``): finishing wakes the engine."""
    parts: Any = None
    """How it is issued, worked out once (on its first engine step): ``False`` (whole), or its
    messages by part (see ``Issuing._parts``)."""
    issued_parts: frozenset[tuple] | None = None
    """The parts whose messages went already, where they go one part at a time: ``(peer,)``
    or ``(peer, kind, index in the unit)`` (see ``Transport.issues_per_peer`` and
    ``issues_per_message``). The unit stays waiting until every part did."""
    ready: Any = None
    """Once issued: true when its work finished (never blocks)."""
    settle: Any = None
    """Once issued: completes it now if nobody did yet (after ``ready`` said true); returns
    whether it did."""
    claim: Any = None
    """Once issued: takes its completion, so that nobody else completes it from then on (a
    fault about to fail it); returns whether it got it."""
    watched: Any = None
    """Once the completion pool has its completion (``Issuing._watch``): the pool's handle."""
    caller_stream: Any = None
    """Where ``caller_event`` is still to be recorded: the raw handle of the caller's current
    stream (``runtime._events.to_record_on_current_stream``). The engine records it before
    ``submit`` returns, in the issue's compiled call where it can; ``None`` once recorded (or
    where there is none)."""
    on_stream: str | None = None
    """Once issued with CUDA work: the transfer stream it is queued on, ``"send"`` or
    ``"recv"`` (see ``Issuing._room_for``); ``None`` again once it ended."""
    kernels: int = 1
    """How many kernels it queued there, as ``_engine_issue._queued_work`` counts them."""
    lane: Any = None
    """The lane its lone static message came by (see :mod:`._lanes`): the short way takes its
    agreement's checks and header from there."""

    def __init__(
        self,
        messages: list[Message],
        transfer: Transfer,
        deadline: float,
        *,
        caller_event: Any = None,
        caller_stream: Any = None,
        after: Unit | None = None,
    ) -> None:
        self.messages = messages
        self.transfer = transfer
        self.deadline = deadline
        self.caller_event = caller_event
        if caller_stream is not None:
            self.caller_stream = caller_stream
        # A unit that must finish first (a ring step reads what the previous step received).
        self.after = after
        self.pending: list[PendingOps] = []

    def __repr__(self) -> str:
        return f"Unit({self.trace_text()}, {self.state})"

    def forget_completion(self) -> None:
        """Drops ``ready``, ``settle``, ``claim`` and ``watched`` once the unit is done or
        failed: they close over the unit itself (the pool's handle, over a function that does),
        and kept, would leave it (and its transfer, messages and completion) to the garbage
        collector. Readers take each into a local first."""
        self.ready = self.settle = self.claim = self.watched = None

    @property
    def peers(self) -> set[int]:
        return {m.op.peer for m in self.messages}

    def trace_text(self) -> str:
        """Its messages for the flight recorder (``_trace``): ``kind/peer/seq@epoch`` each."""
        return " ".join(f"{m.op.kind}/{m.op.peer}/{m.seq}@{m.epoch}" for m in self.messages)


@dataclass(eq=False, slots=True)
class ChannelState:
    next_seq: int = 0
    issue_next: int = 0
    static_desc: Descriptor | None = None
    static_transport: str | None = None
    waiting: deque = field(default_factory=deque)  # unresolved messages, in seq order
    retired: set[int] = field(default_factory=set)  # seqs issued or dropped, ahead of issue_next
    peer_headers: dict[int, dict] = field(default_factory=dict)
    static_candidates: int = 0  # waiting messages with static=True (may set an agreement)
    unconfirmed: dict[int, Any] = field(default_factory=dict)  # seq -> Message issued ahead
    # After a fault the peer started: seqs below this were its old-epoch messages we had
    # already failed (see PairFaults._fault_pair); their headers are dropped.
    first_seq: int = 0
    # A receive of a static channel whose sender may issue ahead met a broken promise: nothing
    # more resolves here until the sender's fault arrives (see Engine._static_broken).
    held: bool = False


@dataclass(eq=False, slots=True)
class PeerState:
    rank: int
    epoch: int = 0
    link: _link.Link | None = None
    connecting: bool = False
    outbox: list = field(default_factory=list)
    lost: BaseException | None = None
    said_bye: bool = False
    prepared: dict = field(default_factory=dict)  # (transport, kind) -> "running" | "done"
    future_frames: list = field(default_factory=list)
    # Per channel: messages of a static channel the peer numbered (and failed) before a fault
    # that we have not posted yet; ours fail on arrival. {kind: (count, error)}
    debts: dict = field(default_factory=dict)
    # Per channel: the peer failed, in a fault we started, messages of ours we had not numbered
    # yet; our next ones take those numbers and fail (see PairFaults._on_fault_ack).
    # {kind: (count, error)}
    numbered_debts: dict = field(default_factory=dict)
    channels: dict = field(default_factory=lambda: {"send": ChannelState(), "recv": ChannelState()})
    # A fault we started, until the peer answers it (see PairFaults): the epoch it ended, and
    # how many messages per channel we had numbered in it. Meanwhile nothing is numbered with
    # the peer: messages of new units wait in ``deferred`` as (message, unit), in order, and
    # those whose units fail meanwhile are only counted, per channel (``tombstones``).
    frozen: int | None = None
    numbered_at_fault: dict = field(default_factory=dict)
    deferred: list = field(default_factory=list)
    tombstones: dict = field(default_factory=dict)
    tombstone_error: BaseException | None = None  # what failed the first of them
    # A symmetric reset (Engine.reset_pair): our waiting caller's future, and the epoch in which
    # the peer said it reached its reset (both needed before the pair's resources go).
    reset_waiter: Any = None
    peer_reset_epoch: int | None = None
    faulting: int = 0  # how deep in handling a fault with the peer we are (PairFaults)
