"""Fake actors for compiler tests: they have a name, a device and a class, and no process."""

from __future__ import annotations

import torch

from tensorferry.graph import ActorMethod


class Worker:
    def produce(self, x) -> torch.Tensor:
        return x

    def consume(self, x) -> torch.Tensor:
        return x

    def combine(self, a, b) -> torch.Tensor:
        return a + b

    def log(self, x) -> None:
        print(x)

    def anything(self, x):
        return x


class FakeActor:
    """Binds like an actor handle, runs nothing."""

    def __init__(self, name: str, device: str = "cpu", cls: type = Worker) -> None:
        self.name = name
        self.device = device
        self.actor_class = cls

    def __getattr__(self, method: str) -> ActorMethod:
        if method.startswith("_"):
            raise AttributeError(method)
        return ActorMethod(self, method)  # type: ignore[arg-type]
