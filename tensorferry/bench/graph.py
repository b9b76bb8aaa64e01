"""``tensorferry bench graph``: per-execute overhead of compiled graphs.

Cases: a 1-actor CPU graph, a 2-actor CPU chain, and (with two GPUs) a 2-actor NCCL graph moving
a 100 KB tensor. Each execution is ``graph.execute(x).get()``; the median over many is the
overhead. Baselines in the same run: a plain function call (the floor) and a round trip over a
``multiprocessing`` pipe with the same tensor (what a naive RPC pays).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from tensorferry.cli._args import add_bench_output_arguments, non_negative_int, positive_int


class Echo:
    """Actor that returns its input (CPU) or a received GPU tensor's first element's tensor."""

    def __init__(self, device: str = "cpu") -> None:
        import torch

        self.device = torch.device(device)

    def echo(self, x: Any) -> Any:
        return x

    def make(self, x: float) -> Any:
        import torch

        # 100 KB on the GPU, the same each time (static shape), from a Python number: no host
        # copy and no device sync inside the method (as in Ray's compiled-graph benchmark).
        return torch.full((25_600,), x, device=self.device)

    def first(self, x: Any) -> Any:
        # A device tensor for the driver: the graph copies it to the host itself (pinned memory,
        # asynchronously), so the method does not sync the device either.
        return x[:1]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--iters", type=positive_int, default=2000, help="timed executions per case"
    )
    parser.add_argument(
        "--warmup", type=non_negative_int, default=200, help="untimed executions first"
    )
    add_bench_output_arguments(parser, "graph")
    parser.epilog = "The 2-actor NCCL case runs only on a machine with two CUDA GPUs."


def _time(fn, iters: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return samples


def _row(case: str, samples: list[float], target: str = "-") -> dict[str, Any]:
    ordered = sorted(samples)
    return {
        "case": case,
        "median_us": statistics.median(ordered) * 1e6,
        "p10_us": ordered[len(ordered) // 10] * 1e6,
        "p90_us": ordered[len(ordered) * 9 // 10] * 1e6,
        "iters": len(ordered),
        "target_us": target,
    }


def _spin_note() -> str:
    from tensorferry.graph._channel import _spin_window_s

    return f"{_spin_window_s() * 1e6:.0f} us"


def _pipe_peer(conn: Any) -> None:
    while True:
        value = conn.recv()
        if value is None:
            return
        conn.send(value)


def run(args: argparse.Namespace) -> int:
    import multiprocessing

    import torch

    from tensorferry.bench._devices import cuda_device_count
    from tensorferry.bench._report import report
    from tensorferry.graph import InputNode, actor

    rows = []
    x = torch.randn(16)
    rows.append(_row("baseline: in-process call", _time(lambda: Echo().echo(x), args.iters, 10)))
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    peer = context.Process(target=_pipe_peer, args=(child,), daemon=True)
    peer.start()

    def pipe_round_trip() -> None:
        parent.send(x)
        parent.recv()

    rows.append(_row("baseline: mp.Pipe round trip", _time(pipe_round_trip, args.iters, 50)))
    parent.send(None)
    peer.join(5)

    EchoActor = actor(Echo)
    a, b = EchoActor.spawn(name="echo0"), EchoActor.spawn(name="echo1")
    try:
        with InputNode() as inp:
            one = a.echo.bind(inp)
        graph = one.compile()
        try:
            assert torch.equal(graph.execute(x).get(timeout=10), x)
            samples = _time(lambda: graph.execute(x).get(10), args.iters, args.warmup)
            rows.append(_row("1-actor CPU graph", samples, "30"))
        finally:
            graph.teardown(kill_actors=False)
        with InputNode() as inp:
            chain = b.echo.bind(a.echo.bind(inp))
        graph = chain.compile()
        try:
            assert torch.equal(graph.execute(x).get(timeout=10), x)
            samples = _time(lambda: graph.execute(x).get(10), args.iters, args.warmup)
            rows.append(_row("2-actor CPU chain", samples))
        finally:
            graph.teardown(kill_actors=False)
    finally:
        a.kill()
        b.kill()
    notes = [
        "per-execute time is execute(x).get() on the driver, 16-float input, median of the timed "
        "executions after warm-up",
        "the targets (<= 30 us for 1 actor, <= 60 us for the NCCL pair) are for a fast host; this "
        "machine's Python speed matters as much as the design",
        f"every wait spins {_spin_note()} before it sleeps (TENSORFERRY_SPIN_US, at least 200 us); "
        "a wait that outlasts the spin adds a wake-up, which dominates on virtual machines",
    ]
    gpus = cuda_device_count()
    if gpus >= 2:
        s = EchoActor.spawn("cuda:0", device=0, name="gpu0")
        r = EchoActor.spawn("cuda:1", device=1, name="gpu1")
        seven = 7.0
        try:
            for overlap in (False, True):
                with InputNode() as inp:
                    node = s.make.bind(inp).with_transport(
                        "nccl", static_shape=True, direct_return=True
                    )
                    dag = r.first.bind(node)
                graph = dag.compile(overlap_communication=overlap)
                try:
                    assert graph.execute(seven).get(timeout=60).item() == 7.0
                    samples = _time(lambda g=graph: g.execute(seven).get(10), args.iters,
                                    args.warmup)  # fmt: skip
                finally:
                    graph.teardown(kill_actors=False)
                label = f"2-actor NCCL 100 KB (overlap {'on' if overlap else 'off'})"
                rows.append(_row(label, samples, "60"))
        finally:
            s.kill()
            r.kill()
        notes.append(
            "NCCL case: the driver passes a Python float; a 100 KB float32 tensor made from it "
            "on cuda:0 goes to cuda:1 over torch.distributed NCCL; the receiver returns its "
            "first element as a device tensor, which the graph copies to the driver's host "
            "memory (the methods never sync the device themselves); the floor under this row "
            "is the same work written by hand, with no executor at all"
        )
    else:
        notes.append("NCCL case skipped: fewer than two CUDA devices")
    report(args.out, "graph_overhead", rows, title="compiled graph per-execute overhead",
           notes=notes)  # fmt: skip
    return 0
