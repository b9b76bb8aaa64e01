"""GPU tensor edges between actors: the link that moves tensors over NCCL.

SWITCH POINT. This is the one place that decides how GPU tensors travel between actor
processes. Today it is ``torch.distributed`` NCCL ``isend``/``irecv`` (:class:`TorchNcclLink`).
``tensorferry.p2p`` offers the same service (``send``/``recv`` returning ``Transfer`` handles with
``wait_stream``) plus the ``nvlink`` and ``ce`` transports; to move onto it, implement
:class:`GpuLink` with it and return that from :func:`make_link`. Nothing else in the graph
layer knows which library is underneath.

Ordering contract a link keeps (what :mod:`tensorferry.graph._gpu` relies on): ``send`` and
``recv`` are called with the stream that orders the transfer as the *current* stream; the
transfer starts after the work already queued there; the returned handle's ``wait()`` makes the
current stream wait for the transfer on the device, without blocking the host.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass
from typing import Any, Protocol

import torch

__all__ = ["GpuLink", "NcclSetup", "TorchNcclLink", "host_store", "make_link"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class NcclSetup:
    """How one actor joins the graph's NCCL group."""

    rank: int
    world_size: int
    ranks: dict[str, int]
    """Actor name to rank, for every actor with an NCCL edge."""
    store_port: int
    """Port of the driver's TCP store."""
    prefix: str
    """Key prefix in the store (the graph's id), so graphs never mix."""
    pairs: tuple[tuple[int, int], ...]
    """Rank pairs that exchange tensors, sorted: communicators are created in this order."""
    timeout_s: float
    store_host: str = "127.0.0.1"
    """Address of the driver's TCP store (the driver's host address when actors run elsewhere)."""


class GpuLink(Protocol):
    def send(self, tensor: torch.Tensor, peer: int) -> Any: ...

    def recv(self, tensor: torch.Tensor, peer: int) -> Any: ...

    def close(self) -> None: ...


def host_store() -> tuple[Any, int]:
    """The driver's TCP store that the actors' NCCL group meets at; returns (store, port)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    return store, store.port


class TorchNcclLink:
    """NCCL point-to-point through ``torch.distributed`` (one process group per graph).

    Args:
        setup: rank, world size and where the store is.
        device: this actor's CUDA device.
    """

    def __init__(self, setup: NcclSetup, device: torch.device) -> None:
        import torch.distributed as dist

        self._dist = dist
        timeout = datetime.timedelta(seconds=setup.timeout_s)
        store = dist.TCPStore(setup.store_host, setup.store_port, is_master=False, timeout=timeout)
        store = dist.PrefixStore(setup.prefix, store)
        dist.init_process_group(
            "nccl",
            store=store,
            rank=setup.rank,
            world_size=setup.world_size,
            timeout=timeout,
            device_id=device,
        )
        self._warm_up(setup, device)

    def _warm_up(self, setup: NcclSetup, device: torch.device) -> None:
        # Each pair's communicator is created by its first operation, which both ranks must
        # reach; walking the pairs in one global order keeps two pairs from waiting on each
        # other (rank 0 creating (0,1) while rank 1 creates (1,2) and rank 2 creates (0,2)).
        probe = torch.ones(1, device=device)
        for low, high in setup.pairs:
            if setup.rank == low:
                self._dist.isend(probe, dst=high).wait()
            elif setup.rank == high:
                self._dist.irecv(probe, src=low).wait()
            else:
                continue
            torch.cuda.synchronize(device)
        log.info("rank %d: NCCL links to %s ready", setup.rank, setup.pairs)

    def send(self, tensor: torch.Tensor, peer: int) -> Any:
        return self._dist.isend(tensor, dst=peer)

    def recv(self, tensor: torch.Tensor, peer: int) -> Any:
        return self._dist.irecv(tensor, src=peer)

    def close(self) -> None:
        if self._dist.is_initialized():
            self._dist.destroy_process_group()


def make_link(setup: NcclSetup, device: torch.device) -> GpuLink:
    """The link the graph uses for GPU edges (see the module doc: the switch point)."""
    return TorchNcclLink(setup, device)
