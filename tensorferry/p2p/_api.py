"""The public calls: send, recv, sendrecv, batch, prepare, ring_all_gather.

Every call validates its arguments on the caller's thread (raising ``TypeError``/``ValueError``
before anything moves), records an event on the caller's current CUDA stream where work is
still queued there, numbers its messages with their pairs and issues what can go at once, then
returns a :class:`Transfer`.

Messages between two ranks match in order per direction: the k-th message rank A sends to rank
B meets the k-th message B receives from A, whichever calls (send, sendrecv, batch) carry them.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import time
from collections.abc import Sequence
from typing import Any

import torch

from tensorferry._seconds import checked_seconds
from tensorferry.errors import TensorFerryError, TransferTimeoutError
from tensorferry.p2p import _context
from tensorferry.p2p._links import first_line
from tensorferry.p2p._message import Message
from tensorferry.p2p._spec import (
    as_recv_list,
    as_tensor_list,
    check_peer,
    check_receives_apart,
)
from tensorferry.p2p._transfer import Transfer
from tensorferry.p2p._transport import P2POp
from tensorferry.runtime._events import current_stream_idle, record_on_current_stream

__all__ = ["send", "recv", "sendrecv", "batch", "Batch", "prepare", "ring_all_gather"]


def _check_options(static: Any, timeout: Any) -> float | None:
    """The call's ``timeout`` as checked seconds (``None``: the ``tf.init`` timeout)."""
    if not isinstance(static, bool):
        raise TypeError(f"static must be a bool, got {type(static).__name__}")
    return None if timeout is None else checked_seconds(timeout, "timeout")


def _message(
    ctx: _context.P2PContext, kind: str, tensors: Any, peer: Any, transport: str, what: str
) -> tuple[Message, bool]:
    """A validated message (not yet submitted) and whether one tensor (not a list) was given."""
    peer = check_peer(
        peer, rank=ctx.rank, world_size=ctx.world_size, what="dst" if kind == "send" else "src"
    )
    if kind == "send":
        items, desc, single = as_tensor_list(tensors, ctx.device, what)
    else:
        items, desc, single = as_recv_list(tensors, ctx.device, what)
    route = ctx.choose(transport, peer, items)
    return Message(P2POp(kind, peer, items, desc), route, None), single  # type: ignore[arg-type]


def _deadline(ctx: _context.P2PContext, timeout: float | None) -> float:
    return time.monotonic() + (timeout if timeout is not None else ctx.timeout_s)


def _submit(ctx: _context.P2PContext, messages: list[Message], transfer: Transfer) -> Transfer:
    """Submits ``messages`` as ``transfer``, after the caller's current stream's work: an
    event marks it, unless that work is over already (then nothing needs to wait for it)."""
    event = None
    cuda = ctx.device.type == "cuda" and any(m.tensors[0].is_cuda for m in messages)
    if cuda and not current_stream_idle(ctx.device.index):
        event = record_on_current_stream(ctx.device.index)
        transfer._caller_event = event  # back to the pool once every message is issued
    by_pair: dict[Any, list[Message]] = {}
    for message in messages:
        message.transfer, message.caller_event = transfer, event
        pair = ctx.pair(message.peer)
        transfer._add(message, pair)
        by_pair.setdefault(pair, []).append(message)
    for pair, theirs in by_pair.items():  # one step per pair: a batch's messages go together
        pair.submit(theirs)
    return transfer


def send(
    tensors: torch.Tensor | Sequence[torch.Tensor],
    dst: int,
    *,
    static: bool = False,
    transport: str = "auto",
    timeout: float | None = None,
) -> Transfer:
    """Sends tensors to rank ``dst``; returns at once.

    Args:
        tensors: a tensor or a non-empty list of contiguous tensors on this rank's device (or
            the CPU). The receiver's buffers must have the same count, shapes and dtypes.
        dst: the receiving rank (not this one).
        static: accepted for compatibility; every message takes the same path.
        transport: ``"auto"`` (``ce`` between GPUs of one host, ``nccl`` between hosts,
            ``gloo`` for CPU tensors), or one of those names.
        timeout: seconds until the transfer fails with ``TransferTimeoutError`` (default: the
            ``tf.init`` timeout).

    Returns:
        A :class:`Transfer`; ``result()`` is ``None``. Reads of ``tensors`` are ordered after
        the work already queued on the caller's current stream; do not overwrite them before
        the transfer is done.

    Raises:
        TypeError, ValueError: bad arguments (nothing was sent).
        RuntimeError: ``tf.init()`` was not called.
    """
    ctx = _context.current()
    timeout = _check_options(static, timeout)
    message, _ = _message(ctx, "send", tensors, dst, transport, "tensors")
    return _submit(ctx, [message], Transfer(_deadline(ctx, timeout)))


def recv(
    buffers: Any,
    src: int,
    *,
    static: bool = False,
    transport: str = "auto",
    timeout: float | None = None,
) -> Transfer:
    """Receives tensors from rank ``src``; returns at once.

    Args:
        buffers: a tensor, a :class:`TensorSpec`, or a non-empty list of them. Tensors are
            written in place; specs are allocated here (on this rank's device). Count, shapes
            and dtypes must equal the sender's, else both sides get ``MismatchError``.
            Tensors that require grad (a model's parameters) are written outside autograd;
            ``result()`` then holds detached views of them.
        src: the sending rank (not this one).
        static, transport, timeout: as for :func:`send`.

    Returns:
        A :class:`Transfer` whose ``result()`` is the received tensor (one buffer passed) or
        list of tensors, safe to use on any stream once ``wait()`` returned (or after
        ``transfer.wait_stream()`` on the consuming stream).

    Raises:
        TypeError, ValueError: bad arguments (nothing was received).
        RuntimeError: ``tf.init()`` was not called.
    """
    ctx = _context.current()
    timeout = _check_options(static, timeout)
    message, single = _message(ctx, "recv", buffers, src, transport, "buffers")
    if len(message.tensors) > 1:
        check_receives_apart([("buffers", "recv", message.tensors)])
    received = message.tensors[0] if single else list(message.tensors)
    return _submit(ctx, [message], Transfer(_deadline(ctx, timeout), received))


def sendrecv(
    send_tensors: Any,
    send_peer: int,
    recv_buffers: Any,
    recv_peer: int,
    *,
    static: bool = False,
    transport: str = "auto",
    timeout: float | None = None,
) -> Transfer:
    """Sends to ``send_peer`` and receives from ``recv_peer`` as one transfer (they may
    differ: rings). Arguments as for :func:`send` and :func:`recv`.

    Returns:
        A :class:`Transfer` whose ``result()`` is what was received (tensor or list).
    """
    ctx = _context.current()
    timeout = _check_options(static, timeout)
    out, _ = _message(ctx, "send", send_tensors, send_peer, transport, "send_tensors")
    inc, single = _message(ctx, "recv", recv_buffers, recv_peer, transport, "recv_buffers")
    check_receives_apart(
        [("send_tensors", "send", out.tensors), ("recv_buffers", "recv", inc.tensors)]
    )
    received = inc.tensors[0] if single else list(inc.tensors)
    return _submit(ctx, [out, inc], Transfer(_deadline(ctx, timeout), received))


class Batch(Transfer):
    """Sends and receives collected in a ``with tf.batch() as b:`` block, submitted on exit;
    the batch is itself the :class:`Transfer` of all of them. Each message goes as soon as its
    peer's side is there, so a batch finishes wherever ``batch_isend_irecv`` does.

    ``result()`` is a list with one entry per :meth:`recv` call, in call order.
    """

    def __init__(self, *, static: bool, transport: str, timeout: float | None) -> None:
        timeout = _check_options(static, timeout)
        self._ctx = _context.current()
        super().__init__(math.inf, [])
        self._transport = transport
        self._timeout = timeout
        self._pending: list[Message] = []
        self._state = "new"

    def __enter__(self) -> Batch:
        if self._state != "new":
            raise RuntimeError("a tf.batch() can be entered once")
        self._state = "open"
        return self

    def send(self, tensors: Any, dst: int) -> None:  # type: ignore[override]
        """Adds a send of ``tensors`` to ``dst`` (validated now). See :func:`tf.send`."""
        self._check_open()
        message, _ = _message(self._ctx, "send", tensors, dst, self._transport, "tensors")
        self._pending.append(message)

    def recv(self, buffers: Any, src: int) -> Any:
        """Adds a receive from ``src``; returns the destination tensor(s) (allocated now for
        specs), valid once the batch is done."""
        self._check_open()
        message, single = _message(self._ctx, "recv", buffers, src, self._transport, "buffers")
        self._pending.append(message)
        received = message.tensors[0] if single else list(message.tensors)
        self._value.append(received)
        return received

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            self._state = "discarded"
            self._fail(exc if isinstance(exc, BaseException) else RuntimeError("discarded"))
            return  # the body raised: nothing was submitted; its error propagates
        messages = self._pending
        if not messages:
            self._state = "discarded"
            err = ValueError("tf.batch() is empty: add at least one send or recv")
            self._fail(err)
            raise err
        try:
            check_receives_apart(
                [(n, m.kind, m.tensors) for n, m in enumerate(messages)],
                names=lambda n: _entry(n, messages[n]),
            )
        except ValueError as err:
            self._state = "discarded"
            self._fail(err)
            raise
        self._state = "submitted"
        self.deadline = _deadline(self._ctx, self._timeout)
        _submit(self._ctx, messages, self)

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._finish()

    def _check_open(self) -> None:
        if self._state != "open":
            raise RuntimeError("add sends/recvs inside the `with tf.batch() as b:` block")

    def wait(self, timeout: float | None = None) -> Batch:
        if self._state in ("new", "open"):
            raise RuntimeError("the batch is submitted when its `with` block exits; wait after it")
        super().wait(timeout)
        return self


def _entry(index: int, message: Message) -> str:
    way = "to" if message.kind == "send" else "from"
    return f"batch entry {index} ({message.kind} {way} rank {message.peer}) tensors"


def batch(*, static: bool = False, transport: str = "auto", timeout: float | None = None) -> Batch:
    """A batch of sends and receives to any peers, submitted together on exit.

    Example::

        with tf.batch() as b:
            b.send(x, 1)
            y = b.recv(tf.TensorSpec((4, 4), torch.float32), 1)
        b.wait(timeout=10)

    Args: as for :func:`send` (applied to every message of the batch).
    """
    return Batch(static=static, transport=transport, timeout=timeout)


def prepare(peers: int | Sequence[int], *, transports: Sequence[str] | None = None) -> None:
    """Makes the pairs with ``peers`` now (their links, and the communicators of two-sided
    routes), so the first transfer pays no set-up.

    Blocking: each peer must call ``prepare`` (or transfer) with this rank too. Pairs are
    prepared in ascending rank order, which keeps rings of prepares from deadlocking.

    Args:
        peers: a rank or ranks (not this one).
        transports: route names to prepare (default: this rank's default route for each peer).

    Raises:
        TypeError, ValueError: bad peers or transports.
        TransferTimeoutError, PeerLostError, TransportError: a peer did not show up in time.
    """
    ctx = _context.current()
    ranks = [peers] if isinstance(peers, int) and not isinstance(peers, bool) else peers
    if not isinstance(ranks, (list, tuple)):
        raise TypeError(f"peers must be a rank or a list of ranks, got {type(peers).__name__}")
    ranks = sorted(
        {check_peer(p, rank=ctx.rank, world_size=ctx.world_size, what="peer") for p in ranks}
    )
    for peer in ranks:
        names = list(transports) if transports is not None else [ctx.default_route(peer)]
        for name in names:
            ctx.prepare(peer, name)


def ring_all_gather(
    out: torch.Tensor, inp: torch.Tensor, *, transport: str = "auto", timeout: float | None = None
) -> Transfer:
    """All-gather around a ring built from :func:`sendrecv`: each step sends to rank + 1 what
    arrived from rank − 1 one step before.

    Args:
        inp: this rank's contribution; same shape and dtype on every rank.
        out: contiguous, ``inp.dtype``, on the same device; shape ``[world * inp.numel()]``
            (flat) or ``[world, *inp.shape]``. Row ``r`` receives rank ``r``'s ``inp``.
        transport: as for :func:`send`.
        timeout: seconds for each step (default: the ``tf.init`` timeout); the whole all-gather
            fails with ``TransferTimeoutError`` once ``world - 1`` times that has passed.

    Every step's messages are numbered at this call, so the steps meet the peers' steps
    whatever other calls follow and whenever the transfer is waited for; a step's send goes
    once the step before received the row it sends.

    Returns:
        A :class:`Transfer` whose ``result()`` is ``out``.

    Raises:
        TypeError, ValueError: bad shapes, dtypes or devices (nothing moved).
    """
    ctx = _context.current()
    timeout = _check_options(False, timeout)
    (inp,), _, _ = as_tensor_list(inp, ctx.device, "inp")
    (out,), _, _ = as_tensor_list(out, ctx.device, "out")
    world, rank = ctx.world_size, ctx.rank
    if out.dtype != inp.dtype:
        raise ValueError(f"out dtype {out.dtype} differs from inp dtype {inp.dtype}")
    if out.device != inp.device:
        raise ValueError(f"out is on {out.device}, inp on {inp.device}")
    flat, stacked = (world * inp.numel(),), (world, *inp.shape)
    if tuple(out.shape) not in (flat, stacked):
        raise ValueError(
            f"out shape {list(out.shape)} must be {list(flat)} or {list(stacked)} "
            f"(world {world} × inp {list(inp.shape)})"
        )
    rows = out.view(world, -1)
    _check_gathers_apart(out, inp, rows[rank], rank)
    rows[rank].copy_(inp.reshape(-1))  # on the caller's current stream, before the event
    if world == 1:
        done = Transfer(_deadline(ctx, timeout), out)
        done._finish()
        return done
    right, left = (rank + 1) % world, (rank - 1) % world
    messages: list[Message] = []
    received: Message | None = None  # the step before's receive
    for step in range(world - 1):
        sent, _ = _message(ctx, "send", rows[(rank - step) % world], right, transport, "out")
        sent.after = received  # it sends the row that receive brings
        received, _ = _message(ctx, "recv", rows[(rank - step - 1) % world], left, transport, "out")
        messages += [sent, received]
    per_step = timeout if timeout is not None else ctx.timeout_s
    deadline = time.monotonic() + per_step * (world - 1)
    return _submit(ctx, messages, Transfer(deadline, out))


def _check_gathers_apart(
    out: torch.Tensor, inp: torch.Tensor, own: torch.Tensor, rank: int
) -> None:
    """``inp`` may be this rank's own row of ``out`` (an all-gather in place) or memory apart
    from ``out``; anything between would be overwritten while it is read."""
    start, end = inp.data_ptr(), inp.data_ptr() + inp.nbytes
    out_start = out.data_ptr()
    if not inp.nbytes or end <= out_start or start >= out_start + out.nbytes:
        return
    if start == own.data_ptr():
        return  # in place: its row already holds it
    raise ValueError(
        f"inp shares memory with out but is not out's row for rank {rank} (elements "
        f"{rank * own.numel()} to {(rank + 1) * own.numel() - 1}): pass that row to gather in "
        "place, or a tensor apart from out"
    )


def _reset_pair(peer: int, *, timeout: float | None = None) -> None:
    """Moves the pair with ``peer`` to a fresh epoch: its communicators are closed and the next
    transfer makes new ones. Benchmark use only (the "uncached" baseline); both ranks call it
    at the same point of their programs, and it returns once both did (or raises
    ``TransferTimeoutError`` after ``timeout``)."""
    ctx = _context.current()
    peer = check_peer(peer, rank=ctx.rank, world_size=ctx.world_size, what="peer")
    pair = ctx.pair(peer)
    low, high = sorted((ctx.rank, peer))
    key = f"tensorferry/reset/{low}-{high}/{pair.resets + 1}"
    seconds = ctx.timeout_s if timeout is None else timeout
    # The ranks meet before either lets go: a message that ended here may still be on its
    # way there (an NCCL send over the network ends once NCCL took its bytes, which NCCL's
    # own thread then writes to the socket), and closing its communicator would cut it off.
    _meet(ctx, f"{key}/called", peer, seconds)
    # What the ranks exchanged is over, but a message nobody waited for (a send left to
    # itself) may still be open: it ends now, as a wait would end it, before its resources go.
    until = time.monotonic() + seconds
    for transfer in pair.open_transfers():
        with contextlib.suppress(TensorFerryError):  # (its own failure: reset() ends it)
            transfer.wait(max(0.0, until - time.monotonic()))
    pair.reset()
    # ... and again before either goes on: a frame of the new epoch from the peer must not
    # arrive before this side let go of the old epoch's resources (a sender would forget the
    # layouts the peer's first posts told it).
    _meet(ctx, f"{key}/done", peer, seconds)


def _meet(ctx: _context.P2PContext, key: str, peer: int, seconds: float) -> None:
    """Returns once ``peer`` came to ``key`` too, in the world's store."""
    ctx.store.set(f"{key}/{ctx.rank}", b"1")
    try:
        ctx.store.wait([f"{key}/{peer}"], datetime.timedelta(seconds=seconds))
    except Exception as exc:
        raise TransferTimeoutError(
            f"resetting the pair with rank {peer}: rank {peer} did not reset it within "
            f"{seconds:g} s ({first_line(exc)})"
        ) from None
