"""GPU edges over ``tensorferry.p2p``: the ``ce`` (copy engine) and ``nvlink`` transports.

An actor with such edges joins a p2p world made of the graph's GPU actors (its rank from the
graph's :class:`~tensorferry.graph._nccl.NcclSetup`), over the driver's store under the graph's
prefix, and prepares its channels at set-up, so the first execution pays no rendezvous.

Why these edges matter for overlap: a copy-engine transfer uses no SMs, so a tensor arriving
while the receiver multiplies the previous one neither slows the product nor is slowed by it;
an NCCL receive kernel competes with the product for SMs.

Ordering: ``send``/``recv`` go through ``tf.send``/``tf.recv``, which start after the work
queued on the caller's current stream; the handle's ``wait()`` makes the current stream wait for
the transfer (``Transfer.wait_stream``), blocking the host only until the transfer is issued —
for a send, until the receiver posted its receive, which the schedule's deadlock check already
treats as blocking.

One p2p world per process: an actor runs one compiled graph at a time, and ``close`` shuts the
world down for the next graph.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

__all__ = ["P2PLinks"]

log = logging.getLogger(__name__)


class _Issued:
    """Handle of one transfer: ``wait()`` orders the current stream after it."""

    __slots__ = ("_transfer",)

    def __init__(self, transfer: Any) -> None:
        self._transfer = transfer

    def wait(self) -> None:
        self._transfer.wait_stream()


class _TransportLink:
    """The :class:`~tensorferry.graph._nccl.GpuLink` of one p2p transport."""

    def __init__(self, tf: Any, transport: str) -> None:
        self._tf = tf
        self.transport = transport

    def send(self, tensor: torch.Tensor, peer: int) -> _Issued:
        return _Issued(self._tf.send(tensor, peer, transport=self.transport))

    def recv(self, tensor: torch.Tensor, peer: int) -> _Issued:
        return _Issued(self._tf.recv(tensor, peer, transport=self.transport))

    def close(self) -> None:
        return None  # the world is P2PLinks'


class P2PLinks:
    """This actor's p2p world and one link per transport it uses.

    Args:
        setup: the graph's :class:`~tensorferry.graph._nccl.NcclSetup` for this actor.
        device: this actor's CUDA device.
        store: the store to meet at, already under the graph's prefix (default: the driver's).

    Raises:
        TransferTimeoutError, PeerLostError, TransportError: a peer did not prepare in time.
        ValueError: a transport cannot run here (the reason says why).
    """

    def __init__(self, setup: Any, device: torch.device, *, store: Any = None) -> None:
        import torch.distributed as dist

        import tensorferry.p2p as tf
        from tensorferry.graph._nccl import _driver_store

        self._tf = tf
        if store is None:
            store = _driver_store(setup)
        tf.init(
            rank=setup.rank,
            world_size=setup.world_size,
            store=dist.PrefixStore("p2p", store),
            device=device,
            timeout=setup.timeout_s,
        )
        try:
            # One global order (transport, then pairs low to high inside tf.prepare) on every
            # rank, so no two ranks wait on each other while preparing.
            for transport in setup.p2p_transports:
                peers = _partners(setup, transport)
                if peers:
                    tf.prepare(peers, transports=[transport])
        except BaseException:
            tf.shutdown()
            raise
        self.links = {t: _TransportLink(tf, t) for t in setup.p2p_transports}
        log.info("rank %d: p2p links %s ready", setup.rank, sorted(self.links))

    def close(self) -> None:
        self._tf.shutdown()


def _partners(setup: Any, transport: str) -> list[int]:
    """Ranks this actor exchanges tensors with over ``transport``."""
    peers = set()
    for name, low, high in setup.p2p_pairs:
        if name == transport and setup.rank in (low, high):
            peers.add(high if setup.rank == low else low)
    return sorted(peers)
