"""``tensorferry bench allgather``: ``tf.ring_all_gather`` against torch.distributed's all-gather.

Every rank contributes ``size`` bytes; each gathers ``world × size``. Compared, at the same
sizes and in the same run: ``tf.ring_all_gather`` over each transport asked for (``world − 1``
``sendrecv`` steps around the ring) and ``torch.distributed.all_gather_into_tensor`` on a
process group of the same backend (NCCL with GPUs, gloo on the CPU). Before timing, each size is
checked byte for byte: the ring's output against torch's.

Timing: from a barrier to the end of the device work (a stream sync on GPU), median of
``--iters`` after warm-up, the slowest rank's. Reported: µs, algorithm bandwidth
(``world × size / time``) and bus bandwidth (``(world − 1) / world`` of it: what each link
carries, NCCL's convention). On one machine with all GPUs of the ring: runs with as many ranks
as GPUs (``--world`` to use fewer); without GPUs, ``--world`` CPU ranks over gloo.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

from tensorferry.cli._args import add_bench_output_arguments, positive_int

__all__ = ["add_arguments", "run"]

_GPU_SIZES = "1M,16M,64M,256M"
_CPU_SIZES = "64K,1M"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--world", type=positive_int, default=None, help="ranks (default: every GPU, or 4)"
    )
    parser.add_argument(
        "--sizes", default=None, help=f"bytes per rank (default {_GPU_SIZES}; CPU {_CPU_SIZES})"
    )
    parser.add_argument(
        "--transports",
        default=None,
        help="tf transports to time (default: nccl,auto, auto being what a ring takes by "
        "default: the copy engine between GPUs of one host; CPU: gloo)",
    )
    parser.add_argument("--iters", type=positive_int, default=20, help="timed iterations per point")
    add_bench_output_arguments(parser, "allgather")


def run(args: argparse.Namespace) -> int:
    from tensorferry.bench._devices import cuda_device_count, require_transports_for
    from tensorferry.bench._report import report
    from tensorferry.bench.sendrecv import parse_sizes
    from tensorferry.p2p._context import TRANSPORTS
    from tensorferry.p2p._launch import run_world

    gpus = cuda_device_count()
    use_cuda = gpus >= 2
    world = args.world or (gpus if use_cuda else 4)
    if world < 2:
        raise SystemExit("--world must be at least 2")
    if use_cuda and world > gpus:
        raise SystemExit(f"--world {world} needs {world} GPUs; this machine has {gpus}")
    if args.iters < 1:
        raise SystemExit("--iters must be at least 1")
    try:
        sizes = parse_sizes(args.sizes or (_GPU_SIZES if use_cuda else _CPU_SIZES))
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    if not sizes or any(size % 4 for size in sizes):
        raise SystemExit("--sizes must be multiples of 4 bytes")
    transports = (args.transports or ("nccl,auto" if use_cuda else "gloo")).split(",")
    unknown = [name for name in transports if name not in TRANSPORTS]
    if unknown:
        raise SystemExit(f"--transports: unknown {unknown}; known: {', '.join(TRANSPORTS)}")
    require_transports_for("cuda" if use_cuda else "cpu", transports, "--transports")
    config = {"sizes": sizes, "transports": transports, "iters": args.iters}
    results = run_world(
        _worker, config, world=world, backend="nccl" if use_cuda else "gloo", timeout=300
    )
    rows = []
    for size in sizes:
        for name in [f"tf ring ({t})" for t in transports] + ["torch all_gather_into_tensor"]:
            seconds = max(r[(name, size)] for r in results)  # the slowest rank
            algo = world * size / seconds / 1e9
            rows.append(
                {
                    "variant": name,
                    "ranks": world,
                    "bytes_per_rank": size,
                    "us": round(seconds * 1e6, 1),
                    "algo_gb_per_s": round(algo, 1),
                    "bus_gb_per_s": round(algo * (world - 1) / world, 1),
                }
            )
    notes = [" ".join(__doc__.split())]
    report(args.out, "allgather", rows, title=__doc__.splitlines()[0], notes=notes)
    return 0


# ---------------------------------------------------------------------- in each rank
def _worker(rank: int, world: int, config: dict) -> dict:
    import tensorferry.p2p as tf
    from tensorferry.p2p._launch import torch_group

    with torch_group("bench/allgather/torch", timeout_s=300):
        return _measure(rank, world, tf._context.current().device, config)


def _measure(rank: int, world: int, device: Any, config: dict) -> dict:
    import torch
    import torch.distributed as dist

    import tensorferry.p2p as tf

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()

    def timed(fn: Any) -> float:
        for _ in range(3):  # warm-up: communicators, first-touch allocations
            fn()
        sync()
        samples = []
        for _ in range(config["iters"]):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            sync()
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples)

    out: dict = {}
    for size in config["sizes"]:
        gen = torch.Generator().manual_seed(1000 * rank + size % 997)
        inp = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen).to(device)
        ring = torch.empty(world * size, dtype=torch.uint8, device=device)
        ref = torch.empty_like(ring)
        dist.all_gather_into_tensor(ref, inp)
        for transport in config["transports"]:
            ring.fill_(0xA5)
            tf.ring_all_gather(ring, inp, transport=transport).wait()
            if not torch.equal(ring, ref):
                raise AssertionError(f"ring all-gather over {transport} differs from torch's")

            def tf_ring(t: str = transport, o: Any = ring, i: Any = inp) -> None:
                tf.ring_all_gather(o, i, transport=t).wait()

            out[(f"tf ring ({transport})", size)] = timed(tf_ring)
            _progress(rank, f"{size} B per rank over {transport}", out)

        def torch_all_gather(o: Any = ref, i: Any = inp) -> None:
            dist.all_gather_into_tensor(o, i)

        out[("torch all_gather_into_tensor", size)] = timed(torch_all_gather)
        _progress(rank, f"{size} B per rank with torch", out)
    return out


def _progress(rank: int, what: str, out: dict) -> None:
    """One line per timed point (rank 0, stderr): a long run shows how far it got."""
    if rank == 0:
        seconds = list(out.values())[-1]
        print(f"allgather: {what}: {seconds * 1e6:.1f} µs (rank 0)", file=sys.stderr, flush=True)
