"""``tensorferry bench toy``: toy programs, cached vs uncached communicators.

Modelled on XLA's cross-host transfer benchmarks (two ranks):

- ``basic_overlap``: rank 0 computes a matmul and sends the result; rank 1 receives it and
  computes on it; ``--steps`` steps.
- ``overlap``: ``--arrays`` arrays per step; each is sent as soon as it is computed, so its
  transfer overlaps the next matmul; rank 1 posts all receives up front and consumes in order.
- ``pp``: a 2-stage pipeline, ``--microbatches`` micro-batches forward (activations 0 → 1),
  then backward (gradients 1 → 0).

Modes: ``cached`` (the pair's communicators and resources made once and reused, as are the
layouts its messages repeat) and ``uncached`` (a fresh communicator for every transfer: both
ranks reset the pair after each transfer, which also makes each transfer wait for the previous
one).
Fairness: uncached is serialised by construction (creating a communicator is a rendezvous);
both modes run the same compute. Times are the max over ranks, from a barrier to a barrier.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from tensorferry.cli._args import add_bench_output_arguments, add_device_argument, positive_int

__all__ = ["add_arguments", "run"]

PROGRAMS = ("basic_overlap", "overlap", "pp")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_device_argument(parser, cuda="NCCL between GPUs 0 and 1", cpu="gloo")
    parser.add_argument(
        "--programs",
        default=",".join(PROGRAMS),
        help=f"comma-separated subset of {','.join(PROGRAMS)}",
    )
    parser.add_argument(
        "--steps", type=positive_int, default=10, help="steps of basic_overlap/overlap"
    )
    parser.add_argument("--arrays", type=positive_int, default=4, help="arrays per step of overlap")
    parser.add_argument("--microbatches", type=positive_int, default=8, help="micro-batches of pp")
    parser.add_argument(
        "--size",
        type=positive_int,
        default=None,
        help="matrix side (default 4096 on GPU, 128 on CPU)",
    )
    parser.add_argument("--modes", default="cached,uncached", help="cached,uncached")
    add_bench_output_arguments(parser, "toy")


def run(args: argparse.Namespace) -> int:
    from tensorferry.bench._devices import on_two_gpus
    from tensorferry.bench._report import report
    from tensorferry.p2p._launch import run_world

    programs = [p for p in args.programs.split(",") if p]
    unknown = set(programs) - set(PROGRAMS)
    if unknown or not programs:
        raise SystemExit(f"--programs: choose one or more of {PROGRAMS}, got {args.programs!r}")
    modes = [m for m in args.modes.split(",") if m]
    if set(modes) - {"cached", "uncached"} or not modes:
        raise SystemExit(f"--modes must be cached, uncached or both, got {args.modes!r}")
    use_cuda = on_two_gpus(args.device)
    config = {
        "programs": programs,
        "modes": modes,
        "steps": args.steps,
        "arrays": args.arrays,
        "microbatches": args.microbatches,
        "size": args.size or (4096 if use_cuda else 128),
    }
    results = run_world(_worker, config, backend="nccl" if use_cuda else "gloo", timeout=120)
    rows = []
    for program in programs:
        times = {m: max(r[program][m]["seconds"] for r in results) for m in modes}
        transfers = results[0][program][modes[0]]["transfers"]
        row = {
            "program": program,
            "device": "cuda (nccl)" if use_cuda else "cpu (gloo)",
            "transfers": transfers,
            "size": config["size"],
        }
        for mode in modes:
            row[f"{mode}_s"] = round(times[mode], 6)
        if "cached" in times and "uncached" in times:
            row["ratio"] = round(times["uncached"] / times["cached"], 1)
        rows.append(row)
    notes = [" ".join(__doc__.split())]
    report(args.out, "toy", rows, title=__doc__.splitlines()[0], notes=notes)
    return 0


# ---------------------------------------------------------------------- in each rank
def _worker(rank: int, world: int, config: dict) -> dict:
    import torch

    import tensorferry.p2p as tf

    if world != 2:
        raise SystemExit("bench toy runs on exactly 2 ranks")
    ctx_device = tf._context.current().device
    torch.manual_seed(rank)
    results: dict[str, Any] = {}
    for program in config["programs"]:
        fn = globals()[f"_{program}"]
        results[program] = {}
        for mode in config["modes"]:
            if mode == "cached":
                fn(rank, ctx_device, config, uncached=False)  # warm-up: the pair's resources
            _barrier(rank, ctx_device)
            t0 = time.perf_counter()
            transfers = fn(rank, ctx_device, config, uncached=mode == "uncached")
            _barrier(rank, ctx_device)
            seconds = time.perf_counter() - t0
            results[program][mode] = {"seconds": seconds, "transfers": transfers}
            if rank == 0:  # one line per timed run: a long (uncached) run shows how far it got
                line = f"toy: {program} {mode}: {seconds:.4f} s (rank 0)"
                print(line, file=sys.stderr, flush=True)
    return results


_barriers = iter(range(1 << 30))


def _barrier(rank: int, device: Any) -> None:
    """Both ranks meet, through the store (no p2p message: it would count as a transfer)."""
    import torch

    import tensorferry.p2p as tf

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    store = tf._context.current().store
    key = f"bench/toy/barrier/{next(_barriers)}"
    store.set(f"{key}/{rank}", "1")
    store.wait([f"{key}/{1 - rank}"])


class _Link:
    """Sends/receives to the other rank in the chosen mode."""

    def __init__(self, rank: int, device: Any, uncached: bool) -> None:
        self.peer = 1 - rank
        self.device = device
        self.uncached = uncached
        self.pending: list = []
        self.count = 0

    def send(self, tensor: Any) -> None:
        import tensorferry.p2p as tf

        handle = tf.send(tensor, self.peer)
        self.count += 1
        if self.uncached:
            handle.wait()
            tf._api._reset_pair(self.peer)
        else:
            self.pending.append(handle)

    def recv(self, like: Any) -> Any:
        import tensorferry.p2p as tf

        handle = tf.recv(tf.TensorSpec.like(like), self.peer)
        self.count += 1
        if self.uncached:
            out = handle.result()
            tf._api._reset_pair(self.peer)
            return out
        return handle

    def ready(self, handle: Any) -> Any:
        """The received tensor, safe on the current stream (no host wait on GPU)."""
        if not hasattr(handle, "wait_stream"):
            return handle
        if self.device.type == "cuda":
            handle.wait_stream()
            return handle._value
        return handle.result()

    def finish(self) -> int:
        for handle in self.pending:
            handle.wait()
        return self.count


def _matrices(device: Any, n: int, count: int) -> list:
    import torch

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return [torch.randn(n, n, device=device, dtype=dtype) / n**0.5 for _ in range(count)]


def _basic_overlap(rank: int, device: Any, config: dict, *, uncached: bool) -> int:
    link = _Link(rank, device, uncached)
    x, w = _matrices(device, config["size"], 2)
    for _ in range(config["steps"]):
        if rank == 0:
            link.send(x @ w)
        else:
            y = link.ready(link.recv(x))
            x = y @ w
    return link.finish()


def _overlap(rank: int, device: Any, config: dict, *, uncached: bool) -> int:
    link = _Link(rank, device, uncached)
    arrays = config["arrays"]
    xs = _matrices(device, config["size"], arrays)
    (w,) = _matrices(device, config["size"], 1)
    for _ in range(config["steps"]):
        if rank == 0:
            for x in xs:
                link.send(x @ w)  # its transfer overlaps the next matmul
        else:
            handles = [link.recv(x) for x in xs] if not uncached else None
            for i in range(arrays):
                y = link.ready(handles[i]) if handles else link.ready(link.recv(xs[i]))
                xs[i] = y @ w
    return link.finish()


def _pp(rank: int, device: Any, config: dict, *, uncached: bool) -> int:
    link = _Link(rank, device, uncached)
    n, mbs = config["size"], config["microbatches"]
    inputs = _matrices(device, n, mbs)
    (w,) = _matrices(device, n, 1)
    if uncached:
        # Lockstep (a reset needs nothing in flight): activation i out, gradient i back.
        for i in range(mbs):
            if rank == 0:
                link.send(inputs[i] @ w)
                inputs[i] = link.ready(link.recv(inputs[0])) @ w.T
            else:
                a = link.ready(link.recv(inputs[0]))
                link.send((a @ w) @ w.T)
        return link.finish()
    if rank == 0:
        for x in inputs:  # forward, stage 1: every activation goes out as soon as computed
            link.send(x @ w)
        grads = [link.recv(inputs[0]) for _ in range(mbs)]
        for i in range(mbs):  # backward, stage 1
            inputs[i] = link.ready(grads[i]) @ w.T
    else:
        acts = [link.recv(inputs[0]) for _ in range(mbs)]
        for i in range(mbs):  # forward + backward, stage 2
            link.send((link.ready(acts[i]) @ w) @ w.T)
    return link.finish()
