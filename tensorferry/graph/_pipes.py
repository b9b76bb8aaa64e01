"""What the driver and an actor send each other through their pipe (constructor arguments,
direct calls, their results): pickled as ``multiprocessing`` pickles it, torch's tensor sharing
included, except that a CPU tensor travels as a copy of its values: inside the message up to
``_INLINE_MAX`` bytes, else in shared memory.

Why a copy: torch's reductions for ``multiprocessing`` move a tensor's storage into shared memory
and hand the receiver that same memory. The sender's tensor and the receiver's were then one:
a weight returned by ``handle.get.call()`` changed in the driver as the actor trained on, and
an argument changed in place by the actor changed in the caller. Graph edges always copied. A
large tensor's copy is made straight into shared memory, one copy as torch's sharing made.

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
from tensorferry.p2p._packing import as_bytes

__all__ = ["lazy_views_resolved"]


# Up to this many bytes a CPU tensor travels inside the message. Above, in shared memory, whose
# descriptor the receiver keeps open while it keeps the tensor: a driver keeping a thousand
# small results of calls ran out of descriptors under the usual limit of 1024, and the pipe
# to that actor broke ("received 0 items of ancdata").
_INLINE_MAX = 1 << 20


class _Pickler(ForkingPickler):
    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        # The copies made here: torch shares their memory by descriptor, which a process being
        # spawned inherits only at its start, after the pickling. They must live until then.
        self.copies: list[torch.Tensor] = []

    def reducer_override(self, obj: Any) -> Any:
        if not isinstance(obj, torch.Tensor):
            return NotImplemented
        kind = type(obj)
        if (
            obj.is_cuda
            or (kind is not torch.Tensor and kind is not torch.nn.Parameter)
            or obj.layout is not torch.strided
            or (obj.requires_grad and not obj.is_leaf)
        ):
            # Shared as torch shares it (CUDA tensors, sparse ones, other subclasses), or
            # refused by torch with an error that says to detach it (an output requiring grad).
            values = resolved(obj)
            return NotImplemented if values is obj else self._shared(values)
        values = host_values(obj)  # contiguous and detached; a lazy view's values
        parameter = kind is torch.nn.Parameter
        nbytes = values.numel() * values.element_size()
        if nbytes <= _INLINE_MAX:
            data = as_bytes(values).numpy().tobytes()
            shape = tuple(values.shape)
            return _inline_tensor, (data, values.dtype, shape, obj.requires_grad, parameter)
        copy = _empty_shared(values)
        if nbytes <= _MEMMOVE_MAX:  # torch's copy would wake its threads for this
            ctypes.memmove(copy.data_ptr(), values.data_ptr(), nbytes)
        else:
            copy.copy_(values)
        if parameter:
            return self._shared(torch.nn.Parameter(copy, requires_grad=obj.requires_grad))
        return self._shared(copy.requires_grad_(obj.requires_grad))

    def _shared(self, tensor: torch.Tensor) -> Any:
        """torch's own reduction of ``tensor``, made here in another's place."""
        self.copies.append(tensor)
        reduce = self.dispatch_table.get(type(tensor))
        return reduce(tensor) if reduce is not None else tensor.__reduce_ex__(5)


def _inline_tensor(
    data: bytes, dtype: torch.dtype, shape: tuple[int, ...], requires_grad: bool, parameter: bool
) -> torch.Tensor:
    """A tensor that travelled inside its message, in memory of its own (not the message's)."""
    raw = torch.empty(len(data), dtype=torch.uint8)
    if data:
        ctypes.memmove(raw.data_ptr(), data, len(data))
    tensor = raw.view(dtype).view(shape)  # (torch warns making some dtypes directly)
    if parameter:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    return tensor.requires_grad_(requires_grad)


def _empty_shared(like: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor of ``like``'s shape and dtype whose memory is allocated shared: torch
    shares it as it is. (``share_memory_()`` on a new tensor would copy it once more.)"""
    nbytes = like.numel() * like.element_size()
    new_shared = getattr(torch.UntypedStorage, "_new_shared", None)  # private to torch
    if new_shared is None:
        return torch.empty(like.shape, dtype=like.dtype).share_memory_()
    raw = torch.empty(0, dtype=torch.uint8).set_(new_shared(nbytes), 0, (nbytes,))
    return raw.view(like.dtype).view(like.shape)


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
