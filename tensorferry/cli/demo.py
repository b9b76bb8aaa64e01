"""``tensorferry demo``: the main job, end to end, on whatever this machine has.

1. Point to point: two local worker processes exchange tensors (NCCL on GPUs, gloo on CPU-only
   machines); every byte is checked and a size/latency/bandwidth table printed.
2. Graph: senders produce tensors and a receiver multiplies each, compiled with overlap off and
   on; results are checked, times printed, schedule and timeline pictures written.
"""

from __future__ import annotations

import argparse

from tensorferry.cli._args import positive_int

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--part", choices=("all", "p2p", "graph"), default="all", help="which demo to run"
    )
    parser.add_argument("--out", default="tensorferry-demo", help="folder for the pictures")
    parser.add_argument("--size", type=positive_int, default=None, help="graph demo matrix side")
    parser.add_argument(
        "--iterations", type=positive_int, default=6, help="graph demo executions/mode"
    )


def run(args: argparse.Namespace) -> int:
    if args.part in ("all", "p2p"):
        from tensorferry.p2p.demo import run_p2p_demo

        print("== point to point")
        run_p2p_demo()
    if args.part in ("all", "graph"):
        from tensorferry.graph.demo import run_graph_demo

        print("== compiled graph, overlap off vs on")
        run_graph_demo(args.out, size=args.size, iterations=args.iterations)
    return 0
