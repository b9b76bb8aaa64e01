"""What values a graph may move between its processes: whether a value pickles (its tensors
left out, as the channels take them out), the tensors it holds, and the errors that name an
argument or result that cannot travel. Shared by the shared-memory and network channels and
the compile-time checks.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Iterable
from typing import Any

import torch

from tensorferry.graph._channel import travels_raw

__all__ = [
    "check_sendable",
    "first_unpicklable",
    "named_arguments",
    "pickle_problem",
    "tensor_layout",
]


class _ProbePickler(pickle.Pickler):
    """Pickles a value with the tensors the channels take out left out (``travels_raw``):
    whether the rest pickles, without copying those tensors to find out. A tensor the channels
    pickle whole (a subclass, say) is pickled here too, so what fails there fails here."""

    def persistent_id(self, obj: Any) -> Any:
        return id(obj) if travels_raw(obj) else None


_PLAIN = frozenset({torch.Tensor, int, float, bool, str, bytes, type(None)})


class _LayoutPickler(_ProbePickler):
    """The probe's pass (tensors left out), noting the shape and dtype of each tensor met."""

    def __init__(self) -> None:
        super().__init__(io.BytesIO(), protocol=5)
        self.layout: list[tuple[tuple[int, ...], torch.dtype]] = []
        self._seen: set[int] = set()

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and id(obj) not in self._seen:
            self._seen.add(id(obj))
            self.layout.append((tuple(obj.shape), obj.dtype))
        return super().persistent_id(obj)


def tensor_layout(value: Any) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of each tensor in ``value`` (a bare tensor, or a structure that
    pickles), in the order pickling meets them."""
    if isinstance(value, torch.Tensor):
        return [(tuple(value.shape), value.dtype)]
    if type(value) in _PLAIN:
        return []
    pickler = _LayoutPickler()
    pickler.dump(value)
    return pickler.layout


def pickle_problem(value: Any) -> Exception | None:
    """Why ``value`` does not pickle (its tensors left out), or ``None`` when it does."""
    if type(value) in _PLAIN:  # on the per-execution path: skip the probe where it cannot fail
        return None
    try:
        _ProbePickler(io.BytesIO(), protocol=5).dump(value)
    except Exception as exc:
        return exc
    return None


def named_arguments(
    args: Iterable[Any], kwargs: Iterable[tuple[str, Any]]
) -> list[tuple[str, Any]]:
    """A call's arguments as errors name them: ``("argument 0", value)``, …,
    ``("keyword argument 'k'", value)``."""
    named = [(f"argument {i}", value) for i, value in enumerate(args)]
    return named + [(f"keyword argument {key!r}", value) for key, value in kwargs]


def first_unpicklable(named: Iterable[tuple[str, Any]]) -> tuple[str, Any, Exception] | None:
    """The first ``(what, value)`` whose value does not pickle, with why; ``None`` when all do.
    Objects of ``multiprocessing`` (locks, queues, pipes) pickle only while a process is
    spawned: never the one named."""
    for what, value in named:
        if type(value).__module__.startswith("multiprocessing"):
            continue
        problem = pickle_problem(value)
        if problem is not None and "through inheritance" not in str(problem):
            return what, value, problem
    return None


def check_sendable(value: Any, what: str) -> None:
    """Raises ``TypeError`` naming ``what`` when ``value`` cannot travel over a graph channel
    (shared-memory or network: both pickle what is not a bare tensor)."""
    problem = pickle_problem(value)
    if problem is not None:
        raise TypeError(
            f"{what} cannot be pickled, so it cannot travel between the graph's processes: "
            f"{problem}"
        ) from problem
