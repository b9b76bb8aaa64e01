"""How compile time grows with a graph's size: lowering and scheduling (overlap on, with the
deadlock simulation it runs for every move it tries) of long chains and wide fans over three
actors. No processes: the actors are the tests' fakes.

Usage: ``python scripts/compile_time_probe.py [N ...]`` (default 100 200 400 800): seconds per
graph of N method calls, best of three.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "graph"))

from graph_fakes import FakeActor

from tensorferry.graph import InputNode, MultiOutputNode
from tensorferry.graph._lower import lower
from tensorferry.graph._schedule import build_schedules


def _chain(actors: list[FakeActor], n: int):
    with InputNode() as inp:
        node = inp
        for i in range(n):
            node = actors[i % len(actors)].consume.bind(node)
    return node


def _fan(actors: list[FakeActor], n: int):
    with InputNode() as inp:
        branches = [actors[i % len(actors)].consume.bind(inp) for i in range(n)]
        return MultiOutputNode(
            [actors[0].combine.bind(branches[i], branches[i + 1]) for i in range(0, n - 1, 2)]
        )


def _seconds(build, actors: list[FakeActor], n: int) -> tuple[float, float]:
    best_lower = best_schedule = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        graph = lower(build(actors, n))
        lowered = time.perf_counter()
        build_schedules(graph, overlap=True)
        best_lower = min(best_lower, lowered - start)
        best_schedule = min(best_schedule, time.perf_counter() - lowered)
    return best_lower, best_schedule


def main() -> None:
    sizes = [int(a) for a in sys.argv[1:]] or [100, 200, 400, 800]
    actors = [FakeActor(f"a{i}") for i in range(3)]
    print("graph        calls  lower s  schedule s")
    for name, build in (("chain", _chain), ("fan", _fan)):
        for n in sizes:
            lowering, scheduling = _seconds(build, actors, n)
            print(f"{name:<12} {n:>5}  {lowering:7.3f}  {scheduling:10.3f}")


if __name__ == "__main__":
    main()
