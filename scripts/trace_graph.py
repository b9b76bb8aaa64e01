"""Where a 2-actor NCCL graph's per-execute time goes (the ``tensorferry bench graph`` case).

Compiles the 100 KB NCCL graph with ``profile=True``, runs it, and prints for each operation the
median of its host start and end (GPU actors record a "host" lane for the thread issuing the
work, and one lane per stream for the device) relative to the driver's ``execute()`` call, and
the median ``execute().get()`` time. All clocks are the host's monotonic clock.
Usage: ``python scripts/trace_graph.py [--iters N]``
"""

import argparse
import statistics
import time
from collections import defaultdict

import torch

from tensorferry.bench.graph import Echo
from tensorferry.graph import InputNode, actor


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--cpu", action="store_true", help="both actors on the CPU (shm edge)")
    args = parser.parse_args()
    EchoActor = actor(Echo)
    if args.cpu:  # the same graph without GPUs: to try the script anywhere
        s, r = EchoActor.spawn(name="cpu0"), EchoActor.spawn(name="cpu1")
    else:
        s = EchoActor.spawn("cuda:0", device=0, name="gpu0")
        r = EchoActor.spawn("cuda:1", device=1, name="gpu1")
    seven = torch.tensor(7.0)
    try:
        for overlap in (False, True):
            with InputNode() as inp:
                made = s.make.bind(inp)
                transport = "shm" if args.cpu else "nccl"
                node = made.with_transport(transport, static_shape=True, direct_return=True)
                dag = r.first.bind(node)
            graph = dag.compile(overlap_communication=overlap, profile=True)
            try:
                starts, totals, records = [], [], []
                for _ in range(args.iters):
                    t0 = time.perf_counter()
                    assert graph.execute(seven).get(10).item() == 7.0
                    totals.append(time.perf_counter() - t0)
                    starts.append(t0)
                    # Actors hand their records over one execution's worth at a time.
                    records = graph.profile_records()
                for _ in range(3):  # the last executions' records come with later ones
                    graph.execute(seven).get(10)
                    records = graph.profile_records()
            finally:
                graph.teardown(kill_actors=False)
            spans = defaultdict(lambda: ([], []))
            skip = args.iters // 3  # warm-up
            for who, execution, index, kind, label, lane, begin, end in records:
                if execution < skip or execution >= len(starts):
                    continue
                origin = starts[execution]
                key = (who, index, kind, label, lane)
                spans[key][0].append((begin - origin) * 1e6)
                spans[key][1].append((end - origin) * 1e6)
            print(
                f"\n== overlap {'on' if overlap else 'off'}: execute().get() median "
                f"{statistics.median(totals[skip:]) * 1e6:.0f} us"
            )
            rows = sorted(spans.items(), key=lambda kv: statistics.median(kv[1][0]))
            for (who, index, kind, label, lane), (b, e) in rows:
                print(
                    f"  {who:>5} #{index} {kind:<7} {lane:<8} start {statistics.median(b):7.0f}"
                    f"  end {statistics.median(e):7.0f}  us   {label}"
                )
    finally:
        s.kill()
        r.kill()


if __name__ == "__main__":
    main()
