"""CPU tier: the p2p API over gloo between 3 real processes (one shared pool per module)."""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time

import pytest
import torch
from _cases import BAD_CALLS
from _pool import WorkerPool

import tensorferry.p2p as tf
from tensorferry.errors import TensorFerryError, TransferTimeoutError
from tensorferry.p2p import _gloo

WORLD = 3


@pytest.fixture(scope="module")
def pool():
    workers = WorkerPool(WORLD, transfer_timeout=10.0, backend="gloo")
    yield workers
    workers.close()


# ---------------------------------------------------------------------- in this process
def test_calls_before_init_raise_clearly():
    assert not tf.is_initialized()
    with pytest.raises(RuntimeError, match=r"tf\.init"):
        tf.send(torch.zeros(2), 1)
    with pytest.raises(RuntimeError, match=r"tf\.init"):
        tf.get_rank()
    tf.shutdown()  # not initialised: a no-op


def test_init_rejects_bad_arguments():
    with pytest.raises(ValueError, match="backend"):
        tf.init("mpi")
    with pytest.raises(TypeError, match="rank"):
        tf.init(rank="0", world_size=2)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            tf.init("nccl", rank=0, world_size=1, init_method="tcp://127.0.0.1:1")
    assert not tf.is_initialized()


def _first_rank_leaves_early(rank: int, world: int) -> str:
    """Rank 0 (which serves the world's store) shuts its layer down first; ranks 1 and 2 then
    make their pair, which needs the store."""
    if rank == 0:
        tf.shutdown()
        time.sleep(3.0)  # the process lives on, as a program after tf.shutdown() does
        return "left"
    time.sleep(0.5)
    peer = 3 - rank
    mine = torch.full((3,), float(rank))
    got = torch.empty(3)
    tf.sendrecv(mine, peer, got, peer).wait(20)
    return f"got {got[0].item():.0f}"


def _short_waits_with_a_long_spin(rank: int, world: int) -> list:
    """Rank 0 polls a pending receive with waits shorter than its spin window."""
    from tensorferry.runtime import _spin

    if rank == 1:
        time.sleep(1.5)
        tf.send(torch.ones(4), 0).wait(20)
        return []
    _spin._window_s = 0.5  # as TENSORFERRY_SPIN_US=500000 would make it
    pending = tf.recv(torch.empty(4), 1)
    took = []
    for timeout in (0.0, 0.02):
        start = time.monotonic()
        with pytest.raises(TransferTimeoutError):
            pending.wait(timeout)
        took.append(time.monotonic() - start)
    pending.wait(20)
    return took


def _fork_and_look(rank: int, world: int) -> str:
    """In a process forked from an initialised rank, the layer is not initialised."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            tf.send(torch.ones(2), 1 - rank)
            answer = "sent"
        except RuntimeError as exc:
            answer = "uninitialised" if "not initialised" in str(exc) else repr(exc)
        os.write(write_end, answer.encode())
        os._exit(0)
    os.close(write_end)
    os.waitpid(pid, 0)
    answer = os.read(read_end, 200).decode()
    os.close(read_end)
    # The parent's layer goes on.
    if rank == 0:
        tf.send(torch.full((2,), 5.0), 1).wait(20)
    else:
        assert tf.recv(torch.empty(2), 0).result(20).tolist() == [5.0, 5.0]
    return answer


def _prepare_with_a_late_peer(rank: int, world: int) -> str:
    """Rank 1 comes 4 s late, past the world's 2 s timeout: rank 0's ``prepare`` fails, and
    then its receive (timeout 20 s) meets rank 1's send. The failed prepare's error was kept
    and failed that receive at once, and, as a fault of the pair, rank 1's send too."""
    if rank == 0:
        try:
            tf.prepare(1)
            return "prepare returned"
        except TransferTimeoutError:
            pass
        return str(tf.recv(torch.zeros(2), 1, timeout=20).result(30).tolist())
    time.sleep(4.0)
    tf.send(torch.full((2,), 7.0), 0, timeout=20).wait(30)
    return "sent"


def test_a_failed_prepare_leaves_the_next_message_to_make_the_pair_afresh():
    from tensorferry.p2p._launch import run_world

    assert run_world(_prepare_with_a_late_peer, backend="gloo", timeout=2) == ["[7.0, 7.0]", "sent"]


def _rank_1_exits(rank: int, world: int) -> str:
    if rank == 1:
        os._exit(3)  # as a crash would: no result, no traceback
    return "returned"


def _rank_1_returns_a_lock(rank: int, world: int) -> object:
    return threading.Lock() if rank == 1 else "returned"


@pytest.mark.parametrize(
    ("fn", "says"),
    [
        (_rank_1_exits, "rank 1: its process ended (exit code 3) without returning"),
        (_rank_1_returns_a_lock, "rank 1's result (lock) cannot be sent back"),
    ],
)
def test_a_rank_that_ends_without_a_result_is_named_at_once(fn, says):
    # Both waited out join_timeout (600 s by default) with nothing said.
    from tensorferry.p2p._launch import run_world

    start = time.monotonic()
    with pytest.raises(RuntimeError, match=re.escape(says)):
        run_world(fn, backend="gloo", timeout=30, join_timeout=120)
    assert time.monotonic() - start < 60


def test_a_wait_shorter_than_the_spin_window_returns_in_its_time():
    from tensorferry.p2p._launch import run_world

    took = run_world(_short_waits_with_a_long_spin, backend="gloo", timeout=30)[0]
    assert max(took) < 0.25, took  # it spun its whole 0.5 s window, twice, before


def test_ranks_still_make_pairs_after_the_store_serving_rank_shut_down():
    from tensorferry.p2p._launch import run_world

    got = run_world(_first_rank_leaves_early, world=3, backend="gloo", timeout=30)
    assert got == ["left", "got 2", "got 1"]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_process_forked_from_a_rank_starts_uninitialised():
    from tensorferry.p2p._launch import run_world

    assert run_world(_fork_and_look, backend="gloo", timeout=60) == ["uninitialised"] * 2


def test_a_rendezvous_that_fails_names_the_init_method_in_one_line():
    from tensorferry.p2p._launch import reserved_port

    with reserved_port() as port:  # bound, never listening: rank 1 cannot connect
        method = f"tcp://127.0.0.1:{port}"
        failed = f"^tf.init: the rendezvous at {method} failed"
        with pytest.raises(RuntimeError, match=failed) as exc:
            tf.init("gloo", rank=1, world_size=2, init_method=method, timeout=1)
    assert "\n" not in str(exc.value)  # torch's text ends in a C++ backtrace
    assert not tf.is_initialized()


def test_the_test_pool_starts_a_fresh_world_after_a_failed_case():
    """What a failed case leaves in flight must not fail the cases after it (it did on the GPU
    tier, hiding which test failed first)."""
    workers = WorkerPool(2, transfer_timeout=60.0, backend="gloo")
    try:
        before = [proc.pid for proc in workers._procs]
        with pytest.raises(AssertionError, match="failed on purpose"):
            workers.run("fails_after_leaving_a_send_in_flight")
        assert workers.broken is None
        assert all(pid not in before for pid in (proc.pid for proc in workers._procs))
        started = time.monotonic()
        assert workers.run("ring_sendrecv", 1) == ["ok", "ok"]
        assert time.monotonic() - started < 10  # not behind the abandoned send's 60 s
    finally:
        workers.close()


def test_a_reserved_port_is_kept_from_plain_binds_but_a_store_can_take_it():
    import datetime
    import errno
    import socket

    import torch.distributed as dist

    from tensorferry.p2p._launch import reserved_port

    with reserved_port() as port:
        # On loopback and on another local address (a listener there, NCCL's on a network
        # card's address say, made the store's bind to every address fail).
        for address in ("127.0.0.1", "127.0.0.2"):
            with socket.socket() as other, pytest.raises(OSError) as exc:
                other.bind((address, port))
            assert exc.value.errno == errno.EADDRINUSE, address
        store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=datetime.timedelta(seconds=10))
        store.set("key", "value")
        assert store.get("key") == b"value"
        del store


def test_init_with_a_store_rejects_bad_arguments():
    import torch.distributed as dist

    store = dist.HashStore()
    with pytest.raises(ValueError, match="rank= and world_size="):
        tf.init(store=store, world_size=2)
    with pytest.raises(ValueError, match="not both"):
        tf.init(store=store, rank=0, world_size=2, init_method="tcp://127.0.0.1:1")
    with pytest.raises(ValueError, match="out of range"):
        tf.init(store=store, rank=2, world_size=2)
    with pytest.raises(TypeError, match="Store"):
        tf.init(store={}, rank=0, world_size=2)
    with pytest.raises(ValueError, match="not a device"):
        tf.init(store=store, rank=0, world_size=2, device="gpu7")
    with pytest.raises(ValueError, match="CUDA device"):
        tf.init("nccl", store=store, rank=0, world_size=2, device="cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="does not exist"):
            tf.init(store=store, rank=0, world_size=2, device="cuda:0")
    assert not tf.is_initialized()


def _swap_over_given_store(rank: int, port: int, queue) -> None:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    tf.init(store=dist.PrefixStore("given", store), rank=rank, world_size=2, device="cpu")
    try:
        mine = torch.arange(5, dtype=torch.float32) + 10 * rank
        got = torch.full((5,), -1.0)
        tf.sendrecv(mine, 1 - rank, got, 1 - rank).wait(20)
        queue.put((rank, got.tolist(), tf.get_world_size()))
    finally:
        tf.shutdown()


def _init_and_shut_down_again_and_again(rank: int, ports: list, queue) -> None:
    """Each cycle meets under a fresh rendezvous and moves one message; the cyclic collector
    stays off, so what shutdown leaves open is counted, not what it would collect later."""
    import gc
    import os

    gc.disable()
    open_fds = []
    for cycle, port in enumerate(ports):
        tf.init("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
        if rank == 0:
            tf.send(torch.full((3,), float(cycle)), 1).wait(20)
        else:
            tf.recv(torch.empty(3), 0).wait(20)
        tf.shutdown()
        open_fds.append(len(os.listdir("/proc/self/fd")))
    queue.put((rank, open_fds))


def _shutdown_with_a_receive_pending(rank: int, world: int) -> str:
    if rank == 1:
        time.sleep(1.0)  # never sends
        return "idle"
    pending = tf.recv(tf.TensorSpec((4,)), 1, timeout=30)
    time.sleep(0.2)  # its pair is being made: a helper waits for rank 1, which never comes
    tf.shutdown()
    # A thread still waiting for the peer must not hold up this process's exit.
    waiting = [t.name for t in threading.enumerate() if "p2p-helper" in t.name and not t.daemon]
    try:
        pending.wait(5)
    except TensorFerryError as exc:  # not an error of the closed engine's internals
        return f"{type(exc).__name__}: {exc}; non-daemon helpers: {waiting}"
    return "no error"


def test_a_transfer_pending_at_shutdown_fails_with_a_clear_error_and_exit_waits_for_nothing():
    from tensorferry.p2p._launch import run_world

    outcome = run_world(_shutdown_with_a_receive_pending, backend="gloo", timeout=60)[0]
    assert outcome.startswith("TensorFerryError: tf.shutdown() was called"), outcome
    assert outcome.endswith("non-daemon helpers: []"), outcome


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts /proc/self/fd")
def test_init_and_shutdown_cycles_leave_no_descriptors_open():
    import multiprocessing

    from tensorferry.p2p._launch import reserved_port

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    with contextlib.ExitStack() as reservations:
        ports = [reservations.enter_context(reserved_port()) for _ in range(8)]
        procs = [
            ctx.Process(target=_init_and_shut_down_again_and_again, args=(r, ports, queue))
            for r in (0, 1)
        ]
        for proc in procs:
            proc.start()
        counts = dict(queue.get(timeout=120) for _ in procs)
    for proc in procs:
        proc.join(30)
    for rank, open_fds in counts.items():
        # Each cycle used to leave the store's connections (and its server on rank 0) open.
        assert open_fds[-1] <= open_fds[0] + 2, (rank, open_fds)


def test_init_with_a_given_store_and_device():
    """Processes that already share a store (a compiled graph's actors) join over it."""
    import multiprocessing

    import torch.distributed as dist

    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_swap_over_given_store, args=(r, master.port, queue)) for r in (0, 1)
    ]
    for proc in procs:
        proc.start()
    results = dict(
        (rank, (got, world)) for rank, got, world in (queue.get(timeout=60) for _ in procs)
    )
    for proc in procs:
        proc.join(30)
    assert results[0] == ([10.0, 11.0, 12.0, 13.0, 14.0], 2)
    assert results[1] == ([0.0, 1.0, 2.0, 3.0, 4.0], 2)


def test_tensor_spec():
    spec = tf.TensorSpec((2, 3), torch.bfloat16)
    assert spec.shape == (2, 3) and spec.empty(torch.device("cpu")).dtype == torch.bfloat16
    assert tf.TensorSpec(4).shape == (4,)
    assert tf.TensorSpec.like(torch.zeros(1, 2, dtype=torch.int8)) == tf.TensorSpec(
        (1, 2), torch.int8
    )
    with pytest.raises(ValueError):
        tf.TensorSpec((-1,))
    with pytest.raises(TypeError):
        tf.TensorSpec((2,), "float32")
    # Quantized tensors are refused; a spec of one failed later, inside torch.empty.
    with pytest.raises(TypeError, match=r"torch\.qint8 is quantized"):
        tf.TensorSpec((2,), torch.qint8)


class _Index:
    """An integer of another type (as numpy's are): it has ``__index__``."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value


def test_tensor_spec_takes_integers_of_other_types_but_not_bools_or_floats():
    assert tf.TensorSpec((_Index(3), 4)).shape == (3, 4)
    assert tf.TensorSpec(_Index(7)).shape == (7,)
    assert tf.TensorSpec((torch.tensor(2), torch.Size([5])[0])).shape == (2, 5)
    assert all(type(s) is int for s in tf.TensorSpec((_Index(3), torch.tensor(2))).shape)
    for bad in ((True, 2), (2.0,), "ab", (None,), 2.5, torch.ones(2)):
        with pytest.raises(TypeError, match="tuple of ints"):
            tf.TensorSpec(bad)


def test_an_unknown_transport_is_named_with_the_known_ones():
    from tensorferry.p2p._context import TRANSPORTS, P2PContext

    with pytest.raises(ValueError, match="unknown transport 'pigeon'; known: auto, ce, gloo"):
        P2PContext._make_route(object.__new__(P2PContext), "pigeon")
    assert TRANSPORTS == ("auto", "ce", "gloo", "nccl", "nvlink")


# ---------------------------------------------------------------------- across processes
def test_finished_messages_leave_nothing_for_the_garbage_collector(pool):
    # A message's objects used to form reference cycles (the engine's closures held their own
    # unit): each message left about 40 objects that only a collection freed, and the
    # collections, a full one among them, paused calls for up to 90 ms.
    assert pool.run("nothing_left_for_the_collector", 4) == [{}] * WORLD


def test_parameters_and_activations_travel_outside_autograd(pool):
    assert pool.run("parameters_travel", 80)[:2] == ["sent", "ok"]


def test_buffers_made_in_inference_mode_receive_inside_and_outside_it(pool):
    assert pool.run("inference_tensors_travel", 90)[:2] == ["sent", "ok"]


def test_send_recv_every_dtype_and_shape(pool):
    assert pool.run("send_recv_all_dtypes", 11)[:2] == ["ok", "ok"]


def test_one_element_tensors_with_a_stride_travel(pool):
    assert pool.run("strided_single_elements", 12)[:2] == ["sent", "ok"]


def test_single_tensor_result_and_callbacks(pool):
    for result in pool.run("single_tensor_and_callbacks")[:1]:
        assert result["callback_thread"] != result["caller_thread"]
        assert result["callback_thread"].startswith("tensorferry-completion")
        assert result["callback_saw_done"] and result["late_callback_ran"]
        assert "done" in result["repr"]


def test_a_send_left_unwaited_is_issued_by_the_wait_for_the_reply(pool):
    # Before, the wait for the reply blocked in gloo while the send still waited for its post,
    # and the idle-pair watcher issued it up to 10 ms later.
    assert pool.run("reply_awaited_beside_an_unwaited_send", 30)[:2] == [["MainThread"]] * 2


def test_a_reset_ends_a_send_nobody_waited_for(pool):
    assert pool.run("reset_after_an_unwaited_send", 70)[:2] == ["ok", "ok"]


def test_ring_sendrecv_send_peer_differs_from_recv_peer(pool):
    assert pool.run("ring_sendrecv", 4) == ["ok"] * WORLD


def test_mixed_batch_to_every_peer(pool):
    # 4 tensors from each of the 2 peers, every byte compared.
    assert pool.run("mixed_batch", 20) == [4 * (WORLD - 1)] * WORLD


def test_many_small_tensors_batched_and_separate(pool):
    assert pool.run("many_small_batch", 64)[:2] == ["sent", "ok"]


def test_repeated_layouts_keep_every_byte(pool):
    assert pool.run("repeated_layouts", 3)[:2] == ["ok", "ok"]


@pytest.mark.parametrize("stacked", [False, True])
@pytest.mark.parametrize("in_place", [False, True])
def test_ring_all_gather(pool, stacked, in_place):
    assert pool.run("all_gather", stacked, in_place) == ["ok"] * WORLD


def test_static_channel_then_change_raises_on_both_sides(pool):
    assert pool.run("static_channel", 4)[:2] == ["ok", "ok"]
    assert pool.run("static_broken")[:2] == ["shape", "shape"]
    # The pair was reset: transfers work again, static or not.
    assert pool.run("static_channel", 2)[:2] == ["ok", "ok"]
    # A static channel stays static: a later, different message is a mismatch (and resets).
    assert pool.run("static_broken")[:2] == ["shape", "shape"]
    assert pool.run("ring_sendrecv", 1) == ["ok"] * WORLD


def test_an_empty_message_on_a_static_channel_completes_only_with_its_send(pool):
    results = pool.run("empty_static_receive_waits_for_its_send")
    assert results[1] == {"done before the send": False, "then": "ok"}, results


@pytest.mark.parametrize(
    "kind", ["count", "dtype", "shape", "shape, a large receive", "shape, a large send"]
)
def test_mismatch_raises_on_both_sides_and_pair_keeps_working(pool, kind):
    field = kind.split(",")[0]
    assert pool.run("mismatch", kind)[:2] == [field, field]
    assert pool.run("send_recv_all_dtypes", 40)[:2] == ["ok", "ok"]


def test_bad_arguments_raise_before_anything_moves(pool):
    outcomes = pool.run("bad_arguments")
    assert len(outcomes[0]) == BAD_CALLS
    assert "cpu on nccl: ValueError" in outcomes[0] and "self: ValueError" in outcomes[0]
    assert "not a tensor: TypeError" in outcomes[0]
    assert "non-contiguous last: ValueError" in outcomes[0]
    assert "sparse csr: TypeError" in outcomes[0] and "devices mixed: ValueError" in outcomes[0]
    assert "conjugate view: ValueError" in outcomes[0]
    assert "negative view last: ValueError" in outcomes[0]
    assert "receive views that overlap: ValueError" in outcomes[0]
    assert pool.run("ring_sendrecv", 1) == ["ok"] * WORLD  # still usable


def _timed_out_then_late_failed(results: list, caller: int) -> bool:
    """``timeout_unmatched``'s results: the caller timed out after about its 1 s timeout, and
    its peer's late side of that message failed with the caller's error well before its own
    5 s timeout (at once, but for the aborting of the pair's communicators it does first)."""
    late = results[1 - caller]
    return 0.9 <= results[caller] < 4.0 and late[0] == "TransferTimeoutError" and late[1] < 2.0


def test_timeout_unmatched_send_then_pair_works(pool):
    assert _timed_out_then_late_failed(pool.run("timeout_unmatched"), caller=0)
    assert pool.run("send_recv_all_dtypes", 60)[:2] == ["ok", "ok"]


def test_timeout_unmatched_recv_then_pair_works(pool):
    assert _timed_out_then_late_failed(pool.run("timeout_unmatched", "auto", "recv"), caller=1)
    assert pool.run("send_recv_all_dtypes", 61)[:2] == ["ok", "ok"]


def test_crossed_faults_keep_both_sides_counting_alike(pool):
    # Both ranks send and neither receives: both time out and fault at once. Each rank's late
    # receive of the other's failed send fails at once too, and the pair goes on in step.
    for _ in range(2):
        results = pool.run("both_send_unmatched")[:2]
        for send, late, seconds in results:
            assert (send, late) == ("TransferTimeoutError", "TransferTimeoutError"), results
            assert seconds < 2.0, results
        assert pool.run("send_recv_all_dtypes", 62)[:2] == ["ok", "ok"]


def test_a_send_after_a_fault_waits_for_the_idle_peer_to_answer_it(pool):
    assert pool.run("send_after_unmatched_to_an_idle_peer")[:2] == ["ok", "ok"]
    assert pool.run("send_recv_all_dtypes", 63)[:2] == ["ok", "ok"]


def test_sends_failed_while_waiting_for_the_peer_to_answer_a_fault_fail_on_both_sides(pool):
    failed = ["TransferTimeoutError", "TransferTimeoutError", "ok"]
    assert pool.run("sends_that_time_out_while_the_peer_is_idle")[:2] == [failed, failed]
    assert pool.run("send_recv_all_dtypes", 64)[:2] == ["ok", "ok"]


def test_a_rank_gone_idle_still_tells_the_peer_what_failed_while_it_waited_for_an_answer(pool):
    # Rank 1's second receive matches a send that rank 0 failed before rank 1 answered its
    # fault: only rank 0 can say so, and it has no call running to read the answer.
    results = pool.run("failed_while_frozen_then_idle", timeout=60)
    (first, first_s), (second, second_s) = results[1]
    assert first == second == "TransferTimeoutError", results[1]
    assert first_s < 1.5 and second_s < 1.5, results[1]  # not the receives' 4 s timeout
    assert pool.run("send_recv_all_dtypes", 65)[:2] == ["ok", "ok"]


def test_ring_all_gathers_meet_their_steps_whenever_they_are_waited_for(pool):
    assert pool.run("ring_all_gathers_beside_other_calls", timeout=60) == [[]] * WORLD


def test_timeouts_past_any_need_and_ring_steps_that_each_keep_theirs(pool):
    assert pool.run("timeouts_past_any_need", timeout=60) == [["ok"] * 3] * WORLD


def test_a_receive_right_after_the_peer_timed_out_fails_with_the_peers_timeout(pool):
    # Rank 1's first receive either learnt of the fault before it was numbered (its watcher
    # read the notice: both go through) or after (it fails with rank 0's timeout, and so does
    # its send): never with an error of its own. The next message meets either way.
    results = pool.run("receive_right_after_the_peer_timed_out", timeout=60)
    sender, receiver = results[0], results[1]
    assert sender[0] == "TransferTimeoutError" and receiver[1] == sender[2] == "ok", results
    assert receiver[0] == sender[1] and receiver[0] in ("ok", "TransferTimeoutError"), results
    assert receiver[2] == "TransferTimeoutError", results  # the send rank 0's receive was for


def test_a_timeout_beside_a_longer_receive_is_a_timeout_on_both_sides(pool):
    # Whichever of the two receives rank 0 waits for, both end with TransferTimeoutError, and
    # so do rank 1's sends meant for them; the pair then works.
    results = pool.run("a_timeout_beside_a_longer_receive", timeout=60)
    step = ["TransferTimeoutError", "TransferTimeoutError", "ok"]
    assert results[0] == step * 6 and results[1] == step * 6, results


def test_messages_of_ever_new_sizes_leave_memory_flat(pool):
    grown = pool.run("messages_of_ever_new_sizes", timeout=120)[:2]
    assert all(growth < 40e6 for growth in grown), grown


def test_kept_heads_stay_within_their_bound_after_a_size_was_taken_up():
    # A message took the last kept head of one size; then heads of many other sizes came back,
    # past the bound: those of the sizes used longest ago go (it raised IndexError, out of a
    # wait(), once the size taken up was the oldest).
    group = _gloo._Group(None, 1, 0)
    first = group.head(1000)
    group.give_back(first)
    assert group.head(1000) is first
    sizes = [300_000 + i for i in range(40)]  # 40 sizes of about 300 kB, two heads each
    last = None
    for size in sizes:
        for _ in range(2):
            last = torch.empty(size, dtype=torch.uint8)
            group.give_back(last)
    kept = [head for heads in group._heads.values() for head in heads]
    assert sum(head.numel() for head in kept) <= _gloo._HEADS_KEPT_BYTES
    assert group.head(sizes[-1]) is last  # the size used last is kept
    assert group.head(sizes[0]).numel() == sizes[0]  # long gone: a new one


def test_a_pair_reset_right_after_a_fault_ends_on_both_sides(pool):
    # The reset's notices must survive the fault's epoch change on the side that reads the
    # fault's notice late, and the fault's answer must survive the reset.
    results = pool.run("reset_right_after_a_fault", timeout=60)
    assert results[0] == ["reset", "ok"], results
    assert results[1] == ["reset", "TransferTimeoutError", "ok"], results
    assert pool.run("send_recv_all_dtypes", 66)[:2] == ["ok", "ok"]


def test_wait_timeout_leaves_transfer_running(pool):
    assert pool.run("wait_timeout_then_complete")[:2] == ["ok", "sent"]


def test_both_directions_in_any_order(pool):
    assert pool.run("cross_traffic", 1 << 20, 3) == ["ok", "ok", "idle"]


def test_prepare_makes_communicators_once(pool):
    results = pool.run("prepare_eagerly")
    assert results[0]["keys"] == [("gloo", 0, 1), ("gloo", 0, 2)] or results[0]["keys"] == [
        ["gloo", 0, 1],
        ["gloo", 0, 2],
    ]
    assert all(r["created_after"] == 0 for r in results)


def test_init_twice(pool):
    assert pool.run("init_twice") == [f"{r}/{WORLD}" for r in range(WORLD)]


def test_errors_are_tensorferry_errors():
    from tensorferry.errors import MismatchError, PeerLostError, TransferTimeoutError

    for cls in (MismatchError, PeerLostError, TransferTimeoutError):
        assert issubclass(cls, TensorFerryError)


def test_broken_static_promise_with_receives_posted_ahead(pool):
    """The receiver's third receive may have been issued ahead when the promise broke (it then
    fails with the fault) or not (it then takes the next message): either way both sides must
    agree on what happened to the third message, and the fourth lands in the fourth receive."""
    results = pool.run("static_broken_with_receives_ahead", timeout=60)
    sends, recvs = results[0]["sends"], results[1]["recvs"]
    assert sends[:2] == ["ok", "mismatch:shape"] and recvs[:2] == ["good0", "mismatch:shape"]
    assert (sends[2], recvs[2]) in {("ok", "good2"), ("mismatch:shape", "mismatch:shape")}, (
        sends,
        recvs,
    )
    assert (sends[3], recvs[3]) == ("ok", "good3"), (sends, recvs)


@pytest.mark.parametrize("static", [False, True], ids=["headers", "static"])
def test_calls_from_many_threads_at_once_each_arrive_once_and_whole(pool, static):
    """Every rank sends and receives from six threads at once (two senders and one receiver
    per peer): every message arrives once, with its bytes."""
    for seed in (5, 6):
        sides = pool.run("calls_from_many_threads", seed, 30, static, timeout=120)
        assert sides == [{p: True for p in range(WORLD) if p != r} for r in range(WORLD)]


def test_a_batch_with_several_peers_does_not_wait_for_one_that_waits_for_another():
    """As torch's batch_isend_irecv: over gloo each peer's part of a batch goes as soon as it
    can (see the case)."""
    # Its own world: the case ends in timeouts.
    workers = WorkerPool(3, transfer_timeout=10.0, backend="gloo")
    try:
        results = workers.run("batch_waits_for_every_peer")
        assert results == ["ok"] * 3, results
    finally:
        workers.close()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_traffic_between_every_pair_arrives_byte_for_byte(pool, seed):
    """Random messages between all three ranks, each rank grouping its side its own way (lone
    calls, mixed batches, sendrecv) and waiting at random points."""
    sides = pool.run("random_traffic", seed, 120, "gloo")
    assert sum(len(s) for s in sides) == 2 * 120  # every message has two sides
    assert all(outcome == "ok" for s in sides for outcome in s.values()), sides


@pytest.mark.parametrize("seed", [417, 419, 650])
def test_random_traffic_with_mistakes_ends_promptly_and_never_in_wrong_bytes(pool, seed):
    """Random traffic in which one message in five is sent with a wrong shape: every message
    ends on both sides without waiting for its timeout, and every receive that succeeds holds
    the sent bytes."""
    sides = pool.run("random_traffic", seed, 12, "gloo", 0.2, 3.0, timeout=120)
    fates: dict[int, list[str]] = {}
    for outcomes in sides:
        for tag, outcome in outcomes.items():
            fates.setdefault(tag, []).append(outcome)
    assert len(fates) == 12 and all(len(fate) == 2 for fate in fates.values()), fates
    for tag, fate in fates.items():
        assert not any("Timeout" in outcome for outcome in fate), (tag, fates)
        assert "wrong bytes" not in fate, (tag, fates)


@pytest.mark.parametrize("seed", [1000, 1002, 1011])
def test_random_programs_with_waits_between_calls_finish_byte_for_byte(pool, seed):
    """Each rank calls its side of random messages in an order of its own and waits between
    calls: every message arrives whole on both sides."""
    sides = pool.run("random_programs", seed, 24, "gloo", timeout=120)
    assert sum(len(s) for s in sides) == 2 * 24  # every message has two sides
    assert all(outcome == "ok" for s in sides for outcome in s.values()), sides


@pytest.mark.parametrize("static", [False, True], ids=["plain", "static"])
def test_sends_ahead_then_receives_waited_one_by_one_finish(pool, static):
    """Both ranks send ahead, then wait for each receive before posting the next."""
    assert pool.run("sends_ahead_then_receives_one_by_one", static, "gloo") == [
        "ok", "ok", "idle"
    ]  # fmt: skip


@pytest.mark.parametrize("seed", [1000, 1002, 1005])
def test_random_programs_with_batches_finish_byte_for_byte(pool, seed):
    """As above, with three calls in ten a batch of two to four messages (any peers, both
    directions)."""
    sides = pool.run("random_programs", seed, 24, "gloo", 10.0, 0.0, 0.3, timeout=120)
    assert sum(len(s) for s in sides) == 2 * 24  # every message has two sides
    assert all(outcome == "ok" for s in sides for outcome in s.values()), sides


@pytest.mark.parametrize("static", [False, True], ids=["plain", "static"])
def test_a_batch_meets_calls_its_peer_makes_one_after_another(pool, static):
    """Each message of a batch goes as soon as it can (as torch's batch_isend_irecv): a batch
    of a send and a receive finishes although its peer sends back only after receiving, and a
    batch of two sends although its peer receives them one at a time."""
    results = pool.run("batch_meets_calls_made_one_after_another", static, "gloo")
    assert results == ["ok", "ok", "idle"]


def test_a_send_does_not_wait_behind_a_send_to_another_peer(pool):
    results = pool.run("send_behind_a_send_its_peer_receives_later", 1 << 16, "gloo")
    assert results == ["ok"] * 3


def test_a_receive_does_not_wait_behind_a_receive_from_another_peer(pool):
    results = pool.run("receive_behind_a_receive_its_peer_sends_later", 1 << 16, "gloo")
    assert results == ["ok"] * 3
