"""What the driver and an actor send each other through their pipe (constructor arguments,
direct calls, their results): pickled as ``multiprocessing`` pickles it, torch's tensor sharing
included, except that a CPU tensor travels as a copy of its values: inside the message up to
``_INLINE_MAX`` bytes, else through shared memory that the receiver holds no descriptor for.

Why a copy: torch's reductions for ``multiprocessing`` move a tensor's storage into shared memory
and hand the receiver that same memory. The sender's tensor and the receiver's were then one:
a weight returned by ``handle.get.call()`` changed in the driver as the actor trained on, and
an argument changed in place by the actor changed in the caller. Graph edges always copied. A
large tensor's copy is made straight into shared memory, one copy as torch's sharing made. The
receiver maps that memory again without keeping torch's file descriptor open.

Why values: those reductions send a tensor's storage and geometry but not its conjugate or
negative bit, so ``handle.f.call(x.conj())`` ran ``f`` on ``x``. Such a view keeps the original's
memory and a flag that operations apply as they read it; its copy holds its values.

A CUDA tensor travels as a copy too, made on its device and shared by torch's CUDA IPC: the
receiver maps the copy, never the sender's tensor (a trainer's weights returned by a call kept
changing in the driver as the actor trained, as CPU tensors did), and copies it at once into
memory of its own, so nothing it keeps lives in the sender's memory (which goes when the sender
exits). Two device copies per tensor and direction; the shared one is freed by its sender once
the receiver has its own.
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

__all__ = ["Unloaded", "pipe_message", "spawn_message"]


# Up to this many bytes a CPU tensor travels inside the message; above, through shared memory,
# which the receiver maps again without a descriptor. torch's own sharing left the receiver
# holding a file descriptor for as long as it kept the tensor: a driver keeping a thousand
# results of calls ran out of them under the usual limit of 1024, and the pipe to that actor
# broke ("received 0 items of ancdata"). Small, because the pipe holds about 176 KiB: a message
# that fits is written whole at once even to an actor still busy with an earlier call (given
# up on); one that does not waits for the actor, up to the call's timeout (see
# ActorHandle._send; before that bound, 1 MiB inside made a call with timeout=1 take 5.5 s).
_INLINE_MAX = 64 << 10


class _Pickler(ForkingPickler):
    """``multiprocessing``'s pickler, with CPU tensors copied (see the module's docstring)."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        # The copies made here: torch shares their memory by descriptor, which a process being
        # spawned inherits only at its start, after the pickling. They must live until then.
        self.copies: list[torch.Tensor] = []
        self._own: set[int] = set()  # ids of those copies: torch reduces them as they are

    def reducer_override(self, obj: Any) -> Any:
        if not isinstance(obj, torch.Tensor) or id(obj) in self._own:
            return NotImplemented
        kind = type(obj)
        if (
            (kind is not torch.Tensor and kind is not torch.nn.Parameter)
            or obj.layout is not torch.strided
            or (obj.requires_grad and not obj.is_leaf)
        ):
            # Shared as torch shares it (sparse tensors, other subclasses), or refused by torch
            # with an error that says to detach it (an output requiring grad).
            values = resolved(obj)
            if values is obj:
                return NotImplemented
            self._keep(values)
            reduce = self.dispatch_table.get(type(values))
            return reduce(values) if reduce is not None else values.__reduce_ex__(5)
        how = (obj.requires_grad, kind is torch.nn.Parameter)
        if obj.is_cuda:
            copy = _device_copy(obj)
            self._keep(copy)  # shared by torch's CUDA sharing, as a plain tensor
            return _owned_cuda_tensor, (copy, *how)
        values = host_values(obj)  # contiguous and detached; a lazy view's values
        nbytes = values.numel() * values.element_size()
        if nbytes <= _INLINE_MAX:
            data = as_bytes(values).numpy().tobytes()
            return _inline_tensor, (data, values.dtype, tuple(values.shape), *how)
        data = as_bytes(values)
        shared = _empty_shared(nbytes)  # bytes: rebuilt as they are (see _private_tensor)
        _copy_values(shared, data)
        self._keep(shared)
        return _private_tensor, (shared, values.dtype, tuple(values.shape), *how)

    def _keep(self, copy: torch.Tensor) -> None:
        self.copies.append(copy)
        self._own.add(id(copy))


def _device_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A CUDA tensor's values in device memory of their own, made on the current stream (torch's
    sharing orders the receiver's reads after it): contiguous, detached, lazy views resolved."""
    nbytes = tensor.numel() * tensor.element_size()
    return _empty(tuple(tensor.shape), tensor.dtype, nbytes, tensor.device).copy_(tensor.detach())


def _owned_cuda_tensor(shared: torch.Tensor, requires_grad: bool, parameter: bool) -> torch.Tensor:
    """A CUDA tensor that arrived through torch's CUDA sharing, copied into this process's own
    memory: the shared one lives in the sender's, which goes when the sender exits (a weight
    kept from an actor read freed memory once the actor was killed). Dropping the shared one
    lets the sender free it."""
    return _as_sent(_device_copy(shared), requires_grad, parameter)


def _copy_values(target: torch.Tensor, source: torch.Tensor) -> None:
    """Copies contiguous ``source`` into contiguous ``target`` of the same size."""
    nbytes = source.numel() * source.element_size()
    if nbytes <= _MEMMOVE_MAX:  # torch's copy would wake its threads for this
        ctypes.memmove(target.data_ptr(), source.data_ptr(), nbytes)
    else:
        target.copy_(source)


def _empty(
    shape: tuple[int, ...], dtype: torch.dtype, nbytes: int, device: Any = None
) -> torch.Tensor:
    """A new contiguous tensor (made as bytes: torch warns making some dtypes directly)."""
    return torch.empty(nbytes, dtype=torch.uint8, device=device).view(dtype).view(shape)


def _as_sent(tensor: torch.Tensor, requires_grad: bool, parameter: bool) -> torch.Tensor:
    if parameter:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    return tensor.requires_grad_(requires_grad)


def _inline_tensor(
    data: bytes, dtype: torch.dtype, shape: tuple[int, ...], requires_grad: bool, parameter: bool
) -> torch.Tensor:
    """A tensor that travelled inside its message, in memory of its own (not the message's)."""
    tensor = _empty(shape, dtype, len(data))
    if data:
        ctypes.memmove(tensor.data_ptr(), data, len(data))
    return _as_sent(tensor, requires_grad, parameter)


def _private_tensor(
    shared: torch.Tensor,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    requires_grad: bool,
    parameter: bool,
) -> torch.Tensor:
    """A tensor whose bytes travelled through shared memory (as bytes: torch's rebuilding of a
    complex32 tensor warns), without the file descriptor torch's rebuilt tensor holds: the
    memory is mapped again from it (no copy), or else copied out."""
    data = _mapped_again(shared)
    if data is None:
        data = torch.empty(shared.numel(), dtype=torch.uint8)
        _copy_values(data, shared)
    return _as_sent(data.view(dtype).view(shape), requires_grad, parameter)


def _mapped_again(shared: torch.Tensor) -> torch.Tensor | None:
    """The bytes of ``shared`` (``uint8``) mapped once more through ``/proc/self/fd``, which
    holds no descriptor once mapped; ``shared`` (and its descriptor) then go as nothing else
    refers to them. ``None`` where that cannot be done (not Linux, a torch without these
    calls)."""
    storage = shared.untyped_storage()
    if not storage.is_shared() or shared.storage_offset() != 0:
        return None
    try:
        fd, size = storage._share_fd_cpu_()  # private to torch: the descriptor it holds
        raw = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=size, dtype=torch.uint8)
    except (AttributeError, RuntimeError, OSError):
        return None
    return raw[: shared.numel()]


def _empty_shared(nbytes: int) -> torch.Tensor:
    """``nbytes`` bytes (``uint8``) allocated in shared memory: torch shares them as they are.
    (``share_memory_()`` on a new tensor would copy it once more.)"""
    new_shared = getattr(torch.UntypedStorage, "_new_shared", None)  # private to torch
    if new_shared is None:
        return torch.empty(nbytes, dtype=torch.uint8).share_memory_()
    return torch.empty(0, dtype=torch.uint8).set_(new_shared(nbytes), 0, (nbytes,))


class _PipeMessage:
    """Pickles ``value`` as :class:`_Pickler` does, inside the pickling of whatever holds it:
    objects that pickle only while a process is spawned (``multiprocessing`` locks) still do.
    ``deferred``: it unpickles as an :class:`Unloaded` message instead of the value."""

    __slots__ = ("_copies", "_deferred", "value")

    def __init__(self, value: Any, *, deferred: bool = False) -> None:
        self.value = value
        self._deferred = deferred
        self._copies: list[torch.Tensor] = []

    def __reduce__(self) -> tuple:
        buffer = io.BytesIO()
        pickler = _Pickler(buffer)
        pickler.dump(self.value)
        self._copies = pickler.copies  # as long as this wrapper: a Process keeps its arguments
        return (Unloaded if self._deferred else pickle.loads), (buffer.getvalue(),)


class Unloaded:
    """A value that arrived pickled, loaded when :meth:`load` is called: a process being
    spawned loads its arguments before it runs a line of ours, and one that cannot be rebuilt
    there ended it with the cause on its stderr only."""

    __slots__ = ("_data",)

    def __init__(self, data: bytes) -> None:
        self._data = data

    def load(self) -> Any:
        return pickle.loads(self._data)


def spawn_message(value: Any) -> Any:
    """``value``, to hand to a process being spawned: as :func:`pipe_message`, but it arrives as
    an :class:`Unloaded` message, loaded where an error in it can be answered."""
    return _PipeMessage(value, deferred=True)


def pipe_message(value: Any) -> Any:
    """``value``, to hand to a pipe or a process: it unpickles as ``value``, its CPU tensors as
    copies of their values (see the module's docstring)."""
    return _PipeMessage(value)
