"""Symmetric-memory pair groups around a ring of every GPU, as the nvlink/ce transports make them.

Run under torchrun with one rank per GPU (``bash scripts/gpu-check.sh symm-pairs``). Each rank
joins a group with each ring neighbour, its lower pair first, and rendezvouses two allocations
per group: ranks then enter a pair's rendezvous having done different numbers of exchanges
before (rank 0 has done its pair with 1; rank 3 has done none), which hung before the groups'
stores renumbered torch's exchanges. Prints ``PROBE PASS`` per rank; exits on a hang after
``PROBE_LIMIT`` seconds with every thread's stack.
"""

import faulthandler
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed import _symmetric_memory as symm_mem

from tensorferry.p2p.nvlink import _symm

faulthandler.dump_traceback_later(float(os.environ.get("PROBE_LIMIT", "45")), exit=True)
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.cuda.set_device(rank)
dist.init_process_group("gloo")
store = dist.distributed_c10d._get_default_store()


def say(*parts: object) -> None:
    print(f"[{rank}]", *parts, file=sys.stderr, flush=True)


def pair_of(peer: int) -> tuple[int, int]:
    return min(rank, peer), max(rank, peer)


keep = []  # groups and handles stay alive to the end
for peer in sorted({(rank - 1) % world, (rank + 1) % world} - {rank}, key=pair_of):
    lo, hi = pair_of(peer)
    name = f"probe-{lo}-{hi}"
    pair_store = dist.PrefixStore(f"pair/{lo}-{hi}", store.clone())
    keep.append(_symm.join_group(name, 0 if rank == lo else 1, 2, pair_store))
    for i in range(2):
        t = symm_mem.empty(4096, dtype=torch.uint8, device=f"cuda:{rank}")
        handle = symm_mem.rendezvous(t, name)
        keep.append((t, handle))
        say("rendezvous", name, i, "done; rank in group", handle.rank)
dist.barrier()
say("PROBE PASS")
