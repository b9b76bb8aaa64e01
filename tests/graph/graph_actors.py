"""Actor classes for the end-to-end tests (imported by the actor processes by name)."""

from __future__ import annotations

import asyncio
import errno
import os
import sys
import threading
import time

import torch


class Tagged(torch.Tensor):
    """A tensor subclass: the graph's channels pickle it whole."""


def unpicklable_tagged(x: torch.Tensor) -> Tagged:
    """``x`` as a :class:`Tagged` holding a lambda, so it does not pickle."""
    tagged = x.as_subclass(Tagged)
    tagged.hook = lambda: None
    return tagged


class Calc:
    def __init__(self, offset: float = 0.0) -> None:
        self.offset = offset
        self.calls = 0

    def add(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x + self.offset

    async def add_later(self, x: torch.Tensor) -> torch.Tensor:
        """An async method: the actor runs it to completion on its own event loop."""
        await asyncio.sleep(0)
        return x + self.offset

    def mul(self, x: torch.Tensor, factor: float = 2.0) -> torch.Tensor:
        return x * factor

    def combine(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + b

    def fail_if(self, x: torch.Tensor, flag: bool) -> torch.Tensor:
        if flag:
            raise ValueError(f"boom on purpose (sum {float(x.sum()):.3f})")
        return x

    def die_if(self, x: torch.Tensor, flag: bool) -> torch.Tensor:
        if flag:
            os._exit(7)
        return x

    def slow(self, x: torch.Tensor, seconds: float) -> torch.Tensor:
        time.sleep(seconds)
        return x

    def lock_if(self, x: torch.Tensor, flag: bool) -> object:
        """A result that cannot be pickled (so cannot leave the process) when ``flag``."""
        return {"lock": threading.Lock(), "x": x} if flag else x

    def tagged_if(self, x: torch.Tensor, flag: bool) -> torch.Tensor:
        """A tensor subclass that cannot be pickled (the channels pickle subclasses whole)
        when ``flag``."""
        return unpicklable_tagged(x) if flag else x

    def structure(self, x: torch.Tensor) -> dict:
        return {"double": x * 2, "items": [x.sum(), "label", 3]}

    def unpack(self, d: dict) -> torch.Tensor:
        return d["double"] + d["items"][0]

    def getpid(self) -> int:
        return os.getpid()

    def forward(self, x: torch.Tensor, shape: str) -> object:
        """Results that require grad: a weight (a leaf, or a ``Parameter``) and an output
        computed from it."""
        weight = torch.full_like(x, self.offset).requires_grad_()
        out = x * weight
        if shape == "bare":
            return out
        if shape == "parameter":
            return torch.nn.Parameter(x.clone())
        return {"out": out, "weight": weight, "param": torch.nn.Parameter(x), "sizes": [x.numel()]}

    def needs_grad(self, value: object) -> list[bool]:
        """Which tensors of ``value`` arrived requiring grad, or as a subclass."""
        if isinstance(value, torch.Tensor):
            return [value.requires_grad or type(value) is not torch.Tensor]
        return [
            t.requires_grad or type(t) is not torch.Tensor
            for t in (value["out"], value["weight"], value["param"])
        ]

    def count(self) -> int:
        return self.calls

    def get_offset(self) -> object:
        return self.offset

    def echo(self, value: object) -> object:
        return value

    def lazy_views(self, x: torch.Tensor) -> dict:
        """Views whose conjugation or negation is a flag over ``x``'s memory."""
        return {"conj": x.conj(), "neg": x[:1].conj().imag, "both": [x.conj(), x]}

    def ones(self, n: int) -> torch.Tensor:
        return torch.ones(n)

    def fill_kept(self, k: float, numel: int) -> torch.Tensor:
        """Fills a tensor this actor keeps with ``k``, in place, and returns it (a trainer's
        weights, synced each step)."""
        kept = getattr(self, "_kept", None)
        if kept is None or kept.numel() != numel:
            kept = self._kept = torch.empty(numel)
        return kept.fill_(k)

    def loads_badly(self) -> object:
        """A result that pickles here and cannot be rebuilt where it arrives."""
        from channel_values import LoadsBadly

        return [LoadsBadly()]

    def add_in_place(self, t: torch.Tensor) -> None:
        """Changes what it was given, in place, and keeps it."""
        self._given = t.add_(self.offset)

    def given(self) -> torch.Tensor:
        return self._given

    def extremes(self, t: torch.Tensor) -> tuple:
        return (t.min().item(), t.max().item())

    def exit_if(self, x: torch.Tensor, how: str) -> object:
        """Raises what is not an ``Exception``, or returns a result whose pickling does."""
        if how == "sys.exit":
            sys.exit(3)
        if how == "interrupt":
            raise KeyboardInterrupt
        if how == "unpicklable":
            return _ExitsWhenPickled()
        return x

    def cramp_shared_memory(self, limit: int) -> None:
        """From now on, in this process, shared-memory segments over ``limit`` bytes cannot be
        made, as in a container whose /dev/shm is nearly full."""
        from tensorferry.graph import _channel

        _channel._map = cramped_map(_channel._map, limit)


def cramped_map(real_map, limit: int):
    """``_channel._map`` refusing to create segments over ``limit`` bytes (ENOSPC)."""

    def cramped(name: str, *, create: bool, size: int = 0):
        if create and size > limit:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_map(name, create=create, size=size)

    return cramped


class Broken:
    def __init__(self) -> None:
        raise RuntimeError("this actor cannot start")


class Keeps:
    """Keeps what it is given (a constructor taking any arguments)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.args, self.kwargs = args, kwargs


class SlowStart:
    def __init__(self, seconds: float) -> None:
        time.sleep(seconds)


class GpuCalc:
    """GPU-side methods; ``device`` is the actor's CUDA device."""

    def __init__(self, device: str, given: torch.Tensor | None = None) -> None:
        self.device = torch.device(device)
        self.given = given  # kept as it arrived: a copy, or the spawner's own memory?

    def make(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.device) * 2

    def get_given(self) -> torch.Tensor | None:
        return self.given

    def add_in_place(self, t: torch.Tensor, k: float) -> None:
        t.add_(k)
        torch.cuda.synchronize(t.device)  # done before the call answers

    def fill_kept(self, k: float, numel: int) -> torch.Tensor:
        """Fills a tensor this actor keeps with ``k``, in place, and returns it (a trainer's
        weights, synced each step)."""
        kept = getattr(self, "_kept", None)
        if kept is None or kept.numel() != numel:
            kept = self._kept = torch.empty(numel, device=self.device)
        return kept.fill_(k)

    def extremes(self, t: torch.Tensor) -> tuple:
        return (t.min().item(), t.max().item())

    def make_elsewhere(self, x: torch.Tensor) -> torch.Tensor:
        """``make``'s result, but on the other GPU of a two-GPU machine: a method may use
        devices other than its actor's."""
        other = torch.device("cuda", 1 - self.device.index)
        return x.to(other) * 2

    def make_pair(self, x: torch.Tensor) -> dict:
        x = x.to(self.device)
        return {"a": x, "b": [x + 1, "tag"]}

    def fail_if(self, x: torch.Tensor, flag: bool) -> torch.Tensor:
        if flag:
            raise ValueError("gpu boom on purpose")
        return x.to(self.device)

    def die_if(self, x: torch.Tensor, flag: bool) -> torch.Tensor:
        if flag:
            os._exit(7)
        return x.to(self.device)

    def stall_if(self, x: torch.Tensor, flag: bool) -> torch.Tensor:
        """Never returns when ``flag``: the method of an actor that has to be killed."""
        while flag:
            time.sleep(1.0)
        return x.to(self.device)

    def resize(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x.to(self.device)[:n]

    def lock_if(self, x: torch.Tensor, flag: bool) -> object:
        """A result that cannot be pickled (so cannot leave the process) when ``flag``."""
        x = x.to(self.device)
        return {"lock": threading.Lock(), "x": x} if flag else x

    def scale(self, t: torch.Tensor, k: float) -> torch.Tensor:
        assert t.device == self.device, (t.device, self.device)
        return (t * k).cpu()

    def count_up(self, t: torch.Tensor, kernels: int) -> torch.Tensor:
        """``t`` plus one, ``kernels`` times, a small kernel each: all queued behind ``t``'s
        receive while that is on its way (a stream takes about a thousand, and the next launch
        waits for room in the launching call)."""
        out = t.clone()
        for _ in range(kernels):
            out.add_(1.0)
        return out.cpu()

    def unpair(self, d: dict) -> torch.Tensor:
        assert d["b"][1] == "tag"
        return (d["a"] + d["b"][0]).cpu()

    def lazy_views(self, x: torch.Tensor) -> dict:
        """Views whose conjugation or negation is a flag over ``x``'s memory, on this GPU."""
        x = x.to(self.device)
        return {"conj": x.conj(), "neg": x[:1].conj().imag, "both": [x.conj(), x]}

    def conj(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.device).conj()

    def host(self, value: object) -> object:
        """``value`` with its tensors copied to the host, flags and all (a tensor that arrived
        with a conjugate bit would still read right: the test checks there is none)."""
        if isinstance(value, torch.Tensor):
            return value.cpu()
        if isinstance(value, dict):
            return {key: self.host(item) for key, item in value.items()}
        if isinstance(value, list):
            return [self.host(item) for item in value]
        return value

    def late(self, x: torch.Tensor, cycles: int) -> torch.Tensor:
        """A CUDA result the GPU is still computing when the method returns."""
        x = x.to(self.device)
        torch.cuda._sleep(cycles)
        return x * 3


def check_unsendable_results(
    graph, through, *, numel: int, timeout: float, method: str = "lock_if"
) -> None:
    """Runs a graph of ``method`` (``lock_if`` or ``tagged_if``) whose result goes to the
    driver and through another actor (``through(x)`` is what that one returns): an execution
    whose result cannot be pickled fails alone with ``ActorError``, and the ones around it
    return whole."""
    import pytest

    import tensorferry as tf

    for flag in (False, True, False, True, False):
        x = torch.randn(numel)
        ref = graph.execute(x, flag)
        if flag:
            with pytest.raises(tf.ActorError, match=rf"{method}.* cannot be pickled"):
                ref.get(timeout=timeout)
        else:
            direct, passed_on = ref.get(timeout=timeout)
            assert torch.equal(direct.cpu(), x), "the result that went to the driver"
            assert torch.equal(passed_on, through(x)), "the result that went through an actor"


class _ExitsWhenPickled:
    def __reduce__(self):
        raise SystemExit("pickling this exits")
