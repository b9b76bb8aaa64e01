"""CPU tests of the store that pair groups' symmetric-memory rendezvous talk through.

torch numbers rendezvous exchanges with one counter per process; a rank that already set up
another pair starts a pair's rendezvous at a higher number than its peer. The tests replay
torch's exchange pattern (``<prefix>/<n>/<rank>``: set one's own key, wait for and read the
others') through a ``PrefixStore``, so the calls reach the renumbering store from C++ as they do
in a real rendezvous.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from tensorferry.p2p.nvlink import _symm


def _all_gather(store: dist.Store, seq: int, rank: int, world: int, value: bytes) -> list[bytes]:
    """torch's store all-gather: its keys carry the process-wide sequence number ``seq``."""
    keys = [f"CUDASymmetricMemory/{seq}/{r}" for r in range(world)]
    store.set(keys[rank], value)
    out = []
    for r in range(world):
        if r != rank:
            store.wait([keys[r]])
        out.append(value if r == rank else store.get(keys[r]))
    return out


def _two_ranks(first_seqs: tuple[int, int], exchanges: int) -> list[list[list[bytes]]]:
    """Two ranks of one group run ``exchanges`` all-gathers, each rank's numbering starting at
    its own ``first_seqs`` entry; returns what each rank gathered, per exchange."""
    shared = dist.HashStore()
    shared.set_timeout(timedelta(seconds=10))
    wrappers = [_symm._GroupSequencedStore(shared) for _ in range(2)]
    results: list[list[list[bytes]]] = [[], []]
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        store = dist.PrefixStore("pair/0-3", wrappers[rank])
        try:
            for i in range(exchanges):
                value = f"rank{rank}-exchange{i}".encode()
                results[rank].append(_all_gather(store, first_seqs[rank] + i, rank, 2, value))
        except BaseException as exc:  # reported below, on the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "the exchange hung"
    assert not errors, errors
    return results


def test_ranks_with_different_process_counters_meet() -> None:
    results = _two_ranks(first_seqs=(7, 0), exchanges=3)
    for i in range(3):
        expected = [f"rank{r}-exchange{i}".encode() for r in range(2)]
        assert results[0][i] == expected
        assert results[1][i] == expected


def test_without_renumbering_the_same_pattern_waits_forever() -> None:
    """The failure the store exists for: raw keys never meet (the wait times out)."""
    shared = dist.HashStore()
    shared.set_timeout(timedelta(seconds=1))
    store = dist.PrefixStore("pair/0-3", shared)
    store.set("CUDASymmetricMemory/7/0", b"x")
    with pytest.raises(Exception, match=r"[Tt]imeout|[Tt]imed out|[Ww]ait"):
        store.wait(["CUDASymmetricMemory/0/1"])


def test_other_keys_pass_through() -> None:
    inner = dist.HashStore()
    store = _symm._GroupSequencedStore(inner)
    for key in ("group_name", "a/b", "x/1/y", "x/y/1", "9/1"):
        store.set(key, b"v")
        assert inner.get(key) == b"v"
    assert store.add("counter", 2) == 2
    assert store.check(["group_name"])


def test_join_group_keeps_its_store_alive() -> None:
    """c10d holds only the C++ half of a Python store: without a Python reference its methods
    are gone. ``join_group`` keeps one per group name."""
    import gc

    name = "tf-test-join-group"
    _symm.join_group(name, 0, 1, dist.HashStore())
    try:
        gc.collect()
        kept = _symm._exchange_stores[name]
        kept.set("CUDASymmetricMemory/41/0", b"v")
        assert kept.get("CUDASymmetricMemory/41/0") == b"v"
    finally:
        _symm._exchange_stores.pop(name, None)
