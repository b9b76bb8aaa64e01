"""A pair of ranks seen from one side: numbering, frames, issue, completion and faults.

Messages are numbered per direction in the order of this rank's calls. The k-th send from A to
B meets the k-th receive B posts from A. Frames (small
JSON dicts on the control links, :mod:`._links`) say what each side posted:

=========  ==============  =====================================================================
frame      from            meaning
=========  ==============  =====================================================================
``h``      sender          header of message n of a two-sided route (nccl): layout and route
``a``      receiver        message n of a two-sided route matched; its receive is issued
``s``      sender          message n left (NCCL: an aborted receive can end without its bytes)
``p``      receiver        post of message n of a route the receiver posts first (ce, gloo):
                           layout, route, where it goes
``m``      the comparer    message n did not match (``dir``: whose message the frame is about)
``f``      either          fault number ``e``: every open message fails; the sender's counts
``fa``     the other side  the answer to ``f``: its counts
``bye``    either          ``tf.shutdown()``: the pair ends
=========  ==============  =====================================================================

Whoever issues the data movement compares the two layouts. On a route the receiver posts first
(ce, gloo) that is the sender: the receiver's call posts its buffers, and the sender writes into
them (ce) or sends into the receives posted there (gloo); after a mismatch it withdraws the post
(gloo: empty sends end the posted receives). On a two-sided route (nccl) the sender issues at
once and the receiver compares (after a mismatch it takes the bytes into scratch, so that
nothing waits). Messages of a direction are issued in number order.

A fault (a deadline passed, a route failed) fails every open message of the pair on both sides
and aborts the pair's route resources: the next message makes fresh ones (a new *epoch*, which
names them). Numbers go on: the k-th call of a direction always meets the peer's k-th call of
it, and where either failed, both do. So a fault sets a *cut* per direction, the larger of both
sides' counts of numbered messages then: every message below it that is not done has failed,
including calls the peer makes only later (a receive posted after its sender gave up fails at
once). The faulting side sends ``f`` with its counts; the peer answers ``fa`` with its own (two
faults that cross answer each other). Until the answer comes the faulting side numbers new
calls but issues none of them: some may fall below the cut. No fault shifts a later message,
and other pairs never hear of it.

A peer that makes no call still answers: a watcher thread (``P2PContext._watch_idle_pairs``)
steps the pairs nobody stepped for a few milliseconds.

Thread-safety: every method runs under the pair's re-entrant lock; callers' threads, the
acceptor thread (attaching the peer's link) and the completion pool's poller (transfers with
callbacks) take it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import select
import threading
import time
from typing import TYPE_CHECKING, Any

from tensorferry.errors import (
    MismatchError,
    PeerLostError,
    TensorFerryError,
    TransferTimeoutError,
    TransportError,
)
from tensorferry.p2p._links import first_line
from tensorferry.p2p._message import ENDED, ISSUED, WAITING, Message
from tensorferry.p2p._spec import compare, descriptor_from_text, descriptor_text

if TYPE_CHECKING:
    from tensorferry.p2p._context import P2PContext

__all__ = ["Pair"]

log = logging.getLogger(__name__)

_ERRORS = {c.__name__: c for c in (MismatchError, TransferTimeoutError, PeerLostError)}
# How often our own link is read for its end (a peer gone without a word); the peer's link,
# read at every step, tells sooner.
_OUT_READ_S = 0.005
# How long a route that found its connection closed waits for the link to say why (a fault
# notice, or its own end) before it faults on its own.
_PEERS_WORD_S = 0.2


class Pair:
    """This rank's side of its pair with ``peer``."""

    def __init__(self, ctx: P2PContext, peer: int) -> None:
        self.ctx = ctx
        self.peer = peer
        self.lock = threading.RLock()
        self.epoch = 0
        self.resets = 0  # reset() calls so far
        self._next = {"send": 0, "recv": 0}
        # Announced and issued in number order: the next number of each to look at.
        self._to_announce = {"send": 0, "recv": 0}
        self._to_issue = {"send": 0, "recv": 0}
        self._cut = {"send": 0, "recv": 0}  # numbers below these that are not done failed
        self._faults = 0  # faults so far: both sides count alike (frames name them)
        self._awaiting: set[int] = set()  # our faults the peer has not answered
        self._fault_error: BaseException | None = None  # what failed the messages below cut
        self._open: dict[str, dict[int, Message]] = {"send": {}, "recv": {}}
        self._frames: dict[str, dict[int, dict]] = {"h": {}, "p": {}}  # came before their call
        # (frame kind, number) of frames new since the last step, and of messages numbered
        # since then whose frame came first: where both are there, the step checks that the two
        # sides chose routes of one kind (_check_new_routes)
        self._unchecked: list[tuple[str, int]] = []
        self._out: Any = None  # our link to the peer (we write; the peer only its bye)
        self._in: Any = None  # the peer's link to us (we read)
        self._out_read_at = 0.0
        self.stepped_at = 0.0  # monotonic time of the last step (progress) anyone ran
        # No open message's deadline comes before this (monotonic): steps look at none before.
        self._deadlines_from = math.inf
        self.lost: BaseException | None = None
        self.streams: dict[str, Any] = {}  # CUDA: one send and one receive stream per pair
        self._client: Any = None

    # ------------------------------------------------------------------ calls
    def submit(self, messages: list[Message]) -> None:
        """Numbers ``messages`` (one call's, in call order) and moves them as far as they go
        now, in one step: a route issues a step's posts or writes together."""
        with self.lock:
            for message in messages:
                if self.lost is not None:
                    self._end(message, self.lost)
                    continue
                kind = message.kind
                message.seq = self._next[kind]
                message.epoch = self.epoch
                self._next[kind] += 1
                if message.seq < self._cut[kind]:  # its peer's side failed in a fault
                    self._end(message, _sibling(self._fault_error, self.peer))
                    continue
                self._open[kind][message.seq] = message
                frame_kind = "h" if kind == "recv" else "p"
                if message.seq in self._frames[frame_kind]:  # (else the frame, once it comes)
                    self._unchecked.append((frame_kind, message.seq))
                if message.transfer is not None:
                    self._deadlines_from = min(self._deadlines_from, message.transfer.deadline)
            self._advance(poll=False)  # the peer's frames are read by whoever waits

    def progress(self) -> None:
        """Reads the peer's frames, ends what passed its deadline, issues what can go and
        completes what finished."""
        with self.lock:
            self.stepped_at = now = time.monotonic()
            self._pump()
            self._check_deadlines(now)
            self._advance()

    def settle(self) -> None:
        """Ends what passed its deadline or its route finished and issues what that lets go,
        without reading the peer's frames: a waiter's look right after a route's blocking wait
        ended (deadlines first: a message that timed out is the fault's cause)."""
        with self.lock:
            self._check_deadlines(time.monotonic())
            self._advance()

    def attach_incoming(self, link: Any) -> None:
        """The acceptor thread hands over the link the peer made to us."""
        with self.lock:
            if self._in is not None and not self._in.closed:
                self._in.close()  # a peer that made a new link: the old one is done
            self._in = link

    @property
    def busy(self) -> bool:
        """Whether messages are open (read without the lock: a hint)."""
        return bool(self._open["send"] or self._open["recv"])

    def waiting(self) -> bool:
        """Whether a message waits for the peer's frame (or its route's making): only a thread
        that steps the pair issues it."""
        with self.lock:
            return any(m.waits_for_peer() for open_ in self._open.values() for m in open_.values())

    def incoming_fd(self) -> int | None:
        """The descriptor the peer's frames arrive on (``None`` before it connected)."""
        link = self._in
        return None if link is None or link.closed else link.fileno()

    def connect(self) -> None:
        """Makes our link to the peer, if not yet made (blocking, bounded by the timeout).

        Raises:
            PeerLostError: the peer cannot be reached.
        """
        if self.lost is not None:
            raise self.lost
        if self._out is None:
            self._out = self.ctx.links.connect(self.peer, self.ctx.timeout_s)

    def open_transfers(self) -> list[Any]:
        """The transfers of the pair's open messages."""
        with self.lock:
            opened = [m for open_ in self._open.values() for m in open_.values()]
        return list({id(m.transfer): m.transfer for m in opened if m.transfer is not None}.values())

    def reset(self) -> None:
        """Lets go of the pair's route resources: the next message makes fresh ones (both ranks
        call it at the same point of their programs, with nothing in flight between them).

        A message still open (``tf._api._reset_pair`` waits for them first) ends as a step
        would end it, or fails if its work has not finished: nothing open may outlive the
        resources it runs on."""
        with self.lock:
            self.progress()
            error = TransportError(f"the pair with rank {self.peer} was reset meanwhile")
            for kind in ("send", "recv"):
                for message in list(self._open[kind].values()):
                    self._end(message, error)
            self.epoch += 1
            self.resets += 1
            self.ctx.evict_routes(self, reason="reset")

    def stream(self, kind: str) -> Any:
        """The CUDA stream this pair's messages of ``kind`` run on."""
        stream = self.streams.get(kind)
        if stream is None:
            from tensorferry.runtime import Client

            if self._client is None:
                self._client = Client(devices=[self.ctx.device])
            stream = self.streams[kind] = self._client.stream(self.ctx.device, kind)
        return stream

    # ------------------------------------------------------------------ frames
    @staticmethod
    def _about(kind: str, message: Message) -> dict:
        """The frame ``kind`` (``h``: a header, ``p``: a post) of ``message``: its number, its
        layout and its route."""
        return {
            "k": kind,
            "e": message.epoch,
            "n": message.seq,
            "d": descriptor_text(message.desc),
            "r": message.route,
        }

    def send_posts(self, posts: list[tuple[Message, dict]]) -> None:
        """Writes the post frame of each ``(message, the route's fields)``, in one write."""
        frames = []
        for message, fields in posts:
            frame = self._about("p", message)
            frame.update(fields)
            frames.append(frame)
        self._send(*frames)

    def _send(self, *frames: dict) -> None:
        """Writes ``frames`` to the peer (in one write), connecting first if need be.

        Raises:
            PeerLostError: the peer cannot be reached (the pair is then lost).
        """
        self.connect()
        try:
            self._out.send(*frames)
        except OSError as exc:
            self._gone(str(exc))
            raise self.lost from None  # type: ignore[misc]

    def _pump(self) -> None:
        """Writes what our link still holds, handles every frame the peer sent so far; notices
        a peer that is gone."""
        if self.lost is not None:
            return  # nothing more comes (what is issued still finishes: see _on_bye)
        if self._out is not None and self._out.wants_write:
            # Frames a full socket did not take (a burst of posts): nothing else writes them.
            try:
                self._out.flush()
            except OSError as exc:
                self._gone(str(exc))
                return
        if self._read_incoming():
            return
        now = time.monotonic()
        if self._out is not None and now > self._out_read_at + _OUT_READ_S:
            self._out_read_at = now
            # The peer writes on our link only its bye (when it never made its own link), then
            # closes it. Its last frames on its own link may have come after our read of it
            # above: they are handled first.
            frames = self._out.receive()
            if frames is None and not self._read_incoming():
                self._gone("its connection closed")
            for frame in frames or ():
                self._on_frame(frame)

    def _read_incoming(self) -> bool:
        """Handles the frames on the peer's link; returns whether the pair is now lost."""
        if self._in is not None:
            frames = self._in.receive()
            if frames is None:
                self._gone("its connection closed")
                return True
            for frame in frames:
                self._on_frame(frame)
                if self.lost is not None:
                    return True
        return False

    def _on_frame(self, frame: dict) -> None:
        kind = frame.get("k")
        if kind == "bye":
            self._on_bye()
            return
        if kind in ("f", "fa"):
            self._on_fault_frame(frame)
            return
        seq = frame["n"]
        mine = "recv" if kind in ("h", "s") else "send" if kind in ("p", "a") else frame.get("dir")
        if seq < self._cut.get(mine, 0):
            return  # about a message a fault failed already
        if kind in ("h", "p"):
            self._frames[kind][seq] = frame  # taken by its message (see _advance)
            self._unchecked.append((kind, seq))
            return
        if kind in ("a", "s"):  # accepted (for our send) / sent (for our receive)
            message = self._open["send" if kind == "a" else "recv"].get(seq)
            if message is not None:
                message.answered = True
            elif kind == "s" and seq in self._frames["h"]:
                # A send can end before its receive is called (NCCL buffers small messages):
                # the header waiting for that receive keeps the word.
                self._frames["h"][seq]["sent"] = True
            return
        if kind == "m":
            message = self._open[mine].get(seq)
            if message is not None:
                error = MismatchError(frame.get("why", "mismatch"), field=frame.get("field"))
                if message.kind == "send":  # a two-sided send: the receiver takes its bytes
                    message.error, message.answered = error, True  # into scratch: it goes on
                elif self.ctx.route(message.route).one_sided:
                    self._end(message, error)  # nothing of it waits on the route
                else:  # a posted gloo receive ends once the sender's empty sends reach it
                    message.error = error

    # ------------------------------------------------------------------ issue
    def _advance(self, *, poll: bool = True) -> None:
        if self._awaiting:
            return  # nothing is issued until the peer answers our fault (see the docstring)
        if self._unchecked:
            self._check_new_routes()
        for kind in ("send", "recv"):
            last = self._next[kind]
            seq = self._to_announce[kind]
            if seq < last:
                posts: list[tuple[Any, Message, None]] = []  # (route, message, None): see _go
                while seq < last:  # (a fault on the way empties _open: look it up each time)
                    message = self._open[kind].get(seq)
                    unannounced = message is not None and not message.announced
                    if unannounced and not self._announce(message, posts):
                        break  # its route is still being made: later messages wait for it
                    seq += 1
                self._to_announce[kind] = seq
                self._go(posts)
            seq = self._to_issue[kind]
            if seq < last:
                writes: list[tuple[Any, Message, dict]] = []  # (route, message, its post)
                while seq < last:
                    message = self._open[kind].get(seq)
                    waiting = message is not None and message.state == WAITING
                    if waiting and not self._try_issue(message, writes):
                        break  # later messages of this direction wait for it
                    seq += 1
                self._to_issue[kind] = seq
                self._go(writes)
            if poll and self._open[kind]:
                for message in list(self._open[kind].values()):
                    if message.state == ISSUED and not self._poll(message):
                        break

    def _announce(self, message: Message, posts: list) -> bool:
        """Tells the peer of ``message``: a two-sided send's header; a posted receive joins
        the step's ``posts`` (posting also issues it: the sender sends once it reads the post).
        A send of a route the receiver posts first is staged: what its issue needs that does
        not depend on the post is done now, while the receiver's call is under way. Returns
        ``False`` when the route's resources with the peer are still being made."""
        route = self.ctx.route(message.route)
        try:
            if not route.receiver_posts:
                if message.kind == "send":
                    self._send(self._about("h", message))
            elif message.kind == "send":
                if message.after is None:  # (a held send's bytes are not there yet)
                    route.stage(self, message)
            else:
                if not route.prepared(self, "recv"):
                    return False
                posts.append((route, message, None))
        except TensorFerryError as exc:  # the pair is lost, or its route failed: a fault
            self._failed(message, exc)
        message.announced = True
        return True

    def _go(self, run: list[tuple[Any, Message, dict | None]]) -> None:
        """Issues a step's posts (receives) or writes (sends, with their posts) on the routes
        the receiver posts first, each route's in one call: the copy-engine route then waits
        for the caller's stream and writes its word once for a batch's messages."""
        while run:
            route = run[0][0]
            ours = [item for item in run if item[0] is route]
            run = [item for item in run if item[0] is not route]
            try:
                if ours[0][2] is None:
                    route.post(self, [message for _, message, _ in ours])
                else:
                    route.write(self, [(message, post) for _, message, post in ours])
            except TensorFerryError as exc:
                self._failed(ours[0][1], exc)
                return  # a fault failed the rest, or the pair is lost
            for _, message, _ in ours:
                message.state = ISSUED  # (only now: threads that wait read it without the lock)

    def _hear_from_peer(self, message: Message, seconds: float) -> None:
        """Reads the peer's frames for up to ``seconds``, until ``message`` ended (a fault
        frame) or the pair is lost (the link's end)."""
        until = time.monotonic() + seconds
        while message.state != ENDED and self.lost is None:
            fd, left = self.incoming_fd(), until - time.monotonic()
            if fd is None or left <= 0:
                return
            select.select([fd], [], [], left)
            self._pump()

    def _failed(self, message: Message, exc: TensorFerryError) -> None:
        """Issuing or completing ``message`` raised: the pair is lost (its messages failed), or
        its route failed, which is a fault, unless the peer's fault explains it. A route that
        found its connection closed asks the link first: a peer whose gloo wait timed out
        closed the connection before its fault's notice left, and the notice (the real cause:
        the peer's timeout) comes on the link within moments, as would the link's end of a
        peer that is gone."""
        if self.lost is None and message.state != ENDED:
            self._pump()  # a fault frame ends the message with the peer's error
            if isinstance(exc, PeerLostError):
                self._hear_from_peer(message, _PEERS_WORD_S)
        if message.state == ENDED:
            return
        if self.lost is not None:
            self._end(message, exc)
        else:
            self._fault(exc, True, cause=message)

    def _check_new_routes(self) -> None:
        """A header for a posted receive, or a post for a two-sided send: the two sides chose
        different routes for one message (neither side would answer the other). Looks only at
        the frames new since the last step and the messages numbered since then after their
        frame, so many receives posted ahead cost each step nothing."""
        unchecked, self._unchecked = self._unchecked, []
        for frame_kind, seq in unchecked:
            frame = self._frames[frame_kind].get(seq)
            message = self._open["recv" if frame_kind == "h" else "send"].get(seq)
            if frame is None or message is None:
                continue
            if self.ctx.route(message.route).receiver_posts == (frame_kind == "h"):
                self._route_mismatch(message, frame)
                return  # a fault: what was left to check is gone with its epoch

    def _try_issue(self, message: Message, writes: list) -> bool:
        """Issues ``message`` if it can go now (a send of a route the receiver posts first
        joins the step's ``writes``); returns whether it was taken care of."""
        route = self.ctx.route(message.route)
        kind, seq = message.kind, message.seq
        if message.held():
            return False  # later messages of its direction wait for it
        if message.after is not None and message.after.error is not None:
            self._failed(message, message.after.error)  # what it would send never came
            return True
        try:
            if not route.prepared(self, kind):
                return False
            if route.receiver_posts:  # a send: the receiver's post says where its bytes go
                post = self._frames["p"].pop(seq, None) or route.posted(self, message)
                if post is None:
                    return False
                if self._agrees(message, post):
                    writes.append((route, message, post))
                return True
            if kind == "send":
                route.start(self, message)
                message.state = ISSUED
                return True
            header = self._frames["h"].pop(seq, None)
            if header is None:
                return False
            if header.get("sent"):
                message.answered = True
            if self._agrees(message, header):
                self._send({"k": "a", "e": self.epoch, "n": seq})
                route.start(self, message)
            elif message.state == ENDED:  # the routes differ: the pair faulted
                return True
            else:  # take the sender's bytes into scratch: its send then ends, nothing waits
                route.start(self, message, into=descriptor_from_text(header["d"]))
            message.state = ISSUED
            return True
        except TensorFerryError as exc:
            self._failed(message, exc)
            return True

    def _agrees(self, message: Message, frame: dict) -> bool:
        """Compares ``message`` with the peer's frame for it. On a difference, tells the peer
        and (for a send, or a one-sided message) fails ``message``; returns whether they agree."""
        if frame.get("r") != message.route:
            self._route_mismatch(message, frame)
            return False
        if frame["d"] == descriptor_text(message.desc):  # one text holds the whole layout
            return True
        theirs = descriptor_from_text(frame["d"])
        sending = message.kind == "send"
        try:
            sender, receiver = (message.desc, theirs) if sending else (theirs, message.desc)
            src, dst = (self.ctx.rank, self.peer) if sending else (self.peer, self.ctx.rank)
            compare(sender, receiver, src=src, dst=dst)
            return True
        except MismatchError as exc:
            about = "recv" if sending else "send"  # the peer's message the frame is about
            self._send(
                {
                    "k": "m",
                    "e": self.epoch,
                    "n": message.seq,
                    "dir": about,
                    "why": str(exc),
                    "field": exc.field,
                }
            )
            if sending:
                route = self.ctx.route(message.route)
                if route.receiver_posts:
                    route.withdraw(self, message, frame)
                self._end(message, exc)
            else:
                message.error = exc  # a two-sided receive: ends once the scratch receive did
            return False

    def _route_mismatch(self, message: Message, frame: dict) -> None:
        error = MismatchError(
            f"rank {self.ctx.rank} and rank {self.peer} chose different transports for message "
            f"{message.seq} ({message.route!r} here, {frame.get('r')!r} there)",
            field="transport",
        )
        self._fault(error, True, cause=message)

    # ------------------------------------------------------------------ completion
    def _poll(self, message: Message) -> bool:
        """Ends ``message`` if its route finished it. Returns whether later messages of its
        direction may have finished: not after an unfinished one of a route that ends them in
        order (a one-sided route's words count up), so a waiter looks at one, not all."""
        route = self.ctx.route(message.route)
        try:
            if not route.finished(self, message):
                return not route.one_sided
        except TensorFerryError as exc:
            self._failed(message, exc)
            return False
        if not route.receiver_posts:
            if message.kind == "send" and route.confirms_receives:
                # (after a mismatch too: the receiver took the bytes into scratch, and that
                # receive ends only on this word)
                self._confirm_sent(message)
            if not message.answered and (message.kind == "send" or route.confirms_receives):
                # The receiver has not said whether it matched / the sender, that it sent.
                return True
        self._end(message, message.error)
        return True

    def _confirm_sent(self, message: Message) -> None:
        """Tells the receiver its message left: a route whose receive can end without its
        bytes when the pair is aborted (NCCL) ends a receive only once its sender says so."""
        if not message.confirmed:
            message.confirmed = True
            with contextlib.suppress(TensorFerryError):
                self._send({"k": "s", "e": self.epoch, "n": message.seq})

    def _check_deadlines(self, now: float) -> None:
        """Faults the pair for the first open message whose deadline passed by monotonic
        ``now``; looks at none before the earliest deadline known to be open."""
        if now <= self._deadlines_from:
            return
        self._deadlines_from = math.inf
        for kind in ("send", "recv"):
            for message in self._open[kind].values():
                if message.transfer is None:
                    continue
                if now <= message.transfer.deadline:
                    self._deadlines_from = min(self._deadlines_from, message.transfer.deadline)
                else:
                    why = (
                        "no matching call within the transfer timeout"
                        if message.state == WAITING
                        else "the transfer did not finish within its timeout"
                    )
                    if message.state == WAITING and self._silent(message):
                        why += (
                            f", or rank {self.peer}'s call chose another transport (a ce send "
                            "and an nccl receive never hear of each other: name one on both sides)"
                        )
                    error = TransferTimeoutError(f"{message.describe()}: timed out ({why})")
                    if message.state == WAITING and self._in is None:
                        error = self._store_problem(message) or error
                    self._fault(error, True, cause=message)
                    return

    def _silent(self, message: Message) -> bool:
        """Whether ``message`` is a CUDA message whose side writes no frame while it waits for
        the peer's (a send the receiver posts for, a two-sided receive): a peer whose call
        chose the other kind of route, also silent, cannot tell it apart from no call."""
        posts = self.ctx.route(message.route).receiver_posts
        cuda = bool(message.tensors) and message.tensors[0].is_cuda
        return cuda and posts == (message.kind == "send")

    def _store_problem(self, message: Message) -> BaseException | None:
        """Why a peer that never reached this rank may not have: the rendezvous store (where
        ranks find each other) is gone, or ``None`` when it answers."""
        try:
            self.ctx.store.check([f"addr/{self.peer}"])
        except Exception as exc:
            return PeerLostError(
                f"{message.describe()}: rank {self.peer} never reached this rank, and the "
                f"rendezvous store does not answer ({first_line(exc)}): its host may be gone"
            )
        return None

    def _end(self, message: Message, error: BaseException | None) -> None:
        if message.state == ENDED:
            return
        message.state = ENDED
        message.error = error
        self._open[message.kind].pop(message.seq, None)
        transfer, message.transfer = message.transfer, None  # no cycle outlives the message
        if transfer is not None:
            transfer._message_ended(message)

    # ------------------------------------------------------------------ faults
    def _fault(self, error: BaseException, notify: bool, *, cause: Message | None = None) -> None:
        """Fails every open message (``cause`` with ``error``, the others with a note of it),
        aborts the pair's route resources and moves to the next epoch. With ``notify`` the
        peer is told, and nothing more is issued until it answers."""
        fault = self._faults
        log.info("p2p: pair with rank %d: fault %d: %s", self.peer, fault, error)
        self._begin_epoch(error, cause)
        if notify:
            self._awaiting.add(fault)
            try:
                self._send({"k": "f", "e": fault, **self._counts(), **_error_fields(error)})
            except TensorFerryError:
                self._awaiting.discard(fault)

    def _begin_epoch(self, error: BaseException, cause: Message | None) -> None:
        self.epoch += 1
        self._faults += 1
        self._fault_error = error
        for kind in ("send", "recv"):
            self._cut[kind] = max(self._cut[kind], self._next[kind])
        self._frames = {"h": {}, "p": {}}
        self._unchecked = []
        opened, self._open = self._open, {"send": {}, "recv": {}}
        self.ctx.evict_routes(self, reason=str(error))
        for messages in opened.values():
            for message in messages.values():
                self._end(message, error if message is cause else _sibling(error, self.peer))

    def _counts(self) -> dict:
        return {"s": self._next["send"], "r": self._next["recv"]}

    def _on_fault_frame(self, frame: dict) -> None:
        """The peer's fault (``f``) or its answer to ours (``fa``): both carry its counts."""
        fault, kind = frame.get("e"), frame["k"]
        if kind == "f" and fault == self._faults:  # its fault, news to us: we fault too
            cls = _ERRORS.get(frame.get("err", ""), TransportError)
            error = cls(f"rank {self.peer} reset the pair: {frame.get('why', '')}")
            if cls is MismatchError:
                error = MismatchError(str(error), field=frame.get("field"))
            self._begin_epoch(error, None)
            self._raise_cut(frame)
            with contextlib.suppress(TensorFerryError):
                self._send({"k": "fa", "e": fault, **self._counts()})
            return
        if fault in self._awaiting:  # the answer to our fault (or a fault crossing ours)
            self._awaiting.discard(fault)
            self._raise_cut(frame)

    def _raise_cut(self, frame: dict) -> None:
        """Lifts the cut to the peer's counts; fails what is now below it."""
        self._cut["send"] = max(self._cut["send"], frame.get("r", 0))
        self._cut["recv"] = max(self._cut["recv"], frame.get("s", 0))
        for kind in ("send", "recv"):
            for seq, message in list(self._open[kind].items()):
                if seq < self._cut[kind]:
                    self._end(message, _sibling(self._fault_error, self.peer))
            for frame_kind in ("h", "p"):
                for seq in [n for n in self._frames[frame_kind] if n < self._cut[kind]]:
                    if (frame_kind == "h") == (kind == "recv"):
                        del self._frames[frame_kind][seq]

    def _on_bye(self) -> None:
        """The peer shut down cleanly: what it can no longer answer fails; what is issued
        already may still finish (its bytes may have been delivered) and ends as its route
        says."""
        self.lost = PeerLostError(f"rank {self.peer} shut down (tf.shutdown())")
        for link in (self._in, self._out):
            if link is not None:
                link.close()
        self._in = self._out = None
        for kind in ("send", "recv"):
            for message in list(self._open[kind].values()):
                posts = self.ctx.route(message.route).receiver_posts
                unanswered = kind == "send" and not posts and not message.answered
                if message.state == WAITING or unanswered:
                    self._end(message, self.lost)

    def _gone(self, why: str) -> None:
        """The peer's link broke or closed without a bye: it is lost."""
        self._lose(PeerLostError(f"rank {self.peer} is gone ({why})"))

    def _lose(self, error: BaseException) -> None:
        """The peer is gone: every open message fails with ``error``, and so does every later
        one."""
        if self.lost is not None and not self._open["send"] and not self._open["recv"]:
            return
        self.lost = error
        for link in (self._in, self._out):
            if link is not None:
                link.close()
        opened, self._open = self._open, {"send": {}, "recv": {}}
        self.ctx.evict_routes(self, reason=str(error))
        for messages in opened.values():
            for message in messages.values():
                self._end(message, error)

    def close(self, reason: BaseException) -> None:
        """``tf.shutdown()``: tells the peer, fails what is open, lets go of everything."""
        with self.lock:
            # A rank that only sent over a route the receiver posts first never wrote a frame,
            # so it never made its own link: the bye then goes back on the peer's.
            link = self._out if self._out is not None else self._in
            if self.lost is None and link is not None and not link.closed:
                with contextlib.suppress(OSError):
                    link.send({"k": "bye"})
            self._lose(reason)
            if self._client is not None:
                self._client.close()
                self._client = None


def _error_fields(error: BaseException) -> dict:
    fields = {"why": str(error), "err": type(error).__name__}
    if isinstance(error, MismatchError):
        fields["field"] = error.field
    return fields


def _sibling(error: BaseException | None, peer: int) -> BaseException:
    """The error of a message that failed because another message of its pair faulted."""
    text = f"the pair with rank {peer} was reset: {error}"
    if isinstance(error, MismatchError):
        return MismatchError(text, field=error.field)
    if isinstance(error, (TransferTimeoutError, PeerLostError)):
        return type(error)(text)
    return TransportError(text)
