"""CPU tests of the pair set-up agreement: threads stand in for processes, each simulated
process with its own set-up lock, and a set-up "rendezvous" is a two-party barrier that breaks
unless both ranks of the pair are inside it at the same time (as torch's would hang)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from tensorferry.errors import TransferTimeoutError
from tensorferry.p2p.nvlink._pair_setup import with_peer_turn


class World:
    """``n`` simulated processes on one store: a lock each, and a record of set-ups."""

    def __init__(self, n: int) -> None:
        self.store = dist.HashStore()
        self.store.set_timeout(timedelta(seconds=30))
        self.locks = [threading.Lock() for _ in range(n)]
        self.barriers: dict[tuple[int, int], threading.Barrier] = {}
        self.inside = [0] * n
        self.made: list[tuple[int, tuple[int, int]]] = []
        self.errors: list[BaseException] = []
        self.guard = threading.Lock()

    def set_up(self, rank: int, peer: int, *, delay_s: float = 0.0) -> None:
        time.sleep(delay_s)
        pair = (min(rank, peer), max(rank, peer))
        with self.guard:
            barrier = self.barriers.setdefault(pair, threading.Barrier(2, timeout=5))
        store = dist.PrefixStore(f"pair/{pair[0]}-{pair[1]}", self.store)

        def rendezvous() -> None:
            with self.guard:
                self.inside[rank] += 1
                assert self.inside[rank] == 1, "two set-ups at once in one process"
            try:
                barrier.wait()  # BrokenBarrierError: the peer was not inside with us
                time.sleep(0.01)
            finally:
                with self.guard:
                    self.inside[rank] -= 1
            with self.guard:
                self.made.append((rank, pair))

        try:
            with_peer_turn(
                store,
                0 if rank == pair[0] else 1,
                rendezvous,
                timeout_s=30,
                what="test",
                lock=self.locks[rank],
            )
        except BaseException as exc:
            self.errors.append(exc)


def _run(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a set-up hung"


def test_a_late_peer_is_met() -> None:
    world = World(2)
    _run(
        [
            threading.Thread(target=world.set_up, args=(0, 1)),
            threading.Thread(target=world.set_up, args=(1, 0), kwargs={"delay_s": 1.0}),
        ]
    )
    assert not world.errors, world.errors
    assert sorted(world.made) == [(0, (0, 1)), (1, (0, 1))]


@pytest.mark.parametrize("n", [3, 4, 8])
def test_every_pair_of_a_ring_is_made_while_each_process_sets_up_both_at_once(n: int) -> None:
    """Each simulated process sets up both its ring pairs on two threads at once, its right-hand
    pair first: left alone, every process would sit in the set-up with its right neighbour,
    which sits in its own with the next — the cycle that hung real rings of four."""
    world = World(n)
    ring = [(rank, p) for rank in range(n) for p in ((rank + 1) % n, (rank - 1) % n)]
    threads = [
        threading.Thread(
            target=world.set_up,
            args=(rank, peer),
            kwargs={"delay_s": 0.0 if peer == (rank + 1) % n else 0.05},
        )
        for rank, peer in ring
    ]
    _run(threads)
    assert not world.errors, world.errors
    expected = sorted((rank, (min(rank, p), max(rank, p))) for rank, p in ring)
    assert sorted(world.made) == expected


def test_an_absent_peer_times_out_and_leaves_the_lock_free() -> None:
    store = dist.PrefixStore("pair/0-1", dist.HashStore())
    lock = threading.Lock()
    ran = []
    t0 = time.monotonic()
    with pytest.raises(TransferTimeoutError, match="did not join"):
        with_peer_turn(store, 0, lambda: ran.append(1), timeout_s=1.0, what="x", lock=lock)
    assert 1.0 <= time.monotonic() - t0 < 5
    assert not ran
    assert lock.acquire(blocking=False)
    lock.release()
    # The withdrawn claim leaves the agreement open: a later pair of arrivals still meets.
    other = threading.Thread(
        target=with_peer_turn,
        args=(store, 1, lambda: ran.append(1)),
        kwargs={"timeout_s": 10, "what": "x", "lock": threading.Lock()},
    )
    other.start()
    with_peer_turn(store, 0, lambda: ran.append(0), timeout_s=10, what="x", lock=lock)
    other.join(timeout=10)
    assert sorted(ran) == [0, 1]


def test_a_store_reused_from_an_earlier_world_is_named() -> None:
    from tensorferry.errors import TransportError

    store = dist.PrefixStore("pair/0-1", dist.HashStore())
    store.set("turn", "go")
    with pytest.raises(TransportError, match="earlier world"):
        with_peer_turn(store, 0, lambda: None, timeout_s=1, what="x", lock=threading.Lock())


def test_set_up_pair_gives_both_ranks_one_group_name_and_their_indices() -> None:
    from tensorferry.p2p.nvlink._pair_setup import set_up_pair

    shared = dist.HashStore()

    class Ctx:  # the parts of a TransportContext that set_up_pair uses
        timeout = timedelta(seconds=10)

        def __init__(self, rank: int) -> None:
            self.rank = rank

        def rank_in_pair(self, peer: int) -> int:
            return 0 if self.rank < peer else 1

        def pair_store(self, peer: int, purpose: str) -> dist.Store:
            lo, hi = sorted((self.rank, peer))
            return dist.PrefixStore(f"pair/{lo}-{hi}/{purpose}", shared)

    built: dict[int, tuple[str, int]] = {}
    locks = {2: threading.Lock(), 5: threading.Lock()}  # one per simulated process

    def rank_main(rank: int, peer: int) -> None:
        built[rank] = set_up_pair(
            Ctx(rank), peer, "ce", lambda group, index, store: (group, index), lock=locks[rank]
        )

    threads = [threading.Thread(target=rank_main, args=(r, p)) for r, p in ((2, 5), (5, 2))]
    _run(threads)
    assert built[2][0] == built[5][0] and built[2][0].startswith("tf-ce-")
    assert (built[2][1], built[5][1]) == (0, 1)
