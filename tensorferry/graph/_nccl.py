"""GPU tensor edges between actors: the link that moves tensors over NCCL.

SWITCH POINT. This is the one place that decides how GPU tensors travel between actor
processes. :func:`make_link` returns

- :class:`DirectNcclLink` when the NCCL library can be loaded (``tensorferry.p2p._nccl_lib``):
  the library called through ``ctypes``, with communicators of the link's own. A send is three
  short library calls that enqueue NCCL's kernel on the current stream; ``ProcessGroupNCCL``
  wraps every operation in a work object, CUDA events, a watchdog entry and a stream of its
  own, about 80 µs of host time per send on the GPU machine — more than a small transfer.
- :class:`TorchNcclLink` where no library can be loaded (a torch that links NCCL statically):
  ``torch.distributed`` NCCL ``isend``/``irecv``, one process group per graph.

Edges over ``ce`` and ``nvlink`` go through ``tensorferry.p2p`` instead
(:mod:`tensorferry.graph._p2p_link`); :func:`make_links` gives an actor one link per transport it
uses. Nothing else in the graph layer knows which library is underneath.

Ordering contract a link keeps (what :mod:`tensorferry.graph._gpu` relies on): ``send`` and
``recv`` are called with the stream that orders the transfer as the *current* stream; the
transfer starts after the work already queued there; the returned handle's ``wait()`` makes the
current stream wait for the transfer on the device, without blocking the host. The caller keeps
each tensor's memory for the stream until the transfer is done (``record_stream``, or memory
allocated on that stream).

:class:`DirectNcclLink` has one communicator per direction of each pair of ranks that exchange
tensors (as ``tensorferry.p2p._nccl`` explains): a communicator runs its operations in the order
each rank issued them, and a rank's sends and receives with one peer are issued on different
streams in orders the two ranks do not share; on one communicator for both directions, a
receive queued ahead of a send on one rank and the reverse on the other would wait for each
other forever.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from tensorferry.errors import TransferTimeoutError
from tensorferry.p2p._nccl_lib import NcclLibrary
from tensorferry.p2p._nccl_lib import library as nccl_library
from tensorferry.p2p._torch_groups import errors_left_to_us
from tensorferry.runtime._communicators import abort_together

__all__ = [
    "GpuLink",
    "NcclSetup",
    "DirectNcclLink",
    "TorchNcclLink",
    "host_store",
    "make_link",
    "make_links",
]

log = logging.getLogger(__name__)

# Ranks within a direction's two-rank communicator: the sending actor is 0, the receiving one 1.
_SENDER = 0
_RECEIVER = 1


@dataclass(frozen=True, slots=True)
class NcclSetup:
    """How one actor joins the graph's GPU links: NCCL, and the p2p layer's ``ce``/``nvlink``."""

    rank: int
    world_size: int
    ranks: dict[str, int]
    """Actor name to rank, for every actor with a GPU edge (NCCL, ce or nvlink)."""
    store_port: int
    """Port of the driver's TCP store."""
    prefix: str
    """Key prefix in the store (the graph's id), so graphs never mix."""
    pairs: tuple[tuple[int, int], ...]
    """Rank pairs that exchange tensors, sorted: communicators are created in this order."""
    timeout_s: float
    store_host: str = "127.0.0.1"
    """Address of the driver's TCP store (the driver's host address when actors run elsewhere)."""
    p2p_pairs: tuple[tuple[str, int, int], ...] = ()
    """``(transport, low rank, high rank)`` of the pairs that exchange tensors over ``ce`` or
    ``nvlink`` (:mod:`tensorferry.graph._p2p_link`); ``pairs`` holds the NCCL ones."""

    @property
    def p2p_transports(self) -> tuple[str, ...]:
        return tuple(sorted({transport for transport, _, _ in self.p2p_pairs}))


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
        with errors_left_to_us():  # or torch ends the actor after a peer's death
            dist.init_process_group(
                "nccl",
                store=_driver_store(setup),
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

    closes_on_any_thread = True
    """``close`` may run on the link watch's thread (see :mod:`tensorferry.graph._link_watch`)
    while the actor's thread is inside a launch behind a receive: aborting the process group
    aborts its communicators, which is what ends that receive. The group is torch's global
    state, but the actor's thread only sends and receives on it, and fails at its next call
    once the group is gone, which is how the graph's end reaches it there."""

    def close(self) -> None:
        """Aborts the process group, as :meth:`DirectNcclLink.close` aborts its communicators:
        destroying it waits for its work, a receive whose sender died included; calling it again
        does nothing. The aborted group is let go on a thread of its own (see
        :func:`_let_go_elsewhere`)."""
        dist = self._dist
        if not dist.is_initialized():
            return
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if abort is None:  # a torch without it: the way that waits for the work
            dist.destroy_process_group()
            return
        group = [dist.group.WORLD]  # the last reference once torch's own are gone
        try:
            abort()
        except Exception:
            log.warning("aborting the graph's NCCL process group failed", exc_info=True)
        _let_go_elsewhere(group)


def _let_go_elsewhere(box: list[Any]) -> None:
    """Drops the last reference to an aborted process group (``box``'s only item) on a daemon
    thread. ``ProcessGroupNCCL``'s destructor joins torch's watchdog thread, which after a peer
    died mid-receive spends seconds on the failed operation (the Python stack it prints waited
    7 s for cold imports on one H100). Dropped on the link watch's thread, the group held the
    actor past teardown's wait, and teardown killed it (one H100, 2026-11-25)."""
    threading.Thread(target=box.clear, name="tf-process-group-release", daemon=True).start()


class _OnStream:
    """Handle of a :class:`DirectNcclLink` transfer. Its NCCL operation was enqueued on the
    current stream itself, so everything queued there afterwards already runs after it:
    ``wait()`` has nothing left to order (``ProcessGroupNCCL`` needs it because it runs the
    operation on a stream of its own)."""

    __slots__ = ()

    def wait(self) -> None:
        return None


_ON_STREAM = _OnStream()


class DirectNcclLink:
    """NCCL point-to-point called directly: one two-rank communicator per direction of each
    pair in ``setup.pairs`` that this rank belongs to, made and connected in the constructor.

    Issuing is not thread-safe: the actor's schedule thread makes every call.

    Args:
        setup: rank, the pairs and where the store is.
        device: this actor's CUDA device.
        lib: the NCCL library (:func:`tensorferry.p2p._nccl_lib.library`).
        store: the store the unique ids travel through, already under ``setup.prefix``; by
            default the driver's TCP store, connected here.

    Raises:
        TransferTimeoutError: a peer's unique id or its first transfer did not come within
            ``setup.timeout_s``.
    """

    def __init__(
        self,
        setup: NcclSetup,
        device: torch.device,
        lib: NcclLibrary,
        *,
        store: Any = None,
    ) -> None:
        self._lib = lib
        self._rank = setup.rank
        self._device = device
        self._index = device.index if device.index is not None else torch.cuda.current_device()
        self._timeout_s = setup.timeout_s
        self._peer_comms: dict[int, tuple[int, int]] = {}
        """Peer rank to (communicator this rank sends on, communicator it receives on)."""
        self._opened: list[int] = []
        """Every communicator made, for ``close``."""
        self._warm_up_stream: Any = None
        if store is None:
            store = _driver_store(setup)
        try:
            # Both ranks of a pair walk the pairs in one global order, low → high before
            # high → low within a pair, so no two ranks wait on each other while creating
            # (see TorchNcclLink._warm_up).
            for low, high in setup.pairs:
                if self._rank not in (low, high):
                    continue
                peer = high if self._rank == low else low
                comms = {
                    src: self._open_direction(store, src, dst)
                    for src, dst in ((low, high), (high, low))
                }
                self._peer_comms[peer] = (comms[self._rank], comms[peer])
        except BaseException:
            self.close()
            raise
        log.info(
            "rank %d: direct NCCL links to ranks %s ready", self._rank, sorted(self._peer_comms)
        )

    def _open_direction(self, store: Any, src: int, dst: int) -> int:
        """Makes the communicator that carries ``src`` → ``dst`` and runs its first transfer."""
        sending = src == self._rank
        peer = dst if sending else src
        key = f"nccl/{src}-to-{dst}"
        if sending:
            unique_id = self._lib.unique_id()
            store.set(key, unique_id)
        else:
            try:
                unique_id = bytes(store.get(key))  # waits up to the store's timeout
            except (RuntimeError, TimeoutError) as exc:
                raise TransferTimeoutError(
                    f"rank {self._rank}: no NCCL id from rank {peer} for {src} → {dst} "
                    f"within {self._timeout_s} s ({exc})"
                ) from exc
        with torch.cuda.device(self._device):
            comm = self._lib.init_rank(2, unique_id, _SENDER if sending else _RECEIVER)
        self._opened.append(comm)
        self._warm_up(comm, sending, peer)
        return comm

    def _warm_up(self, comm: int, sending: bool, peer: int) -> None:
        # NCCL connects the two ranks at their first transfer, a rendezvous: here, bounded by
        # the set-up timeout, rather than in the graph's first execution.
        if self._warm_up_stream is None:
            self._warm_up_stream = torch.cuda.Stream(self._device)
        with torch.cuda.device(self._device), torch.cuda.stream(self._warm_up_stream):
            probe = torch.ones(1, dtype=torch.uint8, device=self._device)
            if sending:
                self._enqueue(self._lib.send, probe, comm, _RECEIVER)
            else:
                self._enqueue(self._lib.recv, probe, comm, _SENDER)
            done = torch.cuda.Event()
            done.record()
        _wait_for_event(
            done, self._timeout_s, f"rank {self._rank}: first NCCL transfer with rank {peer}"
        )

    def send(self, tensor: torch.Tensor, peer: int) -> _OnStream:
        """Enqueues sending ``tensor`` (contiguous, any dtype) to ``peer`` on the current stream."""
        self._enqueue(self._lib.send, tensor, self._comms_with(peer)[0], _RECEIVER)
        return _ON_STREAM

    def recv(self, tensor: torch.Tensor, peer: int) -> _OnStream:
        """Enqueues receiving into ``tensor`` (contiguous; the sender's has as many bytes) from
        ``peer`` on the current stream."""
        self._enqueue(self._lib.recv, tensor, self._comms_with(peer)[1], _SENDER)
        return _ON_STREAM

    def _comms_with(self, peer: int) -> tuple[int, int]:
        try:
            return self._peer_comms[peer]
        except KeyError:
            raise ValueError(
                f"rank {self._rank} has no NCCL communicator with rank {peer} "
                f"(no edge between them, or the link is closed)"
            ) from None

    def _enqueue(
        self, move: Callable[..., None], tensor: torch.Tensor, comm: int, other: int
    ) -> None:
        nbytes = tensor.nbytes
        if not nbytes:
            return  # both ends skip it: the receiver learnt the same shape from the metadata
        if not tensor.is_contiguous():
            raise ValueError(
                f"NCCL moves contiguous tensors as bytes, got strides {tensor.stride()}"
            )
        lib = self._lib
        # A group around the single operation: ncclSend/ncclRecv keep the GIL (they only
        # enqueue), and ncclGroupEnd, which launches and may wait, releases it. A bare
        # ncclSend would launch holding the GIL.
        lib.group_start()
        try:
            move(tensor.data_ptr(), nbytes, other, comm, _current_stream_handle(self._index))
        finally:
            lib.group_end()

    closes_on_any_thread = True
    """``close`` may run on a thread other than the actor's, even while that one is inside a
    transfer call: NCCL's abort is made for a communicator an operation hangs on (see
    :mod:`tensorferry.graph._link_watch`)."""

    def close(self) -> None:
        """Aborts every communicator (abort never waits for the peer, which may be gone);
        calling it again does nothing."""
        opened, self._opened = self._opened, []
        self._peer_comms = {}
        # All at once: one abort waits for the device, which a receive still pending on another
        # communicator (an announced one whose sender died) keeps busy until that one is
        # aborted too (see tensorferry.runtime._communicators.abort_together).
        abort_together([_Aborting(self._lib, comm, self._rank) for comm in opened])


class _Aborting:
    """One communicator of a link, in the shape :func:`abort_together` takes."""

    __slots__ = ("_comm", "_lib", "_rank")

    def __init__(self, lib: NcclLibrary, comm: int, rank: int) -> None:
        self._lib, self._comm, self._rank = lib, comm, rank

    def abort(self) -> None:
        try:
            self._lib.abort(self._comm)
        except Exception:
            log.warning("rank %d: aborting an NCCL communicator failed", self._rank, exc_info=True)


def make_links(setup: NcclSetup, device: torch.device) -> tuple[dict[str, GpuLink], list[Any]]:
    """Every GPU link of this actor: ``({transport: link}, [what to close, in order])``."""
    links: dict[str, GpuLink] = {}
    owners: list[Any] = []
    try:
        if setup.pairs:
            links["nccl"] = make_link(setup, device)
            owners.append(links["nccl"])
        if setup.p2p_pairs:
            from tensorferry.graph._p2p_link import P2PLinks

            p2p = P2PLinks(setup, device)
            owners.append(p2p)
            links.update(p2p.links)
    except BaseException:
        for owner in reversed(owners):
            owner.close()
        raise
    return links, owners


def _driver_store(setup: NcclSetup) -> Any:
    """The driver's TCP store under the graph's prefix (waits there end after the set-up
    timeout)."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=setup.timeout_s)
    store = dist.TCPStore(setup.store_host, setup.store_port, is_master=False, timeout=timeout)
    return dist.PrefixStore(setup.prefix, store)


def _current_stream_handle(index: int) -> int:
    # The raw handle: torch's Stream object costs microseconds on every transfer.
    return torch._C._cuda_getCurrentRawStream(index)


def _wait_for_event(event: Any, timeout_s: float, what: str) -> None:
    """Polls ``event`` on the host until it fired.

    Raises:
        TransferTimeoutError: it did not fire within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while not event.query():
        if time.monotonic() > deadline:
            raise TransferTimeoutError(f"{what} did not finish within {timeout_s} s")
        time.sleep(1e-4)


def make_link(setup: NcclSetup, device: torch.device) -> GpuLink:
    """The link the graph uses for GPU edges (see the module doc: the switch point)."""
    lib = nccl_library()
    if lib is not None:
        return DirectNcclLink(setup, device, lib)
    return TorchNcclLink(setup, device)
