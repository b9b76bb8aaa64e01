"""Does ``ncclCommAbort`` return while a receive is pending whose send never comes?

The p2p layer's speculative issue (static messages received ahead of the peer's header) was
turned off after a run in which such an abort never returned, and a graph's early receives rely
on aborting a link with a receive pending when the sender died. This probe asks NCCL alone,
without the p2p engine: two processes (one GPU each), a fresh two-rank communicator per case,
rank 1 posts a 1 MiB ``ncclRecv`` and rank 0 never sends. Cases:

- ``same-thread``: rank 1 aborts on the thread that posted the receive;
- ``other-thread``: rank 1 aborts on another thread while its main thread polls the receive's
  event;
- ``peer-first``: rank 0 aborts first, then rank 1;
- ``two-comms``: rank 1 has a receive pending on each of two communicators (on two streams,
  as a pair's two directions have) and aborts one while the other's receive still spins. If
  that abort has not returned after 5 s, a helper aborts the other communicator and the probe
  reports whether the first abort returned then (it waits for the device, which the other
  receive keeps busy).

Each rank prints how long its abort took and whether the pending receive's event then fired
(the kernel ended). An abort that does not return within 20 s is reported and the rank exits.

Usage: ``python scripts/nccl_abort_probe.py`` on a machine with two GPUs.
"""

import os
import sys
import threading
import time

import torch
import torch.multiprocessing as mp

CASES = ("same-thread", "other-thread", "peer-first")
RESCUE_AFTER_S = 5.0
ABORT_LIMIT_S = 20.0


def guarded_abort(lib, comm, rank, case):
    """Aborts ``comm``; reports and exits if it has not returned within ABORT_LIMIT_S."""
    done = threading.Event()

    def watchdog():
        if not done.wait(ABORT_LIMIT_S):
            print(f"rank {rank} {case}: ncclCommAbort did NOT return in {ABORT_LIMIT_S} s",
                  flush=True)  # fmt: skip
            os._exit(3)

    threading.Thread(target=watchdog, daemon=True).start()
    start = time.perf_counter()
    lib.abort(comm)
    done.set()
    return time.perf_counter() - start


def abort_on_another_thread(lib, comm, rank, case, posted):
    """Aborts on a helper thread while this one polls the pending receive's event."""
    result = {}
    thread = threading.Thread(
        target=lambda: result.setdefault("took", guarded_abort(lib, comm, rank, case))
    )
    thread.start()
    while thread.is_alive():  # as a caller waiting on the transfer does
        posted.query()
        time.sleep(1e-4)
    return result["took"]


def worker(rank, ids, barrier):
    from tensorferry.p2p._nccl_lib import library

    torch.cuda.set_device(rank)
    lib = library()
    stream = torch.cuda.Stream()
    for case in CASES:
        comm = connect(lib, rank, ids, stream)
        barrier.wait()
        if rank == 1:
            buffer = torch.empty(1 << 20, dtype=torch.uint8, device=rank)
            with torch.cuda.stream(stream):
                lib.group_start()
                lib.recv(buffer.data_ptr(), buffer.numel(), 0, comm, stream.cuda_stream)
                lib.group_end()
                posted = torch.cuda.Event()
                posted.record(stream)
            time.sleep(0.2)
            assert not posted.query(), "the receive finished without a send"
        barrier.wait()  # the receive is pending
        took = None
        # Who aborts first: the receiver (its peer still holds a live communicator), or the
        # sender (as when it faults and tells the receiver).
        for turn in (0, 1) if case == "peer-first" else (1, 0):
            if rank == turn:
                if rank == 1 and case == "other-thread":
                    took = abort_on_another_thread(lib, comm, rank, case, posted)
                else:
                    took = guarded_abort(lib, comm, rank, case)
            barrier.wait()
        fired = None
        if rank == 1:
            deadline = time.monotonic() + 5.0
            while not posted.query() and time.monotonic() < deadline:
                time.sleep(1e-3)
            fired = posted.query()
        print(
            f"rank {rank} {case:13s}: abort took {took * 1e3:8.2f} ms"
            + ("" if fired is None else f"; pending receive's event fired after it: {fired}"),
            flush=True,
        )
        barrier.wait()
    two_comms(lib, rank, ids, barrier)


def connect(lib, rank, ids, stream):
    """A fresh two-rank communicator, connected by a first one-byte transfer."""
    if rank == 0:
        uid = lib.unique_id()
        ids.put(uid)
    else:
        uid = ids.get(timeout=60)
    comm = lib.init_rank(2, uid, rank)
    probe = torch.ones(1, dtype=torch.uint8, device=rank)
    with torch.cuda.stream(stream):
        lib.group_start()
        (lib.send if rank == 0 else lib.recv)(
            probe.data_ptr(), 1, 1 - rank, comm, stream.cuda_stream
        )
        lib.group_end()
    stream.synchronize()
    return comm


def two_comms(lib, rank, ids, barrier):
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    comms = [connect(lib, rank, ids, stream) for stream in streams]
    barrier.wait()
    if rank == 1:
        events = []
        buffers = [torch.empty(1 << 20, dtype=torch.uint8, device=rank) for _ in comms]
        for comm, stream, buffer in zip(comms, streams, buffers, strict=True):
            with torch.cuda.stream(stream):
                lib.group_start()
                lib.recv(buffer.data_ptr(), buffer.numel(), 0, comm, stream.cuda_stream)
                lib.group_end()
                events.append(torch.cuda.Event())
                events[-1].record(stream)
        time.sleep(0.2)
        rescued = threading.Event()

        def rescue():
            time.sleep(RESCUE_AFTER_S)
            rescued.set()
            lib.abort(comms[0])

        helper = threading.Thread(target=rescue, daemon=True)
        helper.start()
        start = time.perf_counter()
        lib.abort(comms[1])  # the other one's receive still spins
        took = time.perf_counter() - start
        print(
            f"rank 1 two-comms    : first abort took {took * 1e3:8.2f} ms; "
            + (
                f"it returned only after the other communicator was aborted ({RESCUE_AFTER_S} s)"
                if rescued.is_set()
                else "it returned while the other receive still spun"
            ),
            flush=True,
        )
        if not rescued.is_set():
            start = time.perf_counter()
            lib.abort(comms[0])
            took = time.perf_counter() - start
            print(f"rank 1 two-comms    : second abort took {took * 1e3:8.2f} ms", flush=True)
    barrier.wait()
    if rank == 0:
        for comm in comms:
            lib.abort(comm)
    barrier.wait()


def main():
    if torch.cuda.device_count() < 2:
        sys.exit("needs two GPUs")
    ctx = mp.get_context("spawn")
    ids, barrier = ctx.Queue(), ctx.Barrier(2, timeout=40)
    procs = [ctx.Process(target=worker, args=(r, ids, barrier)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(100)
        if p.is_alive():
            p.kill()
    print("exit codes:", [p.exitcode for p in procs])


if __name__ == "__main__":
    main()
