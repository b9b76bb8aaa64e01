"""The copy-engine route's READY/DONE word over a run of messages (``one_sided._Word``), with
the driver's stream operations recorded instead of made: one write for a batch, never a word
left behind a wait of its stream, copies that carry on one another joined and queued before
the word; and how a step asks the driver about the allocations it keeps."""

from __future__ import annotations

import pytest

from tensorferry.p2p.copy_engine import one_sided


class _Stream:
    cuda_stream = 7


class _Ops(list):
    """The stream operations made, in order; ``fired``: the caller's events that fired."""

    def __init__(self) -> None:
        super().__init__()
        self.fired: set[str] = set()


@pytest.fixture
def ops(monkeypatch):
    made = _Ops()
    driver = one_sided._driver
    monkeypatch.setattr(one_sided, "is_done", lambda event: event in made.fired)
    monkeypatch.setattr(one_sided, "stream_wait", lambda s, event: made.append(("wait", event)))
    monkeypatch.setattr(driver, "write_value32", lambda s, at, value: made.append(("write", value)))
    monkeypatch.setattr(driver, "wait_value32", lambda s, at, value: made.append(("until", value)))
    monkeypatch.setattr(
        driver, "memcpy_async", lambda dst, src, n, s: made.append(("copy", dst, src, n))
    )
    return made


def _run(word: one_sided._Word, tickets_and_events: list[tuple[int, str]]) -> None:
    for ticket, event in tickets_and_events:
        word.after(event)
        word.owe(ticket)
    word.write()


def test_a_batch_waits_once_and_writes_its_word_once(ops):
    _run(one_sided._Word(_Stream(), 0), [(1, "batch"), (2, "batch"), (3, "batch")])
    assert ops == [("wait", "batch"), ("write", 3)]


def test_a_word_owed_is_written_before_the_stream_waits_for_the_next_event(ops):
    # Separate calls: the first send's word must not wait behind the second call's event,
    # which may itself wait for that word (a ping-pong that orders the caller's stream).
    _run(one_sided._Word(_Stream(), 0), [(1, "first"), (2, "second")])
    assert ops == [("wait", "first"), ("write", 1), ("wait", "second"), ("write", 2)]


def test_a_word_owed_is_written_before_the_stream_waits_for_ready(ops):
    word = one_sided._Word(_Stream(), 0)
    word.after("call")
    word.owe(1)
    word.wait(64, 2)  # the receiver's READY for the next message is not there yet
    word.owe(2)
    word.write()
    assert ops == [("wait", "call"), ("write", 1), ("until", 2), ("write", 2)]


def test_an_event_that_fired_is_not_waited_for(ops):
    ops.fired.add("over")
    _run(one_sided._Word(_Stream(), 0), [(1, "over"), (2, "over")])
    assert ops == [("write", 2)]


class _HostWord:
    def __init__(self, value: int) -> None:
        self.value = value


def test_ready_is_stored_by_the_host_where_its_stream_has_nothing_left(ops):
    ops.fired.add("over")
    host = _HostWord(4)  # the stream's last READY (4) has landed
    _run(one_sided._Word(_Stream(), 0, host=host, written=4), [(5, "over"), (6, "over")])
    assert ops == [] and host.value == 6


def test_ready_goes_on_the_stream_behind_what_the_stream_still_owes(ops):
    ops.fired.add("over")
    host = _HostWord(3)  # READY 4 is still queued on the stream: a store could be undone
    _run(one_sided._Word(_Stream(), 0, host=host, written=4), [(5, "over")])
    assert ops == [("write", 5)] and host.value == 3


def test_ready_goes_on_the_stream_once_the_run_queued_a_wait(ops):
    host = _HostWord(4)
    _run(one_sided._Word(_Stream(), 0, host=host, written=4), [(5, "pending")])
    assert ops == [("wait", "pending"), ("write", 5)] and host.value == 4


def _copy(target: int, source: int, nbytes: int = 16, homes=("a", 1)) -> one_sided._Copy:
    return one_sided._Copy(target, source, nbytes, homes)


def _send(word: one_sided._Word, ticket: int, event: str, *copies: one_sided._Copy) -> None:
    """One message of a write step, in the order the route makes its operations."""
    word.after(event)
    for copy in copies:
        word.copy(copy)
    word.owe(ticket)


def test_copies_that_carry_on_one_another_go_as_one(ops):
    ops.fired.add("over")
    word = one_sided._Word(_Stream(), 0)
    for n in range(3):  # views of one buffer into views of one buffer
        _send(word, n + 1, "over", _copy(1000 + 16 * n, 5000 + 16 * n))
    word.write()
    assert ops == [("copy", 1000, 5000, 48), ("write", 3)]


def test_copies_apart_or_in_other_allocations_stay_apart(ops):
    ops.fired.add("over")
    word = one_sided._Word(_Stream(), 0)
    _send(word, 1, "over", _copy(1000, 5000))
    _send(word, 2, "over", _copy(1016, 6000))  # its source lies elsewhere
    _send(word, 3, "over", _copy(1032, 6016, homes=("b", 1)))  # next to it, another allocation
    word.write()
    assert ops == [
        ("copy", 1000, 5000, 16),
        ("copy", 1016, 6000, 16),
        ("copy", 1032, 6016, 16),
        ("write", 3),
    ]


def test_a_held_copy_goes_before_the_word_and_before_a_wait(ops):
    word = one_sided._Word(_Stream(), 0)
    _send(word, 1, "first", _copy(1000, 5000))
    _send(word, 2, "second", _copy(1016, 5016))  # its caller's work is not over: a wait
    word.wait(64, 3)  # READY of the next message not there yet
    word.copy(_copy(1032, 5032))
    word.owe(3)
    word.write()
    assert ops == [
        ("wait", "first"),
        ("copy", 1000, 5000, 16),
        ("write", 1),
        ("wait", "second"),
        ("copy", 1016, 5016, 16),
        ("write", 2),
        ("until", 3),
        ("copy", 1032, 5032, 16),
        ("write", 3),
    ]


def _fake_allocations(monkeypatch, idents: dict[int, int]) -> list[int]:
    """``allocation_of(address)`` answered from ``idents`` (address -> buffer id; the base and
    size are not read here); returns the addresses asked about, in order."""
    asked: list[int] = []

    def allocation_of(address: int) -> tuple[int, int, int]:
        asked.append(address)
        return idents[address], address, 1

    monkeypatch.setattr(one_sided._driver, "allocation_of", allocation_of)
    return asked


def _kept(address: int, ident: int) -> one_sided._Runs:
    return one_sided._Runs([one_sided._Run(address, 8, ident, address)], key=1)


def test_a_step_asks_once_about_an_allocation_its_messages_share(monkeypatch):
    asked = _fake_allocations(monkeypatch, {100: 5, 200: 5, 300: 6})
    alive: set[int] = set()
    assert _kept(100, 5).current(alive) and _kept(200, 5).current(alive)
    assert _kept(300, 6).current(alive)
    assert asked == [100, 300], "the second message's allocation was found there already"
    assert alive == {5, 6}
    assert _kept(200, 5).current(set()) and asked[-1] == 200, "a new step asks again"


def test_an_allocation_made_again_at_a_kept_address_is_not_the_kept_one(monkeypatch):
    asked = _fake_allocations(monkeypatch, {100: 9})  # freed, then made again: a new id
    alive: set[int] = set()
    assert not _kept(100, 5).current(alive)
    assert alive == set() and asked == [100]
    assert _kept(100, 9).current(alive) and alive == {9}


class _Page:
    """A page whose words (READY and DONE alike) have reached ``reached``, and whose stream
    was given tickets up to ``last_ticket``."""

    def __init__(self) -> None:
        self.reached = 0
        self.last_ticket = 0

    def ready(self) -> int:
        return self.reached

    def done(self) -> int:
        return self.reached

    def close(self) -> None:
        pass


class _Pair:
    peer = 1


@pytest.mark.parametrize("kind", ["send", "recv"])
def test_a_pairs_stream_takes_no_more_messages_than_its_room(kind):
    # A stream holds about 1020 operations before queueing one more blocks the host in the
    # driver; a message that finds its pair's stream holding _IN_FLIGHT unfinished ones waits.
    import torch

    route, page = one_sided.OneSidedRoute(torch.device("cpu")), _Page()
    assert route.prepared(_Pair(), kind), "no page yet"
    pages = route._incoming if kind == "recv" else route._outgoing
    pages[_Pair.peer] = ("its epoch or name", page)
    assert route.prepared(_Pair(), kind), "nothing queued yet"
    page.last_ticket = one_sided._IN_FLIGHT  # tickets 1..128 queued
    assert not route.prepared(_Pair(), kind)
    page.reached = 1  # the device finished the first
    assert route.prepared(_Pair(), kind)
    page.reached = 0
    route.evict(_Pair(), "a fault")  # the page goes, and what it counted with it
    assert route.prepared(_Pair(), kind)
