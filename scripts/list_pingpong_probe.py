"""The ``tf send(list)`` ping-pong of ``tensorferry bench batch`` alone, for profiling.

Ranks 0 and 1 (one GPU each, NCCL) swap a static message of 64 tensors of 4 KiB, as the bench
does: rank 0 sends and then receives, rank 1 receives and then sends, each receive followed by
``wait_stream()`` only. Three repetitions of ``ITERS`` iterations after a warm-up; for each, the
one-way time (half an iteration, the bench's measure) and the main thread's own CPU time per
iteration (``time.thread_time``: where it is below the wall time, the thread waited, for the
GIL or the device). Each rank also prints the other CUDA devices on which its process has a
context (there should be none).

Usage (2 GPUs): ``python scripts/list_pingpong_probe.py [ITERS] [--cpu]`` (default 1000;
``--cpu``: the same over gloo on the CPU, where ``wait_stream()`` is ``wait()``). Under
``py-spy record --gil --threads --subprocesses`` it shows which threads hold the GIL.
"""

import sys
import time

import torch

TENSORS, NUMEL = 64, 1024


def _worker(rank: int, world: int, iters: int) -> dict:
    """One rank's repetitions (see the module docstring)."""
    import torch.distributed as dist

    import tensorferry.p2p as tf
    from tensorferry.p2p._launch import torch_group

    with torch_group("probe/list_pingpong", timeout_s=120):
        device = tf._context.current().device
        cuda = device.type == "cuda"
        peer = 1 - rank
        out = [torch.full((NUMEL,), float(rank * 1000 + i), device=device) for i in range(TENSORS)]
        into = [torch.empty(NUMEL, device=device) for _ in range(TENSORS)]

        def received() -> None:
            handle = tf.recv(into, peer, static=True)
            handle.wait_stream() if cuda else handle.wait()

        def once() -> None:
            if rank == 0:
                tf.send(out, peer, static=True)
                received()
            else:
                received()
                tf.send(out, peer, static=True)

        def sync() -> None:
            if cuda:
                torch.cuda.synchronize()

        for _ in range(20):
            once()
        sync()
        dist.barrier()
        rows = []
        for _ in range(3):
            t0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(iters):
                once()
            cpu = time.thread_time() - c0
            sync()
            wall = time.perf_counter() - t0
            rows.append((wall / iters / 2 * 1e6, cpu / iters * 1e6))
            assert into[-1][0].item() == peer * 1000 + TENSORS - 1, "wrong data"
            dist.barrier()
        others = [i for i in range(torch.cuda.device_count()) if cuda and i != device.index]
        contexts = [i for i in others if torch._C._cuda_hasPrimaryContext(i)]
        return {"rows": rows, "contexts": contexts}


def main() -> None:
    from tensorferry.p2p._launch import run_world

    numbers = [a for a in sys.argv[1:] if a.isdigit()]
    iters = int(numbers[0]) if numbers else 1000
    backend = "gloo" if "--cpu" in sys.argv else "nccl"
    results = run_world(_worker, iters, backend=backend, timeout=300)
    for rank, result in enumerate(results):
        rows = "  ".join(f"one way {w:.0f} µs, main CPU {c:.0f} µs/iter" for w, c in result["rows"])
        print(f"rank {rank}: contexts on other devices {result['contexts']}; {rows}")


if __name__ == "__main__":
    main()
