"""``tensorferry demo``: tensorferry's two jobs, measured and checked on this machine.

The parts live in :mod:`tensorferry.demo`; this module reads the command line and runs them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tensorferry.cli._args import positive_int

__all__ = ["add_arguments", "run", "DESCRIPTION"]

DESCRIPTION = """\
tensorferry's two jobs, measured and checked on this machine.

1. Point to point: two local processes exchange tensors of several sizes with
   tensorferry (tf.send / tf.recv) and with torch.distributed (send / recv), in the
   same run, timed the same way: payloads are made on the device first, each round
   trip starts after a barrier and ends when the device has finished it; the median
   of many round trips follows warm-ups. Every byte is checked: receive buffers are
   poisoned before each transfer, and each rank's payload is its own. A table (size,
   one-way time and GB/s of each, which is faster) is printed and drawn into p2p.png.
2. Compiled actor graph: senders produce tensors, a receiver multiplies each, with
   communication overlap off and on. Every result is checked; the schedules and the
   measured timelines are drawn. On 2 GPUs both modes are timed, and the share of
   communication that overlapped compute is printed from the timelines' own data.
   On the CPU an actor reads, computes and writes one after another, so this part
   only checks results and draws the pictures there: no speed-up is claimed.

Requirements: 2 CUDA GPUs for GPU numbers (NCCL); without them everything runs on the
CPU (gloo over loopback), in under a minute on 2 cores. Pictures need matplotlib
(pip install 'tensorferry[plot]'); without it the demo says so and skips them."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "--part", choices=("all", "p2p", "graph"), default="all", help="which part to run"
    )
    parser.add_argument(
        "--out", default="demo-out", help="folder for the chart and pictures (default demo-out/)"
    )
    parser.add_argument(
        "--device",
        choices=("auto", "cpu"),
        default="auto",
        help="auto: 2 GPUs if there are, else the CPU; cpu: the CPU even beside GPUs",
    )
    parser.add_argument(
        "--repeats",
        type=positive_int,
        default=None,
        help="p2p: timed round trips per size and library (default 50 on GPUs, 20 on the CPU)",
    )
    parser.add_argument(
        "--size", type=positive_int, default=None, help="graph: matrix side (8192 GPU, 512 CPU)"
    )
    parser.add_argument(
        "--iterations",
        type=positive_int,
        default=None,
        help="graph: executions per mode after a warm-up (default 10 on GPUs, 3 on the CPU)",
    )


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if args.part in ("all", "p2p"):
        from tensorferry.demo.p2p import run_p2p_demo

        print("== point to point: tensorferry beside torch.distributed", flush=True)
        run_p2p_demo(device=args.device, iters=args.repeats, chart=out / "p2p.png")
    if args.part in ("all", "graph"):
        from tensorferry.demo.graph import run_graph_demo

        print("== compiled actor graph, overlap off and on", flush=True)
        run_graph_demo(out, size=args.size, iterations=args.iterations, device=args.device)
    return 0
