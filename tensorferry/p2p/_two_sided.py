"""Two-sided routes: the sender issues at once, the receiver after checking the header.

A route wraps a :class:`~tensorferry.p2p._transport.Transport` (``nccl``, ``gloo``): the
transport moves the bytes of a message both sides agreed on, on the pair's stream for its
direction. A pair's transport resources (a communicator, a process group) are a rendezvous
with the peer, so they are made on a thread of their own the first time a direction needs
them in an epoch: the peer may not have called yet. Every later message finds them made.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

import torch

from tensorferry.errors import TensorFerryError, TransportError
from tensorferry.p2p._transport import P2POp, Transport
from tensorferry.runtime import communicator_cache
from tensorferry.runtime._events import stream_wait

if TYPE_CHECKING:
    from tensorferry.p2p._message import Message
    from tensorferry.p2p._pair import Pair

__all__ = ["TwoSidedRoute", "scratch_for"]

log = logging.getLogger(__name__)

_MAKING = "making"


def scratch_for(desc: Any, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Tensors of layout ``desc``: where a mismatched message's bytes go."""
    return tuple(
        torch.empty(shape, dtype=getattr(torch, dtype), device=device) for dtype, shape in desc
    )


class TwoSidedRoute:
    """A transport's messages, issued eagerly by the sender."""

    receiver_posts = False
    one_sided = False
    # A receive of an NCCL communicator aborted under it can end without its bytes: it ends
    # only once its sender said it sent (frame ``s``).
    confirms_receives = True

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self.name = transport.name
        self._lock = threading.Lock()
        # (peer, kind) -> (epoch, True | _MAKING | the exception the making raised)
        self._made: dict[tuple[int, str], tuple[int, Any]] = {}

    def prepared(self, pair: Pair, kind: str) -> bool:
        """Whether ``kind``'s resources with the peer exist for the pair's epoch; starts making
        them if not.

        Raises:
            TensorFerryError: making them failed (a fault of the pair).
        """
        key, epoch = (pair.peer, kind), pair.epoch
        with self._lock:
            made = self._made.get(key)
            if made is not None and made[0] == epoch:
                if made[1] is True:
                    return True
                if made[1] == _MAKING:
                    return False
                del self._made[key]
                raise made[1]
            if self._cached(pair.peer, kind, epoch):
                self._made[key] = (epoch, True)
                return True
            self._made[key] = (epoch, _MAKING)
        self.transport.ctx.start_making(
            self._make, pair.peer, kind, epoch, name="tensorferry-make-pair"
        )
        return False

    def prepare(self, pair: Pair) -> None:
        """Makes both directions' resources now (``tf.prepare``): a rendezvous with the peer."""
        self.transport.prepare([pair.peer])
        with self._lock:
            for kind in ("send", "recv"):
                self._made[(pair.peer, kind)] = (pair.epoch, True)

    def _cached(self, peer: int, kind: str, epoch: int) -> bool:
        rank = self.transport.ctx.rank
        if self.name == "nccl":
            key = ("nccl", rank, peer) if kind == "send" else ("nccl", peer, rank)
        else:
            key = (self.name, min(rank, peer), max(rank, peer))
        made = communicator_cache().get(key)
        return made is not None and getattr(made, "epoch", None) == epoch

    def _make(self, peer: int, kind: str, epoch: int) -> None:
        try:
            self.transport.prepare_direction(peer, kind)
            outcome: Any = True
        except TensorFerryError as exc:
            outcome = exc
        except Exception as exc:
            outcome = TransportError(f"{self.name}: making the pair with rank {peer} failed: {exc}")
        with self._lock:
            made = self._made.get((peer, kind))
            if made is not None and made[0] == epoch:
                self._made[(peer, kind)] = (epoch, outcome)

    def start(self, pair: Pair, message: Message, *, into: Any = None) -> None:
        """Issues ``message`` (a receive into scratch of layout ``into`` when given)."""
        tensors = message.tensors if into is None else scratch_for(into, pair.ctx.device)
        op = P2POp(message.kind, pair.peer, tensors, into or message.desc)
        if tensors and tensors[0].is_cuda:
            stream = pair.stream(message.kind)
            with torch.cuda.device(pair.ctx.device), torch.cuda.stream(stream):
                if message.caller_event is not None:
                    stream_wait(stream, message.caller_event)
                pending = self.transport.start([op], stream=stream)
                done = torch.cuda.Event()
                done.record(stream)
            message.done_event = done
        else:
            pending = self.transport.start([op])
        message.pending = (pending, tensors)

    def finished(self, pair: Pair, message: Message) -> bool:
        """Whether ``message``'s device work ended (its completion event): before that, a
        receive's bytes may not be there yet, and a send's buffer is still being read.

        Raises:
            TransportError: the transport failed it.
        """
        if not message.pending[0].ready():
            return False
        done = message.done_event
        return done is None or done.query()

    def order_stream(self, pair: Pair, message: Message, stream: Any) -> None:
        if message.done_event is not None:
            stream.wait_event(message.done_event)

    def evict(self, pair: Pair, reason: str) -> None:
        with self._lock:
            for kind in ("send", "recv"):
                self._made.pop((pair.peer, kind), None)
        try:
            self.transport.evict(pair.peer, abort=True, reason=reason)
        except Exception:
            log.debug(
                "p2p: evicting %s's pair with rank %d failed", self.name, pair.peer, exc_info=True
            )

    def close(self) -> None:
        self.transport.close()
