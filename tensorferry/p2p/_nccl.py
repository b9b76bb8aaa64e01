"""The NCCL transport: CUDA tensors, one NCCL communicator per direction of a pair of ranks.

Why one per direction: a communicator runs its operations one after another on one stream, in
the order each rank issued them. Messages of the two directions are independent FIFOs here (a
rank may send then receive while its peer does the same, or post eight receives before its first
send), so the two ranks issue them in different orders; on a shared communicator a receive
queued ahead of a send on one rank, and the reverse on the other, wait for each other forever
once messages are too large for NCCL's buffers. With one communicator per direction each keeps
exactly its direction's FIFO order, which both ranks share.

Communicators are our own, made through the NCCL library itself (:mod:`._nccl_lib`): the
sending rank makes the unique id and puts it in a per-pair ``PrefixStore`` of the world store,
so only the two ranks take part. Each is cached in the runtime's communicator cache under
``("nccl", src, dst)`` and made once per direction (per epoch), lazily by the first message that
way (``prepare_direction``), or for both directions by ``prepare``. Making one also runs one tiny
send/recv, because NCCL connects the two ranks at their first transfer: afterwards the first real
transfer pays nothing for set-up. Where the library cannot be loaded (a torch that links NCCL
statically, with no ``nvidia-nccl`` wheel beside it) a ``ProcessGroupNCCL`` per direction stands
in, with the same behaviour and more host time per call.

``start`` issues every message of a call as ONE NCCL group, whatever their directions and
peers, enqueued on the transfer's stream (after the caller's work, before the layer's
completion event): NCCL launches the whole group at once. A lone tensor on our own
communicator, the commonest call, is one ``ncclSend``/``ncclRecv`` outside any group: what
NCCL does with a group of one, with less host work around it. Tensors travel as bytes, so
every dtype works. Tensors
under :data:`PACK_BELOW` of a message with several of them are packed, on the transfer's
stream: into a buffer kept for that layout and direction (:mod:`._staging`: one copy kernel
launch per dtype each way, :mod:`._piece_copy`), or, for a layout whose
tensors cannot be viewed in such a buffer, into a fresh one (one ``cat`` on the sender, one
``_foreach_copy_`` on the receiver). With several peers or both directions the group spans
their communicators (``_enqueue`` says why separate groups would deadlock).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

from tensorferry.errors import TransferTimeoutError, TransportError
from tensorferry.p2p._nccl_lib import NcclLibrary
from tensorferry.p2p._nccl_lib import library as nccl_library
from tensorferry.p2p._packing import as_bytes, pack, unpack, wire_plan
from tensorferry.p2p._staging import Staging, StagingCache, layout_plan
from tensorferry.p2p._torch_groups import errors_left_to_us
from tensorferry.p2p._transport import (
    P2POp,
    PendingOps,
    Transport,
    TransportContext,
    cached_pair,
    few_in_flight,
)
from tensorferry.runtime import communicator_cache
from tensorferry.runtime._communicators import abort_together
from tensorferry.runtime._stream_switch import on_stream

__all__ = ["NcclTransport", "PACK_BELOW"]

log = logging.getLogger(__name__)

_TAG = 0
# Tensors under this size in a message of several travel packed: one cat kernel and one NCCL
# send instead of one send per tensor (each send in a group costs host time in ProcessGroupNCCL,
# and the 64 × 4 KiB batch has to beat 64 separate calls by 10×).
PACK_BELOW = 64 << 10
# ProcessGroupNCCL's own watchdog timeout sits past ours so that our deadline (which aborts
# the pair cleanly) always fires first.
_WATCHDOG_MARGIN_S = 120.0


class _NativePair:
    """One direction of a pair as our own NCCL communicator (:mod:`._nccl_lib`): its kernels
    run on the transfer's stream, so the layer's completion event covers them."""

    def __init__(self, lib: NcclLibrary, comm: int, other: int, epoch: int) -> None:
        self.lib = lib
        self.comm = comm
        self.other = other  # the peer's rank within the pair
        self.epoch = epoch
        self._aborted = False
        # Its first message (the warm-up) connects the two ranks, a rendezvous: until that is
        # done, every NCCL call lets go of the GIL.
        self.connected = False

    def may_hold_gil(self) -> bool:
        """Whether NCCL's calls that launch this pair's work may keep the GIL: the pair is
        connected and few transfers are in flight (see ``few_in_flight``)."""
        return self.connected and few_in_flight()

    def enqueue(self, wire: list[tuple[str, torch.Tensor]], stream: Any) -> None:
        """``wire`` as one NCCL group of its own on ``stream``."""
        self.lib.group_start()
        try:
            self.add(wire, stream.cuda_stream)
        finally:
            self.lib.group_end(self.may_hold_gil())

    def add(self, wire: list[tuple[str, torch.Tensor]], handle: int) -> None:
        """Adds ``wire``'s operations to the NCCL group the caller has open. A contiguous
        tensor of any dtype travels as its bytes: NCCL takes its address and byte count, so no
        ``uint8`` view of it is made (a few microseconds each on the caller's thread)."""
        lib, comm, other = self.lib, self.comm, self.other
        for kind, buf in wire:
            move = lib.send if kind == "send" else lib.recv
            move(buf.data_ptr(), buf.numel() * buf.element_size(), other, comm, handle)

    def move_alone(self, kind: str, buf: torch.Tensor, handle: int) -> None:
        """``buf``'s bytes to or from the peer on the stream ``handle``, outside any group (see
        ``NcclLibrary.move_alone``)."""
        nbytes = buf.numel() * buf.element_size()
        hold = self.may_hold_gil()
        self.lib.move_alone(kind, buf.data_ptr(), nbytes, self.other, self.comm, handle, hold)

    def ready(self, _work: None) -> bool:
        if self._aborted:
            raise TransportError("nccl: the communicator was aborted")
        error = self.lib.async_error(self.comm)
        if error is not None:
            raise TransportError(f"nccl: {error}")
        return True  # the device work itself is covered by the layer's completion event

    def abort(self) -> None:
        if not self._aborted:
            self._aborted = True
            try:
                self.lib.abort(self.comm)
            except Exception:
                log.warning("nccl: aborting a communicator failed", exc_info=True)

    def close(self) -> None:
        # Abort, not destroy: ncclCommAbort is local and never waits for the peer (which may
        # be gone at tf.shutdown, or closing at the same moment in the uncached bench).
        self.abort()


class _GroupPair:
    """One direction of a pair as a ``ProcessGroupNCCL`` (when the NCCL library cannot be
    loaded directly): its own stream, ordered with the transfer's by the work object."""

    def __init__(self, pg: Any, other: int, epoch: int) -> None:
        self.pg = pg
        self.other = other  # the peer's rank within the pair
        self.epoch = epoch

    def enqueue(self, wire: list[tuple[str, torch.Tensor]], stream: Any) -> Any:
        """Issues ``wire`` as one coalesced group on the process group's own stream, after the
        work queued on ``stream``; returns its work, which :meth:`order_after` orders ``stream``
        after (not here: see ``NcclTransport._enqueue``)."""
        pg = self.pg
        with on_stream(stream):  # ProcessGroupNCCL orders its own stream after the current one
            pg._start_coalescing()
            try:
                for kind, buf in wire:
                    (pg.send if kind == "send" else pg.recv)([as_bytes(buf)], self.other, _TAG)
            finally:
                work = pg._end_coalescing()
        return work

    @staticmethod
    def order_after(work: Any, stream: Any) -> None:
        """Makes ``stream`` wait on the device for ``work``; the host goes on."""
        with on_stream(stream):
            work.wait()

    def ready(self, work: Any) -> bool:
        return work.is_completed()

    def abort(self) -> None:
        with contextlib.suppress(Exception):
            self.pg.abort()

    def close(self) -> None:
        self.abort()  # as for _NativePair


class _NcclPending(PendingOps):
    def __init__(self, started: list[tuple[Any, Any]], keep: list[Any]) -> None:
        self._started = started  # (pair, what its enqueue returned)
        self._keep = keep  # packed buffers: alive until the device is done with them

    def ready(self) -> bool:
        try:
            # A loop, not all() of a generator: polled over and over while in flight.
            for pair, work in self._started:  # noqa: SIM110
                if not pair.ready(work):
                    return False
            return True
        except TransportError:
            raise
        except Exception as exc:
            raise TransportError(f"nccl: {exc}") from exc

    def abort(self) -> None:
        abort_together([pair for pair, _ in self._started])


class NcclTransport(Transport):
    """CUDA tensors over NCCL; the default for CUDA tensors."""

    name = "nccl"
    device_type = "cuda"

    def __init__(self, ctx: TransportContext) -> None:
        super().__init__(ctx)
        self._staging = StagingCache()

    def unsupported_reason(self, *, peer: int, tensors: Sequence[torch.Tensor]) -> str | None:
        # A message's tensors share one device (validated). is_cuda, not device.type: asked on
        # every call, and the device's type costs a quarter of a microsecond to read.
        if tensors[0].is_cuda:
            return None
        device = tensors[0].device
        return f"nccl moves CUDA tensors, got a tensor on {device} (use transport='gloo')"

    def _key(self, src: int, dst: int) -> tuple[str, int, int]:
        return ("nccl", src, dst)

    def _prepared_pair(self, src: int, dst: int) -> Any:
        """The communicator pair of direction ``src`` → ``dst``, made by :meth:`prepare`."""
        pair = communicator_cache().get(self._key(src, dst))
        if pair is None:
            raise TransportError(f"nccl: the direction rank {src} → {dst} is not prepared")
        return pair

    def _direction_key(self, peer: int, kind: str) -> tuple[str, int, int]:
        """The cache key of the direction that carries messages of ``kind`` with ``peer``
        (``_key(*_ends(peer, kind))`` in one call: asked on every lone tensor's issue)."""
        rank = self.ctx.rank
        return ("nccl", rank, peer) if kind == "send" else ("nccl", peer, rank)

    def _ends(self, peer: int, kind: str) -> tuple[int, int]:
        """``(src, dst)`` of the direction that carries messages of ``kind`` with ``peer``."""
        return (self.ctx.rank, peer) if kind == "send" else (peer, self.ctx.rank)

    def prepare(self, peers: Sequence[int]) -> None:
        # Both ranks make the pair's two directions in one order: lower rank → higher first.
        for peer in sorted(peers):
            low, high = self.ctx.pair(peer)
            for src, dst in ((low, high), (high, low)):
                self._pair(src, dst)

    def prepare_direction(self, peer: int, kind: str) -> None:
        self._pair(*self._ends(peer, kind))

    def _pair(self, src: int, dst: int) -> _NativePair | _GroupPair:
        key = self._key(src, dst)
        peer = dst if src == self.ctx.rank else src
        epoch = self.ctx.epoch_of(peer)
        return cached_pair(key, epoch, lambda: self._create(src, dst, epoch))

    def _create(self, src: int, dst: int, epoch: int) -> _NativePair | _GroupPair:
        device = self.ctx.device
        sending = src == self.ctx.rank
        peer = dst if sending else src
        store = self.ctx.pair_store(peer, f"nccl/{src}-to-{dst}", epoch)
        self.ctx.meet(store, peer, f"nccl: the direction rank {src} -> {dst}", epoch)
        me = 0 if sending else 1
        lib = nccl_library()
        with torch.cuda.device(device):
            if lib is not None:
                # The sending side makes the id; the store's wait bounds the rendezvous.
                if sending:
                    store.set("unique_id", lib.unique_id())
                comm = lib.init_rank(2, bytes(store.get("unique_id")), me)
                pair: _NativePair | _GroupPair = _NativePair(lib, comm, 1 - me, epoch)
            else:
                import torch.distributed as dist

                options = dist.ProcessGroupNCCL.Options()
                options._timeout = self.ctx.timeout + datetime.timedelta(seconds=_WATCHDOG_MARGIN_S)
                with errors_left_to_us():
                    group = dist.ProcessGroupNCCL(store, me, 2, options)
                pair = _GroupPair(group, 1 - me, epoch)
            # Warm-up message: NCCL connects the two ranks at their first send/recv, a
            # rendezvous; here on this helper thread rather than in the first real transfer.
            stream = torch.cuda.Stream(device)
            with torch.cuda.stream(stream):
                probe = torch.ones(1, dtype=torch.uint8, device=device)
                work = pair.enqueue([("send" if sending else "recv", probe)], stream)
                if isinstance(pair, _GroupPair):
                    pair.order_after(work, stream)
                done = torch.cuda.Event()
                done.record(stream)
        deadline = time.monotonic() + self.ctx.timeout.total_seconds()
        while not done.query():
            if time.monotonic() > deadline:
                pair.abort()
                raise TransferTimeoutError(f"nccl: warm-up with rank {peer} timed out")
            time.sleep(1e-4)
        if isinstance(pair, _NativePair):
            pair.connected = True
        return pair

    def start(self, ops: Sequence[P2POp], *, stream: Any = None) -> PendingOps:
        # No stream switch around it: NCCL, the staging copies and the events take `stream`
        # explicitly; what runs torch operations on the current stream (a fresh packing, a
        # new staging buffer, a ProcessGroupNCCL pair) switches to `stream` itself.
        if len(ops) == 1:
            op = ops[0]
            src, dst = self._ends(op.peer, op.kind)
            pair = self._prepared_pair(src, dst)
            if len(op.tensors) == 1:
                return self._start_one(pair, op, stream)
            if isinstance(pair, _NativePair):
                staging = self._staging_for(op, src, dst, stream)
                if staging is not None and not staging.alone:
                    return self._start_staged(pair, op, staging, stream)
        return self._start_grouped(ops, stream)

    @staticmethod
    def _start_staged(pair: _NativePair, op: P2POp, staging: Staging, stream: Any) -> PendingOps:
        """A message whose tensors all travel in its layout's kept buffer, with one peer on our
        own communicator (many small tensors: a KV cache's blocks, ``bench batch``'s list):
        what :meth:`_start_grouped` does for it, with nothing to group."""
        staging.claim(stream)
        if op.kind == "send":
            staging.pack(op.tensors, stream)  # after the caller's writes
            pair.move_alone("send", staging.buffer, stream.cuda_stream)
        else:
            pair.move_alone("recv", staging.buffer, stream.cuda_stream)
            staging.unpack(op.tensors, stream)
        staging.release(stream)
        return _NcclPending([(pair, None)], [])

    def _start_grouped(self, ops: Sequence[P2POp], stream: Any) -> PendingOps:
        by_direction: dict[tuple[int, int], list[P2POp]] = {}
        for op in ops:
            by_direction.setdefault(self._ends(op.peer, op.kind), []).append(op)
        wires, keep, used = [], [], []
        to_unpack: list[tuple[Any, Any]] = []  # (staging or packed buffer, the tensors)
        for (src, dst), peer_ops in by_direction.items():
            pair = self._prepared_pair(src, dst)
            wire: list[tuple[str, torch.Tensor]] = []
            for op in peer_ops:
                staging = self._staging_for(op, src, dst, stream)
                if staging is not None and staging not in used:  # once per group
                    used.append(staging)
                    staging.claim(stream)
                    if op.kind == "send":
                        staging.pack(op.tensors, stream)  # after the caller's writes
                    else:
                        to_unpack.append((staging, op.tensors))
                    wire.append((op.kind, staging.buffer))
                    wire.extend((op.kind, op.tensors[i]) for i in staging.alone)
                    continue
                packed_idx, alone_idx = wire_plan(op.tensors, pack_below=PACK_BELOW)
                if packed_idx:
                    buf = self._packed_afresh(op, packed_idx, stream, to_unpack)
                    wire.append((op.kind, buf))
                    keep.append(buf)
                wire.extend((op.kind, op.tensors[i]) for i in alone_idx)
            if wire:  # else only empty tensors: nothing to move (both sides agree on that)
                wires.append((pair, wire))
        started = self._enqueue(wires, stream)
        for packed, tensors in to_unpack:  # on `stream`, after the group
            if isinstance(packed, Staging):
                packed.unpack(tensors, stream)
            else:
                with on_stream(stream):
                    unpack(packed, tensors)
        for staging in used:
            staging.release(stream)
        return _NcclPending(started, keep)

    def _packed_afresh(
        self, op: P2POp, indices: list[int], stream: Any, to_unpack: list[tuple[Any, Any]]
    ) -> torch.Tensor:
        """A new buffer for the tensors ``indices`` of ``op`` that travel packed (a layout with
        no staging buffer): filled on ``stream`` for a send; for a receive, listed in
        ``to_unpack`` to be copied out after the group."""
        small = [op.tensors[i] for i in indices]
        with on_stream(stream):  # torch operations: on `stream`, after the caller's writes
            if op.kind == "send":
                return pack(small)
            total = sum(t.numel() * t.element_size() for t in small)
            buf = torch.empty(total, dtype=torch.uint8, device=self.ctx.device)
        to_unpack.append((buf, small))
        return buf

    def _start_one(self, pair: Any, op: P2POp, stream: Any) -> PendingOps:
        """One tensor to or from one peer (the commonest call): what :meth:`start` does, with
        nothing to group, pack or unpack."""
        tensor = op.tensors[0]
        wire = [(op.kind, tensor)] if tensor.numel() else []  # empty: nothing moves either side
        return _NcclPending(self._enqueue([(pair, wire)] if wire else [], stream), [])

    @staticmethod
    def _enqueue(wires: list[tuple[Any, list]], stream: Any) -> list[tuple[Any, Any]]:
        """Issues every direction's operations: our own communicators' in ONE group.

        One group, not one per direction: groups queued one after another on one stream run in
        that order, so with a rank's send group ahead of its receive group on each side, each
        send waits for a receive queued behind the peer's own send — a deadlock once messages
        outgrow NCCL's buffers (a ``sendrecv`` of a few MiB each way). NCCL launches one group
        spanning several communicators as one unit. ``ProcessGroupNCCL`` pairs run on their own
        streams and are issued one by one; only then is the transfer's stream ordered after
        them, since each pair's stream first waits for the work queued on that stream: ordered
        after its send, a pair's receive would start only once the peer's receive took the
        send, which waits behind the peer's own send the same way. A group of one operation (a
        message packed into one buffer) goes as that operation alone, as NCCL would launch it.
        """
        native = [(pair, wire) for pair, wire in wires if isinstance(pair, _NativePair)]
        started: list[tuple[Any, Any]] = [(pair, None) for pair, _ in native]
        if len(native) == 1 and len(native[0][1]) == 1:
            pair, ((kind, buf),) = native[0]
            pair.move_alone(kind, buf, stream.cuda_stream)
        elif native:
            lib = native[0][0].lib
            lib.group_start()
            try:
                for pair, wire in native:
                    pair.add(wire, stream.cuda_stream)
            finally:
                lib.group_end(all(pair.may_hold_gil() for pair, _ in native))
        groups = [
            (pair, pair.enqueue(wire, stream))
            for pair, wire in wires
            if not isinstance(pair, _NativePair)
        ]
        for pair, work in groups:
            pair.order_after(work, stream)
        return started + groups

    def _staging_for(self, op: P2POp, src: int, dst: int, stream: Any) -> Staging | None:
        """The reused packing buffer of this op's layout and direction, or ``None`` when its
        small tensors are packed afresh (no layout given, nothing to pack, or a layout whose
        tensors cannot be viewed in place). A new one is allocated on ``stream``."""
        if op.layout is None:
            return None
        key = (src, dst, op.layout)
        staging = self._staging.get(key)
        if staging is not None:
            return staging
        plan = layout_plan(op.layout, pack_below=PACK_BELOW)
        if not plan.groups or not plan.aligned:
            return None
        with on_stream(stream):
            staging = Staging(plan, op.layout, self.ctx.device)
        self._staging.add(key, staging)
        return staging

    def evict(self, peer: int, *, abort: bool, reason: str = "") -> None:
        keys = [self._direction_key(peer, kind) for kind in ("send", "recv")]
        communicator_cache().evict_together(keys, abort=abort, reason=reason)

    def close(self) -> None:
        self._staging.clear()
        self._evict_cached("shutdown")
