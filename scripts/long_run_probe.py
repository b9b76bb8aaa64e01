"""What a long run leaves behind: memory, descriptors, threads, pooled events and kept results.

Two parts, each measured after a warm-up and again at the end, so growth per operation shows:

- ``p2p``: two ranks move a 4 KiB tensor back and forth, ``static=True`` and not, waiting each
  time; per rank: resident memory, open descriptors, threads, the engine's in-flight units and
  the completion pool's pending items, and on GPUs the bytes torch holds allocated and the
  free events of the event pool.
- ``graph``: a two-actor graph with ``max_inflight=3`` run many times, keeping one ref in ten
  and dropping the rest unread: the driver's resident memory and the results it keeps.

Usage: ``python scripts/long_run_probe.py [--steps N]`` (GPU ranks and actors when two GPUs are
visible, else CPU).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import threading
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "graph"))


def _resident_mib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20


def _p2p_marks(rank: int, device: torch.device) -> dict:
    from tensorferry.p2p import _context
    from tensorferry.runtime import _events

    gc.collect()
    ctx = _context.current()
    marks = {
        "resident MiB": _resident_mib(),
        "descriptors": len(os.listdir("/proc/self/fd")),
        "threads": threading.active_count(),
        "units in flight": len(ctx.engine._issued) + len(ctx.engine._units),
        "completions pending": ctx.completions.pending(),
    }
    if device.type == "cuda":
        marks["cuda bytes allocated"] = torch.cuda.memory_allocated(device)
        marks["free pooled events"] = len(_events._free.get(device.index, ()))
    return marks


def _p2p(rank: int, world: int, steps: int) -> dict:
    import tensorferry as tf
    from tensorferry.p2p import _context

    device = _context.current().device
    peer = 1 - rank
    out = {}
    x = torch.full((1024,), float(rank), device=device)
    into = torch.empty(1024, device=device)
    for step in range(steps):
        static = step % 2 == 0
        if (step + rank) % 2 == 0:
            tf.send(x, peer, static=static).wait(30)
        else:
            tf.recv(into, peer, static=static).wait(30)
        if step in (steps // 10, steps - 1):
            out["after warm-up" if step < steps - 1 else "at the end"] = _p2p_marks(rank, device)
    return out


def _graph(steps: int, on_gpu: bool) -> dict:
    from graph_actors import Calc, GpuCalc

    from tensorferry.graph import InputNode, actor

    if on_gpu:
        first = actor(GpuCalc).spawn("cuda:0", device=0, name="first")
        second = actor(GpuCalc).spawn("cuda:1", device=1, name="second")
        with InputNode() as inp:
            dag = second.scale.bind(first.make.bind(inp), 0.5)
    else:
        first, second = actor(Calc).spawn(1.0, name="first"), actor(Calc).spawn(2.0, name="second")
        with InputNode() as inp:
            dag = second.add.bind(first.add.bind(inp))
    graph = dag.compile(max_inflight=3)
    marks, kept = {}, []
    try:
        for step in range(steps):
            ref = graph.execute(torch.full((25_000,), float(step)))  # 100 KB in
            if step % 10 == 0:
                kept.append(ref)
            if len(kept) > 5:
                kept.pop(0).get(timeout=30)
            if step in (steps // 10, steps - 1):
                gc.collect()
                key = "after warm-up" if step < steps - 1 else "at the end"
                marks[key] = {"resident MiB": _resident_mib(), "results kept": len(graph._results)}
        del ref
    finally:
        graph.teardown()
    return marks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20_000)
    args = parser.parse_args()
    from tensorferry.p2p._launch import run_world

    on_gpu = torch.cuda.is_available() and torch.cuda.device_count() >= 2
    backend = "nccl" if on_gpu else "gloo"
    print(f"p2p over {backend}, {args.steps} messages each way in turn:")
    for rank, marks in enumerate(run_world(_p2p, args.steps, backend=backend, timeout=60)):
        for when, values in marks.items():
            print(f"  rank {rank}, {when}: {values}")
    print(f"graph ({'GPU' if on_gpu else 'CPU'} actors), {args.steps // 4} executions:")
    for when, values in _graph(args.steps // 4, on_gpu).items():
        print(f"  driver, {when}: {values}")


if __name__ == "__main__":
    main()
