"""What the driver and an actor send each other through their pipe (constructor arguments,
direct calls, their results): pickled as ``multiprocessing`` pickles it, torch's tensor sharing
included, except that a CPU tensor travels as a copy of its values.

Why a copy: torch's reductions for ``multiprocessing`` move a tensor's storage into shared memory
and hand the receiver that same memory. The sender's tensor and the receiver's were then one:
a weight returned by ``handle.get.call()`` changed in the driver as the actor trained on, and
an argument changed in place by the actor changed in the caller. Graph edges always copied. The
copy is made straight into shared memory, so a tensor sent once costs what it did (torch's
sharing copied it there too); one sent again, which torch had shared already, now costs a copy.

Why values: those reductions send a tensor's storage and geometry but not its conjugate or
negative bit, so ``handle.f.call(x.conj())`` ran ``f`` on ``x``. Such a view keeps the original's
memory and a flag that operations apply as they read it; its copy holds its values.

CUDA tensors are shared as torch shares them (their memory stays the sender's), with only their
lazy views resolved.
"""

from __future__ import annotations

import ctypes
import io
import pickle
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch

from tensorferry.graph._channel import _MEMMOVE_MAX, host_values, resolved

__all__ = ["lazy_views_resolved"]


class _Pickler(ForkingPickler):
    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        # The copies made here: torch shares their memory by descriptor, which a process being
        # spawned inherits only at its start, after the pickling. They must live until then.
        self.copies: list[torch.Tensor] = []

    def reducer_override(self, obj: Any) -> Any:
        values = _travelling(obj) if isinstance(obj, torch.Tensor) else obj
        if values is obj:
            return NotImplemented
        self.copies.append(values)
        reduce = self.dispatch_table.get(type(values))
        return reduce(values) if reduce is not None else values.__reduce_ex__(5)


def _travelling(tensor: torch.Tensor) -> torch.Tensor:
    """What goes into the pipe in ``tensor``'s place (see the module's docstring): for a CPU
    tensor or ``Parameter``, a copy of its values made straight into shared memory, a leaf's
    ``requires_grad`` and a ``Parameter``'s type kept. Otherwise ``tensor`` itself, its lazy
    views resolved: CUDA tensors, sparse tensors, other subclasses, and outputs that require
    grad (which torch refuses with an error saying to detach them)."""
    kind = type(tensor)
    if (
        tensor.is_cuda
        or (kind is not torch.Tensor and kind is not torch.nn.Parameter)
        or tensor.layout is not torch.strided
        or (tensor.requires_grad and not tensor.is_leaf)
    ):
        return resolved(tensor)
    values = host_values(tensor)  # contiguous and detached; a lazy view's values
    copy = _empty_shared(values)
    nbytes = values.numel() * values.element_size()
    if 0 < nbytes <= _MEMMOVE_MAX:  # torch's copy would wake its threads for this
        ctypes.memmove(copy.data_ptr(), values.data_ptr(), nbytes)
    elif nbytes:
        copy.copy_(values)
    if kind is torch.nn.Parameter:
        return torch.nn.Parameter(copy, requires_grad=tensor.requires_grad)
    return copy.requires_grad_(tensor.requires_grad)


def _empty_shared(like: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor of ``like``'s shape and dtype whose memory is allocated shared: torch
    shares it as it is. (``share_memory_()`` on a new tensor would copy it once more.)"""
    nbytes = like.numel() * like.element_size()
    new_shared = getattr(torch.UntypedStorage, "_new_shared", None)  # private to torch
    if nbytes == 0 or new_shared is None:
        return torch.empty(like.shape, dtype=like.dtype).share_memory_()
    raw = torch.empty(0, dtype=torch.uint8).set_(new_shared(nbytes), 0, (nbytes,))
    return raw.view(like.dtype).view(like.shape)  # (torch warns making some dtypes directly)


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
