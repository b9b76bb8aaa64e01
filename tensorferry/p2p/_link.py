"""The side channel: one connection per pair of ranks, for headers and fault notices.

Headers must not travel on the data transport: the receiver has to know what arrives before it
posts a receive of the right size, and NCCL would need a device-to-host sync to read one. A
plain socket per pair is cheap (microseconds per small frame), non-blocking under a selector on
the p2p engine's thread, and tells us at once when the peer process dies (the kernel closes its
end: EOF or a reset), which NCCL alone does not.

Set-up, only between the two ranks of a pair: every rank listens on one TCP port (and, on
Linux, on an abstract Unix socket) and publishes both addresses in the store at init; the lower
rank of a pair connects to the higher one when it first needs the pair and says hello with its
rank. Ranks of one host (one kernel, one network namespace) connect over the Unix socket: a
small frame costs a third of what it costs on TCP's loopback, for the writer and the reader
alike (each header is one write on the caller's critical path and one read on the peer's).
Ranks of different hosts, or where the Unix socket cannot be reached, use TCP
(``TENSORFERRY_P2P_LOCAL_LINKS=0``: always TCP).

Frames: a 4-byte big-endian length, then UTF-8 JSON of a small dict (never pickle: a peer's
bytes are never executed).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import secrets
import socket
import struct
from typing import Any

from tensorferry import _native

__all__ = [
    "Link",
    "open_listener",
    "open_local_listener",
    "listener_address",
    "connect",
    "advertised_host",
]

_LEN = struct.Struct(">I")
_CHUNK = 1 << 16  # bytes one read takes at most
_AGAIN = (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR)
# Reads one JSON value from the start of a string: json.loads without its whitespace scans and
# its detection of a bytes payload's encoding, a few microseconds a frame on the caller's path.
_decode = json.JSONDecoder().raw_decode


def _unencodable(value: Any) -> Any:
    raise TypeError(f"a frame cannot carry {type(value).__name__}")


def _frame_encoder() -> Any:
    """Writes one frame as compact JSON, as ``json.dumps(frame, separators=(",", ":"))``
    does, but with json's C encoder made once: ``json.dumps`` makes an encoder per call
    (about half of a post frame's host time). Frames are flat dicts: no cycle check."""
    make = json.encoder.c_make_encoder
    if make is None:  # no C accelerator in this Python
        return lambda frame: json.dumps(frame, separators=(",", ":"))
    encode = make(
        None, _unencodable, json.encoder.encode_basestring_ascii, None, ":", ",", False, False, True
    )
    return lambda frame: "".join(encode(frame, 0))


_encode = _frame_encoder()


def _framed(frame: dict[str, Any]) -> bytes:
    """``frame`` as it goes on the wire: its length, then its JSON."""
    payload = _encode(frame).encode()
    return _LEN.pack(len(payload)) + payload


_MAX_FRAME = 64 << 20


def advertised_host(master_addr: str | None) -> str:
    """The address peers should use to reach this host: the local end of a route to the
    rendezvous host (loopback when that is local)."""
    if not master_addr or master_addr in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    try:
        probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            probe.connect((master_addr, 9))  # UDP connect sends nothing
            return probe.getsockname()[0]
        finally:
            probe.close()
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def open_listener(host: str) -> socket.socket:
    """A non-blocking listening socket on an ephemeral port of ``host``'s interface."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1" if host == "127.0.0.1" else "0.0.0.0", 0))
    sock.listen(128)
    sock.setblocking(False)
    return sock


@functools.cache
def local_host_id() -> str | None:
    """What two processes share exactly when each can reach the other's abstract Unix sockets:
    the running kernel (its boot id) and the network namespace (abstract names live in one).
    ``None`` where either cannot be read (not Linux)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return None
    return f"{boot}-{netns}"


def open_local_listener() -> socket.socket | None:
    """A non-blocking listener on an abstract Unix socket (a name only: no file to remove
    afterwards), or ``None`` where there can be none."""
    if local_host_id() is None:
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(f"\0tensorferry-{os.getpid()}-{secrets.token_hex(8)}")
        sock.listen(128)
    except OSError:
        sock.close()
        return None
    sock.setblocking(False)
    return sock


_LOCAL = " unix="


def listener_address(host: str, listener: socket.socket, local: socket.socket | None) -> str:
    """What a rank publishes for its peers: ``host:port``, then `` unix=HOST_ID/NAME`` when it
    also listens on a Unix socket."""
    address = f"{host}:{listener.getsockname()[1]}"
    if local is None:
        return address
    name = local.getsockname()
    name = name.decode() if isinstance(name, bytes) else name
    return f"{address}{_LOCAL}{local_host_id()}/{name[1:]}"  # past the abstract name's NUL


def connect(address: str, *, my_rank: int, timeout: float, local: bool = True) -> socket.socket:
    """Connects to a peer's listener (an address of :func:`listener_address`) and says hello:
    over its Unix socket when ``local`` and the peer is on this host, else over TCP. Blocking."""
    tcp, _, unix = address.partition(_LOCAL)
    sock = _connect_local(unix, timeout) if local and unix else None
    if sock is None:
        host, port = tcp.rsplit(":", 1)
        sock = socket.create_connection((host, int(port)), timeout=timeout)
    payload = json.dumps({"hello": my_rank}).encode()
    sock.sendall(_LEN.pack(len(payload)) + payload)
    return sock


def _connect_local(unix: str, timeout: float) -> socket.socket | None:
    """A connection to the Unix socket ``HOST_ID/NAME``, or ``None`` when the peer is on another
    host, or its socket cannot be reached (another network namespace with the same kernel)."""
    host_id, _, name = unix.partition("/")
    if host_id != local_host_id():
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(f"\0{name}")
    except OSError:
        sock.close()
        return None
    return sock


class Link:
    """A framed, non-blocking connection to one peer. Used only under the p2p engine's lock."""

    def __init__(self, sock: socket.socket, peer: int | None) -> None:
        sock.setblocking(False)
        if sock.family in (socket.AF_INET, socket.AF_INET6):  # TCP: send each small frame now
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        # The compiled helper's calls take the descriptor; asking the socket is a call each time.
        # -1 once closed (sock.fileno() then says the same), never a number reused since.
        self._fd = sock.fileno()
        self.peer = peer
        self._in = bytearray()
        self._out = bytearray()
        self._chunk = bytearray(_CHUNK)  # what one read through the compiled helper takes in
        self.closed = False
        self._ended = False  # the peer closed its end (what came before is still read)

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, *frames: dict[str, Any]) -> None:
        """Writes ``frames`` now, in one system call when nothing is queued before them; what
        the socket does not take waits for :meth:`flush`. Raises OSError if it is broken."""
        data = b"".join(_framed(frame) for frame in frames)
        if self._out:
            self._out += data
            self.flush()
            return
        sent = self._send(data)
        if sent < len(data):
            self._out += memoryview(data)[sent:]

    def flush(self) -> None:
        """Writes queued bytes until the socket would block. Raises OSError if it is broken."""
        while self._out:
            sent = self._send(self._out)
            if not sent:
                return
            del self._out[:sent]

    def _send(self, data: bytes | bytearray) -> int:
        """Writes what the socket takes of ``data`` now; returns how much (0: it would block).
        Raises OSError if the socket is broken."""
        native = _native.helper()  # (its send_now keeps the GIL: it says why)
        if native is None:
            try:
                return self.sock.send(data)
            except (BlockingIOError, InterruptedError):
                return 0
        sent = native.send_now(self._fd, data)
        if sent >= 0:
            return sent
        if -sent in _AGAIN:
            return 0
        raise OSError(-sent, os.strerror(-sent))

    def _recv(self) -> Any:
        """What the socket holds now, up to a chunk (a bytes-like object, empty when it would
        block), or ``None`` at the end of the stream or when the socket is broken."""
        native = _native.helper()
        if native is None:
            try:
                return self.sock.recv(_CHUNK) or None
            except (BlockingIOError, InterruptedError):
                return b""
            except OSError:
                return None
        got = native.recv_now(self._fd, self._chunk)
        if got > 0:
            return memoryview(self._chunk)[:got]
        return b"" if -got in _AGAIN else None

    @property
    def wants_write(self) -> bool:
        return bool(self._out)

    def receive(self) -> list[dict[str, Any]] | None:
        """Reads what is available. Returns the complete frames, or ``None`` at EOF/reset."""
        while not self._ended:
            chunk = self._recv()
            if chunk is None:  # the end: frames that came before it are handled first
                self._ended = True
                break
            if not chunk and not self._in:  # nothing came, nothing left over: most reads
                return []
            self._in += chunk
            if len(chunk) < _CHUNK:
                break
        data, frames, start = self._in, [], 0
        while len(data) - start >= _LEN.size:
            (size,) = _LEN.unpack_from(data, start)
            if size > _MAX_FRAME:
                return None  # garbage on the wire: treat as a lost peer
            end = start + _LEN.size + size
            if len(data) < end:
                break
            text = data[start + _LEN.size : end].decode()
            frame, parsed = _decode(text)  # compact JSON, as send() writes it
            if parsed != len(text) or not isinstance(frame, dict):
                return None  # not a frame of ours: treat as a lost peer
            frames.append(frame)
            start = end
        del data[:start]  # once: frames that came together are not moved once per frame
        if self._ended and not frames:
            return None
        return frames

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._fd = -1
            with contextlib.suppress(OSError):
                self.sock.close()
