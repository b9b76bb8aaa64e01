"""Network channels: one TCP connection per edge, for graphs whose actors live on several hosts.

The Ray executor's counterpart of :mod:`tensorferry.graph._channel`: nothing here assumes a
shared filesystem or shared memory, only that every process of the graph can reach every other
one's listening port (Ray's own requirement for its nodes).

Frame layout (little-endian)::

    head    kind u32 | blob count u32 | pickle bytes u64
    blobs   per tensor: dtype code u16 | ndim u8 | was_cuda u8 | shape int64 x ndim
    pickle  (VALUE frames) the value, each tensor replaced by its blob index
    data    every tensor's raw bytes, in blob order

A bare tensor goes as a TENSOR frame: one blob, no pickle — one header and one copy from the
socket into a fresh tensor on the receiving side. Other values (structures, errors) are pickled
with their tensors taken out as raw blobs, as the shared-memory channels do. A writer that stops
because the graph was torn down sends a BYE frame before closing, so its reader can tell a clean
stop from a peer that died (end of stream without BYE).

Flow control: the reader drains its socket on a receive thread into a queue of at most
``capacity`` messages (the graph's ``max_inflight``); a writer blocks once the queue is full and
the kernel's socket buffers are too. So a write returns before the read happens, as on a
shared-memory channel — never with less buffering than the deadlock check assumes, only with
more — and the driver writing its next inputs cannot wait on an actor that waits to hand it
outputs.

Every wait polls the graph's :class:`NetControl` (stop, dead peer) every few milliseconds and
has a deadline.
"""

from __future__ import annotations

import collections
import contextlib
import io
import pickle
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from tensorferry.errors import TransferTimeoutError
from tensorferry.graph._channel import (
    _DTYPE_CODE,
    GraphStopped,
    PeerDied,
    _TensorPickler,
    dtype_of,
    host_values,
    travels_raw,
    unreadable,
)
from tensorferry.graph._plan import DRIVER, GraphSpec
from tensorferry.p2p._packing import as_bytes

__all__ = [
    "NetControl",
    "NetReader",
    "NetWriter",
    "NetWiring",
    "Listener",
    "establish",
]

_KIND_TENSOR, _KIND_VALUE, _KIND_BYE = 1, 2, 3
_HEAD = struct.Struct("<IIQ")
_BLOB = struct.Struct("<HBB")
_HELLO = struct.Struct("<16sI")  # graph token, edge id
_POLL_S = 0.02  # how often a waiting thread looks at the control flags
_MAX_NDIM = 64


class NetControl:
    """The graph's stop and dead flags inside one process (the shared-memory ``Control``'s role).

    The driver sets them over Ray calls (``stop``, ``mark_dead``); a channel sets ``dead`` itself
    when its peer's connection ends without a BYE. Thread-safe: plain attribute stores.
    """

    def __init__(self) -> None:
        self._stop = False
        self._dead: int | None = None

    def watch_parent(self) -> None:
        """Nothing to do: when the driver goes, its connections end and Ray ends the actors."""

    def stop(self) -> None:
        self._stop = True

    def mark_dead(self, index: int) -> None:
        if self._dead is None:
            self._dead = index

    @property
    def stopped(self) -> bool:
        return self._stop

    @property
    def driver_gone(self) -> bool:
        """Never seen here: when the driver goes, Ray ends the actors (see ``watch_parent``)."""
        return False

    def dead_index(self) -> int | None:
        return self._dead

    def check(self) -> None:
        """Raises :class:`PeerDied` or :class:`GraphStopped` when the graph must end."""
        if self._dead is not None:
            raise PeerDied(self._dead)
        if self._stop:
            raise GraphStopped()

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------- encoding
def _raw(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(as_bytes(tensor).numpy())


def _blob_entry(tensor: torch.Tensor, was_cuda: bool) -> bytes:
    if tensor.dim() > _MAX_NDIM:
        raise ValueError(f"tensors of more than {_MAX_NDIM} dimensions cannot travel")
    shape = tuple(tensor.shape)
    return _BLOB.pack(_DTYPE_CODE[tensor.dtype], len(shape), int(was_cuda)) + struct.pack(
        f"<{len(shape)}q", *shape
    )


def _encode(value: Any) -> list[memoryview | bytes]:
    """The frame of one message, as buffers to send in order."""
    if travels_raw(value):
        was_cuda = value.is_cuda
        tensor = host_values(value)
        head = _HEAD.pack(_KIND_TENSOR, 1, 0) + _blob_entry(tensor, was_cuda)
        return [head, _raw(tensor)]
    buffer = io.BytesIO()
    pickler = _TensorPickler(buffer)
    pickler.dump(value)
    payload = buffer.getvalue()
    # The pickler already moved CUDA tensors to the host; their pids remember where they were.
    table = b"".join(_blob_entry(t, False) for t in pickler.tensors)
    head = _HEAD.pack(_KIND_VALUE, len(pickler.tensors), len(payload)) + table
    return [head + payload, *(_raw(t) for t in pickler.tensors)]


class _BlobUnpickler(pickle.Unpickler):
    """Rebuilds a VALUE frame's structure around the tensors received after it."""

    def __init__(self, data: bytes, blobs: list[torch.Tensor], device: torch.device | None):
        super().__init__(io.BytesIO(data))
        self._blobs = blobs
        self._device = device
        self._moved: dict[int, torch.Tensor] = {}

    def persistent_load(self, pid: Any) -> Any:
        index, _code, _shape, was_cuda = pid
        if not (was_cuda and self._device is not None):
            return self._blobs[index]
        if index not in self._moved:
            self._moved[index] = self._blobs[index].to(self._device)
        return self._moved[index]


@dataclass(slots=True)
class _Frame:
    kind: int
    blobs: list[torch.Tensor]
    cuda_flags: list[bool]
    payload: bytes


# ---------------------------------------------------------------------- sockets
class _PeerGone(Exception):
    """The connection ended (internal)."""


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setblocking(False)


class NetWriter:
    """The writing end of an edge's connection.

    Args:
        sock: the connected socket.
        control: the graph's flags in this process, checked while waiting.
        peer: index of the reading actor (``None``: the driver).
        where: the edge, for error messages.
    """

    def __init__(
        self, sock: socket.socket, control: NetControl, *, peer: int | None, where: str
    ) -> None:
        _tune(sock)
        self._sock = sock
        self._control = control
        self._peer = peer
        self._where = where
        self._poll = select.poll()
        self._poll.register(sock, select.POLLOUT)
        self._lock = threading.Lock()
        self._broken = False  # a frame was cut off: no BYE can follow it
        self._closed = False
        self.ready_at = 0.0
        """When the last write started (monotonic s), for profiles."""

    def write(self, value: Any, *, timeout: float) -> None:
        """Sends one message; returns once its bytes are handed to the kernel.

        Raises:
            TransferTimeoutError: the reader did not make room within ``timeout``.
            GraphStopped, PeerDied: the graph is ending (or the reader's process is gone).
        """
        buffers = _encode(value)
        deadline = time.perf_counter() + timeout
        with self._lock:
            if self._closed:
                raise GraphStopped()
            self.ready_at = time.perf_counter()
            try:
                self._send(buffers, deadline)
            except _PeerGone:
                self._broken = True
                if self._peer is None or self._control.stopped:
                    raise GraphStopped() from None
                self._control.mark_dead(self._peer)
                raise PeerDied(self._peer) from None
            except BaseException:
                self._broken = True
                raise

    def _send(self, buffers: list, deadline: float) -> None:
        views = [memoryview(b).cast("B") for b in buffers]
        views = [v for v in views if v.nbytes]
        while views:
            try:
                sent = self._sock.sendmsg(views)
            except BlockingIOError:
                sent = 0
            except OSError:
                raise _PeerGone() from None
            while sent and views:
                if sent >= views[0].nbytes:
                    sent -= views[0].nbytes
                    views.pop(0)
                else:
                    views[0] = views[0][sent:]
                    sent = 0
            if views:
                self._wait(deadline)

    def _wait(self, deadline: float) -> None:
        left = deadline - time.perf_counter()
        if left <= 0:
            raise TransferTimeoutError(f"{self._where}: write waited past its timeout")
        events = self._poll.poll(min(_POLL_S, left) * 1e3)
        if events and events[0][1] & (select.POLLERR | select.POLLHUP):
            raise _PeerGone()
        self._control.check()

    def close(self) -> None:
        """Closes the connection; after a clean stop it first tells the reader (BYE)."""
        # A write in progress on another thread (a send thread at teardown) keeps the lock: the
        # frame is cut short, so no BYE — the reader is being stopped anyway.
        got = self._lock.acquire(timeout=0.2)
        try:
            if self._closed:
                return
            self._closed = True
            clean = self._control.stopped and self._control.dead_index() is None
            if got and clean and not self._broken:
                with contextlib.suppress(_PeerGone, TransferTimeoutError, GraphStopped, PeerDied):
                    self._send([_HEAD.pack(_KIND_BYE, 0, 0)], time.perf_counter() + 0.5)
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()
        finally:
            if got:
                self._lock.release()


class NetReader:
    """The reading end: a receive thread drains the socket into a queue of ``capacity``.

    Args:
        sock: the accepted socket.
        control: the graph's flags in this process.
        capacity: messages received ahead of :meth:`read` (the graph's ``max_inflight``).
        peer: index of the writing actor (``None``: the driver).
        where: the edge, for error messages.
    """

    def __init__(
        self,
        sock: socket.socket,
        control: NetControl,
        *,
        capacity: int,
        peer: int | None,
        where: str,
    ) -> None:
        _tune(sock)
        self._sock = sock
        self._control = control
        self._capacity = capacity
        self._peer = peer
        self._where = where
        self.device: torch.device | None = None
        """Where tensors that were on a GPU land (``None``: the host)."""
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN)
        self._queue: collections.deque[_Frame] = collections.deque()
        self._cond = threading.Condition()
        self._ended: BaseException | None = None
        self._closed = False
        self.ready_at = 0.0
        """When the last wait ended (monotonic s), for profiles."""
        self._thread = threading.Thread(
            target=self._receive_loop, name=f"tf-net-recv-{where}", daemon=True
        )
        self._thread.start()

    # ------------------------------------------------------------------ receive thread
    def _receive_loop(self) -> None:
        try:
            while True:
                with self._cond:
                    while len(self._queue) >= self._capacity and not self._closed:
                        self._cond.wait(_POLL_S)
                    if self._closed:
                        return
                frame = self._receive_frame()
                with self._cond:
                    if frame.kind == _KIND_BYE:
                        # A clean stop upstream: this process stops too, and says goodbye on
                        # its own connections, so the stop travels down the graph cleanly.
                        self._control.stop()
                        self._ended = GraphStopped()
                        self._cond.notify_all()
                        return
                    self._queue.append(frame)
                    self._cond.notify_all()
        except _PeerGone:
            if self._closed:
                return
            if self._peer is None or self._control.stopped:
                self._control.stop()  # the driver is gone, or the graph is stopping anyway
                ended: BaseException = GraphStopped()
            else:
                self._control.mark_dead(self._peer)
                ended = PeerDied(self._peer)
        except BaseException as exc:  # a malformed frame: the edge cannot go on
            ended = exc
        with self._cond:
            self._ended = ended
            self._cond.notify_all()

    def _receive_into(self, view: memoryview) -> None:
        while view.nbytes:
            try:
                got = self._sock.recv_into(view)
            except BlockingIOError:
                got = -1
            except OSError:
                raise _PeerGone() from None
            if got == 0:
                raise _PeerGone()
            if got > 0:
                view = view[got:]
                continue
            self._poll.poll(_POLL_S * 1e3)
            if self._closed:
                raise _PeerGone()

    def _receive_bytes(self, n: int) -> bytes:
        data = bytearray(n)
        self._receive_into(memoryview(data))
        return bytes(data)

    def _receive_frame(self) -> _Frame:
        kind, count, payload_len = _HEAD.unpack(self._receive_bytes(_HEAD.size))
        if kind == _KIND_BYE:
            return _Frame(kind, [], [], b"")
        if kind not in (_KIND_TENSOR, _KIND_VALUE):
            raise ValueError(f"{self._where}: malformed frame (kind {kind})")
        specs = []
        for _ in range(count):
            code, ndim, was_cuda = _BLOB.unpack(self._receive_bytes(_BLOB.size))
            shape = struct.unpack(f"<{ndim}q", self._receive_bytes(8 * ndim)) if ndim else ()
            specs.append((dtype_of(code), shape, bool(was_cuda)))
        payload = self._receive_bytes(payload_len) if payload_len else b""
        blobs = []
        for dtype, shape, _ in specs:
            tensor = torch.empty(shape, dtype=dtype)
            if tensor.numel():
                self._receive_into(_raw(tensor))
            blobs.append(tensor)
        return _Frame(kind, blobs, [was for _, _, was in specs], payload)

    # ------------------------------------------------------------------ consumer
    def read(self, *, timeout: float) -> Any:
        """The next message, waiting for it.

        Returns:
            The value; a ``RemoteError`` when the writer sent an error in its place.

        Raises:
            TransferTimeoutError: nothing came within ``timeout``.
            GraphStopped, PeerDied: the graph is ending.
        """
        deadline = time.perf_counter() + timeout
        with self._cond:
            while not self._queue:
                if self._ended is not None:
                    ended = self._ended
                    raise ended if not isinstance(ended, PeerDied) else PeerDied(ended.index)
                self._control.check()
                left = deadline - time.perf_counter()
                if left <= 0:
                    raise TransferTimeoutError(
                        f"{self._where}: read waited more than {timeout:.3g} s"
                    )
                self._cond.wait(min(_POLL_S, left))
            frame = self._queue.popleft()
            self._cond.notify_all()  # room for the receive thread
        self.ready_at = time.perf_counter()
        return self._decode(frame)

    def _decode(self, frame: _Frame) -> Any:
        device = self.device
        if frame.kind == _KIND_TENSOR:
            tensor = frame.blobs[0]
            return tensor.to(device) if frame.cuda_flags[0] and device is not None else tensor
        try:
            return _BlobUnpickler(frame.payload, frame.blobs, device).load()
        except Exception as exc:  # that execution fails; the graph goes on
            return unreadable(exc)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=1.0)
        self._sock.close()


# ---------------------------------------------------------------------- wiring
@dataclass(kw_only=True, slots=True, frozen=True)
class NetWiring:
    """How the processes of one graph find each other (sent to every actor with its plan)."""

    token: bytes
    """16 random bytes: a connection that does not present them is not one of the graph's."""
    addresses: dict[str, tuple[str, int]]
    """Process name (an actor's, or ``DRIVER``) to the address its listener accepts on."""
    indices: dict[str, int]
    """Actor name to its index in the graph (reported when it dies)."""
    capacity: int
    """Messages a reader receives ahead (the graph's ``max_inflight``)."""
    timeout_s: float
    """Seconds to connect every edge."""


class Listener:
    """The socket a process accepts its incoming edges on, open while the graph is wired."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("0.0.0.0", 0))  # every interface: peers may be on other hosts
        self._sock.listen(256)
        self._sock.setblocking(False)
        self.port: int = self._sock.getsockname()[1]

    def accept(
        self, edge_ids: set[int], token: bytes, *, deadline: float, control: NetControl
    ) -> dict[int, socket.socket]:
        """Accepts one connection per edge in ``edge_ids``; strangers are dropped."""
        found: dict[int, socket.socket] = {}
        poll = select.poll()
        poll.register(self._sock, select.POLLIN)
        while len(found) < len(edge_ids):
            control.check()
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(edge_ids - set(found))
                raise TransferTimeoutError(f"edges {missing} did not connect in time")
            if not poll.poll(min(_POLL_S, left) * 1e3):
                continue
            try:
                sock, _ = self._sock.accept()
            except BlockingIOError:
                continue
            sock.settimeout(max(0.1, min(5.0, left)))
            try:
                hello = _recv_exactly(sock, _HELLO.size)
            except OSError:
                sock.close()
                continue
            token_got, edge_id = _HELLO.unpack(hello)
            if token_got != token or edge_id not in edge_ids or edge_id in found:
                sock.close()
                continue
            found[edge_id] = sock
        return found

    def close(self) -> None:
        self._sock.close()


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("connection closed during hello")
        data += chunk
    return data


def _connect(
    address: tuple[str, int], edge_id: int, token: bytes, deadline: float
) -> socket.socket:
    while True:
        try:
            sock = socket.create_connection(address, timeout=max(0.1, deadline - time.monotonic()))
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    sock.sendall(_HELLO.pack(token, edge_id))
    return sock


def establish(
    me: str,
    graph: GraphSpec,
    wiring: NetWiring,
    listener: Listener,
    control: NetControl,
) -> tuple[dict[int, NetReader], dict[int, NetWriter]]:
    """Opens every edge of ``graph`` that ``me`` (an actor or ``DRIVER``) reads or writes.

    Writers connect to the reader's listener, then readers accept. A connect completes in the
    peer's listen backlog before the peer accepts, so processes need no particular order.

    Returns:
        ``(readers, writers)`` by edge id.

    Raises:
        TransferTimeoutError: an edge did not connect within ``wiring.timeout_s``.
        GraphStopped: the graph was torn down meanwhile.
    """
    deadline = time.monotonic() + wiring.timeout_s
    writers: dict[int, NetWriter] = {}
    readers: dict[int, NetReader] = {}
    try:
        for edge in graph.edges:
            if edge.src_actor == me:
                sock = _connect(wiring.addresses[edge.dst_actor], edge.edge_id, wiring.token,
                                deadline)  # fmt: skip
                peer = None if edge.dst_actor == DRIVER else wiring.indices[edge.dst_actor]
                writers[edge.edge_id] = NetWriter(
                    sock, control, peer=peer, where=f"edge {edge.edge_id} to {edge.dst_actor}"
                )
        incoming = {e.edge_id for e in graph.edges if e.dst_actor == me}
        sockets = listener.accept(incoming, wiring.token, deadline=deadline, control=control)
        for edge_id, sock in sockets.items():
            edge = graph.edge(edge_id)
            peer = None if edge.src_actor == DRIVER else wiring.indices[edge.src_actor]
            readers[edge_id] = NetReader(
                sock,
                control,
                capacity=wiring.capacity,
                peer=peer,
                where=f"edge {edge_id} from {edge.src_actor}",
            )
    except BaseException:
        for channel in (*readers.values(), *writers.values()):
            channel.close()
        raise
    return readers, writers
