"""The one-host CUDA route: the sender's copy engine writes straight into the receiver's buffers.

Protocol (one pair direction, sender S → receiver R, message number n, ticket t = n + 1)::

    R's call:    its buffers as runs of bytes, each within one allocation (a CUDA IPC
                 handle per allocation, made once)
                 R's pair stream: wait for the caller's stream, then  READY := t
                 (R's host stores it where the caller's work is over and the stream
                 has nothing left to do)
                 frame post(n): layout, route, runs [(handle, offset, bytes)], their key,
                 words' name
    S's call     (once the post is there, and the layouts agree):
                 S's pair stream: wait for the caller's stream; wait  READY >= t
                                  (no wait where S's host reads READY >= t already)
                                  copy its runs into R's mapped runs (copy engine)
                                  DONE := t                       (fenced after the copies)
    both:        done when DONE >= t, read from host memory: no call, no thread

A step of the pair posts or writes a run of messages at once (a batch's, or the sends whose
posts came together): each stream waits once per caller's event and writes its word once,
for the last message (see ``_Word``), so a batch of 64 costs each side two stream operations,
not 128.

Register once, move many: both sides keep what a layout came to, by the tensors' addresses.
R keeps its runs (and gives them a key that the post carries); S keeps the copies it made of
its own runs and R's keyed runs. A repeated message costs each side one lookup and one
pointer query per allocation and step of the pair (which tells an allocation freed and made
again at the same address from the one it knew; a batch's buffers in one allocation cost one
query), whatever the number of tensors: tensors back to back in one allocation on both sides
(a KV cache's blocks, views of one buffer) go as one copy.

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
import itertools
import logging
import mmap
import os
import secrets
import struct
import threading
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from tensorferry import _native
from tensorferry.errors import TransportError
from tensorferry.p2p.copy_engine import _driver
from tensorferry.runtime._events import is_done, stream_wait

if TYPE_CHECKING:
    from tensorferry.p2p._message import Message
    from tensorferry.p2p._pair import Pair

__all__ = ["OneSidedRoute"]

log = logging.getLogger(__name__)

_READY, _DONE = 0, 4  # byte offsets of the words in their page
_RING, _SLOTS = 64, 256  # the posts' ring: its offset in the page, and its 64-bit slots
_TICKET = 0xFFFFFFFF  # a slot holds (key << 32) | ticket


def _on_device(index: int) -> Any:
    """The rank's device made current for the driver calls that follow, unless it is already
    (the usual case: a switch and back cost more than the calls). Its context is then made
    current too, once per thread: a library thread (the pairs' watcher) may issue."""
    if torch._C._cuda_getDevice() == index:  # (torch.cuda.current_device() checks more)
        _driver.bind_context(index)
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
        self.ready_word = ctypes.c_uint32.from_address(self.host + _READY)
        self._ring = (ctypes.c_uint64 * _SLOTS).from_address(self.host + _RING)
        self.told: set[int] = set()  # receiver: layout keys whose post went as a frame
        # The last ticket this side's stream was given for its word of the page (READY on a
        # receiver's, DONE on a sender's): what the stream holds ahead of the device.
        self.last_ticket = 0
        self.layouts: dict[int, dict] = {}  # sender: those posts, by key

    def done(self) -> int:
        return self._done.value

    def ready(self) -> int:
        return self.ready_word.value

    def ring_post(self, seq: int, key: int) -> bool:
        """Receiver: posts message ``seq`` of a layout the sender knows (``key``) in the ring,
        if its slot is free (the message ``_SLOTS`` earlier is done); returns whether it did."""
        if key not in self.told or self._done.value + _SLOTS < seq + 1:
            return False
        self._ring[seq % _SLOTS] = (key << 32) | ((seq + 1) & _TICKET)  # one 8-byte store
        return True

    def ring_read(self, seq: int) -> dict | None:
        """Sender: the post of message ``seq`` if the ring holds it."""
        slot = self._ring[seq % _SLOTS]
        if slot & _TICKET != (seq + 1) & _TICKET:
            return None
        return self.layouts.get(slot >> 32)

    def close(self) -> None:
        _driver.host_unregister(self.host)
        # No view may outlive the map.
        self._done = self.ready_word = self._ring = None  # type: ignore[assignment]
        with contextlib.suppress(BufferError):  # a view still held: the map goes with it
            self._map.close()
        if self.owner:
            with contextlib.suppress(OSError):
                os.unlink(self.path)


class _Word:
    """A stream's word (``READY`` or ``DONE``) over a run of messages that one step of a pair
    posts or writes: written once, for the last of them. Words count up, so one write covers
    every message before it; but a word owed is written before the stream waits on anything
    (the caller's next event, ``READY``): what that waits for may itself wait for the word (a
    ping-pong whose receives order the caller's stream). A batch's messages share one event,
    so the batch costs one wait and one write; separate calls cost one each.

    ``READY`` may be stored by the host itself (``host``: the word in host memory) where its
    stream has nothing left to do: this run queued nothing (the caller's work was over) and
    the word already shows ``written``, the last ticket the stream was given. The receiver's
    post then makes no stream operation at all, and the sender finds ``READY`` set."""

    __slots__ = ("address", "held", "host", "owed", "queued", "stream", "waited", "written")

    def __init__(self, stream: Any, address: int, *, host: Any = None, written: int = 0) -> None:
        self.stream, self.address, self.host, self.written = stream, address, host, written
        self.owed = 0
        self.queued = False  # whether this run queued a stream operation
        self.waited: Any = None
        self.held: _Copy | None = None  # the copy not yet queued: the next one may join it

    def copy(self, copy: _Copy) -> None:
        """Queues ``copy`` on the stream. One that carries on where the copy before it ended, on
        both ends and within the same allocations, joins it: a run's messages from views of one
        buffer into views of one buffer (a batch, posts that came together) go as one copy. The
        copy held for that is queued before any other operation of the stream (a wait, the
        word), so the word still follows every byte it covers."""
        held = self.held
        if held is not None and held.continued_by(copy):
            self.held = held.joined(copy)
            return
        self._queue_held()
        self.held = copy

    def _queue_held(self) -> None:
        held, self.held = self.held, None
        if held is not None:
            _driver.memcpy_async(held.target, held.source, held.nbytes, self.stream.cuda_stream)
            self.queued = True

    def after(self, event: Any) -> None:
        """The stream's later work waits for the caller's ``event`` (once per event), unless
        the caller's work before it is over already (a query costs less than a wait)."""
        if event is None or event is self.waited:
            return
        self.waited = event
        if not is_done(event):
            self.write()
            stream_wait(self.stream, event)
            self.queued = True

    def wait(self, address: int, value: int) -> None:
        """The stream's later work waits until the word at ``address`` is at least ``value``."""
        self.write()
        _driver.wait_value32(self.stream.cuda_stream, address, value)
        self.queued = True

    def owe(self, ticket: int) -> None:
        self.owed = ticket

    def write(self) -> None:
        """Queues the held copy, then the word owed (if any): every operation of the stream
        after this one follows both."""
        self._queue_held()  # the bytes the word covers go first
        if not self.owed:
            return
        if self.host is not None and not self.queued and self.host.value == self.written:
            self.host.value = self.owed  # (nothing of the stream's can land after it)
        else:
            _driver.write_value32(self.stream.cuda_stream, self.address, self.owed)
            self.queued = True
        self.written, self.owed = self.owed, 0


class _Copy(NamedTuple):
    """``nbytes`` from ``source`` to ``target``; ``homes``: the allocations of both ends (a
    copy may not cross from one allocation into the next)."""

    target: int
    source: int
    nbytes: int
    homes: tuple[Any, Any]

    def continued_by(self, other: _Copy) -> bool:
        """Whether ``other`` starts where this one ends, on both ends, in the same allocations."""
        return (
            other.homes == self.homes
            and other.target == self.target + self.nbytes
            and other.source == self.source + self.nbytes
        )

    def joined(self, other: _Copy) -> _Copy:
        return self._replace(nbytes=self.nbytes + other.nbytes)


_CACHED = 256  # layouts kept per table: a program of ever-new addresses starts it afresh

# Messages of a pair's direction that its stream holds and its device has not finished (its
# word has not reached them yet). A stream takes about 1020 operations (a wait, a copy, a word
# write) before the call queueing the next one blocks until the device frees room (measured on
# an H200, 2026-11-29), and a message costs its stream up to three. Blocked there, the call
# would hold the GIL and the pair's lock while the device waits for the peer, which may itself
# be waiting for this side's next post or write: each side would wait for the other, for ever.
# A message that finds its stream this full waits, as for a route being made; a later step
# (a wait, the next call, the idle pairs' watcher) posts or writes it once the device caught up.
_IN_FLIGHT = 128


class _Run:
    """Bytes back to back within one allocation: ``nbytes`` from ``address``."""

    __slots__ = ("address", "base", "handle", "ident", "nbytes", "tensors")

    def __init__(self, address: int, nbytes: int, ident: int, base: int) -> None:
        self.address, self.nbytes, self.ident, self.base = address, nbytes, ident, base
        self.handle = ""
        self.tensors = 1


class _Runs:
    """A message's runs, what a post carries of them (receiver side), and how to tell that
    they still hold.

    A receiver's post names allocations (by handle), so all of them are checked; a sender's
    runs name addresses only, and only one that joins tensors can come to cross from one
    allocation into another."""

    def __init__(self, runs: list[_Run], key: int, *, joined_only: bool = False) -> None:
        self.runs, self.key = runs, key
        self.posted = [[r.handle, r.address - r.base, r.nbytes] for r in runs]
        firsts: dict[int, int] = {}
        for run in runs:
            if run.tensors > 1 or not joined_only:
                firsts.setdefault(run.ident, run.address)
        self._checks = [(address, ident) for ident, address in firsts.items()]

    def current(self, alive: set[int]) -> bool:
        """Whether every allocation is still the one these runs were made in. ``alive``: the
        allocations a step of the pair found still there (each is asked about once a step: a
        batch's buffers in one allocation cost one query); those found here join it."""
        for address, ident in self._checks:
            if ident in alive:
                continue  # still there, so every address it held is still its own
            if _driver.allocation_of(address)[0] != ident:
                return False
            alive.add(ident)
        return True


def _runs(tensors: tuple[torch.Tensor, ...]) -> list[_Run]:
    """``tensors``' bytes in order as runs: a run grows while the next tensor follows it in
    memory within the same allocation (a copy may not cross from one allocation into the
    next). One pointer query per allocation."""
    runs: list[_Run] = []
    homes: list[tuple[int, int, int]] = []  # (base, end, ident) of the allocations seen
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if not nbytes:
            continue
        address = tensor.data_ptr()
        last = runs[-1] if runs else None
        if last is not None and last.address + last.nbytes == address:
            home = next(h for h in homes if h[2] == last.ident)
            if address + nbytes <= home[1]:
                last.nbytes += nbytes
                last.tensors += 1
                continue
        home = next((h for h in homes if h[0] <= address < h[1]), None)
        if home is None:
            ident, base, size = _driver.allocation_of(address)
            home = (base, base + size, ident)
            homes.append(home)
        runs.append(_Run(address, nbytes, home[2], home[0]))
    return runs


def _cut(runs: list[_Run], targets: list[tuple[int, int, str]]) -> list[_Copy]:
    """Copies of ``runs`` into ``targets`` (``(address, bytes, the allocation's handle)``), both
    in message order: one per stretch that lies within one run and one target."""
    copies = []
    i = j = done_i = done_j = 0
    while i < len(runs) and j < len(targets):
        run, (target, room, home) = runs[i], targets[j]
        nbytes = min(run.nbytes - done_i, room - done_j)
        copies.append(_Copy(target + done_j, run.address + done_i, nbytes, (home, run.ident)))
        done_i += nbytes
        done_j += nbytes
        if done_i == run.nbytes:
            i, done_i = i + 1, 0
        if done_j == room:
            j, done_j = j + 1, 0
    if i < len(runs) or j < len(targets):
        raise TransportError("ce: the receiver's buffers do not hold the message's bytes")
    return copies


def _addresses(tensors: tuple[torch.Tensor, ...]) -> bytes:
    """The tensors' data addresses as 64-bit words: with the layout, the key of what a
    message's buffers came to (one compiled call where the helper is loaded: a ``data_ptr()``
    per tensor from Python cost about ten microseconds for 64 tensors)."""
    native = _native.helper()
    if native is not None:
        return native.addresses(tensors)
    return struct.pack(f"={len(tensors)}Q", *[t.data_ptr() for t in tensors])


def _bounded(table: dict) -> dict:
    if len(table) >= _CACHED:
        table.clear()
    return table


class OneSidedRoute:
    """Copy-engine writes into the receiver's buffers; see the module docstring.

    Thread-safety: every method is called under the pair's lock; what pairs share (the maps of
    the peers' allocations, the handles of ours) has its own lock.
    """

    name = "ce"
    receiver_posts = True
    one_sided = True  # posts may come through memory; completion is a word the device writes
    confirms_receives = False  # a receive ends by the word its sender's device writes

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._lock = threading.Lock()
        self._handles: dict[int, str] = {}  # our allocations' handles (hex), by buffer id
        self._mapped: dict[str, int] = {}  # peers' allocations mapped here, by handle (hex)
        self._exports: dict[tuple, _Runs] = {}  # our receive layouts, by (layout, addresses)
        self._plans: dict[tuple, tuple] = {}  # our copies, by (peer, its key, layout, addresses)
        self._keys = itertools.count(1)
        self._incoming: dict[int, tuple[int, _Words]] = {}  # peer -> (epoch, our page)
        self._outgoing: dict[int, tuple[str, _Words]] = {}  # peer -> (page name, its page)

    # ------------------------------------------------------------------ receiver
    def post(self, pair: Pair, messages: list[Message]) -> None:
        """Makes ``messages``' buffers writable by the peer after the caller's earlier work,
        then posts them: in the ring where the sender knows the layout from an earlier frame
        of this epoch (no frame, no system call), else as a frame."""
        words = self._incoming_words(pair)
        stream, first = pair.stream("recv"), messages[0].seq  # (READY shows it when drained)
        ready = _Word(stream, words.device + _READY, host=words.ready_word, written=first)
        posts = []
        alive: set[int] = set()  # allocations this step found still there
        with _on_device(self.device.index):
            for message in messages:
                ready.after(message.caller_event)
                ready.owe(message.seq + 1)
                posts.append(self._exported(message, alive))
                message.pending = words
            ready.write()
        words.last_ticket = messages[-1].seq + 1
        frames = []
        for message, runs in zip(messages, posts, strict=True):
            if not words.ring_post(message.seq, runs.key):
                words.told.add(runs.key)
                frames.append((message, {"x": runs.key, "b": runs.posted, "w": words.name}))
        if frames:
            pair.send_posts(frames)

    def _exported(self, message: Message, alive: set[int]) -> _Runs:
        """The receiver's runs of ``message``'s buffers, made once per layout and addresses
        (``alive``: see :meth:`_Runs.current`)."""
        key = (message.desc, _addresses(message.tensors))
        known = self._exports.get(key)
        if known is None or not known.current(alive):
            runs = _runs(message.tensors)
            with self._lock:
                for run in runs:
                    handle = self._handles.get(run.ident)
                    if handle is None:
                        handle = self._handles[run.ident] = _driver.ipc_handle(run.base).hex()
                    run.handle = handle
            known = _Runs(runs, next(self._keys))
            _bounded(self._exports)[key] = known
        return known

    def _incoming_words(self, pair: Pair) -> _Words:
        kept = self._incoming.get(pair.peer)
        if kept is not None and kept[0] == pair.epoch:
            return kept[1]
        if kept is not None:
            kept[1].close()
        name = f"tensorferry-{os.getpid()}-{pair.peer}-{pair.epoch}-{secrets.token_hex(4)}"
        with _on_device(self.device.index):
            words = _Words(name, create=True)
        self._incoming[pair.peer] = (pair.epoch, words)
        return words

    # ------------------------------------------------------------------ sender
    def write(self, pair: Pair, sends: list[tuple[Message, dict]]) -> None:
        """Copies each message's tensors where the peer's post says, after the caller's
        earlier work and the receiver's ``READY``; then sets ``DONE``."""
        stream = pair.stream("send")
        # One page per epoch, and a step's posts are of one epoch: they all name it.
        words = self._outgoing_words(pair, sends[0][1]["w"])
        done = _Word(stream, words.device + _DONE)
        alive: set[int] = set()  # allocations this step found still there
        with _on_device(self.device.index):
            for message, post in sends:
                words.layouts.setdefault(post["x"], post)
                copies = self._copies(pair, message, post, alive)
                ticket = message.seq + 1
                done.after(message.caller_event)
                if words.ready() < ticket:  # (the usual: the receiver's stream set it already)
                    done.wait(words.device + _READY, ticket)
                for copy in copies:
                    done.copy(copy)
                done.owe(ticket)
                message.pending = words
            done.write()
        words.last_ticket = sends[-1][0].seq + 1

    def stage(self, pair: Pair, message: Message) -> None:
        pass  # a send's copies depend on where the receiver's post says its bytes go

    def posted(self, pair: Pair, message: Message) -> dict | None:
        """The post of ``message`` found in the ring of this epoch's page, if it is there."""
        kept = self._outgoing.get(pair.peer)
        return None if kept is None else kept[1].ring_read(message.seq)

    def _copies(self, pair: Pair, message: Message, post: dict, alive: set[int]) -> list[_Copy]:
        """The message's copies: this side's runs cut where the receiver's runs (``post``)
        end, made once per receiver layout and our addresses (``alive``: see
        :meth:`_Runs.current`)."""
        key = (pair.peer, post["x"], message.desc, _addresses(message.tensors))
        known = self._plans.get(key)
        if known is not None and known[1].current(alive):
            return known[0]
        runs = _Runs(_runs(message.tensors), 0, joined_only=True)
        targets = [(self._mapped_base(h) + offset, nbytes, h) for h, offset, nbytes in post["b"]]
        copies = _cut(runs.runs, targets)
        _bounded(self._plans)[key] = (copies, runs)
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
        with _on_device(self.device.index):
            words = _Words(name, create=False)
        self._outgoing[pair.peer] = (name, words)
        return words

    # ------------------------------------------------------------------ both
    def prepared(self, pair: Pair, kind: str) -> bool:
        """Whether the pair's stream of ``kind`` has room for another message (see
        :data:`_IN_FLIGHT`). Nothing is met over: a pair's first post carries all the sender
        needs."""
        kept = (self._incoming if kind == "recv" else self._outgoing).get(pair.peer)
        if kept is None:  # (its first message makes the page)
            return True
        words = kept[1]
        reached = words.ready() if kind == "recv" else words.done()
        return words.last_ticket - reached < _IN_FLIGHT

    def withdraw(self, pair: Pair, message: Message, post: dict) -> None:
        pass  # nothing of a post waits on the route: the receive ends by the m frame

    def finished(self, pair: Pair, message: Message) -> bool:
        return message.pending.done() >= message.seq + 1

    def order_stream(self, pair: Pair, message: Message, stream: Any) -> None:
        """Makes ``stream`` wait, on the device, for ``message``'s bytes."""
        with _on_device(self.device.index):
            _driver.wait_value32(
                stream.cuda_stream, message.pending.device + _DONE, message.seq + 1
            )

    def evict(self, pair: Pair, reason: str) -> None:
        """A fault or a lost peer: this pair's pages and copies go (a new epoch makes new
        pages; a peer started again numbers its layouts afresh). Other pairs keep theirs."""
        for key in [key for key in self._plans if key[0] == pair.peer]:
            del self._plans[key]
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
