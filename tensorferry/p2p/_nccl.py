"""The NCCL transport: CUDA tensors, one ``ProcessGroupNCCL`` per direction of a pair of ranks.

Why one per direction: a communicator runs its operations one after another on one stream, in
the order each rank issued them. Messages of the two directions are independent FIFOs here (a
rank may send then receive while its peer does the same, or post eight receives before its first
send), so the two ranks issue them in different orders; on a shared communicator a receive
queued ahead of a send on one rank, and the reverse on the other, wait for each other forever
once messages are too large for NCCL's buffers. With one communicator per direction each keeps
exactly its direction's FIFO order, which both ranks share.

Each group is constructed directly on a per-pair ``PrefixStore`` of the world store, as rank 0
(the sending side) or 1 of a 2-rank group, so only the two ranks take part
(``torch.distributed.new_group`` would be collective over the whole world). It is cached in the
runtime's communicator cache under ``("nccl", src, dst)`` and made once per direction (per
epoch), lazily by the first message that way (``prepare_direction``), or for both directions by
``prepare``.

Making one creates the group and runs one tiny send/recv, because ProcessGroupNCCL creates its
point-to-point communicator lazily at the first send/recv: afterwards the first real transfer
pays nothing for set-up.

``start`` issues every message of a call in one direction with one peer as ONE coalesced group
(``_start_coalescing``/``_end_coalescing``, what ``batch_isend_irecv`` does): NCCL launches
the whole group as one kernel. Tensors travel as byte views, so every dtype works. Tensors under
:data:`PACK_BELOW` of a message with several of them are packed (one ``cat`` on the sender, one
``_foreach_copy_`` on the receiver, both on the transfer's stream). A call with several peers,
or both directions, issues one group per direction and peer.
"""

from __future__ import annotations

import contextlib
import datetime
import time
from collections.abc import Sequence
from typing import Any

import torch

from tensorferry.errors import TransferTimeoutError, TransportError
from tensorferry.p2p._packing import as_bytes, pack, unpack, wire_plan
from tensorferry.p2p._transport import P2POp, PendingOps, Transport
from tensorferry.runtime import communicator_cache

__all__ = ["NcclTransport", "PACK_BELOW"]

_TAG = 0
# Tensors under this size in a message of several travel packed: one cat kernel and one NCCL
# send instead of one send per tensor (each send in a group costs host time in ProcessGroupNCCL,
# and the 64 × 4 KiB batch has to beat 64 separate calls by 10×).
PACK_BELOW = 64 << 10
# ProcessGroupNCCL's own watchdog timeout sits past ours so that our deadline (which aborts
# the pair cleanly) always fires first.
_WATCHDOG_MARGIN_S = 120.0


class _NcclPair:
    """The group of one direction of a pair."""

    def __init__(self, pg: Any, other: int, epoch: int) -> None:
        self.pg = pg
        self.other = other  # the peer's rank within the pair
        self.epoch = epoch

    def abort(self) -> None:
        with contextlib.suppress(Exception):
            self.pg.abort()

    def close(self) -> None:
        # Abort, not shutdown(): ncclCommAbort is local and never waits for the peer (which
        # may be gone at tf.shutdown, or closing at the same moment in the uncached bench).
        self.abort()


class _NcclPending(PendingOps):
    def __init__(self, works: list[Any], pairs: list[_NcclPair], keep: list[Any]) -> None:
        self._works = works
        self._pairs = pairs
        self._keep = keep  # packed buffers: alive until the device is done with them

    def ready(self) -> bool:
        try:
            return all(work.is_completed() for work in self._works)
        except Exception as exc:
            raise TransportError(f"nccl: {exc}") from exc

    def abort(self) -> None:
        for pair in self._pairs:
            pair.abort()


class NcclTransport(Transport):
    """CUDA tensors over NCCL; the default for CUDA tensors."""

    name = "nccl"
    device_type = "cuda"

    def estimate_seconds(self, *, peer: int, nbytes: int, num_tensors: int) -> float | None:
        # ~20 µs per group call, ~350 GB/s for large messages (H200 NVLink, GPU.md).
        return 20e-6 + nbytes / 350e9

    def unsupported_reason(self, *, peer: int, tensors: Sequence[torch.Tensor]) -> str | None:
        device = tensors[0].device  # a message's tensors share one device (validated)
        if device.type != "cuda":
            return f"nccl moves CUDA tensors, got a tensor on {device} (use transport='gloo')"
        return None

    def _key(self, src: int, dst: int) -> tuple[str, int, int]:
        return ("nccl", src, dst)

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

    def _pair(self, src: int, dst: int) -> _NcclPair:
        key = self._key(src, dst)
        peer = dst if src == self.ctx.rank else src
        epoch = self.ctx.epoch_of(peer)
        cache = communicator_cache()
        existing = cache.get(key)
        if existing is not None and existing.epoch != epoch:
            cache.evict(key, abort=True, reason="stale epoch")
        return cache.get_or_create(key, lambda: self._create(src, dst, epoch))

    def _create(self, src: int, dst: int, epoch: int) -> _NcclPair:
        import torch.distributed as dist

        device = self.ctx.device
        sending = src == self.ctx.rank
        peer = dst if sending else src
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = self.ctx.timeout + datetime.timedelta(seconds=_WATCHDOG_MARGIN_S)
        store = self.ctx.pair_store(peer, f"nccl/{src}-to-{dst}")
        me = 0 if sending else 1
        pg = dist.ProcessGroupNCCL(store, me, 2, options)
        pair = _NcclPair(pg, 1 - me, epoch)
        # Warm-up message: creates the p2p communicator now (on this helper thread).
        with torch.cuda.device(device):
            stream = torch.cuda.current_stream(device)
            probe = torch.ones(1, dtype=torch.uint8, device=device)
            work = (pg.send if sending else pg.recv)([probe], pair.other, _TAG)
            work.wait()
            done = torch.cuda.Event()
            done.record(stream)
        deadline = time.monotonic() + self.ctx.timeout.total_seconds()
        while not done.query():
            if time.monotonic() > deadline:
                pair.abort()
                raise TransferTimeoutError(f"nccl: warm-up with rank {peer} timed out")
            time.sleep(1e-4)
        return pair

    def start(self, ops: Sequence[P2POp], *, stream: Any = None) -> PendingOps:
        by_direction: dict[tuple[int, int], list[P2POp]] = {}
        for op in ops:
            by_direction.setdefault(self._ends(op.peer, op.kind), []).append(op)
        device = self.ctx.device
        works, pairs, keep, to_unpack = [], [], [], []
        cache = communicator_cache()
        for (src, dst), peer_ops in by_direction.items():
            pair = cache.get(self._key(src, dst))
            if pair is None:
                raise TransportError(f"nccl: the direction rank {src} → {dst} is not prepared")
            wire: list[tuple[str, torch.Tensor]] = []
            for op in peer_ops:
                packed_idx, alone_idx = wire_plan(op.tensors, pack_below=PACK_BELOW)
                if packed_idx:
                    small = [op.tensors[i] for i in packed_idx]
                    if op.kind == "send":
                        buf = pack(small)  # on `stream`: after the caller's writes
                    else:
                        total = sum(t.numel() * t.element_size() for t in small)
                        buf = torch.empty(total, dtype=torch.uint8, device=device)
                        to_unpack.append((buf, small))
                    wire.append((op.kind, buf))
                    keep.append(buf)
                wire.extend((op.kind, as_bytes(op.tensors[i])) for i in alone_idx)
            if not wire:
                continue  # only empty tensors: nothing to move (both sides agree on that)
            pg = pair.pg
            pg._start_coalescing()
            try:
                for kind, buf in wire:
                    if kind == "send":
                        pg.send([buf], pair.other, _TAG)
                    else:
                        pg.recv([buf], pair.other, _TAG)
            finally:
                work = pg._end_coalescing()
            # Orders `stream` (the current stream) after the group; the host does not wait.
            work.wait()
            works.append(work)
            pairs.append(pair)
        for buf, targets in to_unpack:
            unpack(buf, targets)  # on `stream`, after the group (work.wait() above)
        return _NcclPending(works, pairs, keep)

    def evict(self, peer: int, *, abort: bool, reason: str = "") -> None:
        cache = communicator_cache()
        for kind in ("send", "recv"):
            cache.evict(self._key(*self._ends(peer, kind)), abort=abort, reason=reason)

    def close(self) -> None:
        cache = communicator_cache()
        for key in cache.keys():  # noqa: SIM118 (a cache, not a dict)
            if isinstance(key, tuple) and key[:1] == ("nccl",) and self.ctx.rank in key[1:]:
                cache.evict(key, abort=False, reason="shutdown")
