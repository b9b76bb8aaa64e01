"""Pair resources across epochs, in one process: ``cached_pair`` and ``TransportContext.meet``.

A fault moves a pair to its next epoch while the making of the last epoch's resources may still
be under way on a helper thread. These check that the next epoch's making neither takes the
stale resources nor waits on the stale rendezvous, and that a rendezvous that gives up leaves no
mark a late peer could take for it.
"""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch
import torch.distributed as dist

from tensorferry.errors import TransferTimeoutError, TransportError
from tensorferry.p2p import _agreement as agreement
from tensorferry.p2p._transport import StaleEpochError, TransportContext, cached_pair
from tensorferry.runtime import communicator_cache


class _Pair:
    def __init__(self, epoch: int) -> None:
        self.epoch = epoch
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True

    def close(self) -> None:
        self.aborted = True


@pytest.fixture
def key():
    key = ("test-pair-epochs", 0, 1, time.monotonic_ns())
    yield key
    communicator_cache().evict(key, abort=True, reason="test done")


def test_resources_of_an_earlier_epoch_are_replaced(key):
    old = cached_pair(key, 3, lambda: _Pair(3))
    assert cached_pair(key, 3, lambda: _Pair(99)) is old  # made once per epoch
    new = cached_pair(key, 4, lambda: _Pair(4))
    assert new.epoch == 4 and old.aborted and not new.aborted


def test_a_making_for_a_later_epoch_than_ours_is_refused(key):
    cached_pair(key, 5, lambda: _Pair(5))
    with pytest.raises(StaleEpochError):
        cached_pair(key, 4, lambda: _Pair(4))


@pytest.mark.parametrize("old_outcome", ["gives up", "finishes"])
def test_a_making_of_an_earlier_epoch_under_way_is_waited_for_then_replaced(key, old_outcome):
    started, release = threading.Event(), threading.Event()

    def make_old() -> _Pair:
        started.set()
        release.wait(5)
        if old_outcome == "gives up":
            raise StaleEpochError("old making", 1)
        return _Pair(1)

    old_result: list = []

    def old_making() -> None:
        try:
            old_result.append(cached_pair(key, 1, make_old))
        except StaleEpochError as exc:
            old_result.append(exc)

    thread = threading.Thread(target=old_making)
    thread.start()
    assert started.wait(5)
    threading.Timer(0.2, release.set).start()
    new = cached_pair(key, 2, lambda: _Pair(2))
    thread.join(5)
    assert new.epoch == 2
    assert isinstance(old_result[0], StaleEpochError if old_outcome == "gives up" else _Pair)


def _context(rank: int, store, epoch: list[int], timeout_s: float = 5.0) -> TransportContext:
    return TransportContext(
        rank=rank,
        world_size=2,
        device=torch.device("cpu"),
        store=store,
        timeout=datetime.timedelta(seconds=timeout_s),
        epoch_of=lambda peer: epoch[0],
    )


def test_a_meeting_gives_up_when_its_epoch_ends_and_takes_its_claim_back():
    store = dist.HashStore()
    epoch = [7]
    contexts = [_context(rank, store, epoch, timeout_s=0.5) for rank in (0, 1)]
    stores = [ctx.pair_store(1 - ctx.rank, "test", 7) for ctx in contexts]
    threading.Timer(0.1, lambda: epoch.__setitem__(0, 8)).start()
    t0 = time.monotonic()
    with pytest.raises(StaleEpochError, match="moved on from epoch 7"):
        contexts[0].meet(stores[0], 1, "test meeting", 7)
    assert time.monotonic() - t0 < 2.0
    # A peer coming late to epoch 7 must not take rank 0 for there and go on alone.
    with pytest.raises(TransferTimeoutError, match="did not take part"):
        contexts[1].meet(stores[1], 0, "test meeting")


def test_a_meeting_the_peer_committed_to_is_kept_though_its_epoch_ended():
    """The race a mark per rank lost: rank 1 saw rank 0 there just as rank 0 gave up, and
    entered the library's rendezvous alone. Now whoever commits first binds both."""
    store = dist.HashStore()
    peer = _context(1, store, [3])
    peer_store = peer.pair_store(0, "test", 3)

    def epoch_of(_: int) -> int:
        # Rank 0 looked for the peer and found none; now, as it reads the pair's epoch and
        # finds it over, the peer arrives and commits both.
        peer.meet(peer_store, 0, "test meeting", 3)
        return 4

    ctx = _context(0, store, [3])
    ctx.epoch_of = epoch_of
    ctx.meet(ctx.pair_store(1, "test", 3), 1, "test meeting", 3)  # returns: enter with the peer


def test_a_withdrawal_after_the_peer_committed_is_refused():
    store = dist.HashStore()
    assert not agreement.arrive(store, 0)  # rank 0 waits
    assert agreement.arrive(store, 1)  # rank 1 commits both
    assert agreement.peer_committed(store)
    assert not agreement.withdraw(store, 0)  # too late: rank 1 is entering


def test_a_withdrawn_claim_lets_no_one_commit_until_both_come_again():
    store = dist.HashStore()
    assert not agreement.arrive(store, 0)
    assert agreement.withdraw(store, 0)
    assert not agreement.arrive(store, 1)  # rank 0 is not there any more: rank 1 waits
    assert not agreement.peer_committed(store)
    assert agreement.arrive(store, 0)  # rank 0 back: both committed


def test_a_finished_agreement_is_not_entered_again():
    store = dist.HashStore()
    agreement.arrive(store, 0)
    agreement.arrive(store, 1)
    with pytest.raises(TransportError, match="already holds a finished set-up"):
        agreement.arrive(store, 0)


def test_a_meeting_completes_when_both_come():
    store = dist.HashStore()
    epoch = [0]
    contexts = [_context(rank, store, epoch) for rank in (0, 1)]
    stores = [ctx.pair_store(1 - ctx.rank, "test") for ctx in contexts]
    errors: list = []

    def rank_one() -> None:
        time.sleep(0.05)
        try:
            contexts[1].meet(stores[1], 0, "test meeting", 0)
        except Exception as exc:  # reported below
            errors.append(exc)

    thread = threading.Thread(target=rank_one)
    thread.start()
    contexts[0].meet(stores[0], 1, "test meeting", 0)
    thread.join(5)
    assert not errors


def test_a_making_names_its_own_epoch_in_its_store():
    store = dist.HashStore()
    epoch = [5]
    ctx = _context(0, store, epoch)
    ctx.pair_store(1, "test", 4).set("k", "old")
    assert ctx.pair_store(1, "test").compare_set("k", "", "new") == b"new"  # epoch 5's own
    assert ctx.pair_store(1, "test", 4).get("k") == b"old"


class _CountingStore:
    """A store whose clones are counted: each stands for one client connection."""

    def __init__(self) -> None:
        self.store = dist.HashStore()
        self.store.set_timeout(datetime.timedelta(seconds=5))
        self.clones: list = []

    def clone(self):
        clone = dist.PrefixStore("client", self.store)  # the same store, a distinct object
        self.clones.append(clone)
        return clone


def test_makings_borrow_one_store_client_after_another_but_never_one_that_failed():
    counting = _CountingStore()
    ctx = _context(0, counting, [3])
    with ctx.borrowed_pair_store(1, "gloo") as first:
        first.set("k", b"1")
    # Keys land where pair_store puts them: under the pair, its epoch and the purpose.
    assert counting.store.get("client/pair/0-1/epoch3/gloo/k") == b"1"
    with ctx.borrowed_pair_store(1, "nccl/0-to-1"):
        pass
    assert len(counting.clones) == 1, "a making that ended cleanly lends its client on"
    with (
        pytest.raises(RuntimeError, match="rendezvous timed out"),
        ctx.borrowed_pair_store(1, "gloo"),
    ):
        raise RuntimeError("rendezvous timed out")
    with ctx.borrowed_pair_store(1, "gloo"):
        pass
    assert len(counting.clones) == 2, "the failed making's client is never lent again"
    # Two makings at once each have a client of their own.
    with ctx.borrowed_pair_store(1, "a"), ctx.borrowed_pair_store(1, "b"):
        assert len(counting.clones) == 3
    ctx.drop_store_clients()  # tf.shutdown
    assert not ctx._idle_clients
    with ctx.borrowed_pair_store(1, "gloo"):
        pass
    assert len(counting.clones) == 4 and not ctx._idle_clients, "none kept after shutdown"
