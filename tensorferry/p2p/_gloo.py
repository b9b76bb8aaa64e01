"""The CPU route: CPU tensors over gloo, one ``ProcessGroupGloo`` per pair of ranks and epoch.

The receiver posts first (see :mod:`._pair`): its call posts gloo receives into its buffers
under the message's number as gloo's tag, and its post frame tells the sender its layout. The
sender compares, then sends into those receives; gloo's own notice that a receive is posted has
usually arrived by then, so the bytes leave at once. Where the layouts differ the sender writes
``m`` and answers each posted receive with an empty send: the receive ends with no byte written,
and gloo's books of the pair balance (the tag is never used again). Each pair's group is made
directly on a per-pair prefix of the world store (rank 0/1 within the pair), so only the two
ranks take part.

A message travels as its *head* (a status byte, then its tensors under :data:`PACK_BELOW` bytes
packed: gloo pays tens of microseconds per operation) and each larger tensor alone, with no
copy. The status byte tells a receive its sender's bytes (``_AGREED``) from a withdrawal (0).

Completion: a gloo send or receive ends only through its work's ``wait()``, which blocks.
``Transfer.wait`` waits in it on the caller's own thread, as ``torch.distributed``'s callers
do (an issued message needs nothing more of that thread), when its wait may last until the
transfer's deadline. Works nobody waits for that way (a shorter ``wait(timeout)``, whose caller
then waits for the waiter; a done-callback; ``done()`` polled; a send never waited for) go to
one of the pair's two waiter threads, one per direction.
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import datetime
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from tensorferry.errors import PeerLostError, TensorFerryError, TransferTimeoutError, TransportError
from tensorferry.p2p._links import first_line
from tensorferry.p2p._packing import as_bytes
from tensorferry.p2p._transport import TransportContext, cached_pair
from tensorferry.runtime import communicator_cache

if TYPE_CHECKING:
    from tensorferry.p2p._message import Message
    from tensorferry.p2p._pair import Pair

__all__ = ["GlooRoute", "PACK_BELOW"]

log = logging.getLogger(__name__)

PACK_BELOW = 256 << 10
# A message's head starts with a status byte: _AGREED when the sender's layout agreed, 0 when
# the post was withdrawn (the receiver sets it to 0 before posting).
_STATUS = 1
_AGREED = b"\x01"
_LOST_HINTS = ("Connection closed by peer", "Connection reset", "Broken pipe", "EOF")
# gloo's words for a wait that timed out: this work's, or another work's of the pair (gloo then
# closes the pair, and every wait on it fails).
_TIMEOUT_HINTS = ("Timed out waiting", "Application timeout caused pair closure")
_MAKING = "making"
# Works nobody claimed this long after their start go to the pair's waiter thread (a send
# nobody waits for still ends, and its message with it).
_UNCLAIMED_S = 0.002
# A caller whose works a waiter thread waits for looks up this often (seconds): a fault of the
# pair (another message's timeout, the peer's notice) ends its message while the works go on.
_HANDED_OFF_LOOK_S = 0.005
# Groups given up on (faults), the last few kept referenced: see _Group.abort. Older ones go
# (their connections close and their waits end), so faults again and again leak nothing.
_given_up: collections.deque = collections.deque(maxlen=4)
# Heads a pair keeps for reuse (a new one costs an allocation on every message): at most this
# many of one size (a loop of separate calls has as many in flight), of at most _HEAD_KEPT_MAX
# bytes each and _HEADS_KEPT_BYTES in all, the sizes used last kept first (messages of ever
# new sizes must not pile heads up).
_HEADS_KEPT = 64
_HEAD_KEPT_MAX = 1 << 20
_HEADS_KEPT_BYTES = 4 << 20


class _Works:
    """A message's gloo works on ``group``, waited for by one thread (its direction's waiter,
    or the caller of ``Transfer.wait``), which ``taken`` says is chosen; ``finished`` once
    they ended (its fields are set before it). The message's ``head`` goes back to the group
    once they ended; a receive's is first unpacked into its ``small`` tensors where its status
    byte says the layouts agreed, else the receive was ``withdrawn``."""

    __slots__ = (
        "claimed",
        "error",
        "finished",
        "group",
        "head",
        "keep",
        "peer",
        "receive",
        "small",
        "started",
        "taken",
        "withdrawn",
        "works",
    )

    def __init__(
        self,
        works: list,
        group: _Group,
        peer: int,
        *,
        head: torch.Tensor | None = None,
        receive: bool = False,
        small: Sequence[tuple[torch.Tensor, int]] = (),
        keep: Any = None,
    ) -> None:
        self.works, self.group, self.peer, self.head = works, group, peer, head
        self.receive, self.small, self.keep = receive, small, keep
        self.started = time.monotonic()
        self.claimed = threading.Lock()  # held by the one thread that waits for the works
        self.taken = False  # whether a thread was chosen to wait for them (under ``claimed``)
        self.finished = False
        self.withdrawn = False
        self.error: BaseException | None = None

    def run(self, until: float) -> None:
        """Waits for the works until monotonic ``until`` at the latest (then they fail), then
        lets go of ``claimed``, which the calling thread holds: a thread waiting to acquire it
        learns they ended."""
        try:
            if not self.finished:
                self._wait(until)
        finally:
            self.claimed.release()

    def _wait(self, until: float) -> None:
        try:
            for work in self.works:
                left = max(0.001, until - time.monotonic())
                work.wait(_timedelta(left))
            if self.receive:
                self._unpack()
        except Exception as exc:
            text = str(exc)
            if any(hint in text for hint in _LOST_HINTS):
                self.error = PeerLostError(f"gloo: rank {self.peer} is gone ({text.strip()})")
            elif time.monotonic() >= until or any(hint in text for hint in _TIMEOUT_HINTS):
                self.error = TransferTimeoutError(f"gloo: with rank {self.peer}: {text.strip()}")
            else:
                self.error = TransportError(f"gloo: transfer with rank {self.peer} failed: {text}")
        self.works = []  # dropped: a group given up on holds its buffers only weakly
        self.finished = True

    def _unpack(self) -> None:
        """A receive: copies the head's tensors out, unless the message was withdrawn."""
        at = self.head.data_ptr()
        self.withdrawn = ctypes.string_at(at, _STATUS) != _AGREED
        if self.withdrawn:
            return
        at += _STATUS
        for tensor, nbytes in self.small:
            ctypes.memmove(tensor.data_ptr(), at, nbytes)
            at += nbytes


class _Wire:
    """How a message travels (both sides derive it from the layout they agreed on): its head
    (the status byte, then the ``small`` tensors' bytes back to back) and its ``alone``
    tensors, as bytes."""

    __slots__ = ("alone", "head_bytes", "small")

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.small: list[tuple[torch.Tensor, int]] = []
        self.alone: list[torch.Tensor] = []
        self.head_bytes = _STATUS
        for tensor in tensors:
            nbytes = tensor.nbytes
            if nbytes >= PACK_BELOW:
                self.alone.append(as_bytes(tensor))
            elif nbytes:
                self.small.append((tensor, nbytes))
                self.head_bytes += nbytes


def _packed(group: _Group, message: Message) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A send's head (a head of ``group``'s, filled) and the buffers it goes as."""
    wire = _Wire(message.tensors)
    head = group.head(wire.head_bytes)
    at = head.data_ptr()
    ctypes.memmove(at, _AGREED, _STATUS)
    at += _STATUS
    for tensor, nbytes in wire.small:  # (contiguous CPU tensors: plain bytes)
        ctypes.memmove(at, tensor.data_ptr(), nbytes)
        at += nbytes
    return head, [head, *wire.alone]


def _gloo_calls(issue: Callable[[], list]) -> list:
    """``issue()``'s works; gloo's own errors as ``TransportError``, a connection it closed as
    ``PeerLostError`` (the pair then asks its link whether the peer is gone or faulted)."""
    try:
        return issue()
    except RuntimeError as exc:
        text = str(exc).strip()
        lost = any(hint in text for hint in _LOST_HINTS)
        raise (PeerLostError if lost else TransportError)(f"gloo: {text}") from None


def _tag(message: Message) -> int:
    """gloo's tag of ``message``: its number, so a receive answered by empty sends never meets
    a later message's bytes."""
    return message.seq & 0x7FFFFFFF


def _timedelta(seconds: float) -> datetime.timedelta:
    """``seconds`` as gloo's timeout, rounded up to its whole milliseconds: rounded down, gloo's
    wait would time out just before the transfer's deadline, which is then not yet passed."""
    return datetime.timedelta(milliseconds=math.ceil(seconds * 1000))


class _Group:
    """A pair's process group for one epoch, and its waiter threads (one per direction). Kept
    in the runtime's communicator cache under ``("gloo", lo, hi)``."""

    def __init__(self, pg: Any, other: int, epoch: int) -> None:
        self.pg, self.other, self.epoch = pg, other, epoch
        self._waiters: dict[str, queue.SimpleQueue] = {}
        # Heads given back, by size, the size given back last at the end (under the pair's lock)
        self._heads: dict[int, list[torch.Tensor]] = {}
        self._heads_bytes = 0

    def head(self, nbytes: int) -> torch.Tensor:
        """A message's head of ``nbytes`` bytes: one a finished message gave back, or new."""
        free = self._heads.get(nbytes)
        if free is None:
            return torch.empty(nbytes, dtype=torch.uint8)
        if len(free) == 1:  # (no size is kept with no head: the oldest is always one to drop)
            del self._heads[nbytes]
        self._heads_bytes -= nbytes
        return free.pop()

    def give_back(self, head: torch.Tensor) -> None:
        """``head``'s message ended and gloo is done with it: a later message may use it."""
        nbytes = head.numel()
        if nbytes > _HEAD_KEPT_MAX:
            return
        free = self._heads.pop(nbytes, [])
        self._heads[nbytes] = free  # (now the last: the size used last)
        if len(free) >= _HEADS_KEPT:
            return
        free.append(head)
        self._heads_bytes += nbytes
        while self._heads_bytes > _HEADS_KEPT_BYTES:  # the sizes used longest ago go first
            size, oldest = next(iter(self._heads.items()))
            oldest.pop()
            self._heads_bytes -= size
            if not oldest:
                del self._heads[size]

    def abort(self) -> None:
        """A fault: its waiters end after the works they hold (gloo cannot cut a wait short;
        each ends by its deadline, or when the group goes). The group is kept a while (the
        last few faults'): dropped at once, it would close its connection, and the peer's
        transfers on it could fail as if this rank were gone before the fault's notice told it
        why."""
        self.stop()
        _given_up.append(self)

    def close(self) -> None:
        self.stop()

    def waiter(self, kind: str) -> queue.SimpleQueue:
        jobs = self._waiters.get(kind)
        if jobs is None:
            jobs = self._waiters[kind] = queue.SimpleQueue()
            thread = threading.Thread(
                target=_wait_loop, args=(jobs,), name=f"tensorferry-gloo-{kind}"
            )
            thread.daemon = True
            thread.start()
        return jobs

    def stop(self) -> None:
        for jobs in self._waiters.values():
            jobs.put(None)


# Waits under way (their end, monotonic): a waiter that comes out of gloo's wait after the
# interpreter began finalizing kills the process ("terminate called without an active
# exception"), so an exiting process lets them end first, for up to _EXIT_WAIT_S.
_waiting: dict[int, float] = {}
_EXIT_WAIT_S = 10.0


def _wait_loop(jobs: queue.SimpleQueue) -> None:
    me = threading.get_ident()
    while True:
        job = jobs.get()
        if job is None:
            return
        works, until = job
        _waiting[me] = until
        try:
            works.run(until)
        finally:
            _waiting.pop(me, None)


@atexit.register
def _let_waits_end() -> None:
    if not _waiting:
        return
    log.warning(
        "tensorferry: %d gloo transfer(s) still under way at exit; waiting up to %.0f s for "
        "them to end (a gloo wait cut short by the exit would abort the process)",
        len(_waiting),
        _EXIT_WAIT_S,
    )
    end = time.monotonic() + _EXIT_WAIT_S
    while _waiting and time.monotonic() < end:
        time.sleep(0.05)


class GlooRoute:
    """CPU tensors between any two ranks; see the module docstring.

    Thread-safety: calls for one pair come under its lock; the group table has its own.
    """

    name = "gloo"
    receiver_posts = True
    one_sided = False  # posts come as frames; completion is gloo's
    confirms_receives = False

    def __init__(self, ctx: TransportContext) -> None:
        self.ctx = ctx
        self._lock = threading.Lock()
        self._groups: dict[int, tuple[int, Any]] = {}  # peer -> (epoch, _Group | making | error)

    # ------------------------------------------------------------------ the pair's group
    def prepared(self, pair: Pair, kind: str) -> bool:
        """Whether the pair's group exists for its epoch; starts making it if not (on a thread
        of its own: it is a rendezvous, and the peer may not have called yet).

        Raises:
            TensorFerryError: making it failed (a fault of the pair).
        """
        if self._made_group(pair) is not None:  # (the usual answer, without the table's lock)
            return True
        epoch = pair.epoch
        with self._lock:
            made = self._groups.get(pair.peer)
            if made is not None and made[0] == epoch:
                if isinstance(made[1], _Group):
                    return True
                if made[1] == _MAKING:
                    return False
                del self._groups[pair.peer]
                raise made[1]
            cached = communicator_cache().get(self._key(pair.peer))
            if isinstance(cached, _Group) and cached.epoch == epoch:  # made by tf.prepare
                self._groups[pair.peer] = (epoch, cached)
                return True
            self._groups[pair.peer] = (epoch, _MAKING)
        self.ctx.start_making(
            self._make_in_background, pair.peer, epoch, name="tensorferry-gloo-pair"
        )
        return False

    def prepare(self, pair: Pair) -> None:
        """Makes the pair's group now (``tf.prepare``): a rendezvous with the peer."""
        epoch = pair.epoch
        with self._lock:
            if self._made_group(pair) is not None:
                return
            self._groups[pair.peer] = (epoch, _MAKING)
        self._make_in_background(pair.peer, epoch)
        with self._lock:
            made = self._groups.get(pair.peer)
            if made is not None and isinstance(made[1], BaseException):
                # The caller hears of it; the pair's next message tries afresh (kept, the error
                # failed that message too, and with it the peer's, as a fault of the pair).
                del self._groups[pair.peer]
                raise made[1]

    def _make_in_background(self, peer: int, epoch: int) -> None:
        try:
            outcome: Any = self._make(peer, epoch)
        except TensorFerryError as exc:
            outcome = exc
        except Exception as exc:
            text = first_line(exc)
            lost = any(hint in text for hint in (*_LOST_HINTS, "Connection was likely closed"))
            cls = PeerLostError if lost else TransportError
            outcome = cls(f"gloo: making the pair with rank {peer} failed: {text}")
        with self._lock:
            made = self._groups.get(peer)
            if made is not None and made[0] == epoch and made[1] == _MAKING:
                self._groups[peer] = (epoch, outcome)
                return

    def _make(self, peer: int, epoch: int) -> _Group:
        def create() -> _Group:
            import torch.distributed as dist

            with self.ctx.borrowed_pair_store(peer, self.name, epoch) as store:
                self.ctx.meet(store, peer, f"gloo: the pair with rank {peer}", epoch)
                me = self.ctx.rank_in_pair(peer)
                pg = dist.ProcessGroupGloo(store, me, 2, self.ctx.timeout)
            return _Group(pg, 1 - me, epoch)

        return cached_pair(self._key(peer), epoch, create)

    def _key(self, peer: int) -> tuple[str, int, int]:
        return (self.name, *self.ctx.pair(peer))

    def _made_group(self, pair: Pair) -> _Group | None:
        """The pair's group of its epoch, if it is made (a read of the table: no lock)."""
        made = self._groups.get(pair.peer)
        if made is None or made[0] != pair.epoch or type(made[1]) is not _Group:
            return None
        return made[1]

    def _group(self, pair: Pair) -> _Group:
        group = self._made_group(pair)
        if group is None:
            raise TransportError(f"gloo: the pair with rank {pair.peer} is not made")
        return group

    # ------------------------------------------------------------------ messages
    def post(self, pair: Pair, messages: list[Message]) -> None:
        """Writes ``messages``' post frames (each its layout, and how many receives to answer)
        in one write, then posts each one's receives: its head, then each large tensor alone
        (see the module docstring). The frames go first: they are what the sender waits for,
        and a send that comes before its receive is posted waits in gloo."""
        group = self._group(pair)
        wires = [_Wire(message.tensors) for message in messages]
        pair.send_posts(
            [(m, {"g": 1 + len(w.alone)}) for m, w in zip(messages, wires, strict=True)]
        )
        for message, wire in zip(messages, wires, strict=True):
            head = group.head(wire.head_bytes)
            ctypes.memset(head.data_ptr(), 0, _STATUS)  # a withdrawn message leaves it so
            buffers = [head, *wire.alone]
            recv = group.pg.recv
            self._issue(message, group, recv, buffers, head, receive=True, small=wire.small)

    def posted(self, pair: Pair, message: Message) -> None:
        return None  # posts come as frames only

    def stage(self, pair: Pair, message: Message) -> None:
        """Packs a send at its call, where the pair's group is made: its head (the status
        byte saying the layouts agreed, then the small tensors back to back) and its large
        tensors. Once the receiver's post comes, only gloo's send is left to do: the sender
        waits for that post anyway, and the packing is off the message's way."""
        group = self._made_group(pair)
        if group is not None:
            message.staged = _packed(group, message)

    def write(self, pair: Pair, sends: list[tuple[Message, dict]]) -> None:
        """Sends each message into the receives the peer posted (its post): its head, then
        each large tensor (packed at the call where :meth:`stage` could)."""
        group = self._group(pair)
        for message, _ in sends:
            staged, message.staged = message.staged, None
            head, buffers = staged if staged is not None else _packed(group, message)
            self._issue(message, group, group.pg.send, buffers, head, keep=buffers)

    def _issue(
        self,
        message: Message,
        group: _Group,
        move: Callable,
        buffers: list,
        head: torch.Tensor,
        **fields: Any,
    ) -> None:
        """``move`` (the group's send or receive) of each of ``buffers`` (``head`` first) under
        ``message``'s tag; their works become the message's, not taken until a thread waits
        for them."""
        tag = _tag(message)
        works = _gloo_calls(lambda: [move([b], group.other, tag) for b in buffers])
        message.pending = _Works(works, group, message.peer, head=head, **fields)

    def withdraw(self, pair: Pair, message: Message, post: dict) -> None:
        """The layouts differ: answers each receive the peer posted with an empty send, which
        ends it without a byte written (its head's status byte stays 0), so gloo's books of
        the pair balance. Nobody waits for these on the caller's thread."""
        group = self._group(pair)
        empty = torch.empty(0, dtype=torch.uint8)
        tag, count = _tag(message), int(post.get("g", 1))
        send = group.pg.send
        works = _gloo_calls(lambda: [send([empty], group.other, tag) for _ in range(count)])
        drains = _Works(works, group, pair.peer, keep=empty)
        drains.claimed.acquire()  # (the waiter lets go of it)
        drains.taken = True
        group.waiter("send").put((drains, time.monotonic() + self.ctx.timeout.total_seconds()))

    def finished(self, pair: Pair, message: Message) -> bool:
        """Whether ``message``'s works ended. A withdrawn receive ends once the sender's
        ``m`` frame (written before its empty sends) gave it its error.

        Raises:
            TensorFerryError: the works failed.
        """
        works: _Works = message.pending
        if works.finished:
            if works.error is not None:
                raise works.error
            if works.head is not None:  # gloo is done with it (it failed: maybe not)
                head, works.head = works.head, None
                works.group.give_back(head)
            return not works.withdrawn or message.error is not None
        if not works.taken and time.monotonic() > works.started + _UNCLAIMED_S:
            self.hand_off(message, message.transfer.deadline)  # nobody waits in it: a thread
        return False

    def block(self, message: Message, limit: float, deadline: float) -> bool:
        """Waits on this thread until ``message``'s works ended, or until monotonic ``limit``;
        returns whether it waited. An issued message needs nothing more of this thread: a
        send goes into receives the peer posted already, a receive ends by the peer's send
        (or its empty sends, when the layouts differ).

        This thread waits in gloo's own wait when the wait may last until the transfer's
        ``deadline`` (gloo's wait cannot end early without failing the pair's group); for a
        shorter ``limit`` a waiter thread waits in gloo and this one waits for that thread, a
        few milliseconds at a time (the caller looks whether a fault ended the message)."""
        works: _Works = message.pending
        if works.finished:
            return False
        if limit >= deadline and works.claimed.acquire(blocking=False):
            works.taken = True
            works.run(deadline)
            return True
        self.hand_off(message, deadline)
        left = min(limit, deadline) - time.monotonic()
        if left > 0 and works.claimed.acquire(timeout=min(left, _HANDED_OFF_LOOK_S)):
            works.claimed.release()
        return True

    def hand_off(self, message: Message, until: float) -> None:
        """Has the pair's waiter for ``message``'s direction wait for its works (nobody waits
        in them here: a done-callback, ``done()`` polled, a short ``wait``, a send nobody
        waits for)."""
        works: _Works = message.pending
        if works.finished or not works.claimed.acquire(blocking=False):
            return
        if works.taken:  # (a wait on this thread ended them meanwhile)
            works.claimed.release()
            return
        works.taken = True
        works.group.waiter(message.kind).put((works, until))

    def order_stream(self, pair: Pair, message: Message, stream: Any) -> None:
        pass  # CPU tensors: nothing to order on a device

    def evict(self, pair: Pair, reason: str) -> None:
        with self._lock:
            self._groups.pop(pair.peer, None)
        communicator_cache().evict(self._key(pair.peer), abort=True, reason=reason)

    def close(self) -> None:
        with self._lock:
            peers = list(self._groups)
            self._groups.clear()
        for peer in peers:
            communicator_cache().evict(self._key(peer), abort=False, reason="shutdown")
        _given_up.clear()
