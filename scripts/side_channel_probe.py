"""What one header frame costs on the p2p side channel: TCP on loopback against a Unix socket.

Both ends live in this process, connected the way ranks of one host connect (``_link``'s
listeners and ``connect``). Each round writes one frame the size of a one-tensor header with
``Link.write`` (the short way's one system call), then reads it back with ``Link.receive`` (one
read that finds it), then reads an empty socket (what a poll that finds nothing costs). Prints
the median µs of each, per family, three times alternated.

Usage: ``python scripts/side_channel_probe.py [--rounds N]`` (default 20000)
"""

from __future__ import annotations

import socket
import statistics
import sys
import time

from tensorferry.p2p import _link

HEADER = b'{"k":"h","e":0,"c":"s","q":12345,"d":"float32:256","st":true,"t":"nccl"}'


def _connected(family: str) -> tuple[_link.Link, _link.Link]:
    tcp = _link.open_listener("127.0.0.1")
    local = _link.open_local_listener() if family == "unix" else None
    if family == "unix" and local is None:
        sys.exit("no Unix socket here (abstract names need Linux)")
    listener = local or tcp
    listener.setblocking(True)
    address = _link.listener_address("127.0.0.1", tcp, local)
    sock = _link.connect(address, my_rank=0, timeout=5)
    accepted, _ = listener.accept()
    tcp.close()
    if local is not None:
        local.close()
    writer, reader = _link.Link(sock, peer=1), _link.Link(accepted, peer=0)
    assert writer.sock.family == (socket.AF_UNIX if family == "unix" else socket.AF_INET)
    frames: list = []
    while not frames:  # the hello
        frames = reader.receive() or []
    return writer, reader


def _measure(family: str, rounds: int) -> tuple[float, float, float]:
    writer, reader = _connected(family)
    writes, reads, empty = [], [], []
    try:
        for _ in range(rounds):
            t0 = time.perf_counter()
            writer.write(HEADER)
            t1 = time.perf_counter()
            got = reader.receive()
            t2 = time.perf_counter()
            assert got is not None and len(got) == 1, got
            assert reader.receive() == []
            t3 = time.perf_counter()
            writes.append(t1 - t0)
            reads.append(t2 - t1)
            empty.append(t3 - t2)
    finally:
        writer.close()
        reader.close()
    return tuple(statistics.median(x) * 1e6 for x in (writes, reads, empty))


def main() -> None:
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 20000
    print(f"median µs per header frame, {rounds} rounds each: write, read, empty read")
    for _ in range(3):
        for family in ("tcp", "unix"):
            write, read, empty = _measure(family, rounds)
            print(f"  {family:5s} write {write:5.2f}  read {read:5.2f}  empty read {empty:5.2f}")


if __name__ == "__main__":
    main()
