"""The issuing thread: header agreement, per-peer FIFO order, issue, faults.

Callers never block on a peer: ``tf.send`` validates, records an event on the caller's current
stream and queues a *unit* (one call, or one batch) here. This one thread per process then

1. numbers each message per channel (a channel is one direction with one peer) and sends its
   header on the pair's side channel (:mod:`._link`) — at once when it is sure to be needed;
2. resolves messages in channel order: compares our descriptor with the peer's (both sides do,
   so both raise the same ``MismatchError``), or skips the header once a ``static`` agreement
   holds on the channel;
3. issues a unit when all its messages agreed, its transports are prepared for its peers (done
   on helper threads, because preparing is a rendezvous) and every earlier message on its
   channels was issued — then hands the transport's pending ops to the completion pool.

Faults. A *pair fault* (deadline passed, transport error, static agreement broken, a unit
failed half-way) fails every unfinished unit with that peer, aborts and evicts the pair's
transport resources and moves the pair to its next *epoch*; a ``fault`` frame tells the peer,
which does the same: it fails its messages the faulting side had already numbered and renumbers
the rest into the new epoch. A header mismatch on a single message is symmetric and needs no
fault: both sides fail it and go on. A dead peer (side channel closed without ``bye``) fails
everything with it with ``PeerLostError``; other peers are untouched.

Thread-safety: all state below is touched only by the engine thread; other threads talk to it
through :meth:`Engine.call` (a command queue plus a wake-up socket).
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
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tensorferry.errors import (
    MismatchError,
    PeerLostError,
    TensorFerryError,
    TransferTimeoutError,
    TransportError,
)
from tensorferry.p2p import _link
from tensorferry.p2p._spec import Descriptor, compare
from tensorferry.p2p._transfer import Transfer
from tensorferry.p2p._transport import P2POp, PendingOps

if TYPE_CHECKING:
    from tensorferry.p2p._context import P2PContext

__all__ = ["Engine", "Message", "Unit"]

log = logging.getLogger(__name__)

_ERRORS = {c.__name__: c for c in (MismatchError, TransferTimeoutError, PeerLostError)}


@dataclass(eq=False, slots=True)
class Message:
    """One message of a unit: its op, chosen transport and descriptor."""

    op: P2POp
    transport: str
    desc: Descriptor
    static: bool
    seq: int = -1
    epoch: int = -1
    header: bool | None = None  # None: decided when the message reaches its channel's head
    header_sent: bool = False
    resolved: bool = False


@dataclass(eq=False, slots=True)
class Unit:
    """One call or batch: issued as one group (per transport) or failed as a whole."""

    messages: list[Message]
    transfer: Transfer
    deadline: float
    caller_event: Any = None
    state: str = "new"  # new → waiting → issued → done
    pending: list[PendingOps] = field(default_factory=list)
    error: BaseException | None = None
    symmetric_error_peers: set[int] = field(default_factory=set)
    after: Unit | None = None
    """A unit that must finish first (a ring step reads what the previous step received)."""
    after_issued_is_enough: bool = False
    """``after`` only needs to be issued: both units run on one CUDA stream, in order."""

    @property
    def peers(self) -> set[int]:
        return {m.op.peer for m in self.messages}


@dataclass(eq=False, slots=True)
class _Channel:
    next_seq: int = 0
    issue_next: int = 0
    static_desc: Descriptor | None = None
    static_transport: str | None = None
    waiting: deque = field(default_factory=deque)  # unresolved messages, in seq order
    retired: set[int] = field(default_factory=set)  # seqs issued or dropped, ahead of issue_next
    peer_headers: dict[int, dict] = field(default_factory=dict)
    static_candidates: int = 0  # waiting messages with static=True (may set an agreement)


@dataclass(eq=False, slots=True)
class _Peer:
    rank: int
    epoch: int = 0
    link: _link.Link | None = None
    connecting: bool = False
    outbox: list = field(default_factory=list)
    lost: BaseException | None = None
    said_bye: bool = False
    prepared: dict = field(default_factory=dict)  # transport -> "running" | "done"
    future_frames: list = field(default_factory=list)
    # Per channel: messages of a static channel the peer numbered (and failed) before a fault
    # that we have not posted yet; ours fail on arrival. {kind: (count, error)}
    debts: dict = field(default_factory=dict)
    channels: dict = field(default_factory=lambda: {"send": _Channel(), "recv": _Channel()})


class Engine:
    """The p2p issuing thread of one process. Made by ``tf.init``, stopped by ``tf.shutdown``."""

    def __init__(self, ctx: P2PContext) -> None:
        self.ctx = ctx
        self.rank = ctx.rank
        self._peers: dict[int, _Peer] = {}
        self._units: list[Unit] = []  # waiting units, in submission order
        self._issued: set[Unit] = set()
        self._commands: deque[Callable[[], None]] = deque()
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._listener = _link.open_listener(ctx.host)
        self._selector.register(self._listener, selectors.EVENT_READ, "listen")
        self._stopping = False
        self._helpers = ThreadPoolExecutor(
            max_workers=max(4, ctx.world_size),
            thread_name_prefix="tensorferry-p2p-helper",
            initializer=ctx.bind_device,
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
        """Queues ``unit`` (called on the caller's thread; returns at once)."""
        self._commands.append(lambda: self._accept(unit))
        self._wake()

    def stop(self, timeout: float = 5.0) -> None:
        """Says bye to every peer, fails what is left, stops the thread."""
        if not self._thread.is_alive():
            return
        done = self.call(self._shutdown)
        try:
            done.result(timeout)
        finally:
            self._thread.join(timeout)
            self._helpers.shutdown(wait=False, cancel_futures=True)

    def _wake(self) -> None:
        # A full buffer means a wake-up is already pending; a closed one, shutdown.
        with contextlib.suppress(BlockingIOError, OSError):
            self._wake_w.send(b"x")

    # ------------------------------------------------------------------ the loop
    def _run(self) -> None:
        self.ctx.bind_device()
        while not self._stopping:
            timeout = self._next_timeout()
            for key, mask in self._selector.select(timeout):
                try:
                    self._on_event(key, mask)
                except Exception:
                    log.exception("p2p engine: event handler failed")
            while self._commands:
                try:
                    self._commands.popleft()()
                except Exception:
                    log.exception("p2p engine: command failed")
            try:
                self._progress()
                self._expire(time.monotonic())
            except Exception:
                log.exception("p2p engine: progress failed")
        for key in list(self._selector.get_map().values()):
            obj = key.fileobj
            if isinstance(obj, _link.Link):
                obj.close()
        self._selector.close()
        self._listener.close()
        self._wake_r.close()
        self._wake_w.close()

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
                frames = link.receive()
                if frames is None:
                    self._on_link_lost(link)
                    return
                for frame in frames:
                    self._on_frame(link, frame)

    def _update_interest(self, link: _link.Link) -> None:
        if link.closed:
            return
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if link.wants_write else 0)
        self._selector.modify(link, events, link)

    # ------------------------------------------------------------------ peers and links
    def _peer(self, rank: int) -> _Peer:
        peer = self._peers.get(rank)
        if peer is None:
            peer = self._peers[rank] = _Peer(rank)
        return peer

    def _send_frame(self, peer: _Peer, frame: dict) -> None:
        if peer.link is None:
            peer.outbox.append(frame)
            self._ensure_link(peer)
            return
        try:
            peer.link.send(frame)
        except OSError:
            self._on_link_lost(peer.link)
            return
        self._update_interest(peer.link)

    def _ensure_link(self, peer: _Peer) -> None:
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

    def _lose_peer(self, peer: _Peer, err: BaseException, *, clean: bool = False) -> None:
        if peer.lost is not None:
            return
        peer.lost = err
        log.log(logging.INFO if clean else logging.WARNING, "p2p: %s", err)
        # After a clean goodbye, transfers already issued may still complete (the peer's side
        # of them was done when it left); they end on their own, or at their deadline. Its
        # communicators are closed at our shutdown. After a crash everything with it fails now.
        doomed = self._units if clean else self._all_units()
        for unit in [u for u in doomed if peer.rank in u.peers]:
            self._fail_unit(unit, err, cascade=True, skip_peer=peer.rank)
        if not clean:
            self._evict_transports(peer, abort=True, reason=str(err))

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
        if epoch > peer.epoch:
            peer.future_frames.append(frame)  # the peer reset the pair before we did
            return
        if epoch < peer.epoch:
            return  # stale: from before a fault both sides have left
        if kind == "h":
            # The peer's role on ITS channel: "s" = it sends to us → our "recv" channel.
            channel = peer.channels["recv" if frame["c"] == "s" else "send"]
            channel.peer_headers[int(frame["q"])] = frame
        elif kind == "f":
            self._on_fault_frame(peer, frame)

    def _on_fault_frame(self, peer: _Peer, frame: dict) -> None:
        cls = _ERRORS.get(frame.get("err", ""), TransportError)
        text = f"rank {peer.rank} abandoned the transfer: {frame.get('msg', '')}"
        err = MismatchError(text, field=frame.get("field")) if cls is MismatchError else cls(text)
        # Their "send" channel is our "recv" channel and vice versa.
        matched = {"recv": int(frame["n"]["send"]), "send": int(frame["n"]["recv"])}
        self._fault_pair(peer, err, notify=False, matched=matched)

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
        debt_error = self._pay_debts(unit)
        if debt_error is not None:
            unit.state = "waiting"  # so _fail_unit cascades to the unit's other peers
            self._units.append(unit)
            self._fail_unit(unit, debt_error, cascade=True, skip_peer=None)
            return
        unit.state = "waiting"
        self._units.append(unit)
        for message in unit.messages:
            self._number(self._peer(message.op.peer), message)
            self._ensure_prepared(self._peer(message.op.peer), message.transport)

    def _pay_debts(self, unit: Unit) -> BaseException | None:
        """The error of a debt ``unit`` pays off (see ``_Peer.debts``), else ``None``."""
        error = None
        for message in unit.messages:
            peer = self._peer(message.op.peer)
            count, err = peer.debts.get(message.op.kind, (0, None))
            if count > 0:
                peer.debts[message.op.kind] = (count - 1, err)
                error = error or err
        return error

    def _number(self, peer: _Peer, message: Message) -> None:
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
        message.header = None
        message.header_sent = False
        message.resolved = False
        channel.next_seq += 1
        channel.waiting.append(message)
        if message.static:
            channel.static_candidates += 1
        # No agreement now, and none can come from an earlier message: a header is certain,
        # so send it at once (pipelines header round trips of back-to-back calls).
        if channel.static_desc is None and channel.static_candidates == int(message.static):
            message.header = True
            self._send_header(peer, message)
        self._ensure_link(peer)

    def _send_header(self, peer: _Peer, message: Message) -> None:
        message.header_sent = True
        frame = {
            "k": "h",
            "e": message.epoch,
            "c": "s" if message.op.kind == "send" else "r",
            "q": message.seq,
            "d": [[dtype, list(shape)] for dtype, shape in message.desc],
            "st": message.static,
            "t": message.transport,
        }
        self._send_frame(peer, frame)

    def _ensure_prepared(self, peer: _Peer, transport: str) -> None:
        if peer.prepared.get(transport) is not None:
            return
        peer.prepared[transport] = "running"
        epoch, rank = peer.epoch, peer.rank

        def prepare() -> None:
            log.debug("p2p: preparing %s with rank %d (epoch %d)", transport, rank, epoch)
            try:
                self.ctx.transport(transport).prepare([rank])
                error = None
            except BaseException as exc:
                error = exc
            log.debug("p2p: prepared %s with rank %d: %s", transport, rank, error or "ok")
            self.call(lambda: self._on_prepared(rank, transport, epoch, error))

        self._helpers.submit(prepare)

    def _on_prepared(self, rank: int, transport: str, epoch: int, error: Any) -> None:
        peer = self._peer(rank)
        if epoch != peer.epoch:
            return  # a fault reset the pair meanwhile; the new epoch prepares again
        if error is None:
            peer.prepared[transport] = "done"
            return
        peer.prepared.pop(transport, None)
        if not isinstance(error, TensorFerryError):
            error = TransportError(
                f"{transport}: preparing the pair with rank {rank} failed: {error}"
            )
        self._fault_pair(peer, error, notify=True)

    # ------------------------------------------------------------------ progress
    def _progress(self) -> None:
        for peer in list(self._peers.values()):
            for kind in ("send", "recv"):
                self._resolve(peer, kind)
        for unit in list(self._units):
            if unit.state == "waiting" and self._issuable(unit):
                self._issue(unit)

    def _resolve(self, peer: _Peer, kind: str) -> None:
        channel: _Channel = peer.channels[kind]
        while channel.waiting:
            message: Message = channel.waiting[0]
            if message.header is None:
                if channel.static_desc is not None:
                    message.header = False
                else:
                    message.header = True
                    self._send_header(peer, message)
            if message.header:
                frame = channel.peer_headers.pop(message.seq, None)
                if frame is None:
                    return
                self._agree(peer, channel, message, frame)
            else:
                self._check_static(peer, channel, message)
            if peer.channels[kind] is not channel:
                return  # a fault moved the pair to a new epoch meanwhile
            if channel.waiting and channel.waiting[0] is message:
                channel.waiting.popleft()
                if message.static:
                    channel.static_candidates -= 1

    def _agree(self, peer: _Peer, channel: _Channel, message: Message, frame: dict) -> None:
        theirs: Descriptor = tuple((d, tuple(s)) for d, s in frame["d"])
        ours = message.desc
        send_desc, recv_desc = (ours, theirs) if message.op.kind == "send" else (theirs, ours)
        src, dst = (self.rank, peer.rank) if message.op.kind == "send" else (peer.rank, self.rank)
        message.resolved = True
        try:
            if frame["t"] != message.transport:
                raise MismatchError(
                    f"rank {src} -> rank {dst}: transports differ: rank {self.rank} uses "
                    f"{message.transport!r}, rank {peer.rank} uses {frame['t']!r}",
                    field="transport",
                )
            compare(send_desc, recv_desc, src=src, dst=dst)
        except MismatchError as exc:
            unit = self._unit_of(message)
            if unit is not None:
                unit.symmetric_error_peers.add(peer.rank)
                self._fail_unit(unit, exc, cascade=True, skip_peer=None)
            self._retire(channel, message.seq)
            return
        if (
            message.static
            and frame["st"]
            and channel.static_desc is None
            and self.ctx.transport(message.transport).static_skips_headers
        ):
            channel.static_desc = ours
            channel.static_transport = message.transport

    def _check_static(self, peer: _Peer, channel: _Channel, message: Message) -> None:
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
            compare(agreed, message.desc, src=src, dst=dst)
        except MismatchError as exc:
            err = MismatchError(f"static channel changed: {exc}", field=exc.field)
            channel.waiting.popleft()
            if message.static:
                channel.static_candidates -= 1
            self._fault_pair(peer, err, notify=True)

    def _issuable(self, unit: Unit) -> bool:
        before = unit.after
        if before is not None:
            if before.state == "failed":
                err = before.error or TransportError("an earlier step failed")
                self._fail_unit(unit, err, cascade=True, skip_peer=None)
                return False
            if before.state != "done" and not (
                unit.after_issued_is_enough and before.state == "issued"
            ):
                return False
        first_seq: dict[tuple[int, str], int] = {}
        for message in unit.messages:
            peer = self._peers[message.op.peer]
            if not message.resolved or peer.prepared.get(message.transport) != "done":
                return False
            key = (message.op.peer, message.op.kind)
            first_seq[key] = min(first_seq.get(key, message.seq), message.seq)
        # A unit's messages on one channel are numbered consecutively: the unit may go once the
        # channel issued everything before its first one.
        return all(
            self._peers[peer].channels[kind].issue_next == seq
            for (peer, kind), seq in first_seq.items()
        )

    def _issue(self, unit: Unit) -> None:
        log.debug("p2p: issuing %s", unit.transfer.description)
        self._units.remove(unit)
        unit.state = "issued"
        self._issued.add(unit)
        for message in unit.messages:
            self._retire(self._peers[message.op.peer].channels[message.op.kind], message.seq)
        try:
            done_event = self.ctx.issue(unit)  # transports' start(), on the p2p streams
        except BaseException as exc:
            err = exc if isinstance(exc, TensorFerryError) else TransportError(str(exc))
            self._fail_unit(unit, err, cascade=True, skip_peer=None)
            return
        unit.transfer._mark_issued(done_event)
        pending = list(unit.pending)

        def ready() -> bool:
            return all(p.ready() for p in pending) and (done_event is None or done_event.query())

        future = self.ctx.completions.watch(
            ready,
            timeout=max(0.0, unit.deadline - time.monotonic()),
            description=unit.transfer.description,
        )
        future.add_done_callback(lambda f: self._on_completed(unit, f))

    def _on_completed(self, unit: Unit, future: Future) -> None:
        # On a completion-pool worker thread.
        exc = future.exception() if not future.cancelled() else TransportError("cancelled")
        if exc is None:
            unit.state = "done"
            unit.transfer._finish(None)
            self.call(lambda: self._issued.discard(unit))
            return
        if isinstance(exc, TransferTimeoutError):
            exc = TransferTimeoutError(
                f"{unit.transfer.description}: timed out (peer never completed its side)"
            )
        elif not isinstance(exc, TensorFerryError):
            exc = TransportError(f"{unit.transfer.description}: {exc}")
        self.call(lambda: self._fail_unit(unit, exc, cascade=True, skip_peer=None))

    def _retire(self, channel: _Channel, seq: int) -> None:
        channel.retired.add(seq)
        while channel.issue_next in channel.retired:
            channel.retired.discard(channel.issue_next)
            channel.issue_next += 1

    def _expire(self, now: float) -> None:
        for unit in [u for u in self._units if u.deadline <= now]:
            err = TransferTimeoutError(
                f"{unit.transfer.description}: timed out waiting for the peer "
                f"(no matching call within the transfer timeout)"
            )
            self._fail_unit(unit, err, cascade=True, skip_peer=None)

    # ------------------------------------------------------------------ failing
    def _all_units(self) -> list[Unit]:
        return [*self._units, *self._issued]

    def _unit_of(self, message: Message) -> Unit | None:
        for unit in self._all_units():
            if any(m is message for m in unit.messages):
                return unit
        return None

    def _finish(self, unit: Unit, exc: BaseException | None) -> None:
        # Never run user callbacks on this thread: hand completion to the pool.
        transfer = unit.transfer
        self.ctx.completions.watch(lambda: True, then=lambda: transfer._finish(exc))

    def _fail_unit(
        self, unit: Unit, exc: BaseException, *, cascade: bool, skip_peer: int | None
    ) -> None:
        if unit.state in ("done", "failed"):
            return
        was_issued = unit.state == "issued"
        unit.state = "failed"
        unit.error = exc
        if unit in self._units:
            self._units.remove(unit)
        self._issued.discard(unit)
        for pending in unit.pending:
            try:
                pending.abort()
            except Exception:
                log.exception("p2p: abort of pending ops failed")
        self._finish(unit, exc)
        if not cascade:
            return
        # The peers of a failed unit may have issued their side (or will, on agreed headers):
        # fault those pairs so both sides start afresh. A lone symmetric mismatch needs none.
        for rank in sorted(unit.peers):
            if rank == skip_peer:
                continue
            only_mismatch = (
                rank in unit.symmetric_error_peers
                and all(m.resolved for m in unit.messages if m.op.peer == rank)
                and not was_issued
                and len([m for m in unit.messages if m.op.peer == rank]) == 1
            )
            if only_mismatch:
                continue
            peer = self._peer(rank)
            if peer.lost is None:
                self._fault_pair(peer, exc, notify=True)

    def _fault_pair(
        self,
        peer: _Peer,
        err: BaseException,
        *,
        notify: bool,
        matched: dict[str, int] | None = None,
    ) -> None:
        """Moves the pair to its next epoch; see the module docstring."""
        old_epoch = peer.epoch
        if notify:
            # Only messages both sides numbered (headers agreed, or static) count as matched:
            # the peer fails its counterparts of those and renumbers the rest. A message the
            # peer had not yet posted is simply dropped; if it posts it later, it becomes the
            # first message of the new epoch.
            counts = {kind: self._agreed_count(peer.channels[kind]) for kind in ("send", "recv")}
            field_name = getattr(err, "field", None)
            self._send_frame(
                peer,
                {
                    "k": "f",
                    "e": old_epoch,
                    "n": counts,
                    "err": type(err).__name__,
                    "field": field_name,
                    "msg": str(err),
                },
            )
        log.info(
            "p2p: pair with rank %d faulted in epoch %d (%s): %s",
            peer.rank,
            old_epoch,
            "ours" if matched is None else f"theirs, matched {matched}",
            err,
        )
        # Messages the faulting side numbered failed with it; ours after those are renumbered.
        keep: list[Message] = []
        doomed: list[Unit] = []
        for unit in self._all_units():
            for message in unit.messages:
                if message.op.peer != peer.rank:
                    continue
                limit = None if matched is None else matched[message.op.kind]
                if (
                    limit is not None
                    and unit.state == "waiting"
                    and message.seq >= limit
                    and unit not in doomed
                ):
                    keep.append(message)
                elif unit not in doomed:
                    doomed.append(unit)
        keep = [m for m in keep if self._unit_of(m) not in doomed]
        debts = {}
        for kind in ("send", "recv") if matched is not None else ():
            owed = matched[kind] - peer.channels[kind].next_seq
            if owed > 0:  # only on static channels: see _agreed_count
                debts[kind] = (owed, err)
        self._new_epoch(peer, abort=True, reason=str(err))
        peer.debts = debts
        for unit in doomed:
            self._fail_unit(unit, err, cascade=True, skip_peer=peer.rank)
        for message in sorted(keep, key=lambda m: (m.op.kind, m.seq)):
            self._number(peer, message)
            self._ensure_prepared(peer, message.transport)

    @staticmethod
    def _agreed_count(channel: _Channel) -> int:
        # On a static channel every message is matched one to one without negotiation, so
        # all numbered ones count (the peer will post them: it promised static shapes).
        if channel.static_desc is not None or not channel.waiting:
            return channel.next_seq
        return channel.waiting[0].seq  # everything before the oldest unresolved message

    def _new_epoch(self, peer: _Peer, *, abort: bool, reason: str) -> None:
        peer.epoch += 1
        peer.channels = {"send": _Channel(), "recv": _Channel()}
        self._evict_transports(peer, abort=abort, reason=reason)
        replay, peer.future_frames = peer.future_frames, []
        for frame in replay:
            if peer.link is not None:
                self._on_frame(peer.link, frame)

    def _evict_transports(self, peer: _Peer, *, abort: bool, reason: str) -> None:
        names = list(peer.prepared)
        peer.prepared = {}
        for name in names:
            try:
                self.ctx.transport(name).evict(peer.rank, abort=abort, reason=reason)
            except Exception:
                log.exception("p2p: evicting %s for rank %d failed", name, peer.rank)

    # ------------------------------------------------------------------ commands
    def reset_pair(self, rank: int) -> None:
        """Engine-thread command: a clean, symmetric move to the next epoch (fresh transport
        resources), used by the uncached benchmark mode. Both ranks must call it at the same
        point of their programs, with nothing in flight between them."""
        peer = self._peer(rank)
        busy = [u for u in self._all_units() if rank in u.peers]
        if busy:
            raise ValueError(
                f"reset of the pair with rank {rank}: {len(busy)} transfer(s) in "
                "flight; wait for them first"
            )
        self._new_epoch(peer, abort=False, reason="reset")

    def mark_prepared(self, rank: int, transport: str) -> None:
        """Engine-thread command: ``transport`` was prepared for ``rank`` by ``tf.prepare``."""
        self._peer(rank).prepared[transport] = "done"

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
