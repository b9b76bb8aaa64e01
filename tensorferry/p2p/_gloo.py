"""The gloo transport: CPU tensors over TCP, one ``ProcessGroupGloo`` per pair of ranks.

Each pair's group is made directly on a per-pair ``PrefixStore`` of the world store (rank 0/1
within the pair), so only the two ranks take part — ``torch.distributed.new_group`` would be
collective over the whole world. It lives in the runtime's communicator cache under
``("gloo", lo, hi)``, shared by both directions.

Packing: gloo pays ~15–40 µs of fixed cost per message on loopback, so tensors smaller than
:data:`PACK_BELOW` of one message travel packed into one byte buffer (measured on the 2-core CI
machine: 64 × 4 KiB took 0.9–4.1 ms as separate gloo sends, 0.4–1.4 ms packed). Larger tensors
go alone (packing would add a copy for no gain).

Completion: a gloo send/recv ``Work`` only completes through ``wait()``, so a waiter thread per
pair and direction waits on each start's works in order and flags the pending handle (see
``_Waiter`` for why not one per pair).

Exit: nothing cuts such a wait short (neither the group's ``abort()`` nor its destruction ends
it; only its timeout does, or the peer closing the connection). A fault can leave one waiting
for a message the peer never sends. A waiter that comes out of torch's wait after the
interpreter began finalizing kills the process as it tries to take the GIL back ("terminate
called without an active exception", exit code -6), however cleanly the program ended. So at
exit, before finalizing, the process lets such waits end (see :func:`_wait_for_waiters`), and a
pair given up on (aborted, closed) waits no more than a moment for each of its later transfers.
An aborted pair's group is kept until ``tf.shutdown()``: dropped at once, it would close the
connection, and the peer's transfers on it would fail as if the peer were gone
(``PeerLostError``) before the fault's notice told it why.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import logging
import os
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from tensorferry.errors import PeerLostError, TransportError
from tensorferry.p2p._packing import as_bytes, pack, unpack, wire_plan
from tensorferry.p2p._transport import P2POp, PendingOps, Transport, cached_pair
from tensorferry.runtime import communicator_cache

__all__ = ["GlooTransport", "PACK_BELOW"]

log = logging.getLogger(__name__)

PACK_BELOW = 256 << 10
_TAG = 0
# Aborted pairs, kept referenced so that no daemon thread destroys a group at exit.
_graveyard: list[_GlooPair] = []
# Waiters whose thread runs (see the module docstring, "Exit"); guarded by _waiters_lock.
_waiters: set[_Waiter] = set()
_waiters_lock = threading.Lock()
_LOST_HINTS = ("Connection closed by peer", "Connection reset", "Broken pipe", "EOF")
# How long the waiter still waits for each work of a pair given up on (aborted, closed, or the
# process exiting): the ones done by then finish, the others fail (gloo's pending operations
# hold a work's buffer only weakly: dropping an unfinished work is safe).
_GIVEN_UP_WAIT = datetime.timedelta(milliseconds=1)
# How long an exiting process waits, at most, for a gloo wait still under way (see the module
# docstring, "Exit"). One that would go on longer is left: the peer is alive and keeps its side
# open, so it seldom ends in the moment the interpreter finalizes; a peer exiting too closes
# its side, which ends the wait at once, well within this.
_EXIT_WAIT_S = 10.0


class _GlooPending(PendingOps):
    def __init__(self, parts: int) -> None:
        self._left = parts
        self._error: BaseException | None = None
        self._lock = threading.Lock()

    def part_done(self, error: BaseException | None) -> None:
        with self._lock:
            self._left -= 1
            if error is not None and self._error is None:
                self._error = error

    def ready(self) -> bool:
        with self._lock:
            if self._error is not None:
                raise self._error
            return self._left <= 0

    def abort(self) -> None:
        pass  # the pair's group is aborted by evict(); the waiter thread then errors out


class _Waiter:
    """Waits on one direction's works of a pair, in the order they were started, and flags
    each start's pending handle.

    One per direction: a gloo send completes only once the peer posted the matching receive,
    and the peer's program may post it only after a receive of its own completed (two ranks
    that each send twice ahead, then receive one message at a time). Behind one waiter for
    both directions, that receive's completion would wait for the send, and each rank for the
    other. Within a direction, messages match in the order they were posted, so waiting in
    that order holds nothing up."""

    def __init__(self, pair: _GlooPair, direction: str) -> None:
        self.pair: _GlooPair | None = pair
        self.peer = pair.peer
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        # When the wait the waiter is in ends at the latest (monotonic seconds; 0: none).
        self.waits_until = 0.0
        self._thread = threading.Thread(
            target=self._wait_loop, name=f"tensorferry-gloo-{pair.peer}-{direction}", daemon=True
        )
        with _waiters_lock:
            _waiters.add(self)
        self._thread.start()

    def submit(self, works: list[Any], to_unpack: list[Any], pending: _GlooPending) -> None:
        self._jobs.put((works, to_unpack, pending))

    def _wait_loop(self) -> None:
        try:
            while True:
                job = self._jobs.get()
                if job is None:
                    return
                works, to_unpack, pending = job
                pending.part_done(self._wait_for(works, to_unpack))
        finally:
            with _waiters_lock:
                _waiters.discard(self)
            self.pair = None  # the pair holds its waiters: no cycle for the collector

    def _wait_for(self, works: list[Any], to_unpack: list[Any]) -> BaseException | None:
        """Waits for one start's works; returns the transfer's error, or ``None``."""
        try:
            for work in works:
                timeout = _GIVEN_UP_WAIT if self.pair.given_up else self.pair.timeout
                self.waits_until = time.monotonic() + timeout.total_seconds()
                work.wait(timeout)
            for packed, targets in to_unpack:
                unpack(packed, targets)
        except Exception as exc:
            text = str(exc)
            if any(hint in text for hint in _LOST_HINTS):
                return PeerLostError(f"gloo: rank {self.peer} is gone ({text.strip()})")
            return TransportError(f"gloo transfer with rank {self.peer} failed: {text}")
        finally:
            self.waits_until = 0.0
        return None

    def still_waiting(self) -> bool:
        return self._thread.is_alive() and self.waits_until > 0.0

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def stop(self) -> None:
        """Ends the waiter after the works already submitted."""
        self._jobs.put(None)

    def is_current(self) -> bool:
        return self._thread is threading.current_thread()


class _GlooPair:
    """One pair's process group and its two waiters (sends, receives)."""

    def __init__(self, pg: Any, other: int, peer: int, epoch: int, timeout: float) -> None:
        self.pg = pg
        self.other = other  # the peer's rank within the pair
        self.peer = peer
        self.epoch = epoch
        self.timeout = datetime.timedelta(seconds=timeout)
        self.given_up = False  # see _GIVEN_UP_WAIT
        self.waiters = {"send": _Waiter(self, "send"), "recv": _Waiter(self, "recv")}

    def submit_stop(self) -> None:
        """Gives up on the works not waited for yet (see ``_GIVEN_UP_WAIT``); the waiters end
        after them."""
        self.given_up = True
        for waiter in self.waiters.values():
            waiter.stop()

    def close(self) -> None:
        # Stop the waiters first and drop the group on this thread: a group destroyed by a
        # daemon thread while the interpreter exits aborts the process.
        self.submit_stop()
        for waiter in self.waiters.values():
            if not waiter.is_current():
                waiter.join(timeout=2.0)
        self.pg = None

    def abort(self) -> None:
        # Best effort: gloo's abort() unblocks pending waits on some versions; a wait still
        # stuck ends at the group's timeout, or when the peer's group goes. The pair waits in
        # the graveyard until ``GlooTransport.close`` drops it on a non-daemon thread (see
        # ``close`` and the module docstring, "Exit").
        pg = self.pg
        with contextlib.suppress(Exception):
            pg.abort()
        self.submit_stop()
        _graveyard.append(self)


class GlooTransport(Transport):
    """CPU tensors over gloo; the default for CPU tensors."""

    name = "gloo"
    device_type = "cpu"
    static_skips_headers = True  # an abandoned gloo receive fails, it never completes
    issues_per_peer = True  # each pair is its own process group
    issues_per_message = True  # each direction of a pair has its own waiter

    def estimate_seconds(self, *, peer: int, nbytes: int, num_tensors: int) -> float | None:
        return 50e-6 + nbytes / 2e9

    def prepare(self, peers: Sequence[int]) -> None:
        for peer in sorted(peers):
            self._pair(peer)

    def _key(self, peer: int) -> tuple[str, int, int]:
        return (self.name, *self.ctx.pair(peer))

    def _pair(self, peer: int) -> _GlooPair:
        key = self._key(peer)
        epoch = self.ctx.epoch_of(peer)

        def create() -> _GlooPair:
            import torch.distributed as dist

            if _connects_lazily():
                # Gloo then connects through its store later too: a store client of its own.
                making = contextlib.nullcontext(self.ctx.pair_store(peer, self.name, epoch))
            else:
                # Its process group holds on to the store but uses it only to connect, here.
                making = self.ctx.borrowed_pair_store(peer, self.name, epoch)
            with making as store:
                self.ctx.meet(store, peer, f"gloo: the pair with rank {peer}", epoch)
                me = self.ctx.rank_in_pair(peer)
                pg = dist.ProcessGroupGloo(store, me, 2, self.ctx.timeout)
            return _GlooPair(pg, 1 - me, peer, epoch, self.ctx.timeout.total_seconds())

        return cached_pair(key, epoch, create)

    def start(self, ops: Sequence[P2POp], *, stream: Any = None) -> PendingOps:
        # One part per peer and direction: each direction of a pair has its own waiter.
        by_part: dict[tuple[int, str], list[P2POp]] = {}
        for op in ops:
            by_part.setdefault((op.peer, op.kind), []).append(op)
        pairs = {}
        for peer, _ in by_part:
            pairs[peer] = communicator_cache().get(self._key(peer))
            if pairs[peer] is None:
                raise TransportError(f"gloo: the pair with rank {peer} is not prepared")
        pending = _GlooPending(len(by_part))
        for (peer, kind), part_ops in by_part.items():
            pair = pairs[peer]
            works, to_unpack = [], []
            for op in part_ops:
                packed_idx, alone_idx = wire_plan(op.tensors, pack_below=PACK_BELOW)
                buffers: list[torch.Tensor] = []
                if packed_idx:
                    small = [op.tensors[i] for i in packed_idx]
                    if op.kind == "send":
                        buffers.append(pack(small))
                    else:
                        total = sum(t.numel() * t.element_size() for t in small)
                        packed = torch.empty(total, dtype=torch.uint8)
                        buffers.append(packed)
                        to_unpack.append((packed, small))
                buffers.extend(as_bytes(op.tensors[i]) for i in alone_idx)
                if not buffers:
                    # Only empty tensors: a one-byte token still travels, so that the receive
                    # completes only once the send happened. On an agreed static channel no
                    # header does that (static_skips_headers), and a receive that completes
                    # alone would count as done even where a fault abandoned its send.
                    buffers.append(torch.zeros(1, dtype=torch.uint8))
                for buf in buffers:
                    if kind == "send":
                        works.append(pair.pg.send([buf], pair.other, _TAG))
                    else:
                        works.append(pair.pg.recv([buf], pair.other, _TAG))
            pair.waiters[kind].submit(works, to_unpack, pending)
        return pending

    def evict(self, peer: int, *, abort: bool, reason: str = "") -> None:
        communicator_cache().evict(self._key(peer), abort=abort, reason=reason)

    def close(self) -> None:
        while _graveyard:
            _graveyard.pop().close()
        cache = communicator_cache()
        for key in cache.keys():  # noqa: SIM118 (a cache, not a dict)
            if isinstance(key, tuple) and key[:1] == (self.name,) and self.ctx.rank in key[1:]:
                cache.evict(key, abort=False, reason="shutdown")


@atexit.register
def _wait_for_waiters() -> None:
    """At exit, before the interpreter finalizes: lets the gloo waits still under way end (see
    the module docstring, "Exit"), for up to ``_EXIT_WAIT_S``."""
    with _waiters_lock:
        waiters = list(_waiters)
    for pair in {waiter.pair for waiter in waiters}:  # each pair once (two waiters each)
        if pair is not None:  # None: that waiter ended meanwhile
            pair.submit_stop()
    for waiter in waiters:
        left = min(max(0.0, waiter.waits_until - time.monotonic()), _EXIT_WAIT_S)
        if waiter.still_waiting() and left > 1.0:
            log.warning(
                "tensorferry: before exiting, waiting up to %.0f s for a gloo transfer with rank "
                "%d to end: its peer has not done its part (a fault abandoned it, or it was left "
                "in flight at tf.shutdown())",
                left,
                waiter.peer,
            )
        waiter.join(left + 0.1)


def _connects_lazily() -> bool:
    """Whether torch's gloo connects a group's ranks on first use (``TORCH_GLOO_LAZY_INIT``)."""
    return os.environ.get("TORCH_GLOO_LAZY_INIT", "0").strip().lower() not in ("", "0", "false")
