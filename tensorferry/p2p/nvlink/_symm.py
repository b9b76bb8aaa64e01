"""Symmetric allocations: ``empty()`` receive buffers that peers can write straight into.

``empty`` is collective over its group: every rank calls it with the same shape and dtype, in
the same order, so the k-th allocation has the same registration id ``k`` everywhere. A receiver
whose tensor lies in a live registration posts ``(id, byte offset)`` to its sender, which then
stores into the peer's copy of that registration instead of into the staging buffer.

Thread-safe: one lock guards the registry.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import uuid
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "setup_stream",
    "empty",
    "Registration",
    "lookup",
    "registrations",
    "registry_version",
    "group_name_of",
    "join_group",
    "pair_group_name",
]

log = logging.getLogger(__name__)

MAX_REGISTRATIONS = 4096
"""Capacity of the per-group id space (the device tables are sized for it)."""


def pair_group_name(kind: str, store: Any, *, first: bool) -> str:
    """A symmetric-memory group name both ranks of a pair agree on and this process never used
    before: symmetric memory keeps a name's group for the life of the process, while the pair
    may be made again (a new epoch, a new ``tf.init``). The ``first`` rank draws it and posts it
    in the pair's ``store``; the other reads it there."""
    if first:
        name = f"tf-{kind}-{uuid.uuid4().hex[:16]}"
        store.set("group_name", name)
        return name
    return bytes(store.get("group_name")).decode()


def join_group(name: str, rank: int, world_size: int, store: Any) -> Any:
    """Makes ``name`` a symmetric-memory group of these ranks without ``torch.distributed``
    being initialised: its store for the rendezvous, and — because newer torch versions also
    look the name up among c10d's registered process groups during a rendezvous — a small gloo
    group registered under that name when none is. Every rank calls it at the same point. Both
    reach the store through :class:`_GroupSequencedStore`.

    Returns:
        The process group registered here, or ``None``; the caller keeps it alive (c10d holds
        registered groups weakly).
    """
    import datetime

    from torch.distributed import _symmetric_memory as symm_mem

    exchange_store = _GroupSequencedStore(store)
    with _lock:
        _exchange_stores[name] = exchange_store  # c10d calls back into it: keep it alive
    symm_mem._SymmetricMemory.set_group_info(name, rank, world_size, exchange_store)
    c10d = torch._C._distributed_c10d
    try:
        c10d._resolve_process_group(name)
        return None
    except RuntimeError:
        pass
    # A ProcessGroup with a gloo backend, put together as torch.distributed does it. Newer
    # torch versions run the rendezvous exchanges through the group's store: the renumbering one.
    group = dist.ProcessGroup(exchange_store, rank, world_size)
    gloo = dist.ProcessGroup.BackendType.GLOO
    backend = dist.ProcessGroupGloo(
        dist.PrefixStore(f"{name}/gloo", store), rank, world_size, datetime.timedelta(seconds=60)
    )
    group._register_backend(torch.device("cpu"), gloo, backend)
    if hasattr(group, "_set_default_backend"):
        group._set_default_backend(gloo)
    c10d._register_process_group(name, group)
    return group


class _GroupSequencedStore(dist.Store):
    """The store a group's symmetric-memory rendezvous talks through, renumbering its keys.

    torch numbers its rendezvous exchanges (keys ``<prefix>/<n>/<rank>``) with ONE counter per
    process, shared by every group. Two ranks of a pair that took part in different numbers of
    exchanges before — around a ring of four, rank 0 sets up its pair with 1 while rank 3 sets
    up its pair with 0 — would each wait on a key the other never writes. Here the ``k``-th
    exchange of this group is numbered ``k`` on every rank, whatever the process counter says.
    Every other key passes through unchanged.

    c10d reaches the Python methods only while this object lives: :func:`join_group` keeps it.
    """

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self._inner = inner
        self._local: dict[tuple[str, str], int] = {}
        self._next: dict[str, int] = {}
        self._guard = threading.Lock()

    def _key(self, key: str) -> str:
        parts = key.rsplit("/", 2)
        if len(parts) != 3 or not (parts[1].isdigit() and parts[2].isdigit()):
            return key
        prefix, seq, rank = parts
        with self._guard:
            local = self._local.get((prefix, seq))
            if local is None:  # a new exchange: its rank's own key comes first
                local = self._local[(prefix, seq)] = self._next.get(prefix, 0)
                self._next[prefix] = local + 1
        return f"{prefix}/{local}/{rank}"

    def set(self, key: str, value: Any) -> None:
        self._inner.set(self._key(key), value)

    def get(self, key: str) -> bytes:
        return self._inner.get(self._key(key))

    def wait(self, keys: list[str], timeout: Any = None) -> None:
        renamed = [self._key(k) for k in keys]
        if timeout is None:
            self._inner.wait(renamed)
        else:
            self._inner.wait(renamed, timeout)

    def check(self, keys: list[str]) -> bool:
        return self._inner.check([self._key(k) for k in keys])

    def add(self, key: str, amount: int) -> int:
        return self._inner.add(self._key(key), amount)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self._inner.compare_set(self._key(key), expected, desired)

    def delete_key(self, key: str) -> bool:
        return self._inner.delete_key(self._key(key))

    def set_timeout(self, timeout: Any) -> None:
        self._inner.set_timeout(timeout)


_exchange_stores: dict[str, _GroupSequencedStore] = {}


@dataclass(frozen=True, slots=True)
class Registration:
    """One symmetric allocation of a group."""

    reg_id: int
    base: int
    """Our tensor's address (the start of our copy)."""
    nbytes: int
    peer_bases: tuple[int, ...]
    """Address of every rank's copy, in our address space (index = group rank)."""
    tensor_ref: Any
    """Weak reference to the allocation; a dead one is never posted."""
    handle: Any
    """The ``_SymmetricMemory`` handle; holding it keeps the peer mappings alive."""

    def alive(self) -> bool:
        return self.tensor_ref() is not None


_lock = threading.Lock()
_registry: dict[str, list[Registration]] = {}
_version = 0


@contextlib.contextmanager
def setup_stream(device: torch.device) -> Any:
    """Runs a channel's set-up work (zeroing signals, first writes) on a stream of its own and
    waits for that stream alone on the way out.

    Why not ``torch.cuda.synchronize``: it waits for every stream of the device, including
    other channels' transfers, which may be waiting on a peer that is itself inside a set-up
    and synchronising. Around a ring of four over ``ce`` every rank sat in that synchronize.
    """
    stream = torch.cuda.Stream(device)
    with torch.cuda.device(device), torch.cuda.stream(stream):
        yield stream
    stream.synchronize()


def group_name_of(group: Any) -> str:
    """The c10d group name of ``group`` (``None``: the default group)."""
    import torch.distributed as dist

    if group is None:
        group = dist.group.WORLD
    if group is None:
        raise RuntimeError("torch.distributed is not initialised (call init_process_group first)")
    return group.group_name


def empty(
    *size: Any,
    dtype: torch.dtype | None = None,
    device: Any = None,
    group: Any = None,
) -> torch.Tensor:
    """Allocates a tensor in symmetric memory, mapped into every rank of ``group``.

    Collective: every rank of ``group`` calls it with the same ``size`` and ``dtype``, in the
    same order relative to its other ``empty`` calls. Received into over the ``nvlink``
    transport, such a tensor is written by the sender directly (zero-copy: no staging copy).

    Args:
        size: the shape, as integers or one sequence. Must match across ranks.
        dtype: element type (default: torch's default dtype). Must match across ranks.
        device: the CUDA device (default: the current one).
        group: the process group (default: the world).

    Returns:
        An uninitialised contiguous tensor of ``size`` and ``dtype`` on ``device``.

    Raises:
        ValueError: a negative dimension, or a non-CUDA device.
        RuntimeError: torch.distributed is not initialised.
    """
    from torch.distributed import _symmetric_memory as symm_mem

    if len(size) == 1 and isinstance(size[0], Sequence):
        size = tuple(size[0])
    shape = tuple(int(s) for s in size)
    if any(s < 0 for s in shape):
        raise ValueError(f"size must not be negative, got {shape}")
    dtype = torch.get_default_dtype() if dtype is None else dtype
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else device
    dev = torch.device(dev)
    if dev.type != "cuda":
        raise ValueError(f"empty() allocates CUDA symmetric memory, got device {dev}")
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    name = group_name_of(group)
    stride = torch._prims_common.make_contiguous_strides_for(shape)
    # A dedicated allocation (not the implicit pool): its base is its own, so offsets and peer
    # addresses are exact.
    tensor = symm_mem._SymmetricMemory.empty_strided_p2p(shape, stride, dtype, dev)
    handle = symm_mem.rendezvous(tensor, name)
    rank = handle.rank
    offset = tensor.data_ptr() - handle.buffer_ptrs[rank]
    peer_bases = tuple(p + offset for p in handle.buffer_ptrs)
    global _version
    with _lock:
        regs = _registry.setdefault(name, [])
        if len(regs) >= MAX_REGISTRATIONS:
            raise RuntimeError(
                f"more than {MAX_REGISTRATIONS} symmetric allocations in group {name!r}"
            )
        reg = Registration(
            reg_id=len(regs),
            base=tensor.data_ptr(),
            nbytes=tensor.numel() * tensor.element_size(),
            peer_bases=peer_bases,
            tensor_ref=weakref.ref(tensor),
            handle=handle,
        )
        regs.append(reg)
        _version += 1
    log.info(
        "symmetric allocation %d in %s: %s %s (%d bytes)",
        reg.reg_id,
        name,
        shape,
        dtype,
        reg.nbytes,
    )
    return tensor


def lookup(group_name: str, tensor: torch.Tensor) -> tuple[int, int] | None:
    """``(registration id, byte offset)`` of ``tensor`` if it lies wholly inside a live
    registration of ``group_name`` and starts 16-byte aligned, else ``None``."""
    ptr = tensor.data_ptr()
    end = ptr + tensor.numel() * tensor.element_size()
    if ptr % 16:
        return None
    with _lock:
        regs = _registry.get(group_name, ())
        # Newest first: an address freed and reused belongs to the newer allocation.
        for reg in reversed(regs):
            if reg.base <= ptr and end <= reg.base + reg.nbytes and reg.alive():
                return reg.reg_id, ptr - reg.base
    return None


def registrations(group_name: str) -> list[Registration]:
    """A snapshot of ``group_name``'s registrations, in id order."""
    with _lock:
        return list(_registry.get(group_name, ()))


def registry_version() -> int:
    """Grows by one with every registration, in any group (channels refresh their tables)."""
    return _version
