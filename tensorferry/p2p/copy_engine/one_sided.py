"""The one-host CUDA route: the sender's copy engine writes straight into the receiver's buffers.

Protocol (one pair direction, sender S → receiver R, message number n, ticket t = n + 1)::

    R's call:    export each buffer's allocation (a CUDA IPC handle, made once per allocation)
                 R's pair stream: wait for the caller's stream, then  READY := t
                 frame post(n): layout, route, [(handle, offset) per tensor], words' name
    S's call     (once the post is there, and the layouts agree):
                 S's pair stream: wait for the caller's stream; wait  READY >= t
                                  copy every tensor into R's mapped buffer (copy engine)
                                  DONE := t                       (fenced after the copies)
    both:        done when DONE >= t, read from host memory: no call, no thread

``READY`` and ``DONE`` are two 32-bit words of a page of shared memory (``/dev/shm``) that R
makes for the direction and epoch and both processes map and pin for their devices. ``READY``
keeps S from overwriting a buffer that R's earlier work still reads; ``DONE`` tells both hosts
(and R's streams, for ``wait_stream``) that the bytes are there. A fault (a new epoch) makes a
new page, so tickets never meet an older epoch's.

The sender maps each of R's allocations once (``cuIpcOpenMemHandle``, in its own device's
context, with peer access) and keeps it: the handle names the allocation, not the address, so
an allocation freed and made again at the same address comes with a new handle.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import secrets
import threading
from typing import TYPE_CHECKING, Any

import torch

from tensorferry.errors import TransportError
from tensorferry.p2p.copy_engine import _driver

if TYPE_CHECKING:
    from tensorferry.p2p._message import Message
    from tensorferry.p2p._pair import Pair

__all__ = ["OneSidedRoute"]

log = logging.getLogger(__name__)

_READY, _DONE = 0, 4  # byte offsets of the words in their page


def _on_device(index: int) -> Any:
    """The rank's device made current for the driver calls that follow, unless it is already
    (the usual case: a switch and back cost more than the calls)."""
    if torch.cuda.current_device() == index:
        return contextlib.nullcontext()
    return torch.cuda.device(index)


class _Words:
    """A page of shared memory holding a direction's READY and DONE words, pinned here."""

    def __init__(self, name: str, *, create: bool) -> None:
        path = f"/dev/shm/{name}"
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        try:
            fd = os.open(path, flags, 0o600)
        except OSError as exc:
            raise TransportError(f"ce: cannot open the shared page {path}: {exc}") from None
        try:
            if create:
                os.ftruncate(fd, mmap.PAGESIZE)
            self._map = mmap.mmap(fd, mmap.PAGESIZE)
        finally:
            os.close(fd)
        self.name, self.path, self.owner = name, path, create
        self.host = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self.device = _driver.host_register(self.host, mmap.PAGESIZE)
        self._done = ctypes.c_uint32.from_address(self.host + _DONE)

    def done(self) -> int:
        return self._done.value

    def close(self) -> None:
        _driver.host_unregister(self.host)
        self._done = None  # type: ignore[assignment]  # no view may outlive the map
        with contextlib.suppress(BufferError):  # a view still held: the map goes with it
            self._map.close()
        if self.owner:
            with contextlib.suppress(OSError):
                os.unlink(self.path)


class OneSidedRoute:
    """Copy-engine writes into the receiver's buffers; see the module docstring.

    Thread-safety: every method is called under the pair's lock; what pairs share (the maps of
    the peers' allocations, the handles of ours) has its own lock.
    """

    name = "ce"
    one_sided = True
    confirms_receives = False  # a receive ends by the word its sender's device writes

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._lock = threading.Lock()
        self._handles: dict[int, str] = {}  # our allocations' handles (hex), by buffer id
        self._mapped: dict[str, int] = {}  # peers' allocations mapped here, by handle (hex)
        self._incoming: dict[int, tuple[int, _Words]] = {}  # peer -> (epoch, our page)
        self._outgoing: dict[int, tuple[str, _Words]] = {}  # peer -> (page name, its page)

    # ------------------------------------------------------------------ receiver
    def post(self, pair: Pair, message: Message) -> dict:
        """Makes ``message``'s buffers writable by the peer after the caller's earlier work;
        returns what the post frame carries."""
        words = self._incoming_words(pair)
        stream = pair.stream("recv")
        raw = stream.cuda_stream
        with _on_device(self.device.index):
            if message.caller_event is not None:
                stream.wait_event(message.caller_event)
            _driver.write_value32(raw, words.device + _READY, message.seq + 1)
            where = self._export(message.tensors)
        message.pending = words
        return {"b": where, "w": words.name}

    def _export(self, tensors: tuple[torch.Tensor, ...]) -> list:
        """``[handle, offset]`` of each tensor: one driver call per allocation the message
        touches (a KV cache's blocks share a few), the handles made once per allocation."""
        seen: list[tuple[int, int, str]] = []  # (base, end, handle) of this message's
        where = []
        for tensor in tensors:
            nbytes = tensor.numel() * tensor.element_size()
            if nbytes == 0:
                where.append(["", 0])
                continue
            address = tensor.data_ptr()
            known = next((k for k in seen if k[0] <= address and address + nbytes <= k[1]), None)
            if known is None:
                ident, base, size = _driver.allocation_of(address)
                with self._lock:
                    handle = self._handles.get(ident)
                    if handle is None:
                        handle = self._handles[ident] = _driver.ipc_handle(base).hex()
                known = (base, base + size, handle)
                seen.append(known)
            where.append([known[2], address - known[0]])
        return where

    def _incoming_words(self, pair: Pair) -> _Words:
        kept = self._incoming.get(pair.peer)
        if kept is not None and kept[0] == pair.epoch:
            return kept[1]
        if kept is not None:
            kept[1].close()
        name = f"tensorferry-{os.getpid()}-{pair.peer}-{pair.epoch}-{secrets.token_hex(4)}"
        with torch.cuda.device(self.device):
            words = _Words(name, create=True)
        self._incoming[pair.peer] = (pair.epoch, words)
        return words

    # ------------------------------------------------------------------ sender
    def write(self, pair: Pair, message: Message, post: dict) -> None:
        """Copies ``message``'s tensors where the peer's post says, after the caller's earlier
        work and the receiver's ``READY``; then sets ``DONE``."""
        words = self._outgoing_words(pair, post["w"])
        stream = pair.stream("send")
        raw = stream.cuda_stream
        ticket = message.seq + 1
        with _on_device(self.device.index):
            if message.caller_event is not None:
                stream.wait_event(message.caller_event)
            _driver.wait_value32(raw, words.device + _READY, ticket)
            for target, source, nbytes in self._copies(message.tensors, post["b"]):
                _driver.memcpy_async(target, source, nbytes, raw)
            _driver.write_value32(raw, words.device + _DONE, ticket)
        message.pending = words

    def _copies(self, tensors: tuple[torch.Tensor, ...], where: list) -> list[list[int]]:
        """``[target, source, bytes]`` per copy. Tensors that follow each other in memory on
        both sides, each side within one allocation (blocks of a pool, back to back), go as
        one copy: a copy may not cross from one allocation into the next."""
        copies: list[list[int]] = []
        sources: list[tuple[int, int]] = []  # (base, end) of the allocations read so far
        last_handle, last_source = None, None
        for tensor, (handle, offset) in zip(tensors, where, strict=True):
            nbytes = tensor.numel() * tensor.element_size()
            if not nbytes:
                continue
            target, source = self._mapped_base(handle) + offset, tensor.data_ptr()
            home = next((r for r in sources if r[0] <= source and source + nbytes <= r[1]), None)
            if home is None:
                _, base, size = _driver.allocation_of(source)
                home = (base, base + size)
                sources.append(home)
            last = copies[-1] if copies else None
            if (
                last is not None
                and handle == last_handle
                and home == last_source
                and last[0] + last[2] == target
                and last[1] + last[2] == source
            ):
                last[2] += nbytes
            else:
                copies.append([target, source, nbytes])
            last_handle, last_source = handle, home
        return copies

    def _mapped_base(self, handle: str) -> int:
        base = self._mapped.get(handle)
        if base is None:
            with self._lock:
                base = self._mapped.get(handle)
                if base is None:
                    base = self._mapped[handle] = _driver.ipc_open(bytes.fromhex(handle))
        return base

    def _outgoing_words(self, pair: Pair, name: str) -> _Words:
        kept = self._outgoing.get(pair.peer)
        if kept is not None and kept[0] == name:
            return kept[1]
        if kept is not None:
            kept[1].close()
        with torch.cuda.device(self.device):
            words = _Words(name, create=False)
        self._outgoing[pair.peer] = (name, words)
        return words

    # ------------------------------------------------------------------ both
    def prepared(self, pair: Pair, kind: str) -> bool:
        return True  # nothing to meet over: a pair's first post carries all the sender needs

    def finished(self, pair: Pair, message: Message) -> bool:
        return message.pending.done() >= message.seq + 1

    def order_stream(self, pair: Pair, message: Message, stream: Any) -> None:
        """Makes ``stream`` wait, on the device, for ``message``'s bytes."""
        with torch.cuda.device(self.device):
            _driver.wait_value32(
                stream.cuda_stream, message.pending.device + _DONE, message.seq + 1
            )

    def evict(self, pair: Pair, reason: str) -> None:
        """A fault or a lost peer: this pair's pages go (a new epoch makes new ones)."""
        for table in (self._incoming, self._outgoing):
            kept = table.pop(pair.peer, None)
            if kept is not None:
                try:
                    kept[1].close()
                except Exception:
                    log.debug("ce: closing a page failed", exc_info=True)

    def close(self) -> None:
        for table in (self._incoming, self._outgoing):
            for _, words in table.values():
                try:
                    words.close()
                except Exception:
                    log.debug("ce: closing a page failed", exc_info=True)
            table.clear()
