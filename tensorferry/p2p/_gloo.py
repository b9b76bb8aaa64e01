"""The CPU route: CPU tensors over gloo, one ``ProcessGroupGloo`` per pair of ranks and epoch.

Two-sided (see :mod:`._pair`): the sender's call issues its gloo send at once; the receiver
issues its receive once the sender's header matched (or, after a mismatch, into scratch).
Each pair's group is made directly on a per-pair prefix of the world store (rank 0/1 within
the pair), so only the two ranks take part.

Completion: a gloo send or receive ends only through its work's ``wait()``, which blocks.
``Transfer.wait`` waits in it on the caller's own thread, as ``torch.distributed``'s callers
do, where that holds up nothing: a receive at once (its bytes come from a send the peer issued
already), a send once the peer answered its header (the peer posts its receive right then).
Works nobody waits for that way (a done-callback, ``done()`` polled, a send never waited for)
go to one of the pair's two waiter threads, one per direction.

Packing: gloo pays tens of microseconds per operation, so the small tensors of a message travel
packed into one byte buffer; large ones go alone, with no copy.
"""

from __future__ import annotations

import atexit
import collections
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from tensorferry.errors import PeerLostError, TensorFerryError, TransferTimeoutError, TransportError
from tensorferry.p2p._packing import as_bytes, pack, unpack, wire_plan
from tensorferry.p2p._transport import TransportContext, cached_pair
from tensorferry.p2p._two_sided import scratch_for
from tensorferry.runtime import communicator_cache

if TYPE_CHECKING:
    from tensorferry.p2p._message import Message
    from tensorferry.p2p._pair import Pair

__all__ = ["GlooRoute", "PACK_BELOW"]

log = logging.getLogger(__name__)

PACK_BELOW = 256 << 10
_TAG = 0  # messages of a direction are issued in number order: gloo matches them in order
_LOST_HINTS = ("Connection closed by peer", "Connection reset", "Broken pipe", "EOF")
_MAKING = "making"
# Works nobody claimed this long after their start go to the pair's waiter thread (a send
# nobody waits for still ends, and its message with it).
_UNCLAIMED_S = 0.002
# Groups given up on (faults), the last few kept referenced: see _Group.abort. Older ones go
# (their connections close and their waits end), so faults again and again leak nothing.
_given_up: collections.deque = collections.deque(maxlen=4)


class _Works:
    """A message's gloo works, waited for by one thread (its direction's waiter, or the caller
    of ``Transfer.wait``); ``finished`` once they ended (its fields are set before it)."""

    __slots__ = ("claimed", "error", "finished", "keep", "peer", "started", "to_unpack", "works")

    def __init__(self, works: list, to_unpack: list, keep: Any, peer: int) -> None:
        self.works, self.to_unpack, self.keep, self.peer = works, to_unpack, keep, peer
        self.started = time.monotonic()
        self.claimed = threading.Lock()  # held by the one thread that waits for the works
        self.finished = False
        self.error: BaseException | None = None

    def wait(self, until: float) -> None:
        """Waits for the works until monotonic ``until`` at the latest (then they fail)."""
        try:
            for work in self.works:
                left = max(0.001, until - time.monotonic())
                work.wait(_timedelta(left))
            for packed, targets in self.to_unpack:
                unpack(packed, targets)
        except Exception as exc:
            text = str(exc)
            if any(hint in text for hint in _LOST_HINTS):
                self.error = PeerLostError(f"gloo: rank {self.peer} is gone ({text.strip()})")
            elif time.monotonic() >= until:
                self.error = TransferTimeoutError(f"gloo: with rank {self.peer}: {text.strip()}")
            else:
                self.error = TransportError(f"gloo: transfer with rank {self.peer} failed: {text}")
        self.works = []  # dropped: a group given up on holds its buffers only weakly
        self.finished = True


def _timedelta(seconds: float) -> Any:
    import datetime

    return datetime.timedelta(seconds=seconds)


class _Group:
    """A pair's process group for one epoch, and its waiter threads (one per direction). Kept
    in the runtime's communicator cache under ``("gloo", lo, hi)``."""

    def __init__(self, pg: Any, other: int, epoch: int) -> None:
        self.pg, self.other, self.epoch = pg, other, epoch
        self._waiters: dict[str, queue.SimpleQueue] = {}
        self.given_up = False

    def abort(self) -> None:
        """A fault: its waiters end after the works they hold (gloo cannot cut a wait short;
        each ends by its deadline, or when the group goes). The group is kept a while (the
        last few faults'): dropped at once, it would close its connection, and the peer's
        transfers on it could fail as if this rank were gone before the fault's notice told it
        why."""
        self.given_up = True
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
            works.wait(until)
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
    one_sided = False
    confirms_receives = False  # a gloo receive given up on fails; it never ends as done

    def __init__(self, ctx: TransportContext) -> None:
        self.ctx = ctx
        self._lock = threading.Lock()
        self._groups: dict[int, tuple[int, Any]] = {}  # peer -> (epoch, _Group | making | error)
        self._groups_of: dict[int, _Group] = {}  # unclaimed receives' works -> their group

    # ------------------------------------------------------------------ the pair's group
    def prepared(self, pair: Pair, kind: str) -> bool:
        """Whether the pair's group exists for its epoch; starts making it if not (on a thread
        of its own: it is a rendezvous, and the peer may not have called yet).

        Raises:
            TensorFerryError: making it failed (a fault of the pair).
        """
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
        thread = threading.Thread(
            target=self._make_in_background, args=(pair.peer, epoch), name="tensorferry-gloo-pair"
        )
        thread.daemon = True
        thread.start()
        return False

    def prepare(self, pair: Pair) -> None:
        """Makes the pair's group now (``tf.prepare``): a rendezvous with the peer."""
        epoch = pair.epoch
        with self._lock:
            made = self._groups.get(pair.peer)
            if made is not None and made[0] == epoch and isinstance(made[1], _Group):
                return
            self._groups[pair.peer] = (epoch, _MAKING)
        self._make_in_background(pair.peer, epoch)
        with self._lock:
            made = self._groups.get(pair.peer)
        if made is not None and isinstance(made[1], BaseException):
            raise made[1]

    def _make_in_background(self, peer: int, epoch: int) -> None:
        try:
            outcome: Any = self._make(peer, epoch)
        except TensorFerryError as exc:
            outcome = exc
        except Exception as exc:
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
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

    def _group(self, pair: Pair) -> _Group:
        made = self._groups.get(pair.peer)
        if made is None or made[0] != pair.epoch or not isinstance(made[1], _Group):
            raise TransportError(f"gloo: the pair with rank {pair.peer} is not made")
        return made[1]

    # ------------------------------------------------------------------ messages
    def start(self, pair: Pair, message: Message, *, into: Any = None) -> None:
        group = self._group(pair)
        tensors = message.tensors if into is None else scratch_for(into, torch.device("cpu"))
        packed_idx, alone_idx = wire_plan(tensors, pack_below=PACK_BELOW)
        sending = message.kind == "send"
        buffers: list[torch.Tensor] = []
        to_unpack = []
        if packed_idx:
            small = [tensors[i] for i in packed_idx]
            if sending:
                buffers.append(pack(small))
            else:
                total = sum(t.numel() * t.element_size() for t in small)
                buffers.append(torch.empty(total, dtype=torch.uint8))
                to_unpack.append((buffers[-1], small))
        buffers.extend(as_bytes(tensors[i]) for i in alone_idx)
        if not buffers:  # only empty tensors: a token still travels, so the receive waits
            buffers.append(torch.zeros(1, dtype=torch.uint8))
        move = group.pg.send if sending else group.pg.recv
        works = _Works(
            [move([buf], group.other, _TAG) for buf in buffers],
            to_unpack,
            (tensors, buffers),
            pair.peer,
        )
        message.pending = works
        self._groups_of[id(works)] = group  # until a thread claims the wait for them

    def finished(self, pair: Pair, message: Message) -> bool:
        works: _Works = message.pending
        if works.finished:
            if works.error is not None:
                raise works.error
            return True
        if id(works) in self._groups_of and time.monotonic() > works.started + _UNCLAIMED_S:
            self.hand_off(message, message.transfer.deadline)  # nobody waits in it: a thread
        return False

    def block(self, message: Message, until: float) -> bool:
        """Waits on this thread for ``message``'s works, until monotonic ``until`` at the
        latest, where that can hold up nothing; returns whether it did.

        A receive's bytes come from a send the peer issued already. A send ends once the peer
        posted its receive, which it does right after it answered our header: so a send is
        waited for here only once that answer came (before, this thread may be what reads a
        header the peer's progress needs)."""
        works: _Works = message.pending
        if message.kind == "send" and not message.answered:
            return False
        if works.finished or not works.claimed.acquire(blocking=False):
            return False
        self._groups_of.pop(id(works), None)
        works.wait(until)
        return True

    def hand_off(self, message: Message, until: float) -> None:
        """Has the pair's waiter for ``message``'s direction wait for its works (nobody waits
        in them here: a done-callback, ``done()`` polled, a short ``wait``, a send nobody
        waits for)."""
        works: _Works = message.pending
        if works.finished or not works.claimed.acquire(blocking=False):
            return
        group = self._groups_of.pop(id(works), None)
        if group is not None:
            group.waiter(message.kind).put((works, until))
        else:
            works.claimed.release()

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
