"""What a one-sided copy-engine message costs between two GPUs of one host, end to end.

The p2p layer's one-host route writes a message straight into the receiver's buffers with the
copy engine and signals completion with a word the device writes, instead of exchanging headers
through threads. This tool measures what such a route can reach on a machine, with nothing of
the library in the way, beside ``torch.distributed`` (NCCL) timed the same way in the same run:

- the receiver's buffers are mapped into the sender once (CUDA IPC: each allocation's handle,
  opened in the sender's own device context with peer access);
- the sender's stream copies (``cudaMemcpyAsync``) and then writes the message's number into a
  word of pinned, shared host memory (``cuStreamWriteValue32``) that both processes map;
- each side is done when its host sees that word reach the number (a plain memory read).

Rows: 4 KiB one way with the receiver's buffer known ahead (the floor) and with the receiver
posting its buffer over a Unix socket per message (one host handshake); 4 KiB round trip;
64 × 2 MiB as 64 copies; one 1 GiB copy. Every row is timed as ``tensorferry bench peers``
times it: a barrier, the sender's start, then the later of both sides' completion; medians.
Every byte is checked (payloads encode the iteration; buffers poisoned before each).

Run on a machine with two GPUs::

    python -m torch.distributed.run --standalone --nproc-per-node 2 tools/one_sided_ceiling.py

It needs cuda-python (``cuda.bindings``), which the GPU machines have.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import mmap
import os
import pickle
import socket
import statistics
import time

import torch
import torch.distributed as dist

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30


def _check(result, what: str):
    err = result[0] if isinstance(result, tuple) else result
    if int(err) != 0:
        raise RuntimeError(f"{what} failed: {err}")
    return result[1:] if isinstance(result, tuple) and len(result) > 1 else None


class SharedWords:
    """Pinned host words in a /dev/shm file both ranks map: the device writes, hosts read."""

    def __init__(self, name: str, words: int, create: bool) -> None:
        from cuda.bindings import runtime as rt

        path = f"/dev/shm/{name}"
        fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o600)
        if create:
            os.ftruncate(fd, mmap.PAGESIZE)
        self.map = mmap.mmap(fd, mmap.PAGESIZE)
        os.close(fd)
        self.path = path
        self.host = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
        flags = rt.cudaHostRegisterMapped | rt.cudaHostRegisterPortable
        _check(rt.cudaHostRegister(self.host, mmap.PAGESIZE, flags), "cudaHostRegister")
        (dev,) = _check(rt.cudaHostGetDevicePointer(self.host, 0), "cudaHostGetDevicePointer")
        self.device = int(dev)
        self.words = [ctypes.c_uint32.from_address(self.host + 4 * i) for i in range(words)]

    def reset(self) -> None:
        for w in self.words:
            w.value = 0

    def wait_at_least(self, index: int, value: int, limit_s: float = 10.0) -> None:
        word, end = self.words[index], time.monotonic() + limit_s
        while word.value < value:
            if time.monotonic() > end:
                raise TimeoutError(f"word {index} stayed {word.value} < {value}")


def copy_async(dst: int, src: int, nbytes: int, stream: int) -> None:
    from cuda.bindings import runtime as rt

    kind = rt.cudaMemcpyKind.cudaMemcpyDefault
    _check(rt.cudaMemcpyAsync(dst, src, nbytes, kind, stream), "cudaMemcpyAsync")


def write_word(stream: int, address: int, value: int) -> None:
    from cuda.bindings import driver as cu

    _check(
        cu.cuStreamWriteValue32(cu.CUstream(stream), cu.CUdeviceptr(address), value, 0),
        "cuStreamWriteValue32",
    )


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


_opened: dict[bytes, int] = {}


@functools.cache
def _driver() -> ctypes.CDLL:
    cu = ctypes.CDLL("libcuda.so.1")
    u64p, handle = ctypes.POINTER(ctypes.c_uint64), _IpcHandle
    cu.cuMemGetAddressRange_v2.argtypes = [u64p, ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
    cu.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(handle), ctypes.c_uint64]
    cu.cuIpcOpenMemHandle_v2.argtypes = [u64p, handle, ctypes.c_uint]
    return cu


def export(t: torch.Tensor) -> bytes:
    """The CUDA IPC handle of ``t``'s allocation and ``t``'s offset in it."""
    cu = _driver()
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    ptr = ctypes.c_uint64(t.data_ptr())
    ok = cu.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr)
    assert ok == 0, f"cuMemGetAddressRange: {ok}"
    handle = _IpcHandle()
    ok = cu.cuIpcGetMemHandle(ctypes.byref(handle), base)
    assert ok == 0, f"cuIpcGetMemHandle: {ok}"
    raw = ctypes.string_at(ctypes.addressof(handle), ctypes.sizeof(handle))
    return pickle.dumps((raw, t.data_ptr() - base.value))


def open_exported(blob: bytes) -> int:
    """The address, in this process's current device's context, of an exported tensor."""
    raw, offset = pickle.loads(blob)
    if raw in _opened:  # an allocation is opened once per process
        return _opened[raw] + offset
    handle = _IpcHandle.from_buffer_copy(raw)
    ptr = ctypes.c_uint64()
    lazy_peer_access = 0x1
    ok = _driver().cuIpcOpenMemHandle_v2(ctypes.byref(ptr), handle, lazy_peer_access)
    assert ok == 0, f"cuIpcOpenMemHandle: {ok}"
    _opened[raw] = ptr.value
    return ptr.value + offset


def mapped_from(rank: int, tensors: list[torch.Tensor], store, key: str) -> list[int]:
    """Rank 1 publishes its tensors; rank 0 gets their addresses mapped into itself (``rank``
    is the caller's rank, or the other's to map the other way)."""
    if rank == 1:
        store.set(key, pickle.dumps([export(t) for t in tensors]))
        return []
    return [open_exported(blob) for blob in pickle.loads(store.get(key))]


def fill(t: torch.Tensor, it: int) -> None:
    t.view(torch.uint8).copy_(
        (torch.arange(t.numel() * t.element_size(), device=t.device) * 7 + it) % 251
    )


def expect(t: torch.Tensor, it: int, what: str) -> None:
    want = (torch.arange(t.numel() * t.element_size(), device=t.device) * 7 + it) % 251
    if not torch.equal(t.view(torch.uint8), want.to(torch.uint8)):
        raise AssertionError(f"{what}: wrong bytes at iteration {it}")


def timed(rank: int, iters: int, step) -> list[float]:
    """Runs ``step(it)`` after a barrier; each returns (start_ns or None, done_ns). Returns the
    microseconds of each iteration: the later side's done minus the earliest start given (the
    sender's, or for a pulled message whichever side began first)."""
    out = []
    for it in range(iters):
        dist.barrier()
        start, done = step(it)
        got = [None, None]
        dist.all_gather_object(got, (start, done))
        t0 = min(s for s, _ in got if s is not None)  # the earlier start where both start
        out.append((max(d for _, d in got) - t0) / 1e3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=200, help="iterations of small rows")
    parser.add_argument("--big-iters", type=int, default=20, help="iterations of large rows")
    args = parser.parse_args()
    dist.init_process_group("cpu:gloo,cuda:nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    store = dist.distributed_c10d._get_default_store()
    stream = torch.cuda.Stream()
    raw = stream.cuda_stream
    name = f"tf-ceiling-{os.environ['MASTER_PORT']}"
    if rank == 0:
        words = SharedWords(name, 8, create=True)
        words.reset()
    dist.barrier()
    if rank == 1:
        words = SharedWords(name, 8, create=False)
    dist.barrier()
    results: dict[str, list[float]] = {}
    counter = [0]  # the next message number, both ranks alike

    lanes = [torch.cuda.Stream() for _ in range(3)]  # more copy engines for split messages
    joins = [torch.cuda.Event() for _ in lanes]

    def one_way(
        name: str,
        sizes: list[int],
        iters: int,
        posted: bool,
        sock=None,
        streams: int = 1,
        pull: bool = False,
    ) -> None:
        """``streams`` > 1: the copies (a lone buffer cut into that many pieces) go round robin
        over that many streams, joined on the first before the word is written."""
        bufs = [torch.empty(n, dtype=torch.uint8, device=dev) for n in sizes]
        if pull:  # the receiver maps the sender's buffers and copies them in itself
            remote = mapped_from(1 - rank, bufs, store, f"bufs/{name}")
            pairs = zip(remote or [0] * len(bufs), bufs, strict=True)
            pieces = [(b.data_ptr(), src, b.numel()) for src, b in pairs]
        else:
            remote = mapped_from(rank, bufs, store, f"bufs/{name}")
            pairs = zip(bufs, remote or [0] * len(bufs), strict=True)
            pieces = [(d, b.data_ptr(), b.numel()) for b, d in pairs]
        if streams > 1 and len(bufs) == 1:
            d, src, size = pieces[0]
            step = size // streams
            pieces = [(d + i * step, src + i * step, step) for i in range(streams)]
        on = [raw] + [lane.cuda_stream for lane in lanes[: streams - 1]]

        def issue() -> None:
            if streams > 1:  # the extra streams start after the first's earlier work
                start = torch.cuda.Event()
                start.record(stream)
                for lane in lanes[: streams - 1]:
                    lane.wait_event(start)
            for i, (d, src, size) in enumerate(pieces):
                copy_async(d, src, size, on[i % streams])
            for lane, join in zip(lanes[: streams - 1], joins, strict=False):
                join.record(lane)
                stream.wait_event(join)
            write_word(raw, words.device, counter[0])

        def step(it: int):
            counter[0] += 1
            n = counter[0]
            if rank == 0:
                for b in bufs:
                    fill(b, it)
                torch.cuda.synchronize()
            else:
                for b in bufs:
                    b.fill_(0xA5)
                torch.cuda.synchronize()
            dist.barrier()
            if pull:
                start = time.perf_counter_ns()
                if rank == 1:
                    issue()
                words.wait_at_least(0, n)
                done = time.perf_counter_ns()
                if rank == 1:
                    for b in bufs:
                        expect(b, it, name)
                return start, done  # either side may start first: the earlier counts
            if rank == 0:
                start = time.perf_counter_ns()
                if not posted:
                    sock.recv(8)
                issue()
                words.wait_at_least(0, n)
                return start, time.perf_counter_ns()
            if not posted:
                sock.send(n.to_bytes(8, "little"))
            words.wait_at_least(0, n)
            done = time.perf_counter_ns()
            for b in bufs:
                expect(b, it, name)
            return None, done

        results[name] = timed(rank, iters, step)

    def round_trip(name: str, nbytes: int, iters: int) -> None:
        mine = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        out = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        # Each rank maps the other's receive buffer.
        store.set(f"rt/{name}/{rank}", export(mine))
        peer = open_exported(store.get(f"rt/{name}/{1 - rank}"))

        def step(it: int):
            counter[0] += 1
            n = counter[0]
            fill(out, it)
            mine.fill_(0xA5)
            torch.cuda.synchronize()
            dist.barrier()
            if rank == 0:
                start = time.perf_counter_ns()
                copy_async(peer, out.data_ptr(), nbytes, raw)
                write_word(raw, words.device + 4, n)
                words.wait_at_least(2, n)
                done = time.perf_counter_ns()
                expect(mine, it, name)
                return start, done
            words.wait_at_least(1, n)
            copy_async(peer, out.data_ptr(), nbytes, raw)
            write_word(raw, words.device + 8, n)
            words.wait_at_least(2, n)
            done = time.perf_counter_ns()
            expect(mine, it, name)
            return None, done

        results[name] = timed(rank, iters, step)

    def torch_rows() -> None:
        for nbytes in (4 * KIB,):
            buf = torch.empty(nbytes, dtype=torch.uint8, device=dev)

            def one(it: int, buf=buf):
                fill(buf, it) if rank == 0 else buf.fill_(0xA5)
                torch.cuda.synchronize()
                dist.barrier()
                start = time.perf_counter_ns()
                if rank == 0:
                    dist.send(buf, 1)
                else:
                    dist.recv(buf, 0)
                torch.cuda.synchronize()
                done = time.perf_counter_ns()
                if rank == 1:
                    expect(buf, it, "torch one way")
                return (start if rank == 0 else None), done

            results["torch 4 KiB one way"] = timed(rank, args.iters, one)

            def rt(it: int, buf=buf):
                fill(buf, it) if rank == 0 else buf.fill_(0xA5)
                torch.cuda.synchronize()
                dist.barrier()
                start = time.perf_counter_ns()
                if rank == 0:
                    dist.send(buf, 1)
                    dist.recv(buf, 1)
                else:
                    dist.recv(buf, 0)
                    dist.send(buf, 0)
                torch.cuda.synchronize()
                return (start if rank == 0 else None), time.perf_counter_ns()

            results["torch 4 KiB round trip"] = timed(rank, args.iters, rt)

    # A socket pair between the ranks for the posted variant (abstract Unix socket).
    name = f"\0tf-ceiling-{os.environ['MASTER_PORT']}"
    if rank == 1:
        lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        lst.bind(name)
        lst.listen(1)
        dist.barrier()
        sock, _ = lst.accept()
    else:
        dist.barrier()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(name)

    torch_rows()
    one_way("one-sided 4 KiB one way, buffer known", [4 * KIB], args.iters, posted=True)
    one_way("one-sided 4 KiB one way, posted per message", [4 * KIB], args.iters, False, sock)
    round_trip("one-sided 4 KiB round trip", 4 * KIB, args.iters)
    big = args.big_iters
    one_way("one-sided 64 x 2 MiB as 64 copies", [2 * MIB] * 64, big, posted=True)
    one_way("one-sided 64 x 2 MiB, 64 copies on 2 streams", [2 * MIB] * 64, big, True, streams=2)
    one_way("one-sided 64 x 2 MiB, 64 copies on 4 streams", [2 * MIB] * 64, big, True, streams=4)
    one_way("one-sided 128 MiB as one copy", [128 * MIB], big, posted=True)
    one_way("one-sided 128 MiB, 4 pieces on 4 streams", [128 * MIB], big, True, streams=4)
    one_way("one-sided 1 GiB", [GIB], big, posted=True)
    one_way("one-sided 1 GiB, 2 pieces on 2 streams", [GIB], big, True, streams=2)
    one_way("one-sided 1 GiB, 4 pieces on 4 streams", [GIB], big, True, streams=4)
    one_way("pulled 4 KiB one way, buffer known", [4 * KIB], args.iters, True, pull=True)
    one_way("pulled 64 x 2 MiB as 64 copies", [2 * MIB] * 64, big, True, pull=True)
    one_way("pulled 128 MiB as one copy", [128 * MIB], big, True, pull=True)
    one_way("pulled 1 GiB", [GIB], big, True, pull=True)
    if rank == 0:
        print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)} x2")
        print(f"{'row':<48} {'median us':>10} {'p10':>8} {'p90':>8}")
        for row, us in results.items():
            us = sorted(us[len(us) // 10 :])  # the first tenth is warm-up
            p10, p90 = us[len(us) // 10], us[(9 * len(us)) // 10]
            size = GIB if "1 GiB" in row else 128 * MIB if "MiB" in row else 0
            extra = f"  {size / (statistics.median(us) * 1e3):.0f} GB/s" if size else ""
            print(f"{row:<48} {statistics.median(us):>10.1f} {p10:>8.1f} {p90:>8.1f}{extra}")
        os.unlink(words.path)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
