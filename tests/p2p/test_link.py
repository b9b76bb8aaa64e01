"""The p2p side channel (``tensorferry.p2p._link``): its framing, on a loopback TCP connection
and on a Unix socket, and how a rank connects to a peer's listeners."""

from __future__ import annotations

import json
import shutil
import socket
import sys
import time

import pytest

from tensorferry import _native, envs
from tensorferry.p2p import _link
from tensorferry.p2p._link import _LEN, Link

linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="abstract Unix sockets: Linux"
)


@pytest.fixture(params=["compiled calls", "socket methods"])
def calls(request, monkeypatch):
    """How the link makes its system calls: through the compiled helper (holding the GIL),
    where it can be built here, or through the socket's own methods."""
    if request.param == "socket methods":
        monkeypatch.setattr(_native, "helper", lambda: None)
        return request.param
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler on this machine")
    if envs.native_mode() == "0":
        pytest.skip("TENSORFERRY_NATIVE=0: the Python path only")
    _native.start()
    assert _native.wait(timeout=600) is not None, _native.status()
    return request.param


@pytest.fixture(params=["tcp", pytest.param("unix", marks=linux_only)])
def pair(request, calls):
    if request.param == "tcp":
        server = socket.create_server(("127.0.0.1", 0))
        writer = socket.create_connection(server.getsockname())
    else:
        server = _link.open_local_listener()
        server.setblocking(True)
        writer = socket.socket(socket.AF_UNIX)
        writer.connect(server.getsockname())
    reader, _ = server.accept()
    server.close()
    link = Link(reader, peer=1)
    yield link, writer
    link.close()
    writer.close()


def read_until(link: Link, count: int) -> list:
    frames: list = []
    deadline = time.monotonic() + 5
    while len(frames) < count and time.monotonic() < deadline:
        got = link.receive()
        assert got is not None, "the link reported a lost peer"
        frames.extend(got)
    return frames


def encoded(frame: dict) -> bytes:
    payload = json.dumps(frame, separators=(",", ":")).encode()
    return _LEN.pack(len(payload)) + payload


def test_frames_that_come_together_or_in_pieces_are_read_whole(pair):
    link, writer = pair
    frames = [
        {"k": "h", "e": 0, "c": "s", "q": i, "d": "float32:256", "st": True} for i in range(500)
    ]
    wire = b"".join(encoded(f) for f in frames)
    writer.sendall(wire[:7])  # not even a whole length prefix
    assert link.receive() == []
    writer.sendall(wire[7:1000])  # a frame cut in the middle
    writer.sendall(wire[1000:])
    assert read_until(link, 500) == frames
    assert link.receive() == []  # nothing left over


def test_frames_sent_together_are_read_back(pair):
    link, writer = pair
    sender = Link(writer, peer=0)
    sender.send(
        {"k": "f", "e": 3, "msg": 'a "quoted" reason, é'},
        {"k": "h", "e": 0, "c": "r", "q": 7, "d": "", "st": False, "t": "nccl"},
    )
    assert not sender.wants_write
    assert read_until(link, 2) == [
        {"k": "f", "e": 3, "msg": 'a "quoted" reason, é'},
        {"k": "h", "e": 0, "c": "r", "q": 7, "d": "", "st": False, "t": "nccl"},
    ]


@pytest.mark.parametrize(
    "garbage",
    [
        _LEN.pack(1 << 30) + b"x",  # a length no frame has
        _LEN.pack(4) + b"[1] ",  # JSON, but not a frame of ours
        _LEN.pack(5) + b"{} {}",  # trailing bytes after the value
    ],
)
def test_garbage_on_the_wire_counts_as_a_lost_peer(pair, garbage):
    link, writer = pair
    writer.sendall(encoded({"k": "bye"}) + garbage)
    deadline = time.monotonic() + 5
    got: list | None = []
    while got is not None and time.monotonic() < deadline:
        got = link.receive()
    assert got is None


def test_a_closed_connection_counts_as_a_lost_peer(pair):
    link, writer = pair
    writer.close()
    deadline = time.monotonic() + 5
    got: list | None = []
    while got is not None and time.monotonic() < deadline:
        got = link.receive()
    assert got is None


def test_what_the_socket_does_not_take_at_once_is_queued_and_arrives_whole(pair):
    link, writer = pair
    writer.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    sender = Link(writer, peer=0)
    # Larger than the socket buffers on both ends: the first write cannot take it all, and
    # the frames sent after it wait behind what is left of it.
    texts = ["x" * (4 << 20), "after it", "and after that"]
    sender.send({"k": "f", "e": 2, "msg": texts[0]})
    assert sender.wants_write
    sender.send({"k": "f", "e": 2, "msg": texts[1]}, {"k": "f", "e": 2, "msg": texts[2]})
    frames: list = []
    deadline = time.monotonic() + 10
    while len(frames) < 3 and time.monotonic() < deadline:
        sender.flush()
        got = link.receive()
        assert got is not None, "the link reported a lost peer"
        frames.extend(got)
    assert [f["msg"] for f in frames] == texts
    assert not sender.wants_write


@pytest.fixture
def listeners():
    tcp = _link.open_listener("127.0.0.1")
    local = _link.open_local_listener()
    for sock in (tcp, local):
        if sock is not None:
            sock.setblocking(True)
            sock.settimeout(5)
    yield tcp, local
    for sock in (tcp, local):
        if sock is not None:
            sock.close()


def hello_through(listener: socket.socket, sock: socket.socket) -> list:
    """Accepts ``sock``'s connection on ``listener`` and reads its hello."""
    accepted, _ = listener.accept()
    link = Link(accepted, peer=None)
    try:
        return read_until(link, 1)
    finally:
        link.close()
        sock.close()


@linux_only
def test_a_peer_on_this_host_is_reached_over_its_unix_socket(listeners):
    tcp, local = listeners
    address = _link.listener_address("127.0.0.1", tcp, local)
    assert address.startswith(f"127.0.0.1:{tcp.getsockname()[1]} unix=")
    sock = _link.connect(address, my_rank=3, timeout=5)
    assert sock.family == socket.AF_UNIX
    assert hello_through(local, sock) == [{"hello": 3}]


@linux_only
@pytest.mark.parametrize("why", ["switched off", "another host", "socket gone"])
def test_a_peer_is_reached_over_tcp_otherwise(listeners, why):
    tcp, local = listeners
    address = _link.listener_address("127.0.0.1", tcp, local)
    if why == "another host":
        address = address.replace(_link.local_host_id(), "another-boot-id-and-namespace")
    if why == "socket gone":
        local.close()  # as a peer in another network namespace, on the same kernel: unreachable
    sock = _link.connect(address, my_rank=2, timeout=5, local=why != "switched off")
    assert sock.family == socket.AF_INET
    assert hello_through(tcp, sock) == [{"hello": 2}]


def test_without_a_unix_listener_the_address_is_tcp_alone(listeners):
    tcp, _ = listeners
    address = _link.listener_address("127.0.0.1", tcp, None)
    assert address == f"127.0.0.1:{tcp.getsockname()[1]}"
    sock = _link.connect(address, my_rank=1, timeout=5)
    assert sock.family == socket.AF_INET
    assert hello_through(tcp, sock) == [{"hello": 1}]
