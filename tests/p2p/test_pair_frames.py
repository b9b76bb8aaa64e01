"""A pair's frames in the order a peer's wires can deliver them, in one process: a
:class:`~tensorferry.p2p._pair.Pair` fed frames by hand, over a route whose device work is
always finished (what NCCL's routes look like to the pair)."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from tensorferry.errors import MismatchError
from tensorferry.p2p._message import ENDED, ISSUED, Message
from tensorferry.p2p._pair import Pair
from tensorferry.p2p._spec import describe, descriptor_text
from tensorferry.p2p._transport import P2POp


class _Route:
    """A two-sided route that confirms receives (as NCCL's does) and finishes at once."""

    name = "two-sided"
    receiver_posts = False
    one_sided = False
    confirms_receives = True

    def __init__(self) -> None:
        self.started: list[int] = []

    def prepared(self, pair: Pair, kind: str) -> bool:
        return True

    def start(self, pair: Pair, message: Message, *, into=None) -> None:
        self.started.append(message.seq)
        message.pending = "issued"

    def finished(self, pair: Pair, message: Message) -> bool:
        return True


class _Out:
    """Our link to the peer: keeps what we write."""

    closed = False
    wants_write = False  # the socket took every frame

    def __init__(self) -> None:
        self.frames: list[dict] = []

    def send(self, frame: dict) -> None:
        self.frames.append(frame)

    def queue(self, frame: dict) -> None:
        self.frames.append(frame)

    def flush(self) -> None:
        pass

    def receive(self) -> list:
        return []


class _Context:
    rank, timeout_s = 0, 5.0

    def __init__(self) -> None:
        self.two_sided = _Route()

    def route(self, name: str) -> _Route:
        return self.two_sided

    def evict_routes(self, pair: Pair, *, reason: str) -> None:
        pass


@pytest.fixture
def pair():
    pair = Pair(_Context(), peer=1)
    pair._out = _Out()
    return pair


def _receive(pair: Pair) -> Message:
    tensor = torch.zeros(4)
    message = Message(P2POp("recv", 1, (tensor,), describe([tensor])), "two-sided", None)
    pair.submit([message])
    return message


def _header(seq: int) -> dict:
    return {
        "k": "h",
        "e": 0,
        "n": seq,
        "d": descriptor_text(describe([torch.zeros(4)])),
        "r": "two-sided",
    }


def test_a_receive_called_after_its_send_ended_ends(pair):
    # The sender's header and its "sent" come before the receive is called: a small NCCL
    # message ends on the sender once its bytes are buffered.
    pair._on_frame(_header(0))
    pair._on_frame({"k": "s", "e": 0, "n": 0})
    message = _receive(pair)
    pair.progress()
    assert pair.ctx.two_sided.started == [0]
    assert message.state == ENDED and message.error is None
    assert {"k": "a", "e": 0, "n": 0} in pair._out.frames


def test_a_receive_waits_for_its_senders_word(pair):
    message = _receive(pair)
    pair._on_frame(_header(0))
    pair.progress()
    assert message.state == ISSUED  # its bytes may not be there: the send has not ended
    pair._on_frame({"k": "s", "e": 0, "n": 0})
    pair.progress()
    assert message.state == ENDED and message.error is None


def test_a_sent_word_for_a_receive_not_issued_yet_is_kept(pair):
    first, second = _receive(pair), _receive(pair)
    pair._on_frame(_header(1))  # message 1's header and word come first
    pair._on_frame({"k": "s", "e": 0, "n": 1})
    pair.progress()
    assert first.state != ENDED and second.state != ENDED  # issued in number order
    for frame in (_header(0), {"k": "s", "e": 0, "n": 0}):
        pair._on_frame(frame)
    pair.progress()
    assert first.state == ENDED and second.state == ENDED
    assert first.error is None and second.error is None


def test_frames_a_full_socket_did_not_take_are_written_later(pair):
    # A burst of posts (600 receives called at once) fills the socket: what it did not take
    # waits in the link, and the pair's next step writes it though no frame follows.
    import socket

    from tensorferry.p2p._link import Link

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    theirs.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    pair._out, peer = Link(ours, 1), Link(theirs, 0)
    try:
        sent = 0
        while not pair._out.wants_write:
            pair._send({"k": "p", "e": 0, "n": sent, "pad": "x" * 200})
            sent += 1
        received: list[dict] = []
        for _ in range(1000):
            received += peer.receive()
            if len(received) == sent:
                break
            pair.progress()
        assert [frame["n"] for frame in received] == list(range(sent))
    finally:
        pair._out.close()
        peer.close()


def test_a_rank_that_only_sent_says_bye_on_its_peers_link(pair):
    # Over a route the receiver posts first, a rank that only sends never writes a frame and
    # never makes its own link. Its tf.shutdown() still says bye, so a receive already issued
    # on the peer (its bytes may be there) is not failed as if the rank had died.
    import socket

    from tensorferry.p2p._link import Link

    senders_end, receivers_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    sender = Pair(_Context(), peer=1)
    sender._in = Link(senders_end, 1)  # the link the receiver made to it
    pair._out = Link(receivers_end, 0)  # the receiver's own link
    pair._on_frame(_header(0))
    message = _receive(pair)
    pair.progress()
    assert message.state == ISSUED
    sender.close(RuntimeError("tf.shutdown()"))
    for _ in range(200):  # our link is read every few milliseconds
        pair.progress()
        if pair.lost is not None:
            break
        time.sleep(0.005)
    assert "shut down" in str(pair.lost)
    assert message.state == ISSUED  # not failed: its route says how it ends


class _PostingRoute:
    """A route the receiver posts first (as ce and gloo): keeps the runs it is given."""

    name = "posting"
    receiver_posts = True
    one_sided = True
    confirms_receives = False

    def __init__(self) -> None:
        self.runs: list[tuple[str, list[int]]] = []

    def prepared(self, pair: Pair, kind: str) -> bool:
        return True

    def post(self, pair: Pair, messages: list[Message]) -> None:
        self.runs.append(("post", [m.seq for m in messages]))

    def stage(self, pair: Pair, message: Message) -> None:
        self.runs.append(("stage", [message.seq]))

    def posted(self, pair: Pair, message: Message) -> None:
        return None  # posts come as frames here

    def write(self, pair: Pair, sends: list[tuple[Message, dict]]) -> None:
        self.runs.append(("write", [m.seq for m, _ in sends]))

    def finished(self, pair: Pair, message: Message) -> bool:
        return False


def _messages(kind: str, count: int) -> list[Message]:
    tensor = torch.zeros(4)
    op = P2POp(kind, 1, (tensor,), describe([tensor]))
    return [Message(op, "posting", None) for _ in range(count)]


def test_a_calls_messages_are_posted_and_written_as_one_run(pair):
    # One step of the pair hands a call's messages to the route at once: the copy-engine
    # route then waits for the caller's event and writes its word once for all of them.
    route = pair.ctx.two_sided = _PostingRoute()
    receives = _messages("recv", 3)
    pair.submit(receives)
    assert route.runs == [("post", [0, 1, 2])]
    assert all(m.state == ISSUED for m in receives)
    sends = _messages("send", 3)
    pair.submit(sends)
    # Staged at the call (what their issue needs besides the post); no post from the peer yet
    assert route.runs[1:] == [("stage", [0]), ("stage", [1]), ("stage", [2])]
    del route.runs[1:]
    desc = descriptor_text(describe([torch.zeros(4)]))
    for seq in (0, 1):  # two posts come before the next step, the third after it
        pair._on_frame({"k": "p", "e": 0, "n": seq, "d": desc, "r": "posting"})
    pair.progress()
    pair._on_frame({"k": "p", "e": 0, "n": 2, "d": desc, "r": "posting"})
    pair.progress()
    assert route.runs[1:] == [("write", [0, 1]), ("write", [2])]
    assert all(m.state == ISSUED for m in sends)


class _TwoRoutes(_Context):
    """Both kinds of route: the peer may choose the other one for a message."""

    def __init__(self) -> None:
        super().__init__()
        self.posting = _PostingRoute()

    def route(self, name: str) -> Any:
        return self.posting if name == "posting" else self.two_sided


def _frame_of_the_other_route(kind: str, seq: int) -> dict:
    """The peer's frame for our message ``seq`` of ``kind``, from the other kind of route: a
    two-sided send's header for our posted receive, a post for our two-sided send."""
    desc = descriptor_text(describe([torch.zeros(4)]))
    if kind == "recv":
        return {"k": "h", "e": 0, "n": seq, "d": desc, "r": "two-sided"}
    return {"k": "p", "e": 0, "n": seq, "d": desc, "r": "posting"}


@pytest.mark.parametrize("frame_first", [True, False], ids=["frame first", "call first"])
@pytest.mark.parametrize("kind", ["recv", "send"])
def test_routes_of_two_kinds_for_one_message_fail_it_on_the_transport(kind, frame_first):
    # Neither side would ever answer the other (a posted receive reads no header, a two-sided
    # send reads no post): the step that sees both fails the message at once, whichever of
    # the peer's frame and this rank's call came first, and tells the peer.
    pair = Pair(_TwoRoutes(), peer=1)
    pair._out = _Out()
    ours = "posting" if kind == "recv" else "two-sided"
    tensor = torch.zeros(4)
    message = Message(P2POp(kind, 1, (tensor,), describe([tensor])), ours, None)
    if frame_first:
        pair._on_frame(_frame_of_the_other_route(kind, 0))
        pair.submit([message])
    else:
        pair.submit([message])
        pair._on_frame(_frame_of_the_other_route(kind, 0))
        pair.progress()
    assert message.state == ENDED
    assert isinstance(message.error, MismatchError) and message.error.field == "transport"
    assert "different transports for message 0" in str(message.error)
    assert [frame["k"] for frame in pair._out.frames if frame["k"] == "f"] == ["f"]


def test_the_idle_watcher_steps_only_the_pairs_nobody_steps():
    """The watcher thread steps a pair nobody stepped for half its period (a rank that makes
    no call still answers its peer) and leaves one that a caller drives to that caller: its
    step would take the GIL and the pair's lock from under the caller's wait."""
    import threading

    from tensorferry.p2p import _context

    class _Pair:
        def __init__(self) -> None:
            self.lock = threading.RLock()
            self.stepped_at = 0.0
            self.watched = 0

        def progress(self) -> None:
            self.stepped_at = time.monotonic()
            self.watched += 1

    driven, idle = _Pair(), _Pair()
    ctx = object.__new__(_context.P2PContext)
    ctx._stopping = threading.Event()
    ctx._pairs = {1: driven, 2: idle}
    watcher = threading.Thread(target=ctx._watch_idle_pairs)
    watcher.start()
    try:
        until = time.monotonic() + 12 * _context._IDLE_READ_S
        while time.monotonic() < until:
            driven.stepped_at = time.monotonic()  # a caller's wait steps it all along
            time.sleep(_context._IDLE_READ_S / 20)
    finally:
        ctx._stopping.set()
        watcher.join(5)
    assert driven.watched == 0
    assert idle.watched >= 5
