"""The NCCL transport: CUDA tensors, one ``ProcessGroupNCCL`` per pair of ranks.

Each pair's group is constructed directly on a per-pair ``PrefixStore`` of the world store, as
rank 0/1 of a 2-rank group, so only the two ranks take part (``torch.distributed.new_group``
would be collective over the whole world). It is cached in the runtime's communicator cache
under ``("nccl", lo, hi)``, shared by both directions, and made once per pair (per epoch).

``prepare`` creates the group and runs one tiny send/recv exchange in each direction, because
ProcessGroupNCCL creates its point-to-point communicator lazily at the first send/recv: after
``prepare`` the first real transfer pays nothing for set-up.

``start`` issues every message of a call to one peer as ONE coalesced group
(``_start_coalescing``/``_end_coalescing``, what ``batch_isend_irecv`` does): NCCL launches
the whole group as one kernel. Tensors travel as byte views, so every dtype works. Tensors under
:data:`PACK_BELOW` of a message with several of them are packed (one ``cat`` on the sender, one
``_foreach_copy_`` on the receiver, both on the transfer's stream). A call with several peers
issues one group per peer (communicators are per pair).
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

    def _key(self, peer: int) -> tuple[str, int, int]:
        return ("nccl", *self.ctx.pair(peer))

    def prepare(self, peers: Sequence[int]) -> None:
        for peer in sorted(peers):
            self._pair(peer)

    def _pair(self, peer: int) -> _NcclPair:
        key = self._key(peer)
        epoch = self.ctx.epoch_of(peer)
        cache = communicator_cache()
        existing = cache.get(key)
        if existing is not None and existing.epoch != epoch:
            cache.evict(key, abort=True, reason="stale epoch")
        return cache.get_or_create(key, lambda: self._create(peer, epoch))

    def _create(self, peer: int, epoch: int) -> _NcclPair:
        import torch.distributed as dist

        device = self.ctx.device
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = self.ctx.timeout + datetime.timedelta(seconds=_WATCHDOG_MARGIN_S)
        store = self.ctx.pair_store(peer, "nccl")
        me = self.ctx.rank_in_pair(peer)
        pg = dist.ProcessGroupNCCL(store, me, 2, options)
        pair = _NcclPair(pg, 1 - me, epoch)
        # Warm-up exchange: creates the p2p communicator now (on this helper thread).
        with torch.cuda.device(device):
            stream = torch.cuda.current_stream(device)
            out = torch.ones(1, dtype=torch.uint8, device=device)
            into = torch.zeros(1, dtype=torch.uint8, device=device)
            pg._start_coalescing()
            pg.send([out], pair.other, _TAG)
            pg.recv([into], pair.other, _TAG)
            work = pg._end_coalescing()
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
        by_peer: dict[int, list[P2POp]] = {}
        for op in ops:
            by_peer.setdefault(op.peer, []).append(op)
        device = self.ctx.device
        works, pairs, keep, to_unpack = [], [], [], []
        cache = communicator_cache()
        for peer, peer_ops in by_peer.items():
            pair = cache.get(self._key(peer))
            if pair is None:
                raise TransportError(f"nccl: the pair with rank {peer} is not prepared")
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
        communicator_cache().evict(self._key(peer), abort=abort, reason=reason)

    def close(self) -> None:
        cache = communicator_cache()
        for key in cache.keys():  # noqa: SIM118 (a cache, not a dict)
            if isinstance(key, tuple) and key[:1] == ("nccl",) and self.ctx.rank in key[1:]:
                cache.evict(key, abort=False, reason="shutdown")
