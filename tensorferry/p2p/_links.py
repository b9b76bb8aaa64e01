"""Control links: the small frames two ranks exchange about their messages.

Each rank writes its frames for a peer on a connection it makes itself, on first need, and
reads the peer's frames on the connection the peer made (accepted by this rank's acceptor
thread, the only thread here that runs without a caller). Two one-way connections per pair
need no agreement on who connects, and neither side ever waits for the other to connect: a
connection is made as soon as the peer listens, which it does from its ``tf.init``.

A peer that dies closes both: the reader sees the end of its stream, and the writer's socket
becomes readable with nothing to read (it is only ever written).

Ranks of one host connect over abstract Unix sockets, others over TCP (see :mod:`._link`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import selectors
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

from tensorferry.errors import PeerLostError
from tensorferry.p2p import _link

__all__ = ["Links"]

log = logging.getLogger(__name__)

_HELLO_TIMEOUT_S = 10.0


class Links:
    """This rank's listeners, its acceptor thread and the connections it makes.

    Args:
        rank: this rank.
        host: the address peers reach this host at.
        store: the world's store: where each rank publishes its listening address.
        on_incoming: called on the acceptor thread with ``(peer, link)`` for each connection a
            peer made.
    """

    def __init__(
        self, rank: int, host: str, store: Any, on_incoming: Callable[[int, Any], None]
    ) -> None:
        self.rank = rank
        self.store = store
        self._on_incoming = on_incoming
        self._tcp = _link.open_listener(host)
        self._unix = _link.open_local_listener()
        self.address = _link.listener_address(host, self._tcp, self._unix)
        self._selector = selectors.DefaultSelector()
        for listener in (self._tcp, self._unix):
            if listener is not None:
                self._selector.register(listener, selectors.EVENT_READ)
        self._stop_r, self._stop_w = socket.socketpair()
        self._selector.register(self._stop_r, selectors.EVENT_READ)
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name="tensorferry-accept")
        self._thread.daemon = True

    def start(self) -> None:
        self.store.set(f"addr/{self.rank}", self.address)
        self._thread.start()

    def connect(self, peer: int, timeout: float) -> _link.Link:
        """A new connection to ``peer``'s listener (blocking, bounded by ``timeout``).

        Raises:
            PeerLostError: the peer's address cannot be had (the store is gone) or it does not
                answer.
        """
        try:
            address = bytes(self.store.get(f"addr/{peer}")).decode()
        except Exception as exc:  # a DistStoreError, or the store's host is gone
            raise PeerLostError(
                f"cannot reach rank {peer}: its address could not be read from the "
                f"rendezvous store ({first_line(exc)}); the store's host may be gone"
            ) from None
        try:
            sock = _link.connect(address, my_rank=self.rank, timeout=timeout)
        except OSError as exc:
            raise PeerLostError(f"cannot reach rank {peer} at {address}: {exc}") from None
        return _link.Link(sock, peer)

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                ready = self._selector.select()
            except (OSError, ValueError):
                return
            for key, _ in ready:
                if key.fileobj is self._stop_r:
                    return
                try:
                    sock, _ = key.fileobj.accept()  # type: ignore[union-attr]
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    return
                peer = _read_hello(sock)
                if peer is None:
                    sock.close()
                    continue
                try:
                    self._on_incoming(peer, _link.Link(sock, peer))
                except Exception:
                    log.exception("p2p: could not take the link from rank %d", peer)
                    sock.close()

    def close(self) -> None:
        self._closed = True
        self.store = None  # the world's store: nothing of this rank's holds it past shutdown
        with contextlib.suppress(OSError):
            self._stop_w.send(b"x")
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(2.0)
        for sock in (self._tcp, self._unix, self._stop_r, self._stop_w):
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.close()
        with contextlib.suppress(Exception):
            self._selector.close()


def _read_hello(sock: socket.socket) -> int | None:
    """The rank a new connection says it comes from (its first frame, read to its last byte
    and no further: frames may follow at once), or ``None``."""
    sock.setblocking(True)
    sock.settimeout(_HELLO_TIMEOUT_S)
    try:
        head = _read_exactly(sock, 4)
        size = struct.unpack(">I", head)[0] if head else 0
        body = _read_exactly(sock, size) if 0 < size < 4096 else None
        hello = json.loads(body) if body else None
    except (OSError, ValueError):
        return None
    peer = hello.get("hello") if isinstance(hello, dict) else None
    return peer if isinstance(peer, int) else None


def _read_exactly(sock: socket.socket, size: int) -> bytes | None:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s text (torch's errors end in a C++ backtrace), or its
    type's name when it has none."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
