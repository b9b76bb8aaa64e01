"""What the driver and an actor send each other through their pipe (constructor arguments,
direct calls, their results): pickled as ``multiprocessing`` pickles it, torch's tensor sharing
included, except that conjugate and negative views travel as their values.

Why: torch's reductions for ``multiprocessing`` send a tensor's storage and geometry but not its
conjugate or negative bit, so ``handle.f.call(x.conj())`` ran ``f`` on ``x``. Such a view keeps
the original's memory and a flag that operations apply as they read it; here it is resolved
into a copy before it is pickled.
"""

from __future__ import annotations

import io
import pickle
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch

from tensorferry.graph._channel import resolved

__all__ = ["lazy_views_resolved"]


class _Pickler(ForkingPickler):
    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        # The copies made here: torch shares their memory by descriptor, which a process being
        # spawned inherits only at its start, after the pickling. They must live until then.
        self.copies: list[torch.Tensor] = []

    def reducer_override(self, obj: Any) -> Any:
        values = resolved(obj) if isinstance(obj, torch.Tensor) else obj
        if values is obj:
            return NotImplemented
        self.copies.append(values)
        reduce = self.dispatch_table.get(type(values))
        return reduce(values) if reduce is not None else values.__reduce_ex__(5)


class _Resolved:
    """Pickles ``value`` with its lazy views resolved, inside the pickling of whatever holds it:
    objects that pickle only while a process is spawned (``multiprocessing`` locks) still do."""

    __slots__ = ("_copies", "value")

    def __init__(self, value: Any) -> None:
        self.value = value
        self._copies: list[torch.Tensor] = []

    def __reduce__(self) -> tuple:
        buffer = io.BytesIO()
        pickler = _Pickler(buffer)
        pickler.dump(self.value)
        self._copies = pickler.copies  # as long as this wrapper: a Process keeps its arguments
        return pickle.loads, (buffer.getvalue(),)


def lazy_views_resolved(value: Any) -> Any:
    """``value``, to hand to a pipe or a process: it unpickles as ``value`` itself, its
    conjugate and negative views as tensors holding their values."""
    return _Resolved(value)
