"""What the garbage collector does while two ranks exchange messages.

Rank 0 sends ``--count`` messages of 64 × 4 KiB with ``static=True`` (or one 1 KiB tensor with
``--tensors 1``) and rank 1 receives them, each waited for. Each rank prints how many
collections of each generation ran meanwhile, how long they took in all and the longest one
(``gc.callbacks``), and how many objects they freed. Messages whose objects are freed as they
finish leave the collector nothing to do; objects caught in reference cycles make it run, and
now and then a full collection walks every object of the process (torch's included) while
the call that triggered it waits.

Usage: ``python scripts/gc_probe.py [--count N] [--tensors N] [--one-gpu]`` (CPU tensors over
gloo by default; ``--one-gpu``: CUDA tensors over NCCL with both ranks on ``cuda:0``, each
posing to NCCL as a host of its own).
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import torch


def _worker(rank: int, world: int, count: int, tensors: int, one_gpu: bool) -> dict:
    import tensorferry.p2p as tf
    from tensorferry import _native

    if one_gpu:  # before the pair's communicator (scripts/one_gpu_ranks.py)
        os.environ["NCCL_HOSTID"] = f"tensorferry-gc-probe-rank-{rank}"

    _native.wait()
    device = tf._context.current().device
    x = [torch.ones(1024, device=device) for _ in range(tensors)] if tensors > 1 else None
    if x is None:
        x = torch.ones(256, device=device)

    def one() -> None:
        (tf.send(x, 1, static=True) if rank == 0 else tf.recv(x, 0, static=True)).wait(60)

    for _ in range(50):  # warm-up: pair made, channel agreed
        one()
    gc.collect()
    pauses: list[tuple[int, float, int]] = []
    began = [0.0]

    def timed(phase: str, info: dict) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            pauses.append((info["generation"], time.perf_counter() - began[0], info["collected"]))

    gc.callbacks.append(timed)
    t0 = time.perf_counter()
    try:
        for _ in range(count):
            one()
    finally:
        gc.callbacks.remove(timed)
    elapsed = time.perf_counter() - t0
    by_generation = {}
    for generation in range(3):
        mine = [p for p in pauses if p[0] == generation]
        by_generation[generation] = {
            "collections": len(mine),
            "ms": round(sum(p[1] for p in mine) * 1e3, 2),
            "longest_ms": round(max((p[1] for p in mine), default=0.0) * 1e3, 2),
            "freed": sum(p[2] for p in mine),
        }
    return {"rank": rank, "us_per_message": round(elapsed / count * 1e6, 1), **by_generation}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--one-gpu", action="store_true")
    args = parser.parse_args()
    from tensorferry.p2p._launch import run_world

    backend = "nccl" if args.one_gpu else "gloo"
    for result in run_world(_worker, args.count, args.tensors, args.one_gpu, backend=backend):
        print(result)


if __name__ == "__main__":
    main()
