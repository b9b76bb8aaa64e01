"""Runs a torchrun script with every rank on cuda:0: each rank poses as a host of its own to
NCCL (``NCCL_HOSTID``), so NCCL's one-rank-per-GPU check passes and the ranks talk over its
network transport (sockets on loopback). What this shows is correctness over NCCL on a machine
with one GPU; its timings say nothing about NVLink.

    python -m torch.distributed.run --standalone --nproc-per-node 3 \\
        tools/one_gpu_ranks.py tests/p2p/torchrun_suite.py
"""

from __future__ import annotations

import os
import runpy
import sys


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(f"usage: {sys.argv[0]} SCRIPT [ARG...] (under torchrun)")
    os.environ["LOCAL_RANK"] = "0"
    os.environ["NCCL_HOSTID"] = f"tensorferry-rank-{os.environ['RANK']}"
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
