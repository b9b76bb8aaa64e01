"""The Ray executor with GPU actors (two CUDA devices): NCCL edges between Ray actors.

A one-node Ray cluster with two GPUs; Ray gives each actor its own GPU (both see it as
``cuda:0``), so ``auto`` edges between them go over NCCL. NCCL is forced onto its network
transport (``NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1``), the path it takes between hosts. Results
must equal the local executor's, bit for bit.
"""

from __future__ import annotations

import os

import pytest
import torch

import tensorferry as tf
from tensorferry.graph import InputNode, MultiOutputNode, actor
from tensorferry.graph.demo import DemoReceiver, DemoSender

pytestmark = [pytest.mark.multigpu, pytest.mark.timeout(300)]

SIZE, BRANCHES, STEPS = 1024, 3, 4
NCCL_NETWORK = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}


@pytest.fixture(scope="module")
def ray_gpus():
    pytest.importorskip("ray.actor")  # not this folder, which a bare "ray" can name
    import ray

    saved = {key: os.environ.get(key) for key in NCCL_NETWORK}
    os.environ.update(NCCL_NETWORK)  # the Ray workers inherit it
    ray.init(num_cpus=4, num_gpus=2, object_store_memory=200 << 20, include_dashboard=False)
    try:
        yield ray
    finally:
        ray.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _graph(senders: list, receiver: object) -> MultiOutputNode:
    with InputNode() as inp:
        outs = [
            receiver.consume.bind(
                senders[b % len(senders)].produce.bind(inp, b).with_transport("auto")
            )
            for b in range(BRANCHES)
        ]
        return MultiOutputNode(outs)


def _local_results() -> list:
    sender = actor(DemoSender).spawn(SIZE, torch.float16, "cuda:0", device=0, name="l_send")
    receiver = actor(DemoReceiver).spawn(SIZE, torch.float16, "cuda:1", device=1, name="l_recv")
    graph = _graph([sender], receiver).compile(overlap_communication=True)
    try:
        return [graph.execute(step).get(timeout=120) for step in range(STEPS)]
    finally:
        graph.teardown()


def test_nccl_edges_between_ray_gpu_actors_match_the_local_executor(ray_gpus):
    expected = _local_results()
    sender = actor(DemoSender).spawn(
        SIZE, torch.float16, "cuda:0", name="r_send", executor="ray", num_gpus=1
    )
    receiver = actor(DemoReceiver).spawn(
        SIZE, torch.float16, "cuda:0", name="r_recv", executor="ray", num_gpus=1
    )
    try:
        assert sender.device == receiver.device == "cuda:0"
        assert sender.device_key != receiver.device_key  # two GPUs, both cuda:0 inside
        dag = _graph([sender], receiver)
        for overlap in (False, True):
            graph = dag.compile(overlap_communication=overlap, max_inflight=2)
            try:
                assert {e.transport for e in graph.graph.edges if "driver" not in
                        (e.src_actor, e.dst_actor)} == {"nccl"}  # fmt: skip
                for step in range(STEPS):
                    got = graph.execute(step).get(timeout=120)
                    for branch in range(BRANCHES):
                        assert torch.equal(got[branch].cpu(), expected[step][branch].cpu())
            finally:
                graph.teardown(kill_actors=False)
        sender.kill()  # the sender is gone: compiling must refuse
        with pytest.raises(tf.ActorDiedError):
            dag.compile()
    finally:
        for handle in (sender, receiver):
            handle.kill()
