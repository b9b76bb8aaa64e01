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

import contextlib
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
    MismatchError,
    PeerLostError,
    TensorFerryError,
    TransferTimeoutError,
    TransportError,
)
from tensorferry.p2p import _link, _trace
from tensorferry.p2p._engine_faults import PairFaults, mirrored
from tensorferry.p2p._engine_short import ShortWay
from tensorferry.p2p._engine_state import ChannelState, Message, PeerState, Unit
from tensorferry.p2p._spec import Descriptor, compare, descriptor_from_text, descriptor_text
from tensorferry.runtime._daemon_threads import DaemonThreads
from tensorferry.runtime._events import is_done
from tensorferry.runtime._spin import spin_window_s
from tensorferry.runtime._wakeup import write_wakeup

if TYPE_CHECKING:
    from tensorferry.p2p._context import P2PContext

__all__ = ["Engine", "Message", "Unit"]

log = logging.getLogger(__name__)

# A header frame (see _send_header): epoch, "s"/"r", sequence number, descriptor text, static
# ("true"/"false"), transport.
_HEADER = '{"k":"h","e":%d,"c":"%s","q":%d,"d":"%s","st":%s,"t":"%s"}'

_ERRORS = {c.__name__: c for c in (MismatchError, TransferTimeoutError, PeerLostError)}


def _error_of(frame: dict, what: str) -> BaseException:
    """The error a fault (or fault acknowledgement) frame carries, as the peer raised it."""
    cls = _ERRORS.get(frame.get("err", ""), TransportError)
    text = f"{what}: {frame.get('msg', '')}"
    return MismatchError(text, field=frame.get("field")) if cls is MismatchError else cls(text)


# A transfer issued ahead of the peer's header, polled for completion, runs an engine step to
# read the peer's frames unless one ended this recently (seconds): polling many transfers in
# a row would otherwise run a step for each, and with them every frame read once is enough.
_RESTEP_S = 20e-6


def _unreachable(error: BaseException) -> bool:
    """Whether a preparation failed on the network: the peer, or the store between us, gone
    (a rank that exits takes the store with it when it hosts it)."""
    import torch.distributed as dist

    network = getattr(dist, "DistNetworkError", ())
    return isinstance(error, (ConnectionError, network)) and not isinstance(error, TensorFerryError)


def _count_down(debts: dict, kind: str) -> None:
    """One of ``debts[kind]`` paid; a debt paid off leaves the dict (an empty one lets the
    short way go: see ShortWay._issue_agreed)."""
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


def _frame_text(frame: dict) -> str:
    """A side-channel frame for the flight recorder (``_trace``): its kind and numbers."""
    return ",".join(f"{k}={v}" for k, v in frame.items() if k not in ("m", "d", "t"))


class Engine(PairFaults, ShortWay):
    """The p2p issuing thread of one process. Made by ``tf.init``, stopped by ``tf.shutdown``."""

    def __init__(self, ctx: P2PContext) -> None:
        self.ctx = ctx
        self.rank = ctx.rank
        self._peers: dict[int, PeerState] = {}
        self._units: list[Unit] = []  # waiting units, in submission order
        self._issued: set[Unit] = set()
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
        self._stopping = False
        self._short_path = envs.p2p_short_path()  # see _issue_agreed
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
        return f"{self.ctx.host}:{self._listener.getsockname()[1]}"

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
            if self._short_path and self._issue_agreed(unit):
                return
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
        done = self.call(self._shutdown)
        try:
            done.result(timeout)
        finally:
            self._thread.join(timeout)
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
                # instead of taking turns at the GIL with them. It rechecks periodically.
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
            return 0.5
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
                sock, _ = self._listener.accept()
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

    def _read_link(self, link: _link.Link) -> int:
        """Handles the frames that came on ``link``; returns their count, or -1 when the link
        was lost."""
        frames = link.receive()
        if frames is None:
            self._on_link_lost(link)
            return -1
        for frame in frames:
            self._on_frame(link, frame)
        return len(frames)

    def _update_interest(self, link: _link.Link) -> None:
        if link.closed:
            return
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if link.wants_write else 0)
        if events != link.interest:  # unchanged after most flushes: skip the selector's work
            self._selector.modify(link, events, link)
            link.interest = events

    # ------------------------------------------------------------------ peers and links
    def _peer(self, rank: int) -> PeerState:
        peer = self._peers.get(rank)
        if peer is None:
            peer = self._peers[rank] = PeerState(rank)
        return peer

    def _send_frame(self, peer: PeerState, frame: dict | bytes, *, batch: bool = False) -> None:
        """Sends ``frame`` now, or with ``batch`` at the next :meth:`_flush_links` (headers:
        those of one engine step leave in one write). Fault and reset notices go at once: the
        peer must see them before anything the caller does after its transfer failed."""
        if _trace.ON and isinstance(frame, dict):
            _trace.record("frame out", peer.rank, _frame_text(frame))
        if peer.link is None:
            peer.outbox.append(frame)
            self._ensure_link(peer)
            return
        peer.link.queue(frame)
        self._unflushed.add(peer.link)
        if not batch:
            self._flush_links()

    def _flush_links(self) -> None:
        """Writes the frames queued since the last flush: one system call per link for all the
        headers of a batch, rather than one per header."""
        links, self._unflushed = self._unflushed, set()
        for link in links:
            if link.closed:
                continue
            try:
                link.flush()
            except OSError:
                self._on_link_lost(link)
                continue
            self._update_interest(link)

    def _ensure_link(self, peer: PeerState) -> None:
        # The lower rank connects; the higher rank waits for the hello.
        if peer.link is not None or peer.connecting or peer.lost or self.rank > peer.rank:
            return
        peer.connecting = True
        rank = peer.rank

        def connect() -> None:
            log.debug("p2p: connecting to rank %d", rank)
            try:
                sock = _link.connect(
                    self.ctx.peer_address(rank), my_rank=self.rank, timeout=self.ctx.timeout_s
                )
            except Exception as exc:
                err = PeerLostError(f"could not reach rank {rank}'s p2p side channel: {exc}")
                self.call(lambda: self._on_connect_failed(rank, err))
                return
            self.call(lambda: self._attach(rank, _link.Link(sock, rank)))

        self._helpers.submit(connect)

    def _on_connect_failed(self, rank: int, err: BaseException) -> None:
        peer = self._peer(rank)
        peer.connecting = False
        self._lose_peer(peer, err)

    def _attach(self, rank: int, link: _link.Link) -> None:
        peer = self._peer(rank)
        peer.connecting = False
        if peer.link is not None or peer.lost is not None:
            link.close()
            return
        peer.link = link
        link.peer = rank
        if link.fileno() not in self._selector.get_map():
            self._selector.register(link, selectors.EVENT_READ, link)
        outbox, peer.outbox = peer.outbox, []
        for frame in outbox:
            self._send_frame(peer, frame)

    def _on_link_lost(self, link: _link.Link) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(link)
        link.close()
        if link.peer is None:
            return
        peer = self._peer(link.peer)
        if peer.link is not link:
            return
        peer.link = None
        if peer.said_bye:
            err = PeerLostError(f"rank {peer.rank} shut down its p2p layer")
        else:
            err = PeerLostError(f"rank {peer.rank} is gone (its side channel closed)")
        self._lose_peer(peer, err, clean=peer.said_bye)

    def _lose_peer(self, peer: PeerState, err: BaseException, *, clean: bool = False) -> None:
        if peer.lost is not None:
            return
        peer.lost = err
        if peer.reset_waiter is not None:
            peer.reset_waiter.set_exception(PeerLostError(str(err)))
            peer.reset_waiter = None
        log.log(logging.INFO if clean else logging.WARNING, "p2p: %s", err)
        # After a clean goodbye, transfers already issued may still complete (the peer's side
        # of them was done when it left); they end on their own, or at their deadline. Its
        # communicators are closed at our shutdown. After a crash everything with it fails now.
        if not clean:  # first, so that callers who see the error find the caches clean
            self._evict_transports(peer, abort=True, reason=str(err))
        doomed = self._units if clean else self._all_units()
        for unit in [u for u in doomed if peer.rank in u.peers]:
            self._fail_unit(unit, err, cascade=True, skip_peer=peer.rank)

    # ------------------------------------------------------------------ frames
    def _on_frame(self, link: _link.Link, frame: dict) -> None:
        kind = frame.get("k")
        if kind == "hello" or "hello" in frame:
            self._attach(int(frame["hello"]), link)
            return
        if link.peer is None:
            return
        peer = self._peer(link.peer)
        if kind == "bye":
            peer.said_bye = True
            return
        epoch = int(frame["e"])
        if _trace.ON:
            _trace.record("frame in", peer.rank, _frame_text(frame), "our epoch", peer.epoch)
        if epoch > peer.epoch:
            peer.future_frames.append(frame)  # the peer reset the pair before we did
            return
        if epoch < peer.epoch:
            if kind == "f" and peer.frozen == epoch:  # the peer's fault crossed ours
                self._on_crossed_fault(peer, frame, _error_of(frame, f"rank {peer.rank} failed it"))
            return  # else stale: from before a fault both sides have left
        if kind == "h":
            # The peer's role on ITS channel: "s" = it sends to us → our "recv" channel.
            channel = peer.channels["recv" if frame["c"] == "s" else "send"]
            if int(frame["q"]) >= channel.first_seq:
                channel.peer_headers[int(frame["q"])] = frame
        elif kind == "f":
            self._on_fault_frame(peer, frame)
        elif kind == "fa":
            self._on_fault_ack(peer, frame, _error_of(frame, f"rank {peer.rank} failed it too"))
        elif kind == "rs":
            peer.peer_reset_epoch = epoch
            self._maybe_reset(peer)

    def _on_fault_frame(self, peer: PeerState, frame: dict) -> None:
        err = _error_of(frame, f"rank {peer.rank} abandoned the transfer")
        self._fault_pair(
            peer,
            err,
            notify=False,
            numbered=mirrored(frame["all"]),
            finished_there=mirrored(frame.get("done", {"send": 0, "recv": 0})),
        )

    # ------------------------------------------------------------------ submission
    def _accept(self, unit: Unit) -> None:
        if self._stopping:
            self._finish(unit, TensorFerryError("the p2p layer is shutting down"))
            return
        for message in unit.messages:
            peer = self._peer(message.op.peer)
            if peer.lost is not None:
                self._finish(unit, PeerLostError(str(peer.lost)))
                return
        unit.state = "waiting"  # so a failure below cascades to the unit's other peers
        self._units.append(unit)
        error, paid = None, []
        for message in unit.messages:
            peer = self._peer(message.op.peer)
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

    def _send_header(self, peer: PeerState, message: Message, *, now: bool = False) -> None:
        """Queues ``message``'s header for the next :meth:`_flush_links`; with ``now``, sends it
        at once (with anything queued before it)."""
        message.header_sent = True
        if _trace.ON:
            _trace.record("header out", peer.rank, message.op.kind, message.seq, message.epoch)
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

    def _write_now(self, link: _link.Link | None, frame: bytes) -> bool:
        """Writes ``frame`` on ``link`` in one go when nothing else is queued to go with it (the
        short way's lone header: a few microseconds less than the batching around a flush).
        Returns false, having done nothing, when that is not so."""
        if link is None or link.closed or self._unflushed:
            return False
        try:
            link.write(frame)
        except OSError:
            self._on_link_lost(link)
            return True
        if link.wants_write:  # the rest goes when the socket takes it
            self._update_interest(link)
        return True

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
            if self._goes_per_peer(unit):
                self._issue_parts(unit)
            elif self._issuable(unit):
                self._issue(unit)

    def _resolve(self, peer: PeerState, kind: str) -> None:
        channel: ChannelState = peer.channels[kind]
        while channel.waiting and not channel.held:
            message: Message = channel.waiting[0]
            if message.header is None:  # only where static agreements skip headers
                if channel.static_desc is not None:
                    message.header = False
                else:
                    message.header = True
                    self._send_header(peer, message)
            if message.header:
                frame = channel.peer_headers.pop(message.seq, None)
                if frame is not None:
                    self._agree(peer, channel, message, frame)
                elif self._may_speculate(channel, message):
                    self._speculate(peer, channel, message)
                else:
                    return
            else:
                self._check_static(peer, channel, message)
            if peer.channels[kind] is not channel:
                return  # a fault moved the pair to a new epoch meanwhile
            if channel.waiting and channel.waiting[0] is message:
                channel.waiting.popleft()
                if message.static:
                    channel.static_candidates -= 1

    def _may_speculate(self, channel: ChannelState, message: Message) -> bool:
        return (
            message.static
            and channel.static_desc is not None
            and self.ctx.transport(message.transport).static_speculates
        )

    def _speculate(self, peer: PeerState, channel: ChannelState, message: Message) -> None:
        """Resolves a message of an agreed static channel before the peer's header arrived (see
        ``Transport.static_speculates``): checked against the agreement now (a change faults the
        pair before anything moves), issued without waiting, and done only once the peer's
        header confirmed it (:meth:`_confirm`)."""
        self._check_static(peer, channel, message)
        if peer.channels[message.op.kind] is channel:  # no fault: it kept the promise
            message.confirmed = False
            channel.unconfirmed[message.seq] = message

    def _confirm(self, peer: PeerState, kind: str) -> None:
        """Checks the peer's headers of messages issued before they arrived."""
        channel: ChannelState = peer.channels[kind]
        for seq in [q for q in channel.unconfirmed if q in channel.peer_headers]:
            message = channel.unconfirmed.pop(seq)
            try:
                self._compare_header(peer, message, channel.peer_headers.pop(seq))
            except MismatchError as exc:
                # The peer broke the promise: our side is issued, so only a pair fault (which
                # aborts the communicator) ends it: ours, or the sender's (_static_broken).
                err = MismatchError(f"static channel changed: {exc}", field=exc.field)
                self._static_broken(peer, channel, message, err)
                return
            message.confirmed = True

    def _compare_header(self, peer: PeerState, message: Message, frame: dict) -> None:
        """Raises :class:`MismatchError` naming the first field where ``message`` and the peer's
        header ``frame`` for it differ (both sides compare the same pair, so both raise it)."""
        ours = message.desc
        if frame["t"] == message.transport and frame["d"] == descriptor_text(ours):
            return  # the common case: one string comparison
        theirs: Descriptor = descriptor_from_text(frame["d"])
        send_desc, recv_desc = (ours, theirs) if message.op.kind == "send" else (theirs, ours)
        src, dst = (self.rank, peer.rank) if message.op.kind == "send" else (peer.rank, self.rank)
        if frame["t"] != message.transport:
            raise MismatchError(
                f"rank {src} -> rank {dst}: transports differ: rank {self.rank} uses "
                f"{message.transport!r}, rank {peer.rank} uses {frame['t']!r}",
                field="transport",
            )
        compare(send_desc, recv_desc, src=src, dst=dst)

    def _agree(self, peer: PeerState, channel: ChannelState, message: Message, frame: dict) -> None:
        message.resolved = True
        try:
            self._compare_header(peer, message, frame)
        except MismatchError as exc:
            if channel.static_desc is not None and frame.get("st") and self._speculates(frame):
                # The peer may have issued its side ahead: not a lone mismatch.
                err = MismatchError(f"static channel changed: {exc}", field=exc.field)
                self._static_broken(peer, channel, message, err)
                return
            unit = self._unit_of(message)
            if unit is not None:
                unit.symmetric_error_peers.add(peer.rank)
                self._fail_unit(unit, exc, cascade=True, skip_peer=None)
            self._retire(channel, message.seq)
            return
        transport = self.ctx.transport(message.transport)
        if (
            message.static
            and frame["st"]
            and channel.static_desc is None
            and (transport.static_skips_headers or transport.static_speculates)
        ):
            channel.static_desc = message.desc
            channel.static_transport = message.transport

    def _check_static(self, peer: PeerState, channel: ChannelState, message: Message) -> None:
        message.resolved = True
        agreed = channel.static_desc
        assert agreed is not None
        src, dst = (self.rank, peer.rank) if message.op.kind == "send" else (peer.rank, self.rank)
        try:
            if message.transport != channel.static_transport:
                raise MismatchError(
                    f"rank {src} -> rank {dst}: transport changed on a static channel",
                    field="transport",
                )
            compare(
                agreed,
                message.desc,
                src=src,
                dst=dst,
                names=("the channel's agreed layout", f"this {message.op.kind}"),
            )
        except MismatchError as exc:
            err = MismatchError(
                f"static channel changed: {exc} (once agreed, a channel keeps its layout for "
                "every later message, static=False ones included: pass static=True only for a "
                "layout that never changes between these two ranks)",
                field=exc.field,
            )
            channel.waiting.popleft()
            if message.static:
                channel.static_candidates -= 1
            if self.ctx.transport(message.transport).static_speculates:
                self._static_broken(peer, channel, message, err)
            else:  # no headers go out on this channel: the peer learns only from our fault
                self._fault_pair(peer, err, notify=True)

    def _speculates(self, frame: dict) -> bool:
        try:
            return bool(self.ctx.transport(frame["t"]).static_speculates)
        except Exception:  # a transport this rank does not have: it issues nothing ahead here
            return False

    def _static_broken(
        self, peer: PeerState, channel: ChannelState, message: Message, err: BaseException
    ) -> None:
        """A broken static promise on a channel whose messages may be issued ahead of the peer's
        header. Its SENDER faults the pair; the receiver fails its message and holds the channel
        until that fault arrives. Were both to fault at once, each would see the other's notice
        as stale and their counts would never meet; were the receiver to go on, its next receive
        could take the sender's message already in flight."""
        if message.op.kind == "send":
            self._fault_pair(peer, err, notify=True)
            return
        channel.held = True
        unit = self._unit_of(message)
        if unit is not None and unit.state == "waiting":
            self._fail_unit(unit, err, cascade=True, skip_peer=peer.rank)
        # An issued one (received ahead) ends with the sender's fault, which aborts the pair.

    def _issuable(self, unit: Unit) -> bool:
        return self._after_allows(unit) and self._may_go(unit.messages)

    def _after_allows(self, unit: Unit) -> bool:
        """Whether the unit ``unit`` waits for (a ring's previous step) lets it go; fails
        ``unit`` when that one failed."""
        before = unit.after
        if before is None:
            return True
        if before.state == "failed":
            err = before.error or TransportError("an earlier step failed")
            self._fail_unit(unit, err, cascade=True, skip_peer=None)
            return False
        return before.state == "done" or (unit.after_issued_is_enough and before.state == "issued")

    def _may_go(self, messages: list[Message]) -> bool:
        """Whether ``messages`` (a unit's, or its part with one peer) are agreed, their
        transports prepared, and everything before them on their channels issued."""
        first_seq: dict[tuple[int, str], int] = {}
        for message in messages:
            peer = self._peers[message.op.peer]
            prepared = peer.prepared.get((message.transport, message.op.kind))
            if not message.resolved or prepared != "done":
                return False
            key = (message.op.peer, message.op.kind)
            first_seq[key] = min(first_seq.get(key, message.seq), message.seq)
        # A unit's messages on one channel are numbered consecutively: they may go once the
        # channel issued everything before the first of them.
        return all(
            self._peers[peer].channels[kind].issue_next == seq
            for (peer, kind), seq in first_seq.items()
        )

    def _issue(self, unit: Unit) -> None:
        self._units.remove(unit)
        for message in unit.messages:
            self._retire(self._peers[message.op.peer].channels[message.op.kind], message.seq)
        self._start(unit)

    def _goes_per_peer(self, unit: Unit) -> bool:
        """Whether ``unit`` is issued peer by peer (see ``Transport.issues_per_peer``)."""
        return (
            len(unit.messages) > 1  # a lone message (the commonest unit) never is
            and len(unit.peers) > 1
            and all(self.ctx.transport(m.transport).issues_per_peer for m in unit.messages)
        )

    def _issue_parts(self, unit: Unit) -> None:
        """Issues each peer's part of ``unit`` that may go (see ``Transport.issues_per_peer``),
        and once every part went, hands the unit's completion to the completion pool."""
        if not self._after_allows(unit):
            return
        went = set(unit.issued_peers or ())
        for rank in sorted(unit.peers - went):
            part = [m for m in unit.messages if m.op.peer == rank]
            if not self._may_go(part):
                continue
            for message in part:
                self._retire(self._peers[rank].channels[message.op.kind], message.seq)
            went.add(rank)
            unit.issued_peers = frozenset(went)
            if log.isEnabledFor(logging.DEBUG):
                what = unit.transfer.description
                log.debug("p2p: issuing the part with rank %d of %s", rank, what)
            try:
                self.ctx.issue_on_host(unit, part)
            except BaseException as exc:
                err = exc if isinstance(exc, TensorFerryError) else TransportError(str(exc))
                self._fail_unit(unit, err, cascade=True, skip_peer=None)
                return
        if len(went) == len(unit.peers):
            self._units.remove(unit)
            self._start(unit, started=True)

    def _start(self, unit: Unit, *, started: bool = False) -> None:
        """Issues ``unit`` (its messages numbered, agreed and retired; with ``started``, issued
        already, peer by peer) and hands its completion to the completion pool."""
        if log.isEnabledFor(logging.DEBUG) and not started:
            log.debug("p2p: issuing %s", unit.transfer.description)
        unit.state = "issued"
        self._issued.add(unit)
        if _trace.ON:
            _trace.record("issued", None, unit.trace_text())
        try:
            # The transports' start(), on the p2p streams; host transports have no event.
            done_event = None if started else self.ctx.issue(unit)
        except BaseException as exc:
            err = exc if isinstance(exc, TensorFerryError) else TransportError(str(exc))
            self._fail_unit(unit, err, cascade=True, skip_peer=None)
            return
        pending = list(unit.pending)

        messages = unit.messages

        def confirmed() -> bool:
            if all(m.confirmed for m in messages):
                return True
            # Issued ahead of the peer's header (see _speculate): whoever polls reads the
            # peer's frames (a caller waiting, the completion pool), so the engine thread need
            # not be woken for them. One step reads them for every transfer in flight: those
            # polled right after it (a sweep of many) do not take another.
            if time.monotonic() - self._stepped_at > _RESTEP_S:
                self.drive()
            return all(m.confirmed for m in messages)

        def ready() -> bool:
            # Confirmation first: until the peer's header agreed with a message issued ahead of
            # it, a transport error may just be the pair fault on its way, and that fault's
            # error (a MismatchError, say) is the one to report.
            return (
                confirmed()
                and all(p.ready() for p in pending)
                and (done_event is None or is_done(done_event))
            )

        completions = self.ctx.completions
        # On the pool's poller thread: _on_completed is quick and hands user callbacks to a
        # worker. The deadline's timeout is reworded there, naming the unit.
        handle = completions.call_when(
            ready,
            lambda exc: self._on_completed(unit, exc),
            deadline=unit.deadline,
            # A caller waiting on the transfer usually sees it finish within its polling window
            # and completes it itself: the pool's thread stays out of its way until then.
            delay=spin_window_s(),
        )
        unit.ready, unit.settle = ready, lambda: self._settle_seen(unit, handle)
        unit.transfer._mark_issued(
            done_event, ready, unit.settle, expedite=lambda: completions.expedite(handle)
        )

    def _settle_seen(self, unit: Unit, handle: Any) -> None:
        # On the thread that waited and saw the work finish (Transfer._settled): complete the
        # transfer there, so no other thread has to wake up (and take the GIL) for it later.
        if self.ctx.completions.discard(handle):
            self._succeed(unit)

    def _on_completed(self, unit: Unit, exc: BaseException | None) -> None:
        # On the completion pool's poller thread: quick, and no user code here.
        if exc is None:
            self._succeed(unit)
            return
        if isinstance(exc, TransferTimeoutError):
            exc = TransferTimeoutError(
                f"{unit.transfer.description}: timed out (peer never completed its side)"
            )
        elif not isinstance(exc, TensorFerryError):
            exc = TransportError(f"{unit.transfer.description}: {exc}")
        self.call(lambda: self._fail_unit(unit, exc, cascade=True, skip_peer=None))

    def _succeed(self, unit: Unit) -> None:
        # Any thread, no engine hop (a wake-up per transfer): the engine drops done units from
        # its issued set itself (_progress).
        unit.state = "done"
        if _trace.ON:
            _trace.record("done", None, unit.trace_text())
        if not unit.transfer._finish_if_no_callbacks():
            self._finish(unit, None)  # user callbacks: on a completion-pool worker
        if unit.awaited:
            self._wake()  # a unit waits for this one (a ring's next step): issue it now

    def _retire(self, channel: ChannelState, seq: int) -> None:
        channel.retired.add(seq)
        while channel.issue_next in channel.retired:
            channel.retired.discard(channel.issue_next)
            channel.issue_next += 1

    def _expire(self, now: float) -> None:
        for unit in [u for u in self._units if u.deadline <= now]:
            if _trace.ON:
                self._trace_waiting(unit)
            err = TransferTimeoutError(
                f"{unit.transfer.description}: timed out waiting for the peer "
                f"(no matching call within the transfer timeout)"
            )
            self._fail_unit(unit, err, cascade=True, skip_peer=None)

    def _trace_waiting(self, unit: Unit) -> None:
        """Records what ``unit``'s messages still wait for, as it times out."""
        for m in unit.messages:
            peer = self._peer(m.op.peer)
            channel = peer.channels[m.op.kind]
            _trace.record(
                "timing out",
                peer.rank,
                f"{m.op.kind}/{m.seq}@{m.epoch} (pair in epoch {peer.epoch}, frozen {peer.frozen})",
                f"channel head {channel.waiting[0].seq if channel.waiting else None}",
                f"held {channel.held}, peer headers {sorted(channel.peer_headers)}",
                f"prepared {peer.prepared}, debts {dict(peer.debts)}, link {peer.link is not None}",
            )

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
