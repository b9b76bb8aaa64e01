"""CPU tier: the p2p engine's bookkeeping where faults meet, checked on two real processes.

Each case looks at the engine's state around one step it used to get wrong (found with the
random-traffic probe and the flight recorder, ``TENSORFERRY_P2P_TRACE``): the peer's answer to
a fault owing a whole waiting batch, and the frames the short way reads before it issues; or
around a window between threads: a fault while the completion pool completes a transfer.
"""

from __future__ import annotations

import pytest
from _pool import WorkerPool


@pytest.fixture(scope="module")
def pool():
    workers = WorkerPool(2, transfer_timeout=10.0, backend="gloo")
    yield workers
    workers.close()


def test_a_batch_the_peer_owes_fails_alone(pool):
    after, _ = pool.run("owed_messages_fail_without_a_new_fault")
    assert after == {"epochs moved": 0, "debts": [], "frozen": None, "batch": "MismatchError"}
    # The pair still carries messages both ways.
    assert pool.run("ring_sendrecv", 1) == ["ok", "ok"]


def test_the_short_way_handles_frames_as_a_step(pool):
    sender, receiver = pool.run("short_way_reads_in_a_step")
    assert receiver["reads"] > 0, receiver  # the sender's headers were there to read
    for side in (sender, receiver):
        assert side["outside a step"] == 0, side


def test_the_flight_recorder_keeps_a_transfers_events(pool):
    for side in pool.run("recent_events_of_a_transfer"):
        assert side["off"] == [] and side["after"] == [], side
        assert side["numbered"] == 1 and side["header out"] == 1 and side["done"] == 1, side
        assert side["other peers' events"] == 0, side


def test_a_fault_finds_a_finished_send_done_while_the_pool_completes_it(pool):
    assert pool.run("fault_while_the_pool_completes_a_send") == ["ok", "ok"]
    assert pool.run("ring_sendrecv", 1) == ["ok", "ok"]  # the pair goes on
