"""The public calls: send, recv, sendrecv, batch, prepare, ring_all_gather.

Every call validates its arguments on the caller's thread (raising ``TypeError``/``ValueError``
before anything moves), records an event on the caller's current CUDA stream, hands one unit to
the p2p engine (which issues it at once when the peer's header is already there) and returns a
:class:`Transfer` without waiting for the peer.

Messages between two ranks match in FIFO order per direction: the k-th message rank A sends
to rank B meets the k-th message B receives from A, whichever calls (send, sendrecv, batch)
carry them on each side.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import torch

from tensorferry._seconds import checked_seconds
from tensorferry.p2p import _context
from tensorferry.p2p._engine import Message, Unit
from tensorferry.p2p._spec import (
    TensorSpec,
    as_recv_list,
    as_tensor_list,
    check_peer,
    check_receives_apart,
)
from tensorferry.p2p._transfer import Transfer
from tensorferry.p2p._transport import P2POp
from tensorferry.runtime._events import to_record_on_current_stream

__all__ = ["send", "recv", "sendrecv", "batch", "Batch", "prepare", "ring_all_gather"]


def _check_options(static: Any, timeout: Any) -> None:
    if not isinstance(static, bool):
        raise TypeError(f"static must be a bool, got {type(static).__name__}")
    if timeout is not None:
        checked_seconds(timeout, "timeout")


def _message(
    ctx: _context.P2PContext,
    kind: str,
    tensors: Any,
    peer: Any,
    *,
    static: bool,
    transport: str,
    what: str,
) -> tuple[Message, bool]:
    peer_name = "dst" if kind == "send" else "src"
    peer = check_peer(peer, rank=ctx.rank, world_size=ctx.world_size, what=peer_name)
    if kind == "send":
        items, desc, single = as_tensor_list(tensors, ctx.device, what)
    else:
        items, desc, single = as_recv_list(tensors, ctx.device, what)
    name = ctx.choose(transport, peer, items, desc)
    message = Message(P2POp(kind, peer, items, desc), name, desc, static)  # type: ignore[arg-type]
    return message, single


def _caller_event(messages: Sequence[Message], device: torch.device) -> tuple[Any, Any]:
    """An event of the work queued so far on the caller's current stream of ``device`` (its
    CUDA tensors are there) and where it is still to be recorded (``Unit.caller_stream``), or
    ``(None, None)`` for a call with CPU tensors only."""
    for m in messages:  # a loop, not any() of a generator: most calls have one message
        if m.op.tensors[0].is_cuda:
            return to_record_on_current_stream(device.index)
    return None, None


def _deadline(ctx: _context.P2PContext, timeout: float | None) -> float:
    return time.monotonic() + (timeout if timeout is not None else ctx.timeout_s)


def _describe(messages: Sequence[Message]) -> str:
    counts: dict[tuple[str, int], int] = {}
    for m in messages:
        counts[(m.op.kind, m.op.peer)] = counts.get((m.op.kind, m.op.peer), 0) + len(m.op.tensors)
    parts = []
    for (kind, peer), num in counts.items():
        arrow = "to" if kind == "send" else "from"
        parts.append(f"{kind} {num} tensor(s) {arrow} rank {peer}")
    return "; ".join(parts)


def _submit(
    ctx: _context.P2PContext,
    messages: list[Message],
    value: Any,
    timeout: float | None,
    *,
    transfer: Transfer | None = None,
    caller_event: Any = True,
    after: Unit | None = None,
) -> Unit:
    deadline = _deadline(ctx, timeout)
    if transfer is None:
        transfer = Transfer(lambda: _describe(messages), deadline=deadline, value=value)
    else:
        transfer._deadline = deadline
        transfer._value = value
    event, raw = (
        _caller_event(messages, ctx.device) if caller_event is True else (caller_event, None)
    )
    unit = Unit(messages, transfer, deadline, caller_event=event, caller_stream=raw, after=after)
    if after is not None:
        after.awaited = True
        unit.after_issued_is_enough = all(m.op.tensors[0].is_cuda for m in messages) and all(
            m.op.tensors[0].is_cuda for m in after.messages
        )
    transfer._driver = ctx.engine
    ctx.engine.submit(unit)
    return unit


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
        static: promise that every message on this channel (this rank → ``dst``) keeps these
            shapes and dtypes. Once both sides passed ``static=True`` and agreed, later
            messages skip the header exchange on transports where that is safe (gloo); NCCL
            keeps every header but issues without waiting for the peer's (see
            ``Transport.static_skips_headers`` and ``static_speculates``). A later change raises
            ``MismatchError`` on both sides (and resets the pair).
        transport: ``"auto"`` (chosen by device and size), ``"nccl"``, ``"gloo"`` or any
            registered transport.
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
    if static is True and timeout is None and type(dst) is int:
        transfer = ctx.engine.lanes.call("send", tensors, dst, transport)
        if transfer is not None:
            return transfer
    _check_options(static, timeout)
    message, single = _message(
        ctx, "send", tensors, dst, static=static, transport=transport, what="tensors"
    )
    transfer = _submit(ctx, [message], None, timeout).transfer
    if static and single:
        ctx.engine.lanes.offer(message, transport)
    return transfer


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
            Tensors that require grad (a model's parameters) are written outside autograd,
            as under ``torch.no_grad()``; ``result()`` then holds detached views of them.
        src: the sending rank (not this one).
        static, transport, timeout: as for :func:`send`.

    Returns:
        A :class:`Transfer` whose ``result()`` is the received tensor (one buffer passed) or
        list of tensors. They are safe to use on any stream once ``wait()`` returned (or
        after ``transfer.wait_stream()`` on the consuming stream).

    Raises:
        TypeError, ValueError: bad arguments (nothing was received).
        RuntimeError: ``tf.init()`` was not called.
    """
    ctx = _context.current()
    if static is True and timeout is None and type(src) is int:
        transfer = ctx.engine.lanes.call("recv", buffers, src, transport)
        if transfer is not None:
            return transfer
    _check_options(static, timeout)
    message, single = _message(
        ctx, "recv", buffers, src, static=static, transport=transport, what="buffers"
    )
    if len(message.op.tensors) > 1:  # one buffer cannot overlap itself: the lone path skips it
        check_receives_apart([("buffers", "recv", message.op.tensors)])
    received = message.op.tensors[0] if single else list(message.op.tensors)
    transfer = _submit(ctx, [message], received, timeout).transfer
    if static and single and type(buffers) is not TensorSpec:
        ctx.engine.lanes.offer(message, transport)
    return transfer


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
    """Sends to ``send_peer`` and receives from ``recv_peer`` as one group (they may differ:
    rings). Arguments as for :func:`send` and :func:`recv`.

    Returns:
        A :class:`Transfer` whose ``result()`` is what was received (tensor or list).
    """
    ctx = _context.current()
    _check_options(static, timeout)
    out, _ = _message(
        ctx,
        "send",
        send_tensors,
        send_peer,
        static=static,
        transport=transport,
        what="send_tensors",
    )
    inc, single = _message(
        ctx,
        "recv",
        recv_buffers,
        recv_peer,
        static=static,
        transport=transport,
        what="recv_buffers",
    )
    check_receives_apart(
        [("send_tensors", "send", out.op.tensors), ("recv_buffers", "recv", inc.op.tensors)]
    )
    received = inc.op.tensors[0] if single else list(inc.op.tensors)
    _prepare_ring_in_order(ctx, [out, inc])
    return _submit(ctx, [out, inc], received, timeout).transfer


def _entry(index: int, message: Message) -> str:
    way = "to" if message.op.kind == "send" else "from"
    return f"batch entry {index} ({message.op.kind} {way} rank {message.op.peer}) tensors"


def _prepare_ring_in_order(ctx: _context.P2PContext, messages: Sequence[Message]) -> None:
    """Prepares, in ascending pair order, both pairs of a ring step over a transport that asks
    for it (``Transport.prepare_in_order``).

    Why: such a transport's pair set-up is a rendezvous that may hold this process (its
    symmetric-memory exchange) until the peer joins. Made lazily, each rank of a ring of three
    or more would start with its own right-hand pair and wait for a neighbour busy with the
    next pair: a cycle. In one global order (lower pair first) every wait is for a pair the
    peer also reaches first. Returns at once when the pairs are already made.
    """
    peers = sorted({m.op.peer for m in messages})
    if len(peers) < 2:
        return  # one peer: a single pair, nothing to order
    for name in sorted({m.transport for m in messages}):
        transport = ctx.transport(name)
        if transport.prepare_in_order:
            transport.prepare(peers)


class Batch(Transfer):
    """Sends and receives collected in a ``with tf.batch() as b:`` block, issued as one group
    call on exit; the batch is itself the :class:`Transfer` of the whole group.

    ``result()`` is a list with one entry per :meth:`recv` call, in call order.
    """

    def __init__(self, *, static: bool, transport: str, timeout: float | None) -> None:
        _check_options(static, timeout)
        self._ctx = _context.current()
        super().__init__("batch (open)", deadline=math.inf, value=[])
        self._static = static
        self._transport = transport
        self._timeout = timeout
        self._messages: list[Message] = []
        self._received: list[Any] = []
        self._state = "new"

    def __enter__(self) -> Batch:
        if self._state != "new":
            raise RuntimeError("a tf.batch() can be entered once")
        self._state = "open"
        return self

    def send(self, tensors: Any, dst: int) -> None:  # type: ignore[override]
        """Adds a send of ``tensors`` to ``dst`` (validated now). See :func:`tf.send`."""
        self._check_open()
        message, _ = _message(
            self._ctx,
            "send",
            tensors,
            dst,
            static=self._static,
            transport=self._transport,
            what="tensors",
        )
        self._messages.append(message)

    def recv(self, buffers: Any, src: int) -> Any:
        """Adds a receive from ``src``; returns the destination tensor(s) (allocated now for
        specs), valid once the batch is done."""
        self._check_open()
        message, single = _message(
            self._ctx,
            "recv",
            buffers,
            src,
            static=self._static,
            transport=self._transport,
            what="buffers",
        )
        self._messages.append(message)
        received = message.op.tensors[0] if single else list(message.op.tensors)
        self._received.append(received)
        return received

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            self._state = "discarded"
            self._finish(exc if isinstance(exc, BaseException) else RuntimeError("discarded"))
            return  # the body raised: nothing was issued; let its error propagate
        if not self._messages:
            self._state = "discarded"
            err = ValueError("tf.batch() is empty: add at least one send or recv")
            self._finish(err)
            raise err
        messages = self._messages
        try:
            check_receives_apart(
                [(n, m.op.kind, m.op.tensors) for n, m in enumerate(messages)],
                names=lambda n: _entry(n, messages[n]),
            )
        except ValueError as err:
            self._state = "discarded"
            self._finish(err)
            raise
        self._state = "submitted"
        self.description = lambda: f"batch: {_describe(messages)}"  # made when shown
        _submit(self._ctx, messages, self._received, self._timeout, transfer=self)

    def _check_open(self) -> None:
        if self._state != "open":
            raise RuntimeError("add sends/recvs inside the `with tf.batch() as b:` block")

    def wait(self, timeout: float | None = None) -> Batch:
        if self._state in ("new", "open"):
            raise RuntimeError("the batch is issued when its `with` block exits; wait after it")
        super().wait(timeout)
        return self


def batch(*, static: bool = False, transport: str = "auto", timeout: float | None = None) -> Batch:
    """A batch of sends and receives to any peers, issued as one group call on exit.

    Example::

        with tf.batch() as b:
            b.send(x, 1)
            y = b.recv(tf.TensorSpec((4, 4), torch.float32), 1)
        b.wait(timeout=10)

    Args: as for :func:`send` (applied to every message of the batch).
    """
    return Batch(static=static, transport=transport, timeout=timeout)


def prepare(
    peers: int | Sequence[int],
    *,
    transports: Sequence[str] | None = None,
) -> None:
    """Creates communicators with ``peers`` now, so the first transfer pays no set-up.

    Blocking: each peer must call ``prepare`` (or transfer) with this rank too. Pairs are
    prepared in ascending (lo, hi) order, which keeps rings of prepares from deadlocking.

    Args:
        peers: a rank or ranks (not this one).
        transports: names to prepare (default: this rank's default, ``nccl`` or ``gloo``).

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
    names = list(transports) if transports is not None else [ctx.backend]
    for name in names:
        ctx.transport(name)  # validates the name
    for peer in ranks:
        for name in names:
            ctx.transport(name).prepare([peer])
            ctx.engine.call(lambda p=peer, n=name: ctx.engine.mark_prepared(p, n)).result(
                ctx.timeout_s
            )


def ring_all_gather(
    out: torch.Tensor,
    inp: torch.Tensor,
    *,
    transport: str = "auto",
    timeout: float | None = None,
) -> Transfer:
    """All-gather around a ring built from :func:`sendrecv`: each step sends to rank + 1 what
    arrived from rank − 1 one step before.

    Args:
        inp: this rank's contribution; same shape and dtype on every rank.
        out: contiguous, ``inp.dtype``, on the same device; shape ``[world * inp.numel()]``
            (flat) or ``[world, *inp.shape]``. Row ``r`` receives rank ``r``'s ``inp``.
        transport, timeout: as for :func:`send` (timeout covers each step).

    Returns:
        A :class:`Transfer` whose ``result()`` is ``out``.

    Raises:
        TypeError, ValueError: bad shapes, dtypes or devices (nothing moved).
    """
    ctx = _context.current()
    _check_options(False, timeout)
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
    ring = Transfer(
        f"ring_all_gather of {inp.numel()} element(s)", deadline=_deadline(ctx, timeout), value=out
    )
    if world == 1:
        ring._finish(None)
        return ring
    right, left = (rank + 1) % world, (rank - 1) % world
    ring._driver = ctx.engine  # a waiter moves the steps on
    prepared = False
    steps: list[Unit] = []
    for step in range(world - 1):
        send_row, recv_row = (rank - step) % world, (rank - step - 1) % world
        out_msg, _ = _message(
            ctx, "send", rows[send_row], right, static=False, transport=transport, what="out row"
        )
        in_msg, _ = _message(
            ctx, "recv", rows[recv_row], left, static=False, transport=transport, what="out row"
        )
        if not prepared:  # every step uses the same two pairs
            _prepare_ring_in_order(ctx, [out_msg, in_msg])
            prepared = True
        unit = _submit(
            ctx,
            [out_msg, in_msg],
            None,
            timeout,
            caller_event=True if step == 0 else None,
            after=steps[-1] if steps else None,
        )
        steps.append(unit)

    def on_step_done(index: int, transfer: Transfer) -> None:
        exc = transfer._outcome.exception()
        if exc is not None:
            ring._finish(exc)
        elif index == len(steps) - 1:
            ring._finish(None)

    for index, unit in enumerate(steps):
        unit.transfer.add_done_callback(lambda t, i=index: on_step_done(i, t))

    def steps_seen_done() -> bool:
        # A waiter on the ring looks at the steps' device work itself: the completion pool
        # leaves a transfer to its waiting caller for a polling window, and nobody waits on
        # the steps themselves (a ring all-gather took 1.9 ms at any size on 2 GPUs).
        for unit in steps:
            step = unit.transfer
            if step._outcome.done():
                if step._outcome.exception() is not None:
                    return False  # on_step_done fails the ring
            elif not step._settled():
                return False
        return True

    ring._mark_issued(ready=steps_seen_done, settle=ring._finish_if_no_callbacks)
    return ring


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
    transfer makes new ones. Benchmark use only (the "uncached" baseline); both ranks must call
    it at the same point of their programs with nothing in flight between them.

    Raises:
        ValueError: transfers with ``peer`` are still in flight.
    """
    ctx = _context.current()
    peer = check_peer(peer, rank=ctx.rank, world_size=ctx.world_size, what="peer")
    deadline = time.monotonic() + (timeout or ctx.timeout_s)
    while True:  # transfers finished on the device may still await their completion callback
        try:
            both = ctx.engine.call(lambda: ctx.engine.reset_pair(peer)).result(
                timeout or ctx.timeout_s
            )
            both.result(max(0.0, deadline - time.monotonic()))  # the peer reached it too
            return
        except ValueError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1e-4)
