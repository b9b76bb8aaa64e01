"""The side channel: one TCP connection per pair of ranks, for headers and fault notices.

Headers must not travel on the data transport: the receiver has to know what arrives before it
posts a receive of the right size, and NCCL would need a device-to-host sync to read one. A
plain socket per pair is cheap (tens of microseconds per small frame), non-blocking under a
selector on the p2p engine's thread, and tells us at once when the peer process dies (the
kernel closes its end: EOF or a reset), which NCCL alone does not.

Set-up, only between the two ranks of a pair: every rank listens on one port and publishes
``host:port`` in the store at init; the lower rank of a pair connects to the higher one when it
first needs the pair and says hello with its rank.

Frames: a 4-byte big-endian length, then UTF-8 JSON of a small dict (never pickle: a peer's
bytes are never executed).
"""

from __future__ import annotations

import contextlib
import json
import selectors
import socket
import struct
from typing import Any

__all__ = ["Link", "open_listener", "connect", "advertised_host"]

_LEN = struct.Struct(">I")
# Reads one JSON value from the start of a string: json.loads without its whitespace scans and
# its detection of a bytes payload's encoding, a few microseconds a frame on the caller's path.
_decode = json.JSONDecoder().raw_decode
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


def connect(address: str, *, my_rank: int, timeout: float) -> socket.socket:
    """Connects to a peer's listener (``host:port``) and says hello. Blocking."""
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=timeout)
    payload = json.dumps({"hello": my_rank}).encode()
    sock.sendall(_LEN.pack(len(payload)) + payload)
    return sock


class Link:
    """A framed, non-blocking connection to one peer. Used only under the p2p engine's lock."""

    def __init__(self, sock: socket.socket, peer: int | None) -> None:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.peer = peer
        self._in = bytearray()
        self._out = bytearray()
        self.closed = False
        self.interest = selectors.EVENT_READ  # what the engine's selector watches it for

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, frame: dict[str, Any] | bytes) -> None:
        """Queues ``frame`` and writes what the socket takes now."""
        self.queue(frame)
        self.flush()

    def queue(self, frame: dict[str, Any] | bytes) -> None:
        """Queues ``frame`` (a dict, or one already encoded as JSON); :meth:`flush` writes it
        (with whatever else is queued)."""
        if isinstance(frame, bytes):
            payload = frame
        else:
            payload = json.dumps(frame, separators=(",", ":")).encode()
        self._out += _LEN.pack(len(payload))
        self._out += payload

    def flush(self) -> None:
        """Writes queued bytes until the socket would block. Raises OSError if it is broken."""
        while self._out:
            try:
                sent = self.sock.send(self._out)
            except (BlockingIOError, InterruptedError):
                return
            del self._out[:sent]

    def write(self, payload: bytes) -> None:
        """Sends one encoded frame now: in one system call when nothing is queued before it
        (what the socket does not take is queued, as :meth:`send`). Raises OSError if the
        socket is broken."""
        if self._out:
            self.send(payload)
            return
        data = _LEN.pack(len(payload)) + payload
        try:
            sent = self.sock.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        if sent < len(data):
            self._out += data[sent:]

    @property
    def wants_write(self) -> bool:
        return bool(self._out)

    def receive(self) -> list[dict[str, Any]] | None:
        """Reads what is available. Returns the complete frames, or ``None`` at EOF/reset."""
        try:
            while True:
                chunk = self.sock.recv(1 << 16)
                if not chunk:
                    return None
                self._in += chunk
                if len(chunk) < (1 << 16):
                    break
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            return None
        data, frames, start = self._in, [], 0
        while len(data) - start >= _LEN.size:
            (size,) = _LEN.unpack_from(data, start)
            if size > _MAX_FRAME:
                return None  # garbage on the wire: treat as a lost peer
            end = start + _LEN.size + size
            if len(data) < end:
                break
            text = data[start + _LEN.size : end].decode()
            frame, parsed = _decode(text)  # compact JSON, as queue() writes it
            if parsed != len(text) or not isinstance(frame, dict):
                return None  # not a frame of ours: treat as a lost peer
            frames.append(frame)
            start = end
        del data[:start]  # once: frames that came together are not moved once per frame
        return frames

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            with contextlib.suppress(OSError):
                self.sock.close()
