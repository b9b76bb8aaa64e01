"""The ``ce`` transport: :class:`CopyEngineChannel` behind the p2p layer's transport contract.

One channel per pair of ranks (a 2-rank symmetric-memory group on the pair's store), cached in
the runtime's communicator cache under ``("ce", lo, hi)``. Tensors of a message go one by one,
in order, on the channel's own copy streams; the caller's stream waits on them. No SMs.

Importing this module registers the transport.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tensorferry.errors import TransportError
from tensorferry.p2p._transport import P2POp, PendingOps, Transport, register_transport
from tensorferry.p2p.copy_engine import _streamops
from tensorferry.p2p.nvlink._pair_setup import set_up_pair
from tensorferry.runtime import communicator_cache

__all__ = ["CopyEngineTransport", "estimate_ce_seconds"]

# Measured on 2 x H200 (graph-replayed, one way, signalling included): ~34 µs per message at
# 256 B–4 KiB; bandwidth is the copy-engine figure from GPU.md (395 GB/s at 1 GiB).
_LATENCY_S = 34e-6
_BANDWIDTH = 395e9


def estimate_ce_seconds(nbytes: int, num_tensors: int) -> float:
    """Expected seconds for one message over the copy engine."""
    return _LATENCY_S * max(1, num_tensors) + nbytes / _BANDWIDTH


class _CePending(PendingOps):
    def __init__(self, transfers: list[Any]) -> None:
        self._transfers = transfers

    def ready(self) -> bool:
        return all(t.ready() for t in self._transfers)

    def abort(self) -> None:
        return None


class CopyEngineTransport(Transport):
    """Moves agreed messages with copy engines into the peer's symmetric staging."""

    name = "ce"
    # Pair set-up is a symmetric-memory rendezvous; rings of 3+ ranks prepare in order.
    prepare_in_order = True
    device_type = "cuda"

    def unsupported_reason(self, *, peer: int, tensors: Sequence[torch.Tensor]) -> str | None:
        reason = super().unsupported_reason(peer=peer, tensors=tensors)
        if reason:
            return reason
        if not _streamops.available():
            return "ce needs cuda-python (cuda.bindings) for stream memory operations"
        return None

    def estimate_seconds(self, *, peer: int, nbytes: int, num_tensors: int) -> float | None:
        return estimate_ce_seconds(nbytes, num_tensors)

    def prepare(self, peers: Sequence[int]) -> None:
        for peer in peers:
            self._channel(peer)

    def start(self, ops: Sequence[P2POp], *, stream: Any = None) -> PendingOps:
        stream = torch.cuda.current_stream(self.ctx.device) if stream is None else stream
        # Every copy starts after one event and the caller's stream waits for them all only at
        # the end (see CopyEngineChannel.issue: waiting in between deadlocks rings).
        start = torch.cuda.Event()
        start.record(stream)
        transfers = []
        for op in ops:
            channel, other = self._channel(op.peer)
            if channel.broken:
                raise TransportError(f"ce channel to rank {op.peer} is broken ({channel.broken})")
            for tensor in op.tensors:
                if tensor.numel() == 0:
                    continue
                if op.kind == "send":
                    transfers.append(channel.issue(tensor, other, None, None, after=start))
                else:
                    transfers.append(channel.issue(None, None, tensor, other, after=start))
        for transfer in transfers:
            for event in transfer.events:
                stream.wait_event(event)
        return _CePending(transfers)

    def evict(self, peer: int, *, abort: bool, reason: str = "") -> None:
        lo, hi = self.ctx.pair(peer)
        communicator_cache().evict(("ce", lo, hi), abort=abort)

    def close(self) -> None:
        self._evict_cached("shutdown")

    def _channel(self, peer: int) -> tuple[Any, int]:
        from tensorferry.p2p.copy_engine.ce_op import CopyEngineChannel

        lo, hi = self.ctx.pair(peer)
        me = self.ctx.rank_in_pair(peer)

        def make() -> Any:
            return set_up_pair(
                self.ctx,
                peer,
                "ce",
                lambda group, index, store: CopyEngineChannel(
                    device=self.ctx.device, members=(group, index, 2, store)
                ),
            )

        channel = communicator_cache().get_or_create(("ce", lo, hi), make)
        return channel, 1 - me


register_transport("ce", CopyEngineTransport, replace=True)
