"""Actor classes for the Ray executor tests (imported by the Ray workers by name)."""

from __future__ import annotations

import asyncio
import os
import time

import torch


def on_node(node: str) -> dict:
    """Spawn options that put a Ray actor on ``node`` (``"node_a"`` or ``"node_b"``)."""
    return {"executor": "ray", "num_cpus": 0.5, "resources": {node: 0.1}}


def _refuse_to_load() -> None:
    raise ValueError("this value cannot be rebuilt on purpose")


class Unbuildable:
    """Pickles, but cannot be unpickled, in any process."""

    def __reduce__(self):
        return (_refuse_to_load, ())


class Calc:
    def __init__(self, offset: float = 0.0) -> None:
        self.offset = offset

    def unbuildable(self) -> list:
        return [Unbuildable()]

    def add(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.offset

    def combine(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + b

    def echo(self, value: object) -> object:
        return value

    async def add_later(self, x: torch.Tensor) -> torch.Tensor:
        await asyncio.sleep(0)
        return x + self.offset

    def fail_if(self, x: torch.Tensor, flag: bool) -> torch.Tensor:
        if flag:
            raise ValueError(f"boom on purpose (sum {float(x.sum()):.3f})")
        return x

    def slow(self, x: torch.Tensor, seconds: float) -> torch.Tensor:
        time.sleep(seconds)
        return x

    def structure(self, x: torch.Tensor) -> dict:
        return {"double": x * 2, "items": [x.sum(), "label", 3]}

    def unpack(self, d: dict) -> torch.Tensor:
        return d["double"] + d["items"][0]

    def where(self) -> dict:
        import ray

        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id()}


class FailsSetup:
    """Its method exists on the class (so the graph compiles) but not on the instance, so the
    actor fails to set up the graph."""

    def work(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def __getattribute__(self, name: str):
        if name == "work":
            raise RuntimeError("work cannot be looked up on this instance")
        return object.__getattribute__(self, name)


class Broken:
    def __init__(self) -> None:
        raise RuntimeError("this actor cannot start")
