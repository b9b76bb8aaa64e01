"""A GPU actor that updates a tensor in place and returns it every execution (a trainer's
weights, synced to a rollout worker), sent over a GPU edge: does the receiver see each
execution's values, or a mix of two?

The trainer fills its 256 MB tensor with the execution's number and returns it; the rollout
actor returns the minimum and maximum it received. An execution counts as torn when they differ
from each other or from its number. Run for overlap off, on with one execution in flight, and
on with three, over each transport named (default ``nccl``).

Usage (2 GPUs): ``PYTHONPATH=$PWD python3 scripts/inplace_result_probe.py [nccl] [ce] [nvlink]``
"""

import sys

import torch

import tensorferry as tf
from tensorferry.graph import InputNode


class Trainer:
    def __init__(self, device, numel):
        self.device = torch.device(device)
        self.w = torch.zeros(numel, device=self.device)

    def step(self, k):
        self.w.fill_(float(k))  # in place: the last step's send may still be reading it
        return self.w


class Rollout:
    def check(self, w, k):
        """What arrived: ``(execution, min, max)``."""
        return (k, w.min().item(), w.max().item())


if __name__ == "__main__":
    numel = 64 << 20  # 256 MB of float32
    t = tf.actor(Trainer).spawn("cuda:0", numel, device=0, name="trainer")
    r = tf.actor(Rollout).spawn(device=1, name="rollout")
    for transport in sys.argv[1:] or ["nccl"]:
        for overlap, inflight in ((False, 1), (True, 1), (True, 3)):
            with InputNode() as inp:
                dag = r.check.bind(t.step.bind(inp).with_transport(transport), inp)
            g = dag.compile(overlap_communication=overlap, max_inflight=inflight)
            refs = [g.execute(k) for k in range(1, 31)]
            results = [ref.get(timeout=120) for ref in refs]
            torn = [x for x in results if not x[1] == x[2] == x[0]]
            print(
                f"{transport} overlap={overlap} inflight={inflight}: {len(torn)} of 30 torn, "
                f"first {torn[:3]}",
                flush=True,
            )
            g.teardown(kill_actors=False)
    t.kill()
    r.kill()
