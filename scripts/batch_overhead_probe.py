"""The p2p layer's host time for a ``tf.batch`` of many one-tensor messages, wire taken out.

``bench batch``'s ``tf batch`` row (64 × 4 KiB, one ``b.send`` or ``b.recv`` per tensor, one
group call) is that layer's cost plus NCCL's. This probe measures the first part alone, as
``send_overhead_probe.py`` does for one ``tf.send``: two processes share one device (a GPU, or
the CPU with ``--cpu``) and move the messages over a registered transport that moves nothing.
Rank 0 sends, rank 1 receives, ``static=True``; each batch is waited for before the next.

Rows (median µs per batch): ``entries`` the ``b.send``/``b.recv`` calls, ``exit`` leaving the
``with`` block (the whole batch numbered, announced and issued), ``exit cpu`` the calling
thread's own CPU time in it (below ``exit`` where it waited for the GIL or the engine),
``round`` until ``wait()`` returned. ``--count N`` sets the messages per batch (default 64);
``--profile`` prints the 25 costliest functions of each rank's batch exits under ``cProfile``.

Usage: ``python scripts/batch_overhead_probe.py [--cpu] [--count N] [--profile]``
"""

import cProfile
import statistics
import sys
import time

import torch
from send_overhead_probe import _option, init_with_null, profile_text, run_ranks

ROUNDS = 300


def _measure(rank, xs, prof):
    import tensorferry.p2p as tf

    peer = 1 - rank
    entries, exits, exit_cpu, rounds = [], [], [], []
    for i in range(ROUNDS + 20):
        t0 = time.perf_counter()
        with tf.batch(static=True, transport="null") as b:
            for x in xs:
                if rank == 0:
                    b.send(x, peer)
                else:
                    b.recv(x, peer)
            t1 = time.perf_counter()
            c1 = time.thread_time()
            if prof is not None and i >= 20:
                prof.enable()
        if prof is not None:
            prof.disable()
        t2 = time.perf_counter()
        c2 = time.thread_time()
        b.wait()
        if i >= 20:
            entries.append(t1 - t0)
            exits.append(t2 - t1)
            exit_cpu.append(c2 - c1)
            rounds.append(time.perf_counter() - t0)
    return {
        "entries": statistics.median(entries) * 1e6,
        "exit": statistics.median(exits) * 1e6,
        "exit cpu": statistics.median(exit_cpu) * 1e6,
        "round": statistics.median(rounds) * 1e6,
    }


def _worker(rank, port, device, count, profile, queue):
    import tensorferry.p2p as tf

    init_with_null(rank, port, device)
    try:
        xs = [torch.ones(1024, device=device) for _ in range(count)]
        prof = cProfile.Profile() if profile else None
        rows = [_measure(rank, xs, prof) for _ in range(2)]
        out = {"rows": rows}
        if prof is not None:
            out["profile"] = profile_text(prof)
        queue.put((rank, out))
    finally:
        tf.shutdown()


def main():
    device = "cpu" if "--cpu" in sys.argv or not torch.cuda.is_available() else "cuda:0"
    count = int(_option("--count", 64))
    results = run_ranks(_worker, lambda rank: (device, count, "--profile" in sys.argv))
    print(f"host µs per tf.batch of {count} one-tensor messages with no wire, on {device}:")
    for rank, side in ((0, "sends"), (1, "receives")):
        for name in ("entries", "exit", "exit cpu", "round"):
            values = "  ".join(f"{row[name]:8.1f}" for row in results[rank]["rows"])
            print(f"  rank {rank} ({side}), {name:8s} {values}")
    for rank in sorted(results):
        if "profile" in results[rank]:
            print(f"rank {rank}'s batch exits under cProfile:")
            print(results[rank]["profile"])


if __name__ == "__main__":
    main()
