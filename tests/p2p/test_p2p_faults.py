"""CPU tier: a peer killed mid-transfer; the survivor raises PeerLostError in time and keeps
working with the other peers."""

from __future__ import annotations

import time

import pytest
from _pool import WorkerPool

WORLD = 3
DOOMED = 2


@pytest.fixture(scope="module")
def pool():
    workers = WorkerPool(WORLD, transfer_timeout=10.0, backend="gloo")
    yield workers
    workers.close()


def test_peer_killed_mid_transfer(pool):
    # Every pair's communicator exists first, so the doomed rank dies with live ones.
    assert pool.run("ring_sendrecv", 1) == ["ok"] * WORLD
    # Rank 0 waits for a message from the doomed rank; kill it meanwhile.
    pool._conns[0].send(("recv_from_doomed", (DOOMED,)))
    time.sleep(0.5)
    pool.kill(DOOMED)
    status, result = pool._receive(0, 15)
    assert status == "ok", result
    assert result["seconds"] < 8.0, "PeerLostError must come before the transfer timeout"
    assert f"rank {DOOMED}" in result["message"]
    assert ["gloo", 0, DOOMED] not in result["cache_keys"], "the dead pair was not evicted"
    # Rank 1 learns of the loss too (its side channel to rank 2 closed); 0 and 1 still talk,
    # each round quickly.
    time.sleep(0.3)
    took = pool.run("rounds_after_loss", DOOMED, 3, ranks=[0, 1])
    assert max(max(t) for t in took) < 4.0, took


def test_a_peer_that_leaves_before_the_pair_is_made_is_reported_lost():
    import _cases

    from tensorferry.p2p._launch import run_world

    left, (kind, seconds, message) = run_world(_cases.leave_or_receive, backend="gloo", timeout=20)
    assert left == ("left",)
    assert kind == "PeerLostError", message
    assert "rank 0" in message and seconds < 15.0, (seconds, message)


def test_a_process_exits_cleanly_after_its_peer_never_came():
    """The pair's rendezvous, on a helper thread, still waited for the absent peer inside
    gloo when the process exited after tf.shutdown(): the process aborted (exit code -6,
    "terminate called without an active exception")."""
    # The rendezvous outlives the receive.
    pool = WorkerPool(2, transfer_timeout=30.0, backend="gloo")
    try:
        assert pool.run("recv_from_absent") == ["timed out", "idle"]
    finally:
        pool.close()
    assert [proc.exitcode for proc in pool._procs] == [0, 0]


def test_an_exit_lets_a_gloo_wait_under_way_end_first(capfd):
    """A process that leaves with a gloo wait under way (a receive the peer never sends) waits
    for it before the interpreter finalizes, for up to 10 s, and says so: a wait that came out
    of torch while the interpreter finalized aborted the process ("terminate called without an
    active exception", exit code -6). The peer stays longer, so the wait cannot end sooner."""
    import multiprocessing as mp

    import _cases

    from tensorferry.p2p._launch import _entry, reserved_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    fn = _cases.exit_with_a_gloo_wait_stuck
    with reserved_port() as port:
        procs = [
            ctx.Process(target=_entry, args=(fn, rank, 2, port, "gloo", 60.0, (16.0,), queue))
            for rank in range(2)
        ]
        for proc in procs:
            proc.start()
        try:
            rank, status, result = queue.get(timeout=60)
            assert (rank, status, result) == (1, "ok", "left with a receive in flight"), result
            left = time.monotonic()
            procs[1].join(40)
            exit_took = time.monotonic() - left
            assert procs[1].exitcode == 0, procs[1].exitcode
            assert 7.0 < exit_took < 30.0, exit_took  # the 10 s bound, on a busy machine
            assert queue.get(timeout=30)[:2] == (0, "ok")
            procs[0].join(20)
            assert procs[0].exitcode == 0, procs[0].exitcode
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
    err = capfd.readouterr().err
    assert "gloo transfer(s) still under way at exit; waiting up to 10 s" in err, err
