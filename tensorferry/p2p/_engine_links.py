"""The p2p engine's side channels: one link per peer, the frames that travel on them, and
what a lost link means (see :mod:`._link` for the framing).

A mixin of :class:`._engine.Engine`, like :mod:`._engine_faults`: it uses the engine's state
(``_peers``, ``_units``, ``_selector``, ``_unflushed``, ``_helpers``, ``_local_links``,
``ctx``, ``rank``) and steps of the engine and its other parts (``call``, ``_maybe_reset``;
from :class:`._engine_faults.PairFaults`: ``_fault_pair``, ``_fail_unit``, ``_all_units``,
``_on_fault_ack``, ``_on_crossed_fault``, ``_evict_transports``), and runs under the engine's
lock.
"""

from __future__ import annotations

import contextlib
import logging
import selectors

from tensorferry.errors import MismatchError, PeerLostError, TransferTimeoutError, TransportError
from tensorferry.p2p import _link, _trace
from tensorferry.p2p._engine_faults import mirrored
from tensorferry.p2p._engine_state import PeerState

__all__ = ["PeerLinks"]

# The engine's parts log as the engine: one logger to turn up for all of it.
log = logging.getLogger("tensorferry.p2p._engine")

_ERRORS = {c.__name__: c for c in (MismatchError, TransferTimeoutError, PeerLostError)}


def _error_of(frame: dict, what: str) -> BaseException:
    """The error a fault (or fault acknowledgement) frame carries, as the peer raised it."""
    cls = _ERRORS.get(frame.get("err", ""), TransportError)
    text = f"{what}: {frame.get('msg', '')}"
    return MismatchError(text, field=frame.get("field")) if cls is MismatchError else cls(text)


def _frame_text(frame: dict) -> str:
    """A side-channel frame for the flight recorder (``_trace``): its kind and numbers."""
    return ",".join(f"{k}={v}" for k, v in frame.items() if k not in ("m", "d", "t"))


class PeerLinks:
    """Links to peers: made, read, written, lost; frames handed to the engine's handlers."""

    def _read_link(self, link: _link.Link) -> int:
        """Handles the frames that came on ``link``; returns their count, or -1 when the link
        was lost."""
        return self._handle_frames(link, link.receive())

    def _handle_frames(self, link: _link.Link, frames: list[dict] | None) -> int:
        """Handles ``frames`` read from ``link`` (``None``: it was lost); returns their count,
        or -1 when the link was lost."""
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
                    self.ctx.peer_address(rank),
                    my_rank=self.rank,
                    timeout=self.ctx.timeout_s,
                    local=self._local_links,
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
