"""The floor under ``tensorferry bench graph``'s 2-actor NCCL case, on this machine.

The bench's graph: the driver passes a Python float to actor ``gpu0``, which makes a 100 KB
float32 tensor of it on cuda:0 and sends it over NCCL to actor ``gpu1`` on cuda:1, which returns
its first element to the driver's host memory. Here the same work is written by hand, with
nothing of tensorferry's graph layer: three processes (the driver and one per GPU) that hand
over by spinning on shared-memory words (no sleeps, no locks, no pickling), NCCL called through
``ctypes`` on the processes' own streams, the receive buffer allocated once. What is left is
what any executor of that graph pays on this host: three process hand-overs, one kernel launch,
one NCCL send and one receive, one device-to-host copy and its event.

Rows, each the median host time of ``execute`` → result on the driver over ``--iters`` runs:

- ``hand-overs only``: the three hand-overs, no GPU work (the CPU chain's floor);
- ``receive posted on notice``: ``gpu1`` posts its receive when ``gpu0`` says it sent (as the
  graph does with overlap off);
- ``receive posted ahead``: ``gpu1`` posts each receive as soon as the previous execution is
  done (as the graph's early receives do with overlap on).

Every execution checks the value that came back. ``--ops`` also prints the host time of each
CUDA call the graph's actors make per execution, alone in a loop on cuda:0 (median of 2000).

Usage (2 GPUs): ``python scripts/graph_floor_probe.py [--iters N] [--ops]``.
"""

import argparse
import multiprocessing as mp
import statistics
import struct
import time
from multiprocessing.shared_memory import SharedMemory

_I64 = struct.Struct("q")
_F64 = struct.Struct("d")
# Words of the shared block: (sequence, value) for each hand-over.
_IN, _MID, _OUT = 0, 64, 128  # a cache line apart
_NUMEL = 25_600  # 100 KB of float32
MODES = ("hand-overs only", "receive posted on notice", "receive posted ahead")


def _wait_for(buf, offset, k):
    while _I64.unpack_from(buf, offset)[0] != k:
        pass


def _publish(buf, offset, k, value):
    _F64.pack_into(buf, offset + 8, value)
    _I64.pack_into(buf, offset, k)  # after the value: readers spin on the sequence


def _worker(rank, shm_name, unique_id, iters, modes):
    import contextlib

    import torch

    from tensorferry.p2p._nccl_lib import library

    shm = SharedMemory(name=shm_name)
    buf = shm.buf
    gpus = modes != MODES[:1]
    if gpus:
        torch.cuda.set_device(rank)
        lib = library()
        comm = lib.init_rank(2, unique_id, rank)
        stream = torch.cuda.Stream()
        handle = stream.cuda_stream
        into = torch.empty(_NUMEL, device="cuda")
        pinned = torch.empty(1, pin_memory=True)
        host = pinned.numpy()
        event = torch.cuda.Event()
        # NCCL connects a pair at its first transfer, in both ranks' group calls at once: done
        # here, or the first send would wait in its group call for a receive posted on notice.
        with torch.cuda.stream(stream):
            probe = torch.ones(1, device="cuda")
            lib.group_start()
            (lib.send if rank == 0 else lib.recv)(probe.data_ptr(), 4, 1 - rank, comm, handle)
            lib.group_end()
        stream.synchronize()

    def post_receive():
        lib.group_start()
        lib.recv(into.data_ptr(), into.nbytes, 0, comm, handle)
        lib.group_end()

    k = 0
    with torch.cuda.stream(stream) if gpus else contextlib.nullcontext():
        for mode in modes:
            gpu = mode != "hand-overs only"
            ahead = mode == "receive posted ahead"
            if rank == 1 and ahead:
                post_receive()
            for i in range(iters):
                k += 1
                if rank == 0:
                    _wait_for(buf, _IN, k)
                    x = _F64.unpack_from(buf, _IN + 8)[0]
                    if gpu:
                        made = torch.full((_NUMEL,), x, device="cuda")
                        lib.group_start()
                        lib.send(made.data_ptr(), made.nbytes, 1, comm, handle)
                        lib.group_end()
                    _publish(buf, _MID, k, x)
                    continue
                _wait_for(buf, _MID, k)
                if not gpu:
                    _publish(buf, _OUT, k, _F64.unpack_from(buf, _MID + 8)[0])
                    continue
                if not ahead:
                    post_receive()
                pinned.copy_(into[:1], non_blocking=True)
                event.record()
                while not event.query():
                    pass
                value = float(host[0])
                if ahead and i < iters - 1:
                    post_receive()  # the next execution's, once this one's data is read
                _publish(buf, _OUT, k, value)
    if gpus:
        torch.cuda.synchronize()
        lib.destroy(comm)
    del buf
    shm.close()


def _op_costs():
    """Median host µs of each CUDA call the graph's path makes, alone in a loop."""
    import torch

    from tensorferry.runtime._stream_switch import on_stream

    torch.cuda.set_device(0)
    stream, other = torch.cuda.Stream(), torch.cuda.Stream()
    made = torch.ones(_NUMEL, device="cuda")
    pinned = torch.empty(1, pin_memory=True)
    event = torch.cuda.Event()
    event.record(stream)
    torch.cuda.synchronize()

    def in_stream():
        with on_stream(stream):
            pass

    calls = {
        "torch.full 100 KB": lambda: torch.full((_NUMEL,), 3.0, device="cuda"),
        "torch.empty 100 KB": lambda: torch.empty(_NUMEL, device="cuda"),
        "device copy 100 KB": lambda: torch.empty_like(made).copy_(made),
        "copy to pinned, 1 element": lambda: pinned.copy_(made[:1], non_blocking=True),
        "torch.cuda.Event()": torch.cuda.Event,
        "Event.record": lambda: event.record(stream),
        "Event.query": event.query,
        "Stream.wait_event": lambda: other.wait_event(event),
        "record_stream": lambda: made.record_stream(other),
        "on_stream (enter, exit)": in_stream,
        "x[:1]": lambda: made[:1],
    }
    print(f"{'CUDA call (host time)':28s} {'median_us':>9s}")
    for name, call in calls.items():
        samples = []
        for _ in range(2000):
            start = time.perf_counter()
            call()
            samples.append((time.perf_counter() - start) * 1e6)
        torch.cuda.synchronize()
        print(f"{name:28s} {statistics.median(samples):9.2f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=3000)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--ops", action="store_true", help="also time each CUDA call alone")
    parser.add_argument(
        "--handovers-only", action="store_true", help="the first row only (no GPU needed)"
    )
    args = parser.parse_args()
    import torch

    from tensorferry.p2p._nccl_lib import library

    modes = MODES[:1] if args.handovers_only else MODES
    unique_id = None
    if not args.handovers_only:
        lib = library()
        if torch.cuda.device_count() < 2 or lib is None:
            raise SystemExit("needs two GPUs and the NCCL library")
        unique_id = lib.unique_id()
    total = args.iters + args.warmup
    shm = SharedMemory(create=True, size=256)
    buf = shm.buf
    buf[:] = bytes(256)
    context = mp.get_context("spawn")
    workers = [
        context.Process(target=_worker, args=(rank, shm.name, unique_id, total, modes), daemon=True)
        for rank in (0, 1)
    ]
    for w in workers:
        w.start()
    k = 0
    print(f"{'case':28s} {'median_us':>9s} {'p10_us':>8s} {'p90_us':>8s}")
    try:
        for mode in modes:
            samples = []
            for i in range(total):
                k += 1
                x = float(k % 997)
                start = time.perf_counter()
                _publish(buf, _IN, k, x)
                _wait_for(buf, _OUT, k)
                elapsed = time.perf_counter() - start
                got = _F64.unpack_from(buf, _OUT + 8)[0]
                if got != x:
                    raise SystemExit(f"{mode}: execution {k} returned {got}, expected {x}")
                if i >= args.warmup:
                    samples.append(elapsed * 1e6)
            samples.sort()
            n = len(samples)
            print(
                f"{mode:28s} {statistics.median(samples):9.1f} {samples[n // 10]:8.1f} "
                f"{samples[n * 9 // 10]:8.1f}",
                flush=True,
            )
    finally:
        for w in workers:
            w.join(30)
            if w.is_alive():
                w.kill()
        del buf
        shm.close()
        shm.unlink()
    if args.ops:
        _op_costs()


if __name__ == "__main__":
    main()
