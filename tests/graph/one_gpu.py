"""Two graph actors on one GPU that NCCL takes for two hosts: the GPU tier's NCCL edges on a
machine with one GPU (``TF_TEST_ONE_GPU_ACTORS=1``).

NCCL refuses two ranks of one communicator on one GPU unless they say they are on different
hosts (``NCCL_HOSTID``, read when a process makes its first communicator); it then connects
them over its network transport. The graph compiler refuses an NCCL edge between two actors
on one device, which it tells apart by their handles' ``device_key``: a posing handle answers
a key of its own. Correctness only: the transport is not the one two GPUs use, and the ``ce``
and ``nvlink`` edges need two real devices.
"""

from __future__ import annotations

import os
from typing import Any

from tensorferry.graph._actor import ActorHandle

ONE_GPU_ACTORS = os.environ.get("TF_TEST_ONE_GPU_ACTORS") == "1"


class _PosingHandle(ActorHandle):
    """A local actor on ``cuda:0`` that the compiler takes for one on a device of its own."""

    @property
    def device_key(self) -> str:
        return f"{self.device} posing as host {self.name}"


def spawn_on_gpu(actor: Any, index: int, *args: Any, name: str | None = None) -> Any:
    """``actor.spawn(f"cuda:{index}", *args, device=index)``; with ``ONE_GPU_ACTORS``, on
    ``cuda:0`` posing as host ``index`` (its process gets an ``NCCL_HOSTID`` of its own)."""
    if not ONE_GPU_ACTORS:
        return actor.spawn(f"cuda:{index}", *args, device=index, name=name)
    saved = os.environ.get("NCCL_HOSTID")
    os.environ["NCCL_HOSTID"] = f"tensorferry-test-actor-{index}"  # inherited at the spawn
    try:
        handle = actor.spawn("cuda:0", *args, device=0, name=name)
    finally:
        if saved is None:
            del os.environ["NCCL_HOSTID"]
        else:
            os.environ["NCCL_HOSTID"] = saved
    handle.__class__ = _PosingHandle
    return handle
