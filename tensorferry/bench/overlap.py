"""``tensorferry bench overlap``: compiled-graph overlap off / on vs a hand-written optimum.

Workload (the seed example): senders each produce a ``size x size`` tensor, one receiver
multiplies each by a weight and returns the column sums. On two GPUs: one sender actor with
``--branches`` branches on cuda:0, the receiver on cuda:1, NCCL between them, fp16, size 10000.

Three ways, timed the same way (the time between one execution's results reaching the host
and the next's):
- graph, overlap off: the receiver takes a tensor, multiplies it, takes the next;
- graph, overlap on: receives issued up front on their own stream, products wait on events;
- hand-written: two processes with torch.distributed and the same streams/events written by
  hand — the optimum the graph aims at.

Each runs with one execution in flight (``--inflight 1``: the driver waits for a result before
it submits the next execution, so each interval is one execution's latency) and with two
(``--inflight 2``: graphs compiled with ``max_inflight=2``, the hand-written sender one execution
ahead of the receiver): the next execution's first transfer can then hide behind this one's
products, which is what a pipeline that runs the same graph over and over sees.
On a CPU-only machine the graph runs with small sizes over shared memory, and the hand-written
row is the same arithmetic in one process with no transfer at all (a floor, not a peer).
"""

from __future__ import annotations

import argparse
import collections
import itertools
import os
import statistics
import sys
import time
from typing import Any

from tensorferry.cli._args import add_bench_output_arguments, non_negative_int, positive_int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--size", type=positive_int, default=None, help="matrix side (default: 10000 GPU, 384 CPU)"
    )
    parser.add_argument("--branches", type=positive_int, default=3, help="tensors per execution")
    parser.add_argument(
        "--iters", type=positive_int, default=None, help="timed executions (default: 30 GPU, 8 CPU)"
    )
    parser.add_argument(
        "--warmup", type=non_negative_int, default=3, help="untimed executions first"
    )
    parser.add_argument(
        "--inflight",
        default="1,2",
        help="executions in flight to time, comma-separated (graphs compile with max_inflight "
        "set to each)",
    )
    parser.add_argument(
        "--transports",
        default="auto",
        help="graph edge transports to time, comma-separated (auto, nccl, ce, nvlink; the last "
        "three need two CUDA GPUs)",
    )
    add_bench_output_arguments(parser, "overlap")
    parser.epilog = (
        "On a machine with two CUDA GPUs the graph runs between them; otherwise on the CPU, "
        "with small sizes over shared memory."
    )


def _intervals(done_at: list[float]) -> list[float]:
    return [later - earlier for earlier, later in itertools.pairwise(done_at)]


def _time_graph(graph: Any, iters: int, warmup: int, inflight: int) -> list[float]:
    """Seconds between successive executions' results, ``inflight`` executions submitted ahead
    (the graph must be compiled with ``max_inflight >= inflight``)."""
    pending: collections.deque = collections.deque()  # (step, ref), oldest first
    done_at = []

    def read_oldest() -> None:
        step, ref = pending.popleft()
        ref.get(timeout=300)
        if step >= warmup:
            done_at.append(time.perf_counter())

    for step in range(warmup + iters + 1):
        if len(pending) == inflight:
            read_oldest()
        pending.append((step, graph.execute(step)))
    while pending:
        read_oldest()
    return _intervals(done_at)


def _handwritten_rank(rank: int, port: int, size: int, branches: int, iters: int, warmup: int,
                      inflight: int, queue: Any) -> None:  # fmt: skip
    """One rank of the hand-written version: the same work, streams and events by hand; the
    sender runs at most ``inflight`` executions ahead of the receiver's results."""
    import torch
    import torch.distributed as dist

    from tensorferry.graph.demo import _data, _weight
    from tensorferry.runtime import Client

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, device_id=device
    )
    client = Client(devices=[device])
    compute = client.stream(device, "compute")
    comm = client.stream(device, "send" if rank == 0 else "recv")
    dtype = torch.float16
    go = torch.zeros(1, device=device)
    total = warmup + iters + 1
    if rank == 0:
        for step in range(total):
            # At most `inflight` executions ahead, as the graph with max_inflight: wait for the
            # receiver's go of the execution `inflight` back.
            if step >= inflight:
                with torch.cuda.stream(comm):
                    dist.irecv(go, src=1).wait()
                comm.synchronize()
            for branch in range(branches):
                with torch.cuda.stream(compute):
                    x = _data(branch, step, size, dtype, str(device))
                    ready = torch.cuda.Event()
                    ready.record(compute)
                with torch.cuda.stream(comm):
                    comm.wait_event(ready)
                    x.record_stream(comm)
                    dist.isend(x, dst=1).wait()
    else:
        weight = _weight(size, dtype, str(device))
        done_at: list[float] = []
        launched: collections.deque = collections.deque()  # (step, done event, host results)

        def finish_oldest() -> None:
            step, done, _results = launched.popleft()
            done.synchronize()  # the column sums are on the host
            if step >= warmup:
                done_at.append(time.perf_counter())
            if step + inflight < total:  # the sender waits for this go
                with torch.cuda.stream(comm):
                    dist.isend(go, dst=0).wait()

        for step in range(total):
            arrived = []
            with torch.cuda.stream(comm):
                for _ in range(branches):
                    buffer = torch.empty(size, size, dtype=dtype, device=device)
                    dist.irecv(buffer, src=0).wait()
                    event = torch.cuda.Event()
                    event.record(comm)
                    arrived.append((buffer, event))
            with torch.cuda.stream(compute):
                results = []
                for buffer, event in arrived:
                    compute.wait_event(event)
                    buffer.record_stream(compute)
                    column_sums = (buffer @ weight).float().sum(dim=0)
                    # To the host as the graph's driver gets them, without blocking this
                    # thread: the next execution's receives are posted meanwhile.
                    host = torch.empty(size, dtype=torch.float32, pin_memory=True)
                    host.copy_(column_sums, non_blocking=True)
                    results.append(host)
                done = torch.cuda.Event()
                done.record(compute)
            launched.append((step, done, results))
            if len(launched) == inflight:
                finish_oldest()
        while launched:
            finish_oldest()
        queue.put(_intervals(done_at))
    torch.cuda.synchronize(device)
    dist.destroy_process_group()
    client.close()


def _handwritten_gpu(size: int, branches: int, iters: int, warmup: int,
                     inflight: int) -> list[float]:  # fmt: skip
    import multiprocessing
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    procs = [
        context.Process(target=_handwritten_rank,
                        args=(rank, port, size, branches, iters, warmup, inflight, queue))
        for rank in range(2)
    ]  # fmt: skip
    for proc in procs:
        proc.start()
    try:
        samples = queue.get(timeout=300)
    finally:
        for proc in procs:
            proc.join(60)
            if proc.is_alive():
                proc.kill()
    return samples


def _handwritten_cpu(size: int, branches: int, iters: int, warmup: int) -> list[float]:
    import torch

    from tensorferry.graph.demo import _data, _weight

    weight = _weight(size, torch.float32)
    samples = []
    for step in range(warmup + iters):
        inputs = [_data(branch, step, size, torch.float32) for branch in range(branches)]
        start = time.perf_counter()  # the products only: inputs are made before the clock
        for x in inputs:
            (x @ weight).sum(dim=0)
        if step >= warmup:
            samples.append(time.perf_counter() - start)
    return samples


def _progress(version: str, inflight: int, seconds: list[float]) -> None:
    """One line per timed version (stderr): a run of minutes on GPUs shows how far it got."""
    median = statistics.median(seconds) * 1e3
    print(f"overlap: {version}, {inflight} in flight: {median:.2f} ms", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    import torch

    from tensorferry.bench._devices import cuda_device_count, require_cuda_devices
    from tensorferry.bench._report import report, time_ratio_text
    from tensorferry.graph import InputNode, MultiOutputNode, actor
    from tensorferry.graph.demo import DemoReceiver, DemoSender, _check

    transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    try:
        inflights = sorted({int(n) for n in args.inflight.split(",") if n.strip()})
    except ValueError:
        inflights = []
    if not inflights or inflights[0] < 1:
        raise SystemExit(f"--inflight: positive integers, comma-separated, got {args.inflight!r}")
    unknown = sorted(set(transports) - {"auto", "nccl", "ce", "nvlink"})
    if unknown or not transports:
        raise SystemExit(f"--transports: unknown {unknown or 'empty list'}")
    on_gpu = cuda_device_count() >= 2
    if not on_gpu and set(transports) != {"auto"}:  # GPU edges: nccl, ce and nvlink
        require_cuda_devices(2, f"--transports {','.join(transports)}")
    size = args.size or (10_000 if on_gpu else 384)
    iters = args.iters or (30 if on_gpu else 8)
    dtype = torch.float16 if on_gpu else torch.float32
    if on_gpu:
        senders = [actor(DemoSender).spawn(size, dtype, "cuda:0", device=0, name="sender")]
        receiver = actor(DemoReceiver).spawn(size, dtype, "cuda:1", device=1, name="receiver")
    else:
        senders = [actor(DemoSender).spawn(size, dtype, "cpu", name=f"sender{i}")
                   for i in range(2)]  # fmt: skip
        receiver = actor(DemoReceiver).spawn(size, dtype, "cpu", name="receiver")
    reference = "cuda:1" if on_gpu else "cpu"
    times: dict[tuple[str, str, int], list[float]] = {}
    try:
        for transport in transports:
            for overlap in (False, True):
                with InputNode() as inp:
                    outs = [
                        receiver.consume.bind(
                            senders[b % len(senders)]
                            .produce.bind(inp, b)
                            .with_transport(transport, static_shape=True, direct_return=True)
                        )
                        for b in range(args.branches)
                    ]
                    dag = MultiOutputNode(outs)
                for inflight in inflights:
                    graph = dag.compile(overlap_communication=overlap, max_inflight=inflight)
                    try:
                        _check(graph.execute(0).get(timeout=300), 0, size, dtype, reference)
                        key = (transport, "on" if overlap else "off", inflight)
                        times[key] = _time_graph(graph, iters, args.warmup, inflight)
                        _progress(f"graph ({transport}), overlap {key[1]}", inflight, times[key])
                        last = args.warmup + iters + 1  # checked again after the timed runs
                        _check(graph.execute(last).get(timeout=300), last, size, dtype, reference)
                    finally:
                        graph.teardown(kill_actors=False)
    finally:
        for handle in (*senders, receiver):
            handle.kill()
    # On the CPU: one process, nothing in flight, so one floor serves every row.
    floor = None if on_gpu else _handwritten_cpu(size, args.branches, iters, args.warmup)
    for inflight in inflights:
        hand = ("-", "hand", inflight)
        if floor is None:
            times[hand] = _handwritten_gpu(size, args.branches, iters, args.warmup, inflight)
            _progress("hand-written streams", inflight, times[hand])
        else:
            times[hand] = floor
    median = {k: statistics.median(v) * 1e3 for k, v in times.items()}

    def label(key: tuple[str, str, int]) -> str:
        if key[1] == "hand":
            return "hand-written streams" if on_gpu else "products alone, 1 process (floor)"
        return f"graph ({key[0]}), overlap {key[1]}"

    rows = [
        {
            "version": label(key),
            "inflight": key[2],
            "median_ms": median[key],
            "min_ms": min(times[key]) * 1e3,
            "vs_hand": median[key] / median[("-", "hand", key[2])],
            "vs_off": median[key] / median[(key[0], "off", key[2])] if key[1] != "hand" else "",
        }
        for key in sorted(times, key=lambda k: (k[2], k[1] == "hand"))
    ]
    verdict = []
    for inflight in inflights:
        hand_ms = median[("-", "hand", inflight)]
        for transport in transports:
            on, off = median[(transport, "on", inflight)], median[(transport, "off", inflight)]
            verdict += [
                f"{transport}, {inflight} in flight: overlap on: "
                f"{time_ratio_text(on, hand_ms, 'the hand-written version')} "
                "(target: at most 1.05×)",
                f"{transport}, {inflight} in flight: overlap on: "
                f"{time_ratio_text(on, off, 'overlap off')} (target: at most 0.90×)",
            ]
    notes = [
        f"{args.branches} tensors of {size}x{size} {str(dtype).replace('torch.', '')} per "
        f"execution, {iters} timed executions after {args.warmup} warm-up; a time is the "
        "interval between successive executions' results on the host",
        "every version returns the column sums of each product to the host; results of the "
        "graph were checked against a reference recomputed by the driver",
        "graph times include the driver's execute()/get() overhead (tens of microseconds)",
        *verdict,
    ]
    if on_gpu:
        notes.append(
            "hand-written: two processes, torch.distributed NCCL isend/irecv on exclusive "
            "streams from the runtime pool, products waiting on per-receive events"
        )
    else:
        notes.append(
            "CPU: 2 sender actors + 1 receiver over shared memory on "
            f"{os.cpu_count()} cores; the hand-written row does the arithmetic alone in one "
            "process (a floor with no communication), so targets do not apply"
        )
    report(args.out, "overlap", rows, title="graph overlap: off / on / hand-written",
           notes=notes)  # fmt: skip
    return 0
