"""The transport contract: how the p2p layer hands a group of sends/receives to something
that moves bytes (NCCL, gloo, the NVLink copy kernels, the copy engine).

The p2p layer (``tensorferry.p2p``) owns everything above the wire: argument validation,
header exchange (count/shape/dtype agreement between both sides), per-peer FIFO order, stream
ordering with the caller, timeouts, fault handling and :class:`~tensorferry.p2p.Transfer`
handles. A transport only moves bytes for messages both sides have already agreed on.

Vocabulary
==========
- *rank*: a process's global rank; ``ctx.rank`` is ours, peers are other global ranks.
- *message*: one :class:`P2POp` — one or more tensors sent to (or received from) one peer in one
  call. Messages between two ranks are matched in FIFO order per direction: the k-th send
  message from A to B meets B's k-th receive message from A. The layer verified, before calling
  :meth:`Transport.start`, that both sides agree on the count, shapes and dtypes (and on which
  transport carries the message), so a transport may rely on sizes matching exactly.
- *pair*: two ranks; a transport keeps its per-pair resources (a communicator, staging buffers)
  in :func:`tensorferry.runtime.communicator_cache` under a key such as ``(name, lo, hi)``,
  shared by both directions — or one per direction, where a shared one would order the two
  directions' messages against each other (NCCL: see :mod:`._nccl`).
- *epoch*: the layer's count of faults on a pair. After a fault both sides move to the next epoch
  and each transport is told to :meth:`~Transport.evict` the pair; resources made afterwards must
  rendezvous under the new epoch — use :meth:`TransportContext.pair_store`, which already
  includes it, for every store key of a pair.

The call sequence
=================
A transport carries the messages of a two-sided route (:mod:`._two_sided`). For each message
the layer, under its pair's lock (on the caller's thread, or a thread driving the pair):

1. picks the transport: the one named by the caller; ``"auto"`` picks ``ce`` between GPUs of
   one host, ``nccl`` between hosts and ``gloo`` for CPU tensors, never ``nvlink``;
2. calls :meth:`Transport.unsupported_reason` on the caller's thread, before anything moves — a
   non-``None`` reason becomes a ``ValueError`` for the caller;
3. once per direction, pair and epoch, calls :meth:`Transport.prepare_direction` with that peer
   on a thread of its own (preparing is a rendezvous with the peer, who may not have called
   yet). ``tf.prepare(peers)`` calls :meth:`Transport.prepare` eagerly;
4. issues a send at once, and a receive once the sender's header agreed (or, after a
   mismatch, into scratch of the sender's layout): :meth:`Transport.start` with the one
   message, for CUDA on the pair's stream for its direction, which already waits for the
   caller's work;
5. polls :meth:`PendingOps.ready` when it looks for progress; a receive ends only once its
   sender also said that it sent (an aborted NCCL receive can end without its bytes). On a
   fault it calls :meth:`Transport.evict` with ``abort=True``.

Rules a transport keeps
=======================
- :meth:`Transport.start` must not block on the peer (no rendezvous, no host waits for device
  work); it enqueues work and returns. It is only ever called under the layer's engine lock
  (from the caller's thread or the layer's own), one call at a time, so it need not be
  re-entrant; :meth:`PendingOps.ready` and :meth:`PendingOps.abort` are
  called from other threads (the completion pool) and must be thread-safe with respect to it.
- Stream ordering (CUDA): device work issued by ``start`` runs after every piece of work queued
  on ``stream`` before the call (the layer already made ``stream`` wait for the caller's current
  stream). Work queued on ``stream`` after ``start`` returns must run only after the ops finished
  (a transport with internal streams makes ``stream`` wait on them before returning). The layer
  records its completion event on ``stream`` right after ``start``.
- Messages to one peer in one direction go on the wire in the order given; a transport may pack
  several tensors of a message into one buffer, coalesce all messages of a ``start`` call into one
  group call, or split large ones, as long as the receiver sees the same bytes.
- The caller keeps every tensor alive until the pending ops are ready or aborted; a transport
  need not ``record_stream`` them for that reason (it must for its own internal streams).
- Errors: ``ready()`` raises :class:`~tensorferry.PeerLostError` when the peer is gone,
  :class:`~tensorferry.TransportError` for other failures; it never blocks.
- Thread-safety of ``prepare``/``evict``/``close``: may run concurrently with ``start`` for
  *other* peers; keep per-pair state in the communicator cache (single-flight) or under a lock.

The transports
==============
``nccl`` (:mod:`._nccl`) and ``nvlink`` (:mod:`tensorferry.p2p.nvlink.transport`); the layer
makes each once per process, when a message first names it (``_context.TWO_SIDED``).
"""

from __future__ import annotations

import abc
import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, ClassVar, Literal

import torch

from tensorferry.errors import TensorFerryError, TransferTimeoutError, TransportError
from tensorferry.p2p import _agreement as agreement
from tensorferry.runtime import communicator_cache, completion_pool

# Store clients kept for later pairs' makings (a process rarely makes more at once).
_IDLE_CLIENTS = 4
# A transport's call that only launches work on a connected pair may keep the GIL while fewer
# transfers than this wait to finish (see few_in_flight).
HOLD_GIL_BELOW = 128

__all__ = [
    "P2POp",
    "PendingOps",
    "StaleEpochError",
    "cached_pair",
    "few_in_flight",
    "HOLD_GIL_BELOW",
    "Transport",
    "TransportContext",
]


def few_in_flight() -> bool:
    """Whether so few transfers of this process wait to finish (``HOLD_GIL_BELOW``) that a
    launch finds room in the device's queue (about a thousand launches) and cannot wait there
    for a peer. A transport's call that only launches work on a pair already connected may then
    keep the GIL through it: let go, another of the process's threads (the completion pool's
    poller, in a burst of sends) takes it meanwhile, and the caller waits for that thread to let
    go again, tens of microseconds a call. With more in flight, such a call lets go of the GIL,
    so that the library's other threads (a dead peer's notice, a timeout) still run should it
    block. A thread of the user's own that launches onto a full queue holds the GIL as it
    waits: torch's launches keep it."""
    return completion_pool().waiting_hint() < HOLD_GIL_BELOW


@dataclass(frozen=True, slots=True)
class P2POp:
    """One message: tensors sent to, or received into, one peer.

    Attributes:
        kind: ``"send"`` or ``"recv"``.
        peer: the other side's global rank (never our own).
        tensors: contiguous tensors on the transport's device; for ``"recv"`` they are written.
            Their shapes and dtypes equal the peer's, in order (verified by the layer).
        layout: the tensors' ``(dtype name, shape)`` descriptor when the layer made it (equal
            on both sides), else ``None``; transports may key per-layout caches on it.
    """

    kind: Literal["send", "recv"]
    peer: int
    tensors: tuple[torch.Tensor, ...]
    layout: Any = None

    @property
    def nbytes(self) -> int:
        """Bytes of the whole message."""
        return sum(t.numel() * t.element_size() for t in self.tensors)


@dataclass(slots=True)
class TransportContext:
    """What a transport knows about its process, given to its factory.

    Attributes:
        rank: this process's global rank.
        world_size: number of ranks.
        device: this process's device (``cuda:N`` or ``cpu``).
        store: the world's key-value store, already prefixed for tensorferry.
        timeout: bound for any rendezvous (store waits, communicator creation).
        epoch_of: the current epoch of the pair with a peer (see the module docstring).
        stopping: set by ``tf.shutdown()``: a rendezvous still waiting for its peer gives up
            (see :meth:`meet`), and :meth:`end_makings` waits for the threads making pairs.
    """

    rank: int
    world_size: int
    device: torch.device
    store: Any
    timeout: timedelta
    epoch_of: Callable[[int], int] = field(default=lambda peer: 0)
    stopping: threading.Event = field(default_factory=threading.Event)
    _idle_clients: list = field(default_factory=list, init=False, repr=False)
    """Store clients that finished a pair's making cleanly, for the next (borrowed_pair_store)."""
    _keeping_clients: bool = field(default=True, init=False, repr=False)
    """False once :meth:`drop_store_clients` ran (``tf.shutdown``)."""
    _clients_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    _makings: set = field(default_factory=set, init=False, repr=False)
    """Threads making a pair's resources (:meth:`start_making`), while they run."""
    _makings_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def start_making(self, make: Callable[..., Any], *args: Any, name: str) -> None:
        """Runs ``make(*args)`` on a thread of its own: a rendezvous with a peer that may not
        have called yet. :meth:`end_makings` waits for it."""
        thread = threading.Thread(target=self._making, args=(make, args), name=name)
        thread.daemon = True
        with self._makings_lock:
            self._makings.add(thread)
        thread.start()

    def _making(self, make: Callable[..., Any], args: tuple) -> None:
        try:
            make(*args)
        finally:
            with self._makings_lock:
                self._makings.discard(threading.current_thread())

    def end_makings(self, timeout_s: float) -> None:
        """``tf.shutdown()``, once ``stopping`` is set: waits up to ``timeout_s`` for the
        threads still making pairs, which then leave their rendezvous within milliseconds. A
        process that exited while one was inside a store call aborted ("terminate called
        without an active exception", exit code -6)."""
        deadline = time.monotonic() + timeout_s
        with self._makings_lock:
            threads = list(self._makings)
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def pair(self, peer: int) -> tuple[int, int]:
        """``(lo, hi)``: the pair's ranks in ascending order."""
        return (min(self.rank, peer), max(self.rank, peer))

    def rank_in_pair(self, peer: int) -> int:
        """0 for the lower rank of the pair, 1 for the higher."""
        return 0 if self.rank < peer else 1

    def pair_store(self, peer: int, purpose: str, epoch: int | None = None) -> Any:
        """A store private to this pair, ``epoch`` (default: its current one) and ``purpose``
        (e.g. the transport name). Both ranks of the pair get the same prefix; no other rank
        uses it. A making for one epoch names it: the pair may have moved on since the making
        began, and a store of the next epoch would let it meet that epoch's making.

        It is a fresh client connection where the store supports ``clone()``: a blocking wait
        on one pair's rendezvous must not hold up another pair's (TCPStore clients serialise
        their requests, so a shared client could deadlock rendezvous around a ring).
        """
        import torch.distributed as dist

        base = self.store.clone() if hasattr(self.store, "clone") else self.store
        return dist.PrefixStore(self._pair_prefix(peer, purpose, epoch), base)

    @contextlib.contextmanager
    def borrowed_pair_store(self, peer: int, purpose: str, epoch: int | None = None) -> Any:
        """:meth:`pair_store` for a making that uses its store only while it runs (this block):
        its client connection is lent to this making alone and, when the block ends without an
        error, kept for the next one rather than closed. For what keeps using its store after
        the making (``ProcessGroupNCCL``, symmetric memory), take :meth:`pair_store`. Gloo's
        pairs borrow; NCCL's communicators could too (they need the store only to meet and pass
        their id) but still open their own, until the GPU tiers have run that way.

        Why: on some machines a process's store connections stall 5 s in torch's connect, every
        25th of them (``docs/transfers.md``), and a process that remakes pairs after faults made
        dozens. A client whose making failed (a rendezvous timed out, with a request perhaps
        unanswered) is never lent again."""
        import torch.distributed as dist

        if not hasattr(self.store, "clone"):
            yield dist.PrefixStore(self._pair_prefix(peer, purpose, epoch), self.store)
            return
        with self._clients_lock:
            client = self._idle_clients.pop() if self._idle_clients else None
        if client is None:
            client = self.store.clone()
        yield dist.PrefixStore(self._pair_prefix(peer, purpose, epoch), client)
        with self._clients_lock:  # not reached when the block raised
            if self._keeping_clients and len(self._idle_clients) < _IDLE_CLIENTS:
                self._idle_clients.append(client)

    def drop_store_clients(self) -> None:
        """Lets go of the store clients kept for later makings, whose connections close with
        their last reference (``tf.shutdown``: a process that inits and shuts down again and
        again must not collect them); a making still running keeps its own until it ends."""
        with self._clients_lock:
            self._keeping_clients = False
            self._idle_clients = []

    def _pair_prefix(self, peer: int, purpose: str, epoch: int | None) -> str:
        lo, hi = self.pair(peer)
        epoch = self.epoch_of(peer) if epoch is None else epoch
        return f"pair/{lo}-{hi}/epoch{epoch}/{purpose}"

    def meet(self, store: Any, peer: int, what: str, epoch: int | None = None) -> None:
        """Returns once both ranks of the pair committed to the rendezvous that follows on
        ``store``, the pair's (:mod:`._agreement`): a library's own (gloo's process group,
        NCCL's communicator), which blocks in native code until the peer comes or its timeout.
        Either both ranks return or neither does.

        Waiting for the peer ends at once when ``stopping`` is set (a thread left waiting in a
        library's rendezvous when the process exited after ``tf.shutdown()`` aborted the
        process: "terminate called without an active exception", exit code -6), and when the
        pair left ``epoch`` (the one ``store`` is for): a fault moved it on, and the peer, which
        may have nothing to send in that epoch, may never come; a wait left running would hold
        up the next epoch's pair, made under the same cache key. Unless the peer committed
        first: then it is entering the rendezvous, and this rank returns to enter it too.

        Raises:
            TensorFerryError: ``tf.shutdown()`` was called meanwhile.
            StaleEpochError: the pair left ``epoch`` meanwhile.
            TransferTimeoutError: the peer did not come within the timeout.
            TransportError: ``store`` holds a finished agreement already (used twice).
        """
        me = self.rank_in_pair(peer)
        if agreement.arrive(store, me):
            return
        deadline = time.monotonic() + self.timeout.total_seconds()
        pause = 1e-3
        while not agreement.peer_committed(store):
            error: BaseException | None = None
            if self.stopping.is_set():
                error = TensorFerryError(f"{what}: tf.shutdown() was called")
            elif epoch is not None and self.epoch_of(peer) != epoch:
                error = StaleEpochError(what, epoch)
            elif time.monotonic() > deadline:
                error = TransferTimeoutError(
                    f"{what}: rank {peer} did not take part within "
                    f"{self.timeout.total_seconds():.3g} s"
                )
            if error is not None:
                try:
                    withdrawn = agreement.withdraw(store, me)
                except Exception:  # the store is gone: so is any peer that could commit
                    withdrawn = True
                if withdrawn:
                    raise error
                return  # the peer committed a moment ago and is entering: so do we
            self.stopping.wait(pause)
            pause = min(pause * 2, 5e-3)  # a pair made late by a few ms at most


class StaleEpochError(TransportError):
    """Making a pair's resources for an epoch the pair has left (a fault moved it on)."""

    def __init__(self, what: str, epoch: int) -> None:
        super().__init__(f"{what}: the pair moved on from epoch {epoch} (a fault)")
        self.epoch = epoch


def cached_pair(key: Any, epoch: int, create: Callable[[], Any]) -> Any:
    """The pair resources cached under ``key`` for ``epoch`` (their ``epoch`` attribute),
    made by ``create()`` if missing. Those of an earlier epoch are evicted (aborted), and a
    making of them still under way is waited for and then replaced.

    Raises:
        StaleEpochError: ``epoch`` itself is over (resources of a later one exist).
    """
    cache = communicator_cache()
    while True:
        existing = cache.get(key)
        if existing is not None and existing.epoch < epoch:
            cache.evict(key, abort=True, reason="stale epoch")
        try:
            pair = cache.get_or_create(key, create)
        except StaleEpochError as exc:
            if exc.epoch >= epoch:
                raise
            continue  # an earlier epoch's making gave up: now make ours
        if pair.epoch == epoch:
            return pair
        if pair.epoch > epoch:
            raise StaleEpochError(f"pair {key}", epoch)


class PendingOps(abc.ABC):
    """Device (or host) work issued by :meth:`Transport.start`, not yet known to be done."""

    @abc.abstractmethod
    def ready(self) -> bool:
        """True once every op finished and its bytes are in place. Never blocks.

        Raises:
            PeerLostError: the peer is gone.
            TransportError: the transport failed.
        """

    @abc.abstractmethod
    def abort(self) -> None:
        """Best-effort stop of work that will not finish (peer lost, deadline passed).

        May abort the pair's communicator; the layer calls :meth:`Transport.evict` afterwards.
        Must not raise and must not block for long.
        """


class Transport(abc.ABC):
    """Moves agreed messages between this process and its peers.

    Subclasses set :attr:`name` and :attr:`device_type` and implement the abstract methods.
    """

    name: ClassVar[str] = ""
    """Registry name; appears in headers, errors and communicator-cache keys."""
    device_type: ClassVar[str] = "cuda"
    """Device type of the tensors it moves: ``"cuda"`` or ``"cpu"``."""

    def __init__(self, ctx: TransportContext) -> None:
        self.ctx = ctx

    def unsupported_reason(self, *, peer: int, tensors: Sequence[torch.Tensor]) -> str | None:
        """Why this transport cannot carry ``tensors`` to/from ``peer``, or ``None`` if it can.

        Called on the caller's thread before anything moves; must be cheap (microseconds) and
        not talk to the peer. The default checks the device type only. Overrides may add size
        limits, topology (peer on another host), dtype restrictions, alignment …

        Args:
            peer: the other side's global rank (already validated: in range, not self).
            tensors: the message's tensors (already validated: contiguous, all on one device,
                ``ctx.device`` or the CPU).
        """
        tensor = tensors[0]  # a message's tensors share one device (validated)
        # The flags first: the device's type costs a quarter of a microsecond to read.
        if tensor.is_cuda if self.device_type == "cuda" else tensor.is_cpu:
            return None
        device = tensor.device
        if device.type != self.device_type:
            return f"{self.name} moves {self.device_type} tensors, got a tensor on {device}"
        return None

    @abc.abstractmethod
    def prepare(self, peers: Sequence[int]) -> None:
        """Makes this transport's resources for each pair with ``peers`` (a rendezvous: the peer
        must prepare too). Idempotent per pair and epoch; blocks until ready or
        ``ctx.timeout`` passes.

        Raises:
            PeerLostError / TransferTimeoutError: the peer did not show up.
            TransportError: resources could not be made.
        """

    def prepare_direction(self, peer: int, kind: str) -> None:
        """Makes what messages of ``kind`` (``"send"``: to ``peer``, ``"recv"``: from it) need;
        the layer calls this, lazily, once per direction, pair and epoch. The peer makes the
        other end when it first moves a message the other way round (its ``"recv"`` for our
        ``"send"``). Default: :meth:`prepare` of the whole pair (idempotent); transports with
        separate resources per direction override it."""
        self.prepare([peer])

    @abc.abstractmethod
    def start(self, ops: Sequence[P2POp], *, stream: Any = None) -> PendingOps:
        """Issues ``ops`` (one group: sends and receives to any prepared peers) without blocking.

        Args:
            ops: messages in the order the caller issued them.
            stream: CUDA stream the work is ordered on (``None`` for CPU transports); see the
                stream rules in the module docstring.

        Returns:
            A handle whose :meth:`PendingOps.ready` turns true when all ops finished.
        """

    def evict(self, peer: int, *, abort: bool, reason: str = "") -> None:  # noqa: B027
        """Drops this transport's resources for the pair with ``peer`` (``abort`` after a
        fault: the resources may hold hung work). The next use makes fresh ones under the
        pair's new epoch. Default: nothing to drop."""

    def close(self) -> None:  # noqa: B027
        """Releases every resource (``tf.shutdown``). Default: nothing to release."""

    def _evict_cached(self, reason: str) -> None:
        """Drops this transport's communicators of this rank from the runtime's cache (keys
        ``(name, rank, rank)``), so a later ``tf.init`` never finds the old world's."""
        cache = communicator_cache()
        for key in cache.keys():  # noqa: SIM118 (a cache, not a dict)
            if isinstance(key, tuple) and key[:1] == (self.name,) and self.ctx.rank in key[1:]:
                cache.evict(key, abort=False, reason=reason)
