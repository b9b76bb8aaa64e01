"""Where a compiled graph's per-execute time goes.

Two graphs: ``echo`` is the ``tensorferry bench graph`` NCCL case (a 100 KB tensor from cuda:0
to cuda:1, one element back), ``overlap`` the ``tensorferry bench overlap`` graph (three
10000² fp16 tensors from cuda:0, multiplied on cuda:1). Each is compiled with ``profile=True``,
overlap off and on, and run; the script prints for each operation the median of its start and
end relative to the driver's ``execute()`` call: GPU actors record a "host" lane (the thread
issuing the work) and one lane per stream (the device). All clocks are the host's monotonic
clock. With ``--png DIR`` it also draws each timeline.

Usage: ``python scripts/trace_graph.py [--graph echo|overlap] [--iters N] [--cpu] [--png DIR]``
"""

import argparse
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

from tensorferry.bench.graph import Echo
from tensorferry.graph import InputNode, MultiOutputNode, actor
from tensorferry.graph.demo import DemoReceiver, DemoSender


def echo_graph(cpu: bool):
    EchoActor = actor(Echo)
    if cpu:  # the same graph without GPUs: to try the script anywhere
        s, r = EchoActor.spawn(name="cpu0"), EchoActor.spawn(name="cpu1")
    else:
        s = EchoActor.spawn("cuda:0", device=0, name="gpu0")
        r = EchoActor.spawn("cuda:1", device=1, name="gpu1")
    with InputNode() as inp:
        made = s.make.bind(inp)
        transport = "shm" if cpu else "nccl"
        dag = r.first.bind(made.with_transport(transport, static_shape=True, direct_return=True))
    return dag, [s, r], lambda step: 7.0


def overlap_graph(cpu: bool):
    size, dtype = (384, torch.float32) if cpu else (10_000, torch.float16)
    where = ("cpu", "cpu") if cpu else ("cuda:0", "cuda:1")
    devices = {} if cpu else {"s": {"device": 0}, "r": {"device": 1}}
    sender = actor(DemoSender).spawn(size, dtype, where[0], name="sender", **devices.get("s", {}))
    receiver = actor(DemoReceiver).spawn(
        size, dtype, where[1], name="receiver", **devices.get("r", {})
    )
    with InputNode() as inp:
        outs = [
            receiver.consume.bind(
                sender.produce.bind(inp, b).with_transport(
                    "auto", static_shape=True, direct_return=True
                )
            )
            for b in range(3)
        ]
    return MultiOutputNode(outs), [sender, receiver], lambda step: step


def trace(dag, make_input, overlap: bool, iters: int, png: Path | None, name: str) -> None:
    graph = dag.compile(overlap_communication=overlap, profile=True)
    try:
        starts, totals, records = [], [], []
        for step in range(iters):
            t0 = time.perf_counter()
            graph.execute(make_input(step)).get(60)
            totals.append(time.perf_counter() - t0)
            starts.append(t0)
            # Actors hand their records over one execution's worth at a time.
            records = graph.profile_records()
        for step in range(3):  # the last executions' records come with later ones
            graph.execute(make_input(iters + step)).get(60)
            records = graph.profile_records()
        if png is not None:
            path = png / f"timeline_{name}_overlap_{'on' if overlap else 'off'}.png"
            graph.visualize_timeline(path, last=3)
            print(f"wrote {path}")
    finally:
        graph.teardown(kill_actors=False)
    spans = defaultdict(lambda: ([], []))
    skip = iters // 3  # warm-up
    for who, execution, index, kind, label, lane, begin, end in records:
        if execution < skip or execution >= len(starts):
            continue
        origin = starts[execution]
        spans[(who, index, kind, label, lane)][0].append((begin - origin) * 1e6)
        spans[(who, index, kind, label, lane)][1].append((end - origin) * 1e6)
    median = statistics.median(totals[skip:]) * 1e6
    print(
        f"\n== {name}, overlap {'on' if overlap else 'off'}: execute().get() median {median:.0f} us"
    )
    rows = sorted(spans.items(), key=lambda kv: statistics.median(kv[1][0]))
    for (who, index, kind, label, lane), (b, e) in rows:
        print(
            f"  {who:>8} #{index} {kind:<7} {lane:<8} start {statistics.median(b):8.0f}"
            f"  end {statistics.median(e):8.0f}  us   {label}"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--graph", choices=("echo", "overlap"), default="echo")
    parser.add_argument("--iters", type=int, default=None, help="default: echo 300, overlap 15")
    parser.add_argument("--cpu", action="store_true", help="actors on the CPU (shm edges)")
    parser.add_argument("--png", type=Path, default=None, help="folder for timeline pictures")
    args = parser.parse_args()
    build = echo_graph if args.graph == "echo" else overlap_graph
    iters = args.iters or (300 if args.graph == "echo" else 15)
    dag, handles, make_input = build(args.cpu)
    try:
        for overlap in (False, True):
            trace(dag, make_input, overlap, iters, args.png, args.graph)
    finally:
        for handle in handles:
            handle.kill()


if __name__ == "__main__":
    main()
