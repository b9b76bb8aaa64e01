"""Under torchrun: ``tf.init()`` from the environment, then rings, a batch and an all-gather,
every byte checked. Exit code 0 on every rank means success.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/p2p/torchrun_check.py
"""

from __future__ import annotations

import sys

import torch

import tensorferry.p2p as tf


def main() -> int:
    tf.init(timeout=60)
    rank, world = tf.get_rank(), tf.get_world_size()
    device = tf._context.current().device
    right, left = (rank + 1) % world, (rank - 1) % world
    for size in (1, 1000, 1 << 20, 1 << 24):
        out = torch.full((size,), float(rank), device=device)
        into = torch.full((size,), -1.0, device=device)
        tf.sendrecv(out, right, into, left).wait(60)
        assert torch.all(into == float(left)), f"sendrecv {size}"
    with tf.batch() as b:
        b.send([torch.full((n,), rank * 10.0 + n, device=device) for n in (3, 5000, 70000)], right)
        got = b.recv([tf.TensorSpec((n,)) for n in (3, 5000, 70000)], left)
    b.wait(60)
    for n, t in zip((3, 5000, 70000), got, strict=True):
        assert torch.all(t == left * 10.0 + n), f"batch {n}"
    inp = torch.arange(6, device=device, dtype=torch.float32) + 100 * rank
    gathered = tf.ring_all_gather(torch.empty(world, 6, device=device), inp).result(60)
    for r in range(world):
        assert torch.equal(
            gathered[r], torch.arange(6, device=device, dtype=torch.float32) + 100 * r
        )
    print(f"rank {rank}/{world} on {device}: torchrun check ok", flush=True)
    tf.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
