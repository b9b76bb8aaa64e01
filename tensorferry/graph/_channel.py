"""Shared-memory channels: single-producer single-consumer rings between processes.

Layout of one segment (all counters little-endian int64, each on its own cache line)::

    offset 0     write_seq   messages written so far (only the writer stores it)
    offset 64    read_seq    messages read so far (only the reader stores it)
    offset 128   slots, slot_size
    offset 256   slot 0 | slot 1 | ... (message n lives in slot n % slots)

    slot: [kind u32 | aux u32 | payload bytes u64 | dtype u32 | pad | shape int64 x ndim]
          ... padded to META bytes ... [payload]

A message is published by storing ``write_seq + 1`` after its bytes are in the slot, and
released by storing ``read_seq + 1`` after the reader copied it out; a single writer and a
single reader per counter need no lock. The ordering relies on the CPU keeping stores in
program order (x86-64 does; Python gives no fence to ask for it elsewhere).

A bare CPU tensor travels as raw bytes (no pickling): the hot path is one ``copy_`` in and
one out. Other values are pickled. A message larger than a slot makes the writer create a larger
segment and send its name (a RELOCATE message); the reader follows and unlinks the old one.

Waits (:func:`wait_until`) spin, yielding the core between polls, then sleep with a growing
back-off, checking the graph's :class:`Control` block so a stopped graph or a dead actor ends
every wait promptly. Every wait has a deadline. Waking from a sleep costs far more than a poll
(``time.sleep`` overruns by the timer slack, ~50 µs, ``time.sleep(0)`` included, and a virtual
machine adds its own wake-up latency), and in a graph run back to back each process waits about
one execution's time; so on hosts with cores to spare the spin lasts ``TENSORFERRY_SPIN_US``
(default 1 ms on hosts with at least 8 CPUs), never less than 200 µs. On smaller hosts a longer
spin takes the core from the process being waited for. After the spin the sleeps stay short
(20 µs asked) for the first 50 ms of a wait, so an execution of a few milliseconds is not
noticed a whole back-off sleep late, and only then grow to 1 ms. Actor processes ask the kernel
for a 1 µs timer slack (:func:`tensorferry.runtime._spin.precise_sleeps`), so their short
sleeps are short.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import io
import mmap
import os
import pickle
import struct
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from tensorferry.errors import TransferTimeoutError
from tensorferry.p2p._packing import as_bytes
from tensorferry.runtime._spin import spin_until, spin_window_s

__all__ = [
    "Channel",
    "Control",
    "GraphStopped",
    "PeerDied",
    "RemoteError",
    "unlink_prefix",
    "wait_until",
]

_HEADER = 256
_META = 256
_WRITE, _READ, _GEOMETRY = 0, 64, 128  # byte offsets in the header
_I64 = struct.Struct("<q")
_PAIR = struct.Struct("<qq")
_HEAD = struct.Struct("<qqq")  # kind | aux << 32, payload bytes, dtype code
_SHAPES = [struct.Struct(f"<{n}q") for n in range(33)]
# Below this a plain memmove beats torch's copy (which may use several threads above it).
_MEMMOVE_MAX = 4 << 20
_KIND_TENSOR, _KIND_PICKLE, _KIND_ERROR, _KIND_RELOCATE = 1, 2, 3, 4
_FLAG_WAS_CUDA = 1 << 16
_MAX_NDIM = (_META - 24) // 8
_SPIN_MIN_S = 200e-6
_SLEEP_MIN_S = 20e-6
_SLEEP_MAX_S = 1e-3
# After the spin, a wait keeps its sleeps at the minimum for this long before backing off: a
# graph whose executions take milliseconds (each process idles most of one execution) would
# otherwise learn of its next input up to a whole back-off sleep late.
_SHORT_SLEEPS_S = 50e-3

# The dtypes whose tensors travel as raw bytes, by code: a code is an index into this list, the
# same in every process of a graph whatever its torch version (a name this torch lacks keeps its
# slot, empty). torch's own pickling is no fallback for the newer ones: a float8 tensor it
# pickles does not load again.
_DTYPE_NAMES = (
    "float32", "float64", "float16", "bfloat16", "int8", "uint8", "int16", "int32", "int64",
    "bool", "complex64", "complex128", "uint16", "uint32", "uint64", "float8_e4m3fn",
    "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "complex32",
)  # fmt: skip
_DTYPES: list[torch.dtype | None] = [getattr(torch, name, None) for name in _DTYPE_NAMES]
_DTYPE_CODE = {dtype: code for code, dtype in enumerate(_DTYPES) if dtype is not None}
# Tensors that travel as their bytes: plain ones, and Parameters, which arrive as plain tensors
# as over GPU edges (see host_values). Other subclasses are pickled whole.
RAW_TENSOR_TYPES = frozenset((torch.Tensor, torch.nn.Parameter))
_READABLE_DEVICES = frozenset(("cpu", "cuda"))  # where a tensor's bytes can be read from


def travels_raw(value: Any) -> bool:
    """Whether the channels take ``value`` out of the pickle and move it as its bytes: a plain
    tensor or ``Parameter``, strided, in host or CUDA memory, of a dtype with a code. Any other
    tensor (a subclass, a sparse one, one on the meta device, which has no bytes) is pickled
    whole. The compile- and execute-time checks (``_sendable``) leave out exactly these."""
    return (
        type(value) in RAW_TENSOR_TYPES
        and value.layout is torch.strided
        and value.device.type in _READABLE_DEVICES
        and value.dtype in _DTYPE_CODE
    )


def dtype_of(code: int) -> torch.dtype:
    """The dtype of a code that arrived; raises ``TypeError`` for one this torch lacks."""
    dtype = _DTYPES[code] if 0 <= code < len(_DTYPES) else None
    if dtype is None:
        name = _DTYPE_NAMES[code] if 0 <= code < len(_DTYPE_NAMES) else f"code {code}"
        raise TypeError(f"a tensor of dtype {name} arrived; this process's torch has no such dtype")
    return dtype


def unreadable(exc: BaseException) -> RemoteError:
    """What a reader hands on in place of a value it could not rebuild: that execution fails
    with this error (``get()`` raises it) and the graph goes on."""
    return RemoteError(
        "the receiving process",
        f"{type(exc).__name__}: {exc} (rebuilding a value that arrived)",
        "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
    )


class GraphStopped(Exception):
    """The graph was torn down while this process waited (internal; ends the actor loop)."""


class PeerDied(Exception):
    """An actor of the graph died (internal; the driver turns it into ActorDiedError)."""

    def __init__(self, index: int) -> None:
        super().__init__(f"actor #{index} died")
        self.index = index


class _NoRoom(Exception):
    """A message's larger segment could not be made (``/dev/shm`` is full); nothing of the
    message was written."""


class RemoteError:
    """An exception raised by an actor method, carried to the driver in place of the result."""

    def __init__(self, where: str, message: str, traceback: str) -> None:
        self.where = where
        self.message = message
        self.traceback = traceback

    def __reduce__(self):
        return (RemoteError, (self.where, self.message, self.traceback))


def _map(name: str, *, create: bool, size: int = 0) -> mmap.mmap:
    """Maps ``/dev/shm/<name>`` (created with ``size`` bytes, or attached at its size).

    Plain files under /dev/shm rather than ``multiprocessing.shared_memory``: that one registers
    every attach with the resource tracker, which then unlinks segments behind the graph's back.
    The graph removes its segments itself (:func:`unlink_prefix`).
    """
    path = f"/dev/shm/{name}"
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if not create:
            return mmap.mmap(fd, os.fstat(fd).st_size)
        try:
            # Reserved now, not on first touch: a segment larger than what /dev/shm has left
            # (64 MiB in a default Docker container) fails here with ENOSPC, where a sparse one
            # (ftruncate) killed the process that wrote into it with SIGBUS.
            os.posix_fallocate(fd, 0, size)
            return mmap.mmap(fd, size)
        except OSError:
            os.unlink(path)
            raise
    finally:
        os.close(fd)


def _address(buffer: mmap.mmap) -> int:
    view = ctypes.c_char.from_buffer(buffer)
    address = ctypes.addressof(view)
    del view  # an export would keep the map from closing; the address stays valid while open
    return address


def unlink_prefix(prefix: str) -> int:
    """Removes every segment whose name starts with ``prefix``; returns how many."""
    removed = 0
    for path in glob.glob(f"/dev/shm/{prefix}*"):
        try:
            os.unlink(path)
            removed += 1
        except FileNotFoundError:
            pass
    return removed


_spin_s: float | None = None


def _spin_window_s() -> float:
    """How long a wait spins before it sleeps (read once per process; see the module doc)."""
    global _spin_s
    if _spin_s is None:
        _spin_s = max(_SPIN_MIN_S, spin_window_s())
    return _spin_s


def wait_until(
    ready: Callable[[], bool],
    *,
    control: Any,
    timeout: float,
    what: str,
    idle: Callable[[], Any] | None = None,
    spin_s: float | None = None,
    max_pause_s: float = _SLEEP_MAX_S,
) -> float:
    """Waits until ``ready()`` is true: spins for up to ``spin_s``, then sleeps with a back-off.

    The spin yields the core between polls (``os.sched_yield``: other processes of the graph may
    need it), but it never sleeps. Every sleep checks ``control``.

    Args:
        ready: the condition; cheap, never blocks.
        control: the graph's flags (``check()`` raises when the graph must end).
        timeout: seconds before :class:`TransferTimeoutError`.
        what: the wait, for the error message.
        idle: called between polls (work the waiting thread does meanwhile).
        spin_s: how long to poll before the first sleep (default: the process's window).
        max_pause_s: the longest sleep between polls.

    Returns:
        When ``ready()`` was seen true (``time.perf_counter()``).

    Raises:
        TransferTimeoutError: not ready within ``timeout``.
        GraphStopped, PeerDied: the graph is ending.
    """
    if spin_s is None:
        spin_s = _spin_s if _spin_s is not None else _spin_window_s()
    deadline = time.perf_counter() + timeout
    if spin_until(ready, min(spin_s, timeout), idle=idle):
        return time.perf_counter()
    now = time.perf_counter()
    pause = min(_SLEEP_MIN_S, max_pause_s)
    back_off_at = now + _SHORT_SLEEPS_S
    while True:
        control.check()
        if now > deadline:
            raise TransferTimeoutError(f"{what} waited more than {timeout:.3g} s")
        time.sleep(pause)
        if now > back_off_at:
            pause = min(pause * 2, max_pause_s)
        if idle is not None:
            idle()
        if ready():
            return time.perf_counter()
        now = time.perf_counter()


class Control:
    """A small shared block of flags every wait of the graph checks.

    Flags: ``stop`` (teardown asked every loop to end), ``dead`` (1 + index of an actor that
    died, 0 when none).
    """

    _STOP, _DEAD = 0, 8

    def __init__(self, name: str, *, create: bool) -> None:
        self.name = name
        self._map = _map(name, create=create, size=64)
        self._parent = os.getppid()
        self._check_parent = False

    def watch_parent(self) -> None:
        """In an actor: also stop when the driver process is gone."""
        self._check_parent = True

    @property
    def driver_gone(self) -> bool:
        """Whether the driver this actor watches is gone (it never tore the graph down)."""
        return self._check_parent and os.getppid() != self._parent

    def stop(self) -> None:
        _I64.pack_into(self._map, self._STOP, 1)

    def mark_dead(self, index: int) -> None:
        if not _I64.unpack_from(self._map, self._DEAD)[0]:
            _I64.pack_into(self._map, self._DEAD, index + 1)

    @property
    def stopped(self) -> bool:
        return bool(_I64.unpack_from(self._map, self._STOP)[0])

    def dead_index(self) -> int | None:
        dead = _I64.unpack_from(self._map, self._DEAD)[0]
        return dead - 1 if dead else None

    def check(self) -> None:
        """Raises :class:`GraphStopped` or :class:`PeerDied` when the graph must end."""
        stop, dead = _PAIR.unpack_from(self._map, 0)
        if dead:
            raise PeerDied(dead - 1)
        if stop:
            raise GraphStopped()
        if self.driver_gone:
            raise GraphStopped()

    def close(self) -> None:
        self._map.close()


class _Segment:
    __slots__ = ("address", "map", "name", "slot_size", "slots")

    def __init__(self, name: str, *, slots: int = 0, slot_size: int = 0) -> None:
        create = slots > 0
        self.name = name
        self.map = _map(name, create=create, size=_HEADER + slots * slot_size)
        if create:
            _PAIR.pack_into(self.map, _GEOMETRY, slots, slot_size)
        self.slots, self.slot_size = _PAIR.unpack_from(self.map, _GEOMETRY)
        self.address = _address(self.map)

    def slot(self, seq: int) -> int:
        return _HEADER + (seq % self.slots) * self.slot_size

    def counter(self, offset: int) -> int:
        return _I64.unpack_from(self.map, offset)[0]

    def close(self, *, unlink: bool = False) -> None:
        self.map.close()
        if unlink:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"/dev/shm/{self.name}")


def _align(n: int) -> int:
    return (n + 63) & ~63


def resolved(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` with no conjugate or negative bit: ``x.conj()`` keeps ``x``'s bytes and a flag,
    so moved as bytes it would arrive as ``x``. A copy only for such a view (asking costs a
    fraction of resolving, which is a dispatched call even when there is nothing to do)."""
    if tensor.is_neg() or tensor.is_conj():
        return tensor.resolve_conj().resolve_neg()
    return tensor


def host_values(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s values in contiguous host memory, ready to travel as raw bytes (see
    :func:`resolved`). Copies only what needs it: every bare tensor a graph moves passes here.

    Detached: a tensor arrives as data, never requiring grad, as over the GPU edges (autograd
    does not cross processes; a receiver that wants a gradient asks for one itself)."""
    if tensor.requires_grad:
        tensor = tensor.detach()
    if tensor.is_cuda:
        tensor = tensor.cpu()
    tensor = resolved(tensor)
    return tensor if tensor.is_contiguous() else tensor.contiguous()


class _TensorPickler(pickle.Pickler):
    """Pickles a value but takes its tensors out as raw blobs, laid out after the pickle."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=5)
        self.tensors: list[torch.Tensor] = []
        self._seen: dict[int, int] = {}

    def persistent_id(self, obj: Any) -> Any:
        if not travels_raw(obj):
            return None
        index = self._seen.get(id(obj))
        if index is None:
            index = self._seen[id(obj)] = len(self.tensors)
            self.tensors.append(host_values(obj))
        return (index, _DTYPE_CODE[obj.dtype], tuple(obj.shape), obj.is_cuda)


class _TensorUnpickler(pickle.Unpickler):
    """Rebuilds the tensors a :class:`_TensorPickler` took out, copying them from the slot."""

    def __init__(self, data: bytes, address: int, device: torch.device | None) -> None:
        super().__init__(io.BytesIO(data))
        self._next = address  # where the next new blob starts
        self._device = device
        self._tensors: dict[int, torch.Tensor] = {}

    def persistent_load(self, pid: Any) -> Any:
        index, code, shape, was_cuda = pid
        tensor = self._tensors.get(index)
        if tensor is None:
            tensor = torch.empty(shape, dtype=dtype_of(code))
            nbytes = tensor.numel() * tensor.element_size()
            ctypes.memmove(tensor.data_ptr(), self._next, nbytes)
            self._next += _align(nbytes)
            self._tensors[index] = tensor
        if was_cuda and self._device is not None:
            return tensor.to(self._device)
        return tensor


class Channel:
    """One end of a shared-memory ring (a writer or a reader, never both).

    Args:
        name: segment name (the driver creates it with :meth:`create`).
        control: the graph's control block, checked while waiting.
        device: the reader's GPU, where tensors that were on a GPU land (``None``: host).
    """

    def __init__(self, name: str, control: Control, *, device: torch.device | None = None) -> None:
        self._seg = _Segment(name)
        self._control = control
        self._device = device
        self._generation = 0
        self._base = name
        self.ready_at = 0.0
        """When the last wait ended (monotonic s): profiles show the copy, not the wait."""

    @property
    def slots(self) -> int:
        """How many messages the ring holds."""
        return self._seg.slots

    @staticmethod
    def create(name: str, *, slots: int, slot_size: int) -> None:
        """Creates the segment (driver side); the ends attach with ``Channel(name, ...)``."""
        if slots < 1 or slot_size < _META + 64:
            raise ValueError(f"bad channel geometry: {slots} slots of {slot_size} bytes")
        slot_size = (slot_size + 63) // 64 * 64
        _Segment(name, slots=slots, slot_size=slot_size).close()

    # ------------------------------------------------------------------ waiting
    def _wait_readable(self, timeout: float) -> int:
        seg = self._seg
        seq = _I64.unpack_from(seg.map, _READ)[0]
        if _I64.unpack_from(seg.map, _WRITE)[0] > seq:
            self.ready_at = time.perf_counter()
            return seq
        self.ready_at = wait_until(
            lambda: _I64.unpack_from(seg.map, _WRITE)[0] > seq,
            control=self._control,
            timeout=timeout,
            what=f"channel {self._base}: read",
        )
        return seq

    def _wait_writable(self, timeout: float) -> int:
        seg = self._seg
        seq = _I64.unpack_from(seg.map, _WRITE)[0]
        slots = seg.slots
        if seq - _I64.unpack_from(seg.map, _READ)[0] >= slots:
            self.ready_at = wait_until(
                lambda: seq - _I64.unpack_from(seg.map, _READ)[0] < slots,
                control=self._control,
                timeout=timeout,
                what=f"channel {self._base}: write",
            )
        else:
            self.ready_at = time.perf_counter()
        return seq

    def readable(self) -> bool:
        """A message is waiting (never blocks)."""
        seg = self._seg
        return seg.counter(_WRITE) > seg.counter(_READ)

    def writable(self) -> bool:
        """A slot is free (never blocks)."""
        seg = self._seg
        return seg.counter(_WRITE) - seg.counter(_READ) < seg.slots

    # ------------------------------------------------------------------ writing
    def write(self, value: Any, *, timeout: float) -> None:
        """Writes one message, waiting for a free slot.

        Raises:
            TransferTimeoutError: no slot freed within ``timeout``.
            GraphStopped, PeerDied: the graph is ending.
        """
        try:
            if travels_raw(value):
                self._write_tensor(value, timeout)
            elif isinstance(value, RemoteError):
                self._write_bytes(_KIND_ERROR, pickle.dumps(value), timeout)
            else:
                self._write_object(value, timeout)
        except _NoRoom as exc:
            # Nothing of the message was written: its reader gets this error in its place, as
            # for a method that raised, and the graph goes on.
            error = RemoteError("the graph's shared memory (/dev/shm)", str(exc), "")
            self._write_bytes(_KIND_ERROR, pickle.dumps(error), timeout)

    def _write_tensor(self, tensor: torch.Tensor, timeout: float) -> None:
        flags = _FLAG_WAS_CUDA if tensor.is_cuda else 0
        code = _DTYPE_CODE[tensor.dtype]
        ndim = tensor.dim()
        if ndim > _MAX_NDIM:
            self._write_object(tensor, timeout)
            return
        tensor = host_values(tensor)
        nbytes = tensor.numel() * tensor.element_size()
        seq = self._fit(self._wait_writable(timeout), nbytes)
        seg = self._seg
        off = seg.slot(seq)
        _HEAD.pack_into(seg.map, off, _KIND_TENSOR | ((ndim | flags) << 32), nbytes, code)
        _SHAPES[ndim].pack_into(seg.map, off + 24, *tensor.shape)
        if nbytes <= _MEMMOVE_MAX:
            ctypes.memmove(seg.address + off + _META, tensor.data_ptr(), nbytes)
        else:
            target = torch.frombuffer(seg.map, dtype=torch.uint8, count=nbytes, offset=off + _META)
            target.copy_(as_bytes(tensor))
            del target
        _I64.pack_into(seg.map, _WRITE, seq + 1)

    def _write_object(self, value: Any, timeout: float) -> None:
        buffer = io.BytesIO()
        pickler = _TensorPickler(buffer)
        pickler.dump(value)
        payload = buffer.getbuffer()
        blobs = [(t, t.numel() * t.element_size()) for t in pickler.tensors]
        total = _align(len(payload)) + sum(_align(n) for _, n in blobs)
        seq = self._fit(self._wait_writable(timeout), total)
        seg = self._seg
        off = seg.slot(seq)
        _HEAD.pack_into(seg.map, off, _KIND_PICKLE, len(payload), total)
        start = off + _META
        seg.map[start : start + len(payload)] = payload
        cursor = seg.address + start + _align(len(payload))
        for tensor, nbytes in blobs:
            ctypes.memmove(cursor, tensor.data_ptr(), nbytes)
            cursor += _align(nbytes)
        del payload
        _I64.pack_into(seg.map, _WRITE, seq + 1)

    def _write_bytes(self, kind: int, payload: bytes, timeout: float) -> None:
        seq = self._fit(self._wait_writable(timeout), len(payload))
        seg = self._seg
        off = seg.slot(seq)
        _HEAD.pack_into(seg.map, off, kind, len(payload), 0)
        seg.map[off + _META : off + _META + len(payload)] = payload
        _I64.pack_into(seg.map, _WRITE, seq + 1)

    def _fit(self, seq: int, nbytes: int) -> int:
        """Relocates to a larger segment when ``nbytes`` does not fit a slot; returns the
        sequence number to write at."""
        seg = self._seg
        if _META + nbytes <= seg.slot_size:
            return seq
        slot_size = seg.slot_size
        while _META + nbytes > slot_size:
            slot_size *= 2
        self._generation += 1
        name = f"{self._base}g{self._generation}"
        try:
            new = _Segment(name, slots=seg.slots, slot_size=slot_size)
        except OSError as exc:
            raise _NoRoom(
                f"OSError: no room for a {nbytes}-byte message ({seg.slots} slot(s) of "
                f"{slot_size} bytes): {exc.strerror}; give /dev/shm more room (docker run "
                "--shm-size=...) or move less at once"
            ) from exc
        payload = name.encode()
        off = seg.slot(seq)
        _HEAD.pack_into(seg.map, off, _KIND_RELOCATE, len(payload), 0)
        seg.map[off + _META : off + _META + len(payload)] = payload
        _I64.pack_into(seg.map, _WRITE, seq + 1)
        seg.close()  # the reader unlinks it once it has followed
        self._seg = new
        return 0

    # ------------------------------------------------------------------ reading
    def read(self, *, timeout: float) -> Any:
        """Reads the next message, waiting for it.

        Returns:
            The value; a :class:`RemoteError` when the writer sent an error in its place.

        Raises:
            TransferTimeoutError: nothing came within ``timeout``.
            GraphStopped, PeerDied: the graph is ending.
        """
        while True:
            seq = self._wait_readable(timeout)
            seg = self._seg
            off = seg.slot(seq)
            word, nbytes, code = _HEAD.unpack_from(seg.map, off)
            kind = word & 0xFFFFFFFF
            start = off + _META
            if kind == _KIND_TENSOR:
                aux = word >> 32
                try:
                    out = self._read_tensor(seg, off, aux & 0xFFFF, nbytes, code)
                except Exception as exc:  # a dtype this torch lacks
                    out = unreadable(exc)
                _I64.pack_into(seg.map, _READ, seq + 1)
                if aux & _FLAG_WAS_CUDA and self._device is not None and type(out) is torch.Tensor:
                    return out.to(self._device)
                return out
            payload = seg.map[start : start + nbytes]
            if kind == _KIND_PICKLE:
                blobs = seg.address + start + _align(nbytes)
                try:
                    value = _TensorUnpickler(payload, blobs, self._device).load()
                except Exception as exc:  # the slot is read all the same: the next one is next
                    value = unreadable(exc)
                _I64.pack_into(seg.map, _READ, seq + 1)
                return value
            _I64.pack_into(seg.map, _READ, seq + 1)
            if kind == _KIND_RELOCATE:
                self._seg = _Segment(payload.decode())
                seg.close(unlink=True)
                continue
            return pickle.loads(payload)  # _KIND_ERROR

    @staticmethod
    def _read_tensor(seg: _Segment, off: int, ndim: int, nbytes: int, code: int) -> torch.Tensor:
        shape = _SHAPES[ndim].unpack_from(seg.map, off + 24)
        out = torch.empty(shape, dtype=dtype_of(code))
        start = off + _META
        if nbytes <= _MEMMOVE_MAX:
            ctypes.memmove(out.data_ptr(), seg.address + start, nbytes)
        else:
            source = torch.frombuffer(seg.map, dtype=torch.uint8, count=nbytes, offset=start)
            as_bytes(out).copy_(source)
            del source
        return out

    def close(self) -> None:
        self._seg.close()
