"""One message: the tensors of one call (or batch entry) to or from one peer, and its state."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from tensorferry.p2p._spec import Descriptor
from tensorferry.p2p._transport import P2POp

if TYPE_CHECKING:
    from tensorferry.p2p._transfer import Transfer

__all__ = ["Message", "WAITING", "ISSUED", "ENDED"]

# A message's life: numbered and waiting for its peer's frame (or its route's making), issued
# (its device or gloo work runs), ended (done, or failed with ``error``).
WAITING, ISSUED, ENDED = "waiting", "issued", "ended"


class Message:
    """A send or receive of one call, to one peer. Fields are guarded by its pair's lock.

    Attributes:
        kind: ``"send"`` or ``"recv"``.
        op: what the route moves (peer, tensors, layout).
        route: the name of the route (transport) that carries it.
        transfer: the :class:`Transfer` it belongs to.
        caller_event: a CUDA event of the caller's stream at the call (``None`` on the CPU).
        seq, epoch: its number in its direction of the pair, and the pair's epoch then.
        state: ``WAITING``, ``ISSUED`` or ``ENDED``.
        pending: the route's handle of the issued work.
        staged: what its route prepared at the call for its issue (a gloo send's packed
            bytes), or ``None``.
        announced: its frame went to the peer (a two-sided send's header, a one-sided
            receive's post).
        answered: a two-sided send: the receiver's answer (accepted or mismatched) came; a
            receive of a route that confirms receives: its sender said it sent.
        confirmed: a send of such a route: it told the receiver it sent.
        error: why it failed (set once it is known; it ends with it).
        done_event: a CUDA event after its device work, for ``Transfer.wait_stream``.
        after: a message of this rank that must end before this one is issued (a ring
            all-gather's send, after the receive that brings the row it sends), or ``None``.
    """

    __slots__ = (
        "after",
        "announced",
        "answered",
        "caller_event",
        "confirmed",
        "done_event",
        "epoch",
        "error",
        "kind",
        "op",
        "pending",
        "route",
        "seq",
        "staged",
        "state",
        "transfer",
    )

    def __init__(
        self, op: P2POp, route: str, transfer: Transfer | None, caller_event: Any = None
    ) -> None:
        self.kind = op.kind
        self.op = op
        self.route = route
        self.transfer = transfer
        self.caller_event = caller_event
        self.seq = -1
        self.epoch = -1
        self.state = WAITING
        self.pending: Any = None
        self.staged: Any = None
        self.answered = False
        self.announced = False
        self.confirmed = False
        self.error: BaseException | None = None
        self.done_event: Any = None
        self.after: Message | None = None

    def held(self) -> bool:
        """Whether it waits for its ``after`` message, not for its peer."""
        return self.after is not None and self.after.state != ENDED

    def waits_for_peer(self) -> bool:
        """Whether it waits for its peer's frame (or its route's making): only a thread that
        steps its pair issues it then."""
        return self.state == WAITING and not self.held()

    @property
    def peer(self) -> int:
        return self.op.peer

    @property
    def desc(self) -> Descriptor:
        return self.op.layout

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.op.tensors

    def describe(self) -> str:
        way = "to" if self.kind == "send" else "from"
        return f"{self.kind} {len(self.op.tensors)} tensor(s) {way} rank {self.peer}"
