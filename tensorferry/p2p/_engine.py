"""The issuing thread: header agreement, per-peer FIFO order, issue, faults.

Callers never block on a peer: ``tf.send`` validates, records an event on the caller's current
stream and hands a *unit* (one call, or one batch) to the engine, which then

1. numbers each message per channel (a channel is one direction with one peer) and sends its
   header on the pair's side channel (:mod:`._link`) — at once when it is sure to be needed;
2. resolves messages in channel order: compares our descriptor with the peer's (both sides do,
   so both raise the same ``MismatchError``), or skips the header once a ``static`` agreement
   holds on the channel;
3. issues a unit when all its messages agreed, its transports are prepared for its peers (done
   on helper threads, because preparing is a rendezvous) and every earlier message on its
   channels was issued — then hands the transport's pending ops to the completion pool.

A lone message that keeps its static channel's agreement takes all three steps at once, on
the caller's thread, without the generic step around them (:mod:`._engine_short`).

The engine's parts live in mixins, one idea each, all on the one state below: the side
channels and their frames (:mod:`._engine_links`), step 2 (:mod:`._engine_agreement`), pair
faults (:mod:`._engine_faults`), step 3 and completion (:mod:`._engine_issue`) and the short
way; this module keeps the loop, the calls from other threads, submission and teardown.

Faults. A *pair fault* (deadline passed, transport error, static agreement broken, a unit
failed half-way) fails every unfinished unit with that peer, aborts and evicts the pair's
transport resources and moves the pair to its next *epoch*; a ``fault`` frame tells the peer
how many messages per channel the faulting side had numbered (and failed). The peer fails its
side of every one of them: those it posted already, now; the others as it posts them (debts,
which take no number), so both sides keep counting messages alike and a late call never takes
a message meant for an earlier one. Its messages past those counts go on, renumbered into the
new epoch. Should it fail some of those too (receives issued ahead on a static channel), its
``fault ack`` frame says how many, and the faulting side fails as many of its next messages,
which take those numbers of the new epoch. The faulting side numbers nothing more with the
peer until that answer comes (new messages wait, in order): two faults started at once then
meet cleanly, each notice serving as the other's answer. Units whose work had finished when
the fault came are completed, not failed, and those the faulting side saw finish get a moment
to finish here too. A header mismatch on a single message is symmetric and needs no fault:
both sides fail it and go on — except on a static channel whose transport issues messages
ahead of the peer's header: there the sender faults the pair and the receiver waits for that
fault. A dead peer (side channel closed without ``bye``) fails everything with it with
``PeerLostError``; other peers are untouched.

Who does the work. Each step runs on whichever thread can take it first, so that none waits
for a thread wake-up (tens of microseconds on bare metal, hundreds on some virtual machines):
the caller's own thread accepts its unit and drives it as far as it goes without waiting
(:meth:`Engine.submit`); a caller waiting on a transfer keeps driving it (:meth:`Engine.drive`,
reading the peer's headers itself); the engine thread handles whatever arrives while no caller
is there (frames, preparations, deadlines, faults).

Thread-safety: all state below is guarded by one re-entrant lock; other threads queue work for
the engine thread through :meth:`Engine.call` (a command queue plus a wake-up socket).
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from tensorferry import envs
from tensorferry.errors import (
    PeerLostError,
    TensorFerryError,
    TransportError,
)
from tensorferry.p2p import _link, _trace
from tensorferry.p2p._engine_agreement import HeaderAgreement
from tensorferry.p2p._engine_faults import PairFaults
from tensorferry.p2p._engine_issue import Issuing, Unwatched
from tensorferry.p2p._engine_links import PeerLinks
from tensorferry.p2p._engine_short import ShortWay
from tensorferry.p2p._engine_state import Message, PeerState, Unit
from tensorferry.p2p._lanes import Lanes
from tensorferry.p2p._spec import descriptor_text
from tensorferry.runtime._daemon_threads import DaemonThreads
from tensorferry.runtime._wakeup import write_wakeup

if TYPE_CHECKING:
    from tensorferry.p2p._context import P2PContext

__all__ = ["Engine", "Message", "Unit"]

log = logging.getLogger(__name__)

# A header frame (see _send_header): epoch, "s"/"r", sequence number, descriptor text, static
# ("true"/"false"), transport.
_HEADER = '{"k":"h","e":%d,"c":"%s","q":%d,"d":"%s","st":%s,"t":"%s"}'


def _unreachable(error: BaseException) -> bool:
    """Whether a preparation failed on the network: the peer, or the store between us, gone
    (a rank that exits takes the store with it when it hosts it)."""
    import torch.distributed as dist

    network = getattr(dist, "DistNetworkError", ())
    return isinstance(error, (ConnectionError, network)) and not isinstance(error, TensorFerryError)


def _count_down(debts: dict, kind: str) -> None:
    """One of ``debts[kind]`` paid; a debt paid off leaves the dict (an empty one lets the
    short way go: see ShortWay._issue_short)."""
    count, err = debts[kind]
    if count > 1:
        debts[kind] = (count - 1, err)
    else:
        del debts[kind]


# How long tf.shutdown() waits, at most, for the helper threads to end (see stop): longer
# than a store client takes to open at worst in practice (5 s, seen on a CPU machine), which a
# pair's making does first and which nothing can cut short.
_HELPERS_EXIT_S = 6.0

# While callers drive, the engine thread still wakes this often (seconds) to see whether they
# stopped, in case none of them could tell it (see end_driving).
_DRIVEN_RECHECK_S = 0.005
# With nothing in flight the engine thread leaves the peers' frames to the next call, but reads
# them itself this often (seconds), so that a rank that makes no more calls still answers its
# peers' faults.
_IDLE_READ_S = 0.5


class Engine(PeerLinks, HeaderAgreement, Issuing, PairFaults, ShortWay):
    """The p2p issuing thread of one process. Made by ``tf.init``, stopped by ``tf.shutdown``."""

    def __init__(self, ctx: P2PContext) -> None:
        self.ctx = ctx
        self.rank = ctx.rank
        self._peers: dict[int, PeerState] = {}
        self._units: list[Unit] = []  # waiting units, in submission order
        self._issued: set[Unit] = set()
        # Units with CUDA work queued, per transfer stream (see Issuing._room_for).
        self._on_stream: dict[str, set[Unit]] = {"send": set(), "recv": set()}
        self._full_streams: set[str] = set()  # those with no room left: a hint, for the short way
        self._awaiting_room = False
        # Issued units whose completion their callers usually take (see Unwatched): what is
        # left, the completion pool's poller hands to the pool.
        self._unwatched = Unwatched(self._watch)
        ctx.completions.add_sweeper(self._unwatched)
        self._commands: deque[Callable[[], None]] = deque()
        # Set by callers when they write a wake-up byte, cleared by the engine after draining
        # them: while set, a wake-up is already on its way and callers skip the syscall (which
        # would also hand the engine thread the GIL in the middle of the caller's call).
        self._wake_pending = False
        # True while the engine thread is awake (running, or polling without blocking): it
        # looks at the command queue before it blocks again, so callers skip the wake-up
        # write — a syscall that would also let this thread take the GIL mid-call.
        self._awake = False
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._wake_selector = selectors.DefaultSelector()  # while callers drive: wake-ups only
        self._wake_selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._listener = _link.open_listener(ctx.host)
        self._selector.register(self._listener, selectors.EVENT_READ, "listen")
        # Peers on this host connect here instead (see _link): cheaper frames both ways.
        self._local_links = envs.p2p_local_links()
        self._local_listener = _link.open_local_listener() if self._local_links else None
        if self._local_listener is not None:
            self._selector.register(self._local_listener, selectors.EVENT_READ, "listen")
        self._stopping = False
        self._short_path = envs.p2p_short_path()  # see _issue_short
        self.lanes = Lanes(self)  # the repeated calls of agreed static channels
        # Guards all the state below. The engine thread holds it while it handles what woke it;
        # callers hold it to queue and drive their own units (see submit and drive).
        self._lock = threading.RLock()
        # Set on a thread while it runs an engine step: a transfer's ready() called from
        # inside one (fault handling) must not start another (see _issue).
        self._stepping = threading.local()
        # When the last engine step ended (on any thread): see _RESTEP_S.
        self._stepped_at = 0.0
        # When the engine thread's select returns at the latest: a unit due earlier wakes it.
        self._wakes_at = 0.0
        # Callers polling drive() now, and whether the engine thread watches the peers' links
        # (it does not while callers drive; see begin_driving).
        self._drivers = 0
        self._drivers_lock = threading.Lock()
        self._watching_links = True
        self._unflushed: set[_link.Link] = set()  # links with queued frames (_flush_links)
        # Preparing is a rendezvous that blocks its helper until the peer prepares too: room for
        # both directions with every peer at once (and the side-channel connects), so a rank
        # never waits for a helper while a peer waits for it.
        # Daemon threads: a rendezvous whose peer never comes must not hold up the process's
        # exit (see runtime._daemon_threads).
        self._helpers = DaemonThreads(
            max(4, 2 * ctx.world_size + 1), "tensorferry-p2p-helper", ctx.bind_device
        )
        self._thread = threading.Thread(target=self._run, name="tensorferry-p2p", daemon=True)

    @property
    def address(self) -> str:
        return _link.listener_address(self.ctx.host, self._listener, self._local_listener)

    def start(self) -> None:
        self._thread.start()

    # ------------------------------------------------------------------ other threads
    def call(self, fn: Callable[[], Any]) -> Future:
        """Runs ``fn()`` on the engine thread; returns a future of its result."""
        future: Future = Future()

        def command() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:
                    future.set_exception(exc)

        self._commands.append(command)
        self._wake()
        return future

    def submit(self, unit: Unit) -> None:
        """Accepts ``unit`` and drives it as far as it goes now, on the caller's thread: numbers
        its messages, sends their headers, reads the headers its peers already sent and issues
        it if it may go. Never blocks on a peer; what is left is done by whichever thread next
        sees progress (a caller waiting on a transfer, or the engine thread).

        Doing this here rather than handing the unit to the engine thread saves a thread
        wake-up per call on the critical path (tens of microseconds on bare metal, hundreds on
        some virtual machines), and the GIL hand-over that comes with it.
        """
        with self._lock:
            if self._stopping:
                raise TensorFerryError("tf.shutdown() was called: no new transfers")
            if self._short_path and self._issue_short(unit):
                return
            if unit.caller_stream is not None:  # before anything can issue it, in this call
                self.ctx.record_caller(unit)
            # What already arrived first (a fault notice moves the pair to its next epoch
            # before this unit is numbered), then the unit.
            self._handle(self._selector.select(0), accept=unit)
            left_waiting = unit.state == "waiting"
        if unit.deadline < self._wakes_at or (left_waiting and not self._watching_links):
            # The engine thread must expire it earlier than it planned to wake, or watch the
            # peers' frames for it (it stopped while callers were driving).
            self._wake()

    def drive(self) -> None:
        """One step of the engine on a waiting caller's thread: handles what arrived (headers,
        faults) and issues what may go. Returns at once if another thread holds the engine."""
        if getattr(self._stepping, "on", False) or not self._lock.acquire(blocking=False):
            return
        try:
            if not self._stopping:  # stopped: its selectors are closed, its units failed
                self._handle(self._selector.select(0))
        finally:
            self._lock.release()

    def begin_driving(self) -> None:
        """A caller is about to poll :meth:`drive`: until :meth:`end_driving`, the engine thread
        leaves the peers' frames to it. Otherwise both threads would wake for every frame and
        take turns at the GIL, which costs the waiting caller far more than reading them."""
        with self._drivers_lock:
            self._drivers += 1

    def end_driving(self) -> None:
        with self._drivers_lock:
            self._drivers -= 1
            last = self._drivers == 0
        if last and self._units and not self._watching_links:
            self._wake()  # units still wait for frames: the engine thread watches them again

    def stop(self, timeout: float = 5.0) -> None:
        """Says bye to every peer, fails what is left, stops the thread."""
        if not self._thread.is_alive():
            return
        self.lanes.close()
        done = self.call(self._shutdown)
        try:
            done.result(timeout)
        finally:
            self._thread.join(timeout)
            self.ctx.completions.remove_sweeper(self._unwatched)
            # A rendezvous told to stop (``TransportContext.stopping``) ends within
            # milliseconds, a store client being opened within seconds: let them leave native
            # code before the process may exit. Idle helpers end at once.
            self._helpers.shutdown(wait_s=_HELPERS_EXIT_S)

    def _wake(self) -> None:
        if self._wake_pending or self._awake:  # the engine will see the command anyway
            return
        self._wake_pending = True
        write_wakeup(self._wake_w)

    # ------------------------------------------------------------------ the loop
    def _run(self) -> None:
        self.ctx.bind_device()
        # No busy-polling here: this thread needs the GIL for all its work, and a caller that
        # runs Python meanwhile would hand it back and forth through the kernel on every poll.
        self._awake = True
        while not self._stopping:
            with self._lock:  # a unit accepted from here on sees when this thread wakes
                timeout = self._next_timeout()
                # The peers' frames are for callers to read while they drive, and when nothing
                # is in flight (the next call reads what came): this thread then stays asleep
                # instead of taking turns at the GIL with them. It rechecks periodically, and
                # when idle reads them itself every _IDLE_READ_S (below).
                watch_links = self._drivers == 0 and self._busy()
                if self._drivers:
                    timeout = min(timeout, _DRIVEN_RECHECK_S)
                self._watching_links = watch_links
                self._wakes_at = time.monotonic() + timeout
            if timeout > 0:
                # About to block: callers must write wake-ups again. A command queued before
                # this store is seen by the check below; one queued after sees the flag down.
                self._awake = False
                if self._commands:
                    timeout = 0.0
            selector = self._selector if watch_links else self._wake_selector
            events = selector.select(timeout)
            self._awake = True
            if self._drivers and not self._commands and all(k.data != "wake" for k, _ in events):
                continue  # a caller is driving and reads the frames itself
            if not events and timeout > 0 and not watch_links and not self._drivers:
                # Idle a while (_IDLE_READ_S): read what the peers sent after all. A peer may
                # wait on this rank (for the answer to its fault) while this rank calls nothing.
                events = self._selector.select(0)
            with self._lock:
                self._wakes_at = 0.0
                self._handle(events)
        for key in list(self._selector.get_map().values()):
            obj = key.fileobj
            if isinstance(obj, _link.Link):
                obj.close()
        self._selector.close()
        self._wake_selector.close()
        self._listener.close()
        if self._local_listener is not None:
            self._local_listener.close()
        self._wake_r.close()
        self._wake_w.close()

    def _handle(self, events: list, accept: Unit | None = None) -> None:
        """One step of the engine: what woke it, queued commands, then ``accept`` (a unit
        submitted now), then progress and deadlines."""
        self._stepping.on = True
        try:
            self._step(events, accept)
        finally:
            self._stepping.on = False
            self._stepped_at = time.monotonic()

    def _step(self, events: list, accept: Unit | None) -> None:
        for key, mask in events:
            try:
                self._on_event(key, mask)
            except Exception:
                log.exception("p2p engine: event handler failed")
        while self._commands:
            try:
                self._commands.popleft()()
            except Exception:
                log.exception("p2p engine: command failed")
        if accept is not None:
            self._accept(accept)
        try:
            self._progress()
            self._expire(time.monotonic())
        except Exception:
            log.exception("p2p engine: progress failed")
        self._flush_links()

    def _busy(self) -> bool:
        """Something waits for the peers' frames: units (headers), transfers in flight (a fault
        must end them promptly), a pair reset (the peer's reset notice), our fault's answer (a
        peer frozen: the answer may oblige us to fail messages there, see ``_unfreeze``, which
        the peer waits for even when this rank makes no more calls)."""
        return (
            bool(self._units)
            or any(u.state != "done" for u in self._issued)
            or any(
                peer.reset_waiter is not None or peer.frozen is not None
                for peer in self._peers.values()
            )
        )

    def _next_timeout(self) -> float:
        if self._commands:
            return 0.0
        if not self._units:
            return _IDLE_READ_S
        soonest = min(u.deadline for u in self._units)
        return min(0.5, max(0.0, soonest - time.monotonic()))

    def _on_event(self, key: selectors.SelectorKey, mask: int) -> None:
        if key.data == "wake":
            try:
                while self._wake_r.recv(4096):
                    pass
            except (BlockingIOError, OSError):
                pass
            # Cleared after draining, before the commands run: a command queued from here on
            # either runs in this turn or writes a fresh wake-up.
            self._wake_pending = False
        elif key.data == "listen":
            try:
                sock, _ = key.fileobj.accept()  # type: ignore[union-attr]
            except (BlockingIOError, OSError):
                return
            link = _link.Link(sock, peer=None)  # peer known from its hello
            self._selector.register(link, selectors.EVENT_READ, link)
        else:
            link: _link.Link = key.data
            if mask & selectors.EVENT_WRITE:
                try:
                    link.flush()
                except OSError:
                    self._on_link_lost(link)
                    return
                self._update_interest(link)
            if mask & selectors.EVENT_READ:
                self._read_link(link)

    # ------------------------------------------------------------------ submission
    def _accept(self, unit: Unit) -> None:
        if self._stopping:
            self._finish(unit, TensorFerryError("the p2p layer is shutting down"))
            return
        peers = [self._peer(message.op.peer) for message in unit.messages]
        for peer in peers:
            if peer.lost is not None:
                self._finish(unit, PeerLostError(str(peer.lost)))
                return
        unit.state = "waiting"  # so a failure below cascades to the unit's other peers
        self._units.append(unit)
        error, paid = None, []
        for message, peer in zip(unit.messages, peers, strict=True):
            if peer.frozen is not None:  # numbered once the peer answered our fault
                peer.deferred.append((message, unit))
                continue
            debt = self._pay_debt(peer, message.op.kind)
            if debt is not None:
                error = error or debt
                paid.append(message)
                continue
            self._number(peer, message)
            self._ensure_prepared(peer, message.transport, message.op.kind)
        if error is not None:
            # A peer whose every message of this unit paid a debt failed its side already: no
            # fault with it (one would fail what it posted since). The unit's other messages
            # were numbered: the fault that fails them tells their peers.
            numbered = {m.op.peer for m in unit.messages if m not in paid}
            settled = frozenset(m.op.peer for m in paid if m.op.peer not in numbered)
            self._fail_unit(unit, error, cascade=True, skip_peer=settled)

    def _pay_debt(self, peer: PeerState, kind: str) -> BaseException | None:
        """The error of a debt that our next message of ``kind`` with ``peer`` pays off (see
        ``PeerState.debts`` and ``PeerState.numbered_debts``), else ``None``."""
        count, err = peer.debts.get(kind, (0, None))
        if count > 0:
            _count_down(peer.debts, kind)
            return err
        count, err = peer.numbered_debts.get(kind, (0, None))
        if count > 0:  # the number the peer skipped is ours to consume
            _count_down(peer.numbered_debts, kind)
            channel = peer.channels[kind]
            channel.next_seq += 1
            self._retire(channel, channel.next_seq - 1)
            return err
        return None

    def _number(self, peer: PeerState, message: Message) -> None:
        channel = peer.channels[message.op.kind]
        if log.isEnabledFor(logging.DEBUG):  # once per message of every batch: not for nothing
            log.debug(
                "p2p: %s message %d, epoch %d, peer %d, static agreed %s",
                message.op.kind,
                channel.next_seq,
                peer.epoch,
                peer.rank,
                channel.static_desc is not None,
            )
        message.seq = channel.next_seq
        message.epoch = peer.epoch
        if _trace.ON:
            _trace.record("numbered", peer.rank, message.op.kind, message.seq, "epoch", peer.epoch)
        message.header = None
        message.header_sent = False
        message.resolved = False
        # A message issued ahead in an earlier epoch was doomed there; one only resolved ahead
        # (its unit not yet issued) is carried into this epoch, where it must be agreed anew.
        message.confirmed = True
        channel.next_seq += 1
        channel.waiting.append(message)
        if message.static:
            channel.static_candidates += 1
        # No agreement now, and none can come from an earlier message (or none ever skips this
        # transport's headers): a header is certain, so send it at once. This pipelines the
        # header round trips of back-to-back calls instead of paying one per message.
        skips = self.ctx.transport(message.transport).static_skips_headers
        if not skips or (
            channel.static_desc is None and channel.static_candidates == int(message.static)
        ):
            message.header = True
            self._send_header(peer, message)
        self._ensure_link(peer)

    def _send_header(
        self, peer: PeerState, message: Message, *, now: bool = False, data: bytes | None = None
    ) -> None:
        """Queues ``message``'s header for the next :meth:`_flush_links`; with ``now``, sends it
        at once (with anything queued before it). ``data``: the header, encoded already (by the
        message's lane)."""
        message.header_sent = True
        if _trace.ON:
            _trace.record("header out", peer.rank, message.op.kind, message.seq, message.epoch)
        if data is None:
            # Written out rather than json.dumps of a dict: one header per message, on the
            # caller's critical path. Every value is a number, a fixed word or a string with
            # nothing to escape (the descriptor text, a transport name).
            frame = _HEADER % (
                message.epoch,
                "s" if message.op.kind == "send" else "r",
                message.seq,
                descriptor_text(message.desc),
                "true" if message.static else "false",
                message.transport,
            )
            data = frame.encode()
        if now and self._write_now(peer.link, data):
            return
        self._send_frame(peer, data, batch=True)
        if now:
            self._flush_links()

    def _ensure_prepared(self, peer: PeerState, transport: str, kind: str) -> None:
        key = (transport, kind)
        if peer.prepared.get(key) is not None:
            return
        peer.prepared[key] = "running"
        epoch, rank = peer.epoch, peer.rank
        if _trace.ON:
            _trace.record("preparing", rank, transport, kind, "epoch", epoch)

        def prepare() -> None:
            log.debug("p2p: preparing %s %s rank %d (epoch %d)", transport, kind, rank, epoch)
            try:
                self.ctx.transport(transport).prepare_direction(rank, kind)
                error = None
            except BaseException as exc:
                error = exc
            log.debug("p2p: prepared %s with rank %d: %s", transport, rank, error or "ok")
            self.call(lambda: self._on_prepared(rank, key, epoch, error))

        self._helpers.submit(prepare)

    def _on_prepared(self, rank: int, key: tuple[str, str], epoch: int, error: Any) -> None:
        peer = self._peer(rank)
        if _trace.ON:
            _trace.record("prepared", rank, *key, "epoch", epoch, error or "ok", "now", peer.epoch)
        if epoch != peer.epoch:
            return  # a fault reset the pair meanwhile; the new epoch prepares again
        if error is None:
            peer.prepared[key] = "done"
            return
        peer.prepared.pop(key, None)
        transport = key[0]
        if _unreachable(error):
            error = PeerLostError(
                f"{transport}: rank {rank} could not be reached while preparing the pair "
                f"(has it exited?): {error}"
            )
        elif not isinstance(error, TensorFerryError):
            error = TransportError(
                f"{transport}: preparing the pair with rank {rank} failed: {error}"
            )
        self._fault_pair(peer, error, notify=True)

    # ------------------------------------------------------------------ progress
    def _progress(self) -> None:
        if any(u.state == "done" for u in self._issued):
            self._issued = {u for u in self._issued if u.state != "done"}
        for peer in list(self._peers.values()):
            for kind in ("send", "recv"):
                self._resolve(peer, kind)
                if peer.channels[kind].unconfirmed:
                    self._confirm(peer, kind)
        self._flush_links()  # headers out before the (slower) issuing: the peers wait for them
        for unit in list(self._units):
            if unit.state != "waiting":
                continue
            # Whole where every message may go (one check, one start, the usual case), else
            # part by part where the transports allow (see Issuing._parts).
            if self._issuable(unit):
                self._issue(unit)
            elif unit.state == "waiting" and self._goes_in_parts(unit):
                self._issue_parts(unit)

    # ------------------------------------------------------------------ commands
    def reset_pair(self, rank: int) -> Future:
        """Engine-thread command: a clean, symmetric move to the next epoch (fresh transport
        resources), used by the uncached benchmark mode. Both ranks must call it at the same
        point of their programs, with nothing in flight between them. Returns a future that
        completes once both sides reached it and the pair moved on."""
        peer = self._peer(rank)
        # A transfer its caller saw finish is done already (Transfer._settled completes it),
        # or is being completed by the pool this instant: the caller retries on ValueError.
        busy = [u for u in self._all_units() if rank in u.peers]
        if busy:
            raise ValueError(
                f"reset of the pair with rank {rank}: {len(busy)} transfer(s) in "
                "flight; wait for them first"
            )
        if peer.lost is not None:
            raise PeerLostError(str(peer.lost))
        # Our side is done, but the peer's side of the last transfer may still be running on
        # its device: its communicator must outlive that. Both sides say so first.
        waiter: Future = Future()
        peer.reset_waiter = waiter
        self._send_frame(peer, {"k": "rs", "e": peer.epoch})
        self._maybe_reset(peer)
        return waiter

    def _maybe_reset(self, peer: PeerState) -> None:
        # Not while a fault is unanswered or being handled: its answer (our fault's, or ours
        # to the peer's) is for the epoch the reset would leave, and would be dropped there.
        if (
            peer.reset_waiter is None
            or peer.peer_reset_epoch != peer.epoch
            or peer.frozen is not None
            or peer.faulting
        ):
            return
        waiter, peer.reset_waiter, peer.peer_reset_epoch = peer.reset_waiter, None, None
        self._new_epoch(peer, abort=False, reason="reset")
        waiter.set_result(None)

    def mark_prepared(self, rank: int, transport: str) -> None:
        """Engine-thread command: ``transport`` was prepared for ``rank`` by ``tf.prepare``
        (both directions)."""
        for kind in ("send", "recv"):
            self._peer(rank).prepared[(transport, kind)] = "done"

    def _shutdown(self) -> None:
        self._stopping = True
        err = TensorFerryError("tf.shutdown() was called with this transfer in flight")
        for unit in list(self._all_units()):
            self._fail_unit(unit, err, cascade=False, skip_peer=None)
        for peer in self._peers.values():
            if peer.link is not None:
                try:
                    peer.link.sock.setblocking(True)
                    peer.link.sock.settimeout(1.0)
                    peer.link.flush()
                    peer.link.send({"k": "bye"})
                    peer.link.flush()
                except OSError:
                    pass
