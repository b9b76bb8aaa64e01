"""End-to-end CPU graphs over real actor processes: results, errors, deaths, teardown."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import random
import signal
import threading
import time
import warnings

import pytest
import torch
from channel_values import LoadsBadly, every_raw_dtype, same_bytes
from graph_actors import (
    Broken,
    Calc,
    Keeps,
    SlowStart,
    check_unsendable_results,
    cramped_map,
    unpicklable_tagged,
)
from killed_driver import kill_a_driver, no_segments

import tensorferry as tf
from tensorferry.graph import InputNode, MultiOutputNode, actor

pytestmark = pytest.mark.timeout(120)

CalcActor = actor(Calc)


@pytest.fixture(scope="module")
def trio():
    handles = [
        CalcActor.spawn(offset, name=f"calc{i}") for i, offset in enumerate((1.0, 10.0, 100.0))
    ]
    yield handles
    for handle in handles:
        handle.kill()


@pytest.mark.parametrize("overlap", [False, True])
def test_chain_results_are_right_every_time(trio, overlap):
    a, b, _ = trio
    with InputNode() as inp:
        dag = b.mul.bind(a.add.bind(inp), 3.0)
    graph = dag.compile(overlap_communication=overlap)
    try:
        for _ in range(50):
            x = torch.randn(random.randint(1, 64), 3)
            assert torch.allclose(graph.execute(x).get(timeout=10), (x + 1.0) * 3.0)
    finally:
        graph.teardown(kill_actors=False)
    assert a.is_alive() and b.is_alive()


def test_fan_out_fan_in_keywords_and_multi_output(trio):
    a, b, c = trio
    with InputNode() as inp:
        left = a.add.bind(inp[0])
        right = b.mul.bind(inp[0], factor=inp.scale)
        joined = c.combine.bind(left, right)
        dag = MultiOutputNode([joined, left, c.add.bind(right)])
    graph = dag.compile()
    try:
        for _ in range(20):
            x, scale = torch.randn(5, 7), random.uniform(-2, 2)
            joined, left, right = graph.execute(x, scale=scale).get(timeout=10)
            assert torch.allclose(left, x + 1.0)
            assert torch.allclose(joined, x + 1.0 + x * scale)
            assert torch.allclose(right, x * scale + 100.0)
        with pytest.raises(TypeError, match="scale"):
            graph.execute(torch.ones(1))
        # Arguments the graph never reads are a mistake, not a no-op.
        with pytest.raises(
            TypeError, match=r"2 positional arguments but the graph reads inp\[:1\]"
        ):
            graph.execute(torch.ones(1), torch.ones(1), scale=1.0)
        with pytest.raises(TypeError, match=r"scael= but the graph reads inp.scale"):
            graph.execute(torch.ones(1), scale=1.0, scael=2.0)
        x = torch.randn(5, 7)  # nothing was submitted: the graph goes on
        assert torch.allclose(graph.execute(x, scale=0.5).get(timeout=10)[1], x + 1.0)
    finally:
        graph.teardown(kill_actors=False)


def test_a_kept_tensor_changed_by_the_next_execution_arrives_as_it_was_returned(trio):
    """With overlap on, a CPU actor's results are written by its send thread while its next
    methods run: a tensor it keeps and fills again in place arrived mixed with the next
    execution's values (4 of 20 executions, 64 MB, three in flight)."""
    a, b, _ = trio
    with InputNode() as inp:
        dag = b.extremes.bind(a.fill_kept.bind(inp, 16 << 20))
    graph = dag.compile(overlap_communication=True, max_inflight=3, buffer_size_bytes=80 << 20)
    try:
        refs = [graph.execute(float(k)) for k in range(1, 21)]
        assert [ref.get(timeout=60) for ref in refs] == [(float(k), float(k)) for k in range(1, 21)]
    finally:
        graph.teardown(kill_actors=False)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_kept_tensor_changed_by_a_later_method_arrives_as_it_was_returned(trio, overlap):
    """Without overlap, a result for another actor was written at its consumer's turn, after
    its actor's later methods of the execution: one that filled the kept tensor again made it
    arrive with the later values (with overlap on, as it was returned)."""
    a, b, _ = trio
    with InputNode() as inp:
        first = a.fill_kept.bind(inp[0], 4)
        again = a.fill_kept.bind(inp[1], 4)  # the same kept tensor, filled in place
        dag = MultiOutputNode([b.extremes.bind(first), again])
    graph = dag.compile(overlap_communication=overlap)
    try:
        for k in range(1, 4):
            extremes, filled_again = graph.execute(float(k), -float(k)).get(timeout=30)
            assert extremes == (float(k), float(k))
            assert torch.equal(filled_again, torch.full((4,), -float(k)))
    finally:
        graph.teardown(kill_actors=False)


@pytest.mark.parametrize("overlap", [False, True])
def test_many_executions_in_flight(trio, overlap):
    a, b, c = trio
    with InputNode() as inp:
        dag = MultiOutputNode([c.add.bind(b.add.bind(a.add.bind(inp)))])
    graph = dag.compile(overlap_communication=overlap, max_inflight=3)
    try:
        inputs = [torch.randn(8, 8) for _ in range(24)]
        refs = [graph.execute(x) for x in inputs]  # more than max_inflight: execute makes room
        order = list(range(len(refs)))
        random.shuffle(order)
        for i in order:
            (result,) = refs[i].get(timeout=10)
            assert torch.allclose(result, inputs[i] + 111.0), i
        assert refs[order[0]].get() is not None  # a second get returns the kept value
    finally:
        graph.teardown(kill_actors=False)


def test_results_of_dropped_refs_are_not_kept(trio):
    """A loop that executes and keeps only some refs: the graph keeps no result nobody can get
    (it kept every one it had read), and the refs kept still get theirs, in any order."""
    a, b, _ = trio
    with InputNode() as inp:
        dag = b.add.bind(a.add.bind(inp))
    graph = dag.compile(max_inflight=3)
    try:
        kept = {}
        for i in range(60):
            ref = graph.execute(torch.full((16,), float(i)))
            if i % 7 == 0:
                kept[i] = ref  # the others are dropped at once, unread
            assert len(graph._results) <= len(kept), i  # only results a kept ref may get
        del ref  # the last one
        for i in sorted(kept, reverse=True):
            assert torch.equal(kept[i].get(timeout=10), torch.full((16,), i + 11.0))
        last = graph.execute(torch.zeros(16)).get(timeout=10)  # reads every execution before
        assert torch.equal(last, torch.full((16,), 11.0))
        assert graph._results == {} and graph._forgotten == set()
    finally:
        graph.teardown(kill_actors=False)


def test_actor_error_reaches_get_and_graph_keeps_working(trio):
    a, b, _ = trio
    with InputNode() as inp:
        dag = b.add.bind(a.fail_if.bind(inp[0], inp[1]))
    graph = dag.compile()
    try:
        for step in range(6):
            x = torch.randn(4)
            ref = graph.execute(x, step % 2 == 1)
            if step % 2:
                with pytest.raises(tf.ActorError) as info:
                    ref.get(timeout=10)
                text = str(info.value)
                assert "boom on purpose" in text and "calc0.fail_if#0" in text
                assert "Traceback" in text and "graph_actors.py" in text
            else:
                assert torch.allclose(ref.get(timeout=10), x + 10.0)
    finally:
        graph.teardown(kill_actors=False)


@pytest.mark.parametrize("how, raised", [("sys.exit", "SystemExit: 3"), ("interrupt", "KeyboardI")])
def test_a_method_raising_what_is_not_an_exception_fails_its_execution_only(trio, how, raised):
    """sys.exit() or KeyboardInterrupt in a method ended the actor's loop: get() waited out its
    whole timeout, and so did every later execution."""
    a, _, _ = trio
    with InputNode() as inp:
        dag = a.exit_if.bind(inp[0], inp[1])
    graph = dag.compile(get_timeout=60)
    try:
        started = time.monotonic()
        with pytest.raises(tf.ActorError, match=f"exit_if#0 raised {raised}"):
            graph.execute(torch.zeros(2), how).get()
        assert time.monotonic() - started < 10
        x = torch.randn(2)
        assert torch.equal(graph.execute(x, "no").get(timeout=10), x)
    finally:
        graph.teardown(kill_actors=False)


def test_an_actor_whose_loop_fails_ends_gets_at_once(trio, caplog):
    """Outside its methods (here: pickling its result raises SystemExit), an actor's loop can
    still fail; the driver's waits then end at once instead of at their timeouts."""
    a, _, _ = trio
    with InputNode() as inp:
        dag = MultiOutputNode([a.exit_if.bind(inp[0], inp[1])])
    graph = dag.compile(get_timeout=60)
    try:
        started = time.monotonic()
        with pytest.raises(tf.ActorDiedError, match="calc0 stopped running the graph"):
            graph.execute(torch.zeros(2), "unpicklable").get()
        assert time.monotonic() - started < 10
    finally:
        graph.teardown(kill_actors=False)
    assert "pickling this exits" in caplog.text  # teardown logs why
    assert a.getpid.call() == a.pid  # the process goes on, ready for direct calls and graphs


def test_structures_and_large_tensors(trio):
    a, b, _ = trio
    with InputNode() as inp:
        dag = b.unpack.bind(a.structure.bind(inp))
    graph = dag.compile(buffer_size_bytes=64 << 10)  # small slots: large messages relocate
    try:
        for n in (3, 300_000, 2_000_000, 10):
            x = torch.randn(n, dtype=torch.float64)
            assert torch.allclose(graph.execute(x).get(timeout=30), x * 2 + x.sum())
    finally:
        graph.teardown(kill_actors=False)


def test_execute_async(trio):
    a, _, _ = trio
    with InputNode() as inp:
        dag = a.mul.bind(inp, 5.0)
    graph = dag.compile(max_inflight=2)

    async def main():
        xs = [torch.randn(3) for _ in range(6)]
        futures = [await graph.execute_async(x) for x in xs]
        results = [await f for f in futures]
        return xs, results

    try:
        xs, results = asyncio.run(main())
        for x, result in zip(xs, results, strict=True):
            assert torch.allclose(result, x * 5.0)
    finally:
        graph.teardown(kill_actors=False)


def test_get_timeout_then_result(trio):
    a, _, _ = trio
    with InputNode() as inp:
        dag = a.slow.bind(inp, 0.5)
    graph = dag.compile()
    try:
        x = torch.randn(2)
        ref = graph.execute(x)
        with pytest.raises(tf.TransferTimeoutError, match="execution 0's result did not come"):
            ref.get(timeout=0.05)
        assert torch.equal(ref.get(timeout=10), x)
    finally:
        graph.teardown(kill_actors=False)


def test_execute_without_room_names_its_limits_and_the_graph_goes_on(trio):
    a, _, _ = trio
    with InputNode() as inp:
        dag = a.slow.bind(inp, 0.5)
    graph = dag.compile(max_inflight=1, submit_timeout=0.05)
    try:
        x = torch.randn(2)
        first = graph.execute(x)
        with pytest.raises(tf.TransferTimeoutError) as caught:
            graph.execute(x + 1)
        text = str(caught.value)
        assert "submit_timeout" in text and "max_inflight=1" in text, text
        assert "execution 0 has not finished" in text and "channel" not in text, text
        assert torch.equal(first.get(timeout=10), x)
        assert torch.equal(graph.execute(x + 2).get(timeout=10), x + 2)  # nothing was submitted
    finally:
        graph.teardown(kill_actors=False)


def test_direct_calls_and_busy_actor(trio):
    a, _, _ = trio
    assert a.getpid.call() == a.pid
    calls = a.count.call()
    with InputNode() as inp:
        dag = a.add.bind(inp)
    graph = dag.compile()
    try:
        assert torch.equal(graph.execute(torch.ones(2)).get(timeout=30), torch.full((2,), 2.0))
        with pytest.raises(RuntimeError, match="already runs a compiled graph"):
            a.add.bind(InputNode()).compile()
        with pytest.raises(RuntimeError, match="runs a compiled graph"):
            a.count.call()
    finally:
        graph.teardown(kill_actors=False)
    assert a.count.call() == calls + 1  # it answers again, the graph's call counted


def test_a_call_behind_another_threads_call_keeps_its_own_timeout():
    calc = CalcActor.spawn(1.0, name="busy")
    try:
        slow = threading.Thread(target=calc.slow.call, args=(torch.ones(1), 4.0))
        slow.start()
        deadline = time.monotonic() + 3.0
        while not calc._lock.locked() and time.monotonic() < deadline:
            time.sleep(0.01)  # until the slow call holds the actor (a loaded machine is slow)
        started = time.monotonic()
        with pytest.raises(tf.TransferTimeoutError, match=r"busy\.add was not called: for 0\.5 s"):
            calc.add.call(torch.ones(1), timeout=0.5)
        assert time.monotonic() - started < 2.0  # not the slow call's 4 s
        slow.join()
        x = torch.randn(3)
        assert torch.equal(calc.add.call(x, timeout=10), x + 1.0)  # nothing was left owed
    finally:
        calc.kill()


def test_arguments_that_do_not_fit_are_refused_before_anything_is_sent_or_started(trio):
    a = trio[0]
    with pytest.raises(TypeError, match=r"calc0\.add\.call\(\): .*too many positional"):
        a.add.call(torch.ones(1), torch.ones(1))
    with pytest.raises(TypeError, match=r"calc0\.mul\.call\(\): .*unexpected keyword .*fctor"):
        a.mul.call(torch.ones(1), fctor=2.0)
    x = torch.randn(2)
    assert torch.equal(a.mul.call(x, factor=3.0), x * 3.0)  # nothing was left owed
    started = time.monotonic()
    with pytest.raises(TypeError, match=r"Calc\.spawn\(\): .*unexpected keyword .*ofset"):
        CalcActor.spawn(ofset=1.0, name="never-started")
    assert time.monotonic() - started < 1.0  # refused before a process started
    children = [child.name for child in multiprocessing.active_children()]
    assert "tensorferry-actor-never-started" not in children


def test_a_call_whose_argument_or_result_cannot_be_rebuilt_fails_alone(trio):
    a = trio[0]
    with pytest.raises(tf.ActorError, match=r"(?s)could not be rebuilt in the actor.*on purpose"):
        a.echo.call(LoadsBadly())  # this ended the actor's process
    with pytest.raises(tf.ActorError, match=r"(?s)cannot be rebuilt in this process.*on purpose"):
        a.loads_badly.call()
    x = torch.randn(3)
    assert torch.equal(a.add.call(x), x + 1.0)  # the same actor, each call its own answer
    # The process died of it at start, before any of our code ran: the cause was on its stderr.
    why = r"(?s)unbuildable: the constructor's arguments could not be rebuilt .*on purpose"
    with pytest.raises(tf.ActorError, match=why):
        CalcActor.spawn(LoadsBadly(), name="unbuildable")
    assert "tensorferry-actor-unbuildable" not in [
        c.name for c in multiprocessing.active_children()
    ]


def test_ctrl_c_reaching_the_actors_leaves_graphs_and_calls_running(trio):
    """Ctrl-C in a terminal signals the whole job: the actors' loops ended with it."""
    a, b, _ = trio
    with InputNode() as inp:
        graph = b.add.bind(a.add.bind(inp)).compile()
    try:
        x = torch.randn(3)
        assert torch.equal(graph.execute(x).get(timeout=30), (x + 1.0) + 10.0)
        for handle in (a, b):
            os.kill(handle.pid, signal.SIGINT)  # while the graph waits for an input
        time.sleep(0.5)
        assert torch.equal(graph.execute(x).get(timeout=30), (x + 1.0) + 10.0)
    finally:
        graph.teardown(kill_actors=False)
    threading.Timer(0.3, os.kill, (a.pid, signal.SIGINT)).start()  # while a method runs
    assert torch.equal(a.slow.call(x, 1.0, timeout=30), x)


def test_a_call_to_an_actor_still_busy_keeps_its_timeout_with_a_large_tensor():
    """A message the pipe cannot hold blocks its writer until the actor reads: a large tensor
    inside the message held a call with timeout=1 for 5.5 s behind a call given up on."""
    calc = CalcActor.spawn(1.0, name="backlog")
    try:
        with pytest.raises(tf.TransferTimeoutError):
            calc.slow.call(torch.ones(1), 5.0, timeout=0.3)
        started = time.monotonic()
        with pytest.raises(tf.TransferTimeoutError, match="did not answer in 1 s"):
            calc.echo.call(torch.randn(250_000), timeout=1.0)  # 1 MB
        assert time.monotonic() - started < 3.0
        for _ in range(2):  # more than the pipe holds: written part-way, then not at all
            started = time.monotonic()
            with pytest.raises(tf.TransferTimeoutError, match=r"did not answer|was not called"):
                calc.echo.call(b"x" * 2_000_000, timeout=1.0)
            assert time.monotonic() - started < 3.0
        x = torch.randn(250_000)
        assert torch.equal(calc.echo.call(x, timeout=30), x)  # its own answer, after the owed
        with pytest.raises(tf.TransferTimeoutError):
            calc.slow.call(torch.ones(1), 60.0, timeout=0.3)
        with pytest.raises(tf.TransferTimeoutError):
            calc.echo.call(b"y" * 2_000_000, timeout=0.5)  # the pipe is full again
        started = time.monotonic()
        calc.kill(timeout=2.0)
        assert time.monotonic() - started < 5.0 and not calc.is_alive()
    finally:
        calc.kill()


class _Interrupted(BaseException):
    """Raised by a signal handler, as Ctrl-C raises KeyboardInterrupt (not an Exception)."""


def test_a_direct_call_interrupted_while_it_waits_leaves_later_calls_their_own_answers():
    calc = CalcActor.spawn(1.0, name="interrupted")

    def interrupt(signum, frame):
        raise _Interrupted

    previous = signal.signal(signal.SIGUSR1, interrupt)
    try:
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGUSR1)).start()
        with pytest.raises(_Interrupted):
            calc.slow.call(torch.full((2,), 42.0), 4.0)  # (slack for a loaded machine)
        for i in range(2):  # the slow call's late answer (42s) is dropped, not returned
            x = torch.randn(2)
            assert torch.equal(calc.add.call(x, timeout=10), x + 1.0), i
    finally:
        signal.signal(signal.SIGUSR1, previous)
        calc.kill()


class _CutsOff:
    """The pipe's socket, interrupted once part-way through a message: its first write takes
    the first 2 bytes only, its second raises; then it writes as the socket does."""

    def __init__(self, sock) -> None:
        self.sock, self.writes = sock, 0

    def sendmsg(self, views, *args):
        self.writes += 1
        if self.writes == 1:
            return self.sock.sendmsg([views[0][:2]], *args)
        if self.writes == 2:
            raise _Interrupted
        return self.sock.sendmsg(views, *args)

    def __getattr__(self, name):
        return getattr(self.sock, name)


def test_a_message_cut_off_part_way_is_finished_and_its_answer_dropped(monkeypatch):
    """An interrupt between two writes of one message: the rest would have been read as the
    next message's start. It is written in the background, and the next call gets its own
    answer."""
    calc = CalcActor.spawn(1.0, name="cut-off")
    try:
        monkeypatch.setattr(calc, "_out", _CutsOff(calc._out))
        with pytest.raises(_Interrupted):
            calc.add.call(torch.full((2,), 42.0))
        for i in range(2):
            x = torch.randn(2)
            assert torch.equal(calc.add.call(x, timeout=10), x + 1.0), i
        assert calc.is_alive()
    finally:
        monkeypatch.undo()
        calc.kill()


def test_a_direct_call_that_times_out_leaves_later_calls_and_graphs_their_own_answers():
    """The actor goes on with a call its caller gave up on and answers it later: that answer
    must not be taken for the next call's (every later call returned the one before's)."""
    calc = CalcActor.spawn(1.0, name="late")
    try:
        with pytest.raises(tf.TransferTimeoutError, match=r"late\.slow did not answer"):
            calc.slow.call(torch.full((2,), 42.0), 1.0, timeout=0.2)
        assert calc.is_alive()
        for i in range(3):
            x = torch.randn(2)
            assert torch.equal(calc.add.call(x), x + 1.0), i
        with pytest.raises(tf.TransferTimeoutError):
            calc.slow.call(torch.full((2,), 7.0), 1.0, timeout=0.2)
        with InputNode() as inp:
            dag = calc.mul.bind(inp, 3.0)
        graph = dag.compile()  # its set-up answer comes after the late one
        try:
            x = torch.randn(4)
            assert torch.equal(graph.execute(x).get(timeout=10), x * 3.0)
        finally:
            graph.teardown(kill_actors=False)
        x = torch.randn(2)
        assert torch.equal(calc.add.call(x), x + 1.0)
    finally:
        calc.kill()


def test_compile_on_an_actor_still_running_a_call_given_up_on_is_bounded_and_harmless():
    """Such an actor reads no plan until the call ends: compile waited out its whole start
    timeout (180 s by default), then stopped the actor. (One whose call ends within the
    timeout: see the test above.)"""
    calc = CalcActor.spawn(1.0, name="busy")
    try:
        with pytest.raises(tf.TransferTimeoutError):
            calc.slow.call(torch.ones(1), 5.0, timeout=0.2)
        with InputNode() as inp:
            dag = calc.mul.bind(inp, 3.0)
        started = time.monotonic()
        with pytest.raises(tf.GraphCompileError, match=r"busy is still running a direct call"):
            dag.compile(start_timeout=1.0)
        assert time.monotonic() - started < 5.0
        assert calc.is_alive() and calc.graph is None
        with pytest.raises(ValueError, match="start_timeout"):
            dag.compile(start_timeout=0)
        x = torch.randn(2)
        assert torch.equal(calc.add.call(x, timeout=30), x + 1.0)  # once the slow call ended
    finally:
        calc.kill()


def test_a_constructor_slower_than_start_timeout_names_it_and_leaves_no_process():
    started = time.monotonic()
    with pytest.raises(tf.ActorDiedError, match=r"start_timeout=1 s .* needs a larger") as caught:
        actor(SlowStart).spawn(60.0, start_timeout=1, name="slow-start")
    assert time.monotonic() - started < 10
    assert type(caught.value) is tf.ActorDiedError  # not an internal subclass
    children = [child.name for child in multiprocessing.active_children()]
    assert "tensorferry-actor-slow-start" not in children, children


def test_constructor_error_is_an_actor_error():
    with pytest.raises(tf.ActorError, match="this actor cannot start"):
        actor(Broken).spawn()


@pytest.mark.parametrize("overlap", [False, True])
def test_async_methods_run_to_completion_in_graphs_and_direct_calls(trio, overlap):
    a, b, _ = trio
    x = torch.randn(6)
    assert torch.equal(a.add_later.call(x), x + 1.0)
    with InputNode() as inp:
        dag = b.add_later.bind(a.add_later.bind(inp))
    graph = dag.compile(overlap_communication=overlap)
    try:
        for i in range(5):
            assert torch.equal(graph.execute(x * i).get(timeout=30), x * i + 1.0 + 10.0)
    finally:
        graph.teardown(kill_actors=False)


@contextlib.contextmanager
def _echo_chain(a, b):
    """A graph passing its input through ``a`` then ``b`` unchanged; torn down, actors kept."""
    with InputNode() as inp:
        graph = b.echo.bind(a.echo.bind(inp)).compile()
    try:
        yield graph
    finally:
        graph.teardown(kill_actors=False)


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_tensors_of_every_dtype_travel_bit_for_bit(trio):
    a, b, _ = trio
    tensors = every_raw_dtype()
    assert len(tensors) >= 15  # float8s and the wide unsigned ints among them
    with _echo_chain(a, b) as graph:
        for tensor in tensors:  # a bare tensor, then inside a structure
            assert same_bytes(graph.execute(tensor).get(timeout=30), tensor), tensor.dtype
        got = graph.execute({"all": tensors}).get(timeout=30)["all"]
        assert all(same_bytes(g, t) for g, t in zip(got, tensors, strict=True))


@pytest.mark.parametrize("shape", ["bare", "parameter", "structure"])
def test_tensors_that_require_grad_arrive_as_data_as_over_gpu_edges(trio, shape):
    a, b, _ = trio
    with InputNode() as inp:
        made = a.forward.bind(inp, shape)
        dag = MultiOutputNode([made, b.needs_grad.bind(made)])
    graph = dag.compile()
    try:
        for n in (5, 300_000):  # in the ring's slot, then relocated
            x = torch.randn(n)
            got, seen_by_b = graph.execute(x).get(timeout=30)
            out = got if shape != "structure" else got["out"]
            assert type(out) is torch.Tensor and not out.requires_grad
            assert torch.equal(out, x * 1.0)
            if shape == "structure":
                for key, want in (("weight", torch.ones(n)), ("param", x)):
                    assert type(got[key]) is torch.Tensor and not got[key].requires_grad
                    assert torch.equal(got[key], want)
                assert got["sizes"] == [n]
            assert seen_by_b == [False] * (3 if shape == "structure" else 1)
    finally:
        graph.teardown(kill_actors=False)


def test_a_value_that_cannot_be_rebuilt_fails_its_execution_only(trio):
    a, b, _ = trio
    x = torch.randn(3)
    with _echo_chain(a, b) as graph:
        for value in (x, [LoadsBadly(), x], x * 2):
            ref = graph.execute(value)
            if isinstance(value, list):
                with pytest.raises(tf.ActorError, match="cannot be rebuilt on purpose"):
                    ref.get(timeout=30)
            else:
                assert torch.equal(ref.get(timeout=30), value)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_process_forked_from_the_driver_leaves_its_graph_and_actors_alone(trio):
    a, b, _ = trio
    x = torch.randn(4)
    with InputNode() as inp:
        graph = b.add.bind(a.add.bind(inp)).compile()
    try:
        assert torch.equal(graph.execute(x).get(timeout=30), (x + 1.0) + 10.0)
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: try the graph and an actor, then exit as a script would
            import atexit

            seen = []
            for attempt in (lambda: graph.execute(x), lambda: a.getpid.call()):
                try:
                    attempt()
                    seen.append("worked")
                except RuntimeError as exc:
                    seen.append("forked" if "forked from" in str(exc) else repr(exc))
            os.write(write_end, ",".join(seen).encode())
            graph.teardown()  # neither may touch the parent's graph or actors
            a.kill()
            atexit._run_exitfuncs()  # ours, multiprocessing's (it terminated daemon children)
            os._exit(0)
        os.close(write_end)
        _, status = os.waitpid(pid, 0)
        assert os.read(read_end, 200).decode() == "forked,forked" and status == 0
        os.close(read_end)
        # The parent's graph and actors were left alone.
        assert a.is_alive() and b.is_alive()
        for i in range(3):
            assert torch.equal(graph.execute(x * i).get(timeout=30), (x * i + 1.0) + 10.0)
    finally:
        graph.teardown(kill_actors=False)


def test_direct_calls_with_what_cannot_be_pickled_fail_alone(trio):
    a, _, _ = trio
    x = torch.randn(5)
    with pytest.raises(TypeError, match=r"calc0\.mul\(\): keyword argument 'factor' \(lock\)"):
        a.mul.call(x, factor=threading.Lock())
    with pytest.raises(TypeError, match=r"calc0\.combine\(\): argument 1 \(function\)"):
        a.combine.call(x, lambda: 1)
    # The result of a call that does not pickle: the caller's error; the actor lives on.
    with pytest.raises(tf.ActorError, match="lock_if returned a value that cannot be pickled"):
        a.lock_if.call(x, True)
    assert a.is_alive()
    assert torch.equal(a.lock_if.call(x, False), x)
    assert torch.equal(a.mul.call(x, factor=3.0), x * 3.0)


@pytest.mark.parametrize("overlap", [False, True])
def test_promises_on_shared_memory_edges_are_kept_as_on_gpu_edges(trio, overlap):
    """static_shape and direct_return are promises wherever "auto" sends the result: a result
    that breaks one fails its execution (as over NCCL), and the graph goes on."""
    a, b, _ = trio
    with InputNode() as inp:
        fixed = a.echo.bind(inp[0]).with_transport("shm", static_shape=True)
        single = a.echo.bind(inp[1]).with_transport("auto", direct_return=True)
        dag = MultiOutputNode([b.echo.bind(fixed), b.echo.bind(single)])
    graph = dag.compile(overlap_communication=overlap)
    try:
        x, y = torch.randn(4), torch.randn(3)
        # The first result sets the layout; a structure holding the same layout keeps it.
        for value in (x, {"again": x + 1.0}, torch.randn(4)):
            got = graph.execute(value, y).get(timeout=30)
            same = got[0]["again"] if isinstance(value, dict) else got[0]
            want = value["again"] if isinstance(value, dict) else value
            assert torch.equal(same, want) and torch.equal(got[1], y)
        for changed, why in ((torch.randn(5), r"\(5,\)"), (x.double(), "float64")):
            # The error names the node whose promise broke (it named "edge 1").
            with pytest.raises(
                tf.ActorError,
                match=rf"calc0\.echo#0 was compiled with static_shape=True but .*{why}",
            ):
                graph.execute(changed, y).get(timeout=30)
        with pytest.raises(
            tf.ActorError,
            match=r"result of calc0\.echo#1 goes over .* direct_return=True but is a int, not",
        ):
            graph.execute(x, 3).get(timeout=30)
        got = graph.execute(x, y).get(timeout=30)
        assert torch.equal(got[0], x) and torch.equal(got[1], y)
    finally:
        graph.teardown(kill_actors=False)


def _lazy_views_as_values(x):
    return {
        "conj": x.conj().resolve_conj(),
        "neg": x[:1].conj().imag.resolve_neg(),
        "both": [x.conj().resolve_conj(), x],
    }


def _assert_values(got, want):
    assert got.keys() == want.keys()
    for key in ("conj", "neg"):
        assert not got[key].is_conj() and not got[key].is_neg()
        assert torch.equal(got[key], want[key]), key
    assert all(torch.equal(g, w) for g, w in zip(got["both"], want["both"], strict=True))


@pytest.mark.parametrize("overlap", [False, True])
def test_conjugate_and_negative_views_travel_as_their_values(trio, overlap):
    """x.conj() keeps x's memory and a flag: moved as bytes it arrived as x. In graphs (as a
    result, a bare input, over shared memory) and in direct calls, it arrives as its values."""
    a, b, _ = trio
    x = torch.randn(4, dtype=torch.complex64)
    with InputNode() as inp:
        dag = MultiOutputNode([b.echo.bind(a.lazy_views.bind(inp[0])), a.echo.bind(inp[1])])
    graph = dag.compile(overlap_communication=overlap)
    try:
        for _ in range(2):
            views, echoed = graph.execute(x, x.conj()).get(timeout=30)
            _assert_values(views, _lazy_views_as_values(x))
            assert torch.equal(echoed, x.conj().resolve_conj())
    finally:
        graph.teardown(kill_actors=False)
    _assert_values(a.lazy_views.call(x), _lazy_views_as_values(x))
    assert torch.equal(a.echo.call(x.conj()), x.conj().resolve_conj())
    neg = x[:1].conj().imag
    assert torch.equal(a.echo.call([neg])[0], neg.resolve_neg())


def test_a_conjugate_view_given_to_spawn_arrives_as_its_values():
    x = torch.randn(3, dtype=torch.complex64)
    handle = CalcActor.spawn(x.conj())
    try:
        assert torch.equal(handle.get_offset.call(), x.conj().resolve_conj())
    finally:
        handle.kill()


def test_direct_calls_and_spawn_hand_over_copies_not_the_senders_memory():
    """torch's multiprocessing pickling moves a CPU tensor into shared memory and hands the
    receiver that memory: the caller's tensor and the actor's were one, both ways."""
    weights = torch.randn(5)
    handle = CalcActor.spawn(weights)  # its offset
    try:
        sent = weights.clone()
        weights.add_(100.0)  # the driver changes what it gave spawn
        assert torch.equal(handle.get_offset.call(), sent)
        synced = handle.fill_kept.call(1.0, 4)  # a tensor the actor keeps, filled in place
        handle.fill_kept.call(2.0, 4)
        assert torch.equal(synced, torch.ones(4))
        arg = torch.randn(5)
        before = arg.clone()
        handle.add_in_place.call(arg)
        assert torch.equal(arg, before)  # the actor changed its copy only
        assert torch.equal(handle.given.call(), before + sent)
        big = torch.randn(1000)
        assert torch.equal(handle.echo.call(big[10:20:3]), big[10:20:3])  # a view: its values
        huge = torch.randn(5 << 20)  # over the size copied by memmove
        assert torch.equal(handle.echo.call(huge), huge)
        assert handle.echo.call(torch.ones(0, 3)).shape == (0, 3)
        tensors = every_raw_dtype()
        assert all(
            same_bytes(g, t) for g, t in zip(handle.echo.call(tensors), tensors, strict=True)
        )
        # What makes a weight a weight comes along.
        param = torch.nn.Parameter(torch.randn(3))
        got = handle.echo.call({"w": param, "leaf": param.detach().requires_grad_()})
        assert type(got["w"]) is torch.nn.Parameter and got["w"].requires_grad
        assert got["leaf"].requires_grad and got["leaf"].is_leaf
        assert torch.equal(got["w"], param) and torch.equal(got["leaf"], param)
        with pytest.raises(TypeError, match="detach"):  # torch's refusal: autograd stays home
            handle.echo.call(param * 2)
        assert torch.equal(handle.echo.call(param.detach() * 2), param.detach() * 2)
    finally:
        handle.kill()


def test_a_large_complex32_tensor_reaches_an_actor_without_a_warning(capfd):
    """torch's rebuilding of a shared complex32 tensor warned in the receiving actor (once per
    process: a fresh actor shows it). Its bytes travel instead."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns as it makes complex32 tensors
        x = torch.randn(100_000, dtype=torch.complex64).to(torch.complex32)  # 400 KB
    handle = CalcActor.spawn(name="complex32")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the driver's own rebuilding of the result
            got = handle.echo.call(x)
        assert torch.equal(got.view(torch.int32), x.view(torch.int32))
    finally:
        handle.kill()
    assert "ComplexHalf" not in capfd.readouterr().err


def test_results_of_calls_kept_by_the_hundred_hold_no_descriptors(trio):
    """A tensor shared by torch keeps a file descriptor open in its receiver: a driver keeping
    a thousand small results ran out under the usual limit of 1024, and the pipe broke."""
    import resource

    a = trio[0]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    in_use = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (in_use + 64, hard))
    try:
        kept = [a.ones.call(4) for _ in range(300)]
        kept += [a.echo.call(torch.full((3,), float(i))) for i in range(300)]
        large = [a.ones.call(400_000) for _ in range(100)]  # 1.6 MB: through shared memory
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert all(torch.equal(t, torch.ones(4)) for t in kept[:300])
    assert all(torch.equal(t, torch.full((3,), float(i))) for i, t in enumerate(kept[300:]))
    assert all(torch.equal(t, torch.ones(400_000)) for t in large)
    assert torch.equal(a.add.call(torch.zeros(2)), torch.ones(2))  # the pipe still works


def test_timeouts_that_could_never_end_are_refused_and_nothing_changes(trio):
    a, b, _ = trio
    x = torch.randn(3)
    with pytest.raises(ValueError, match="call\\(\\): timeout must be a finite number"):
        a.add.call(x, timeout=float("inf"))
    with pytest.raises(ValueError, match="start_timeout must be > 0 seconds"):
        CalcActor.spawn(start_timeout=0)
    with InputNode() as inp:
        graph = b.add.bind(a.add.bind(inp)).compile()
    try:
        ref = graph.execute(x)
        for endless in (float("inf"), float("nan"), -1.0):
            with pytest.raises(ValueError, match="timeout must be"):
                ref.get(timeout=endless)
            with pytest.raises(ValueError, match="timeout must be"):
                graph.teardown(timeout=endless)
        assert torch.equal(ref.get(timeout=30), (x + 1.0) + 10.0)  # the graph still runs
        assert torch.equal(graph.execute(x).get(timeout=30), (x + 1.0) + 10.0)
    finally:
        graph.teardown(kill_actors=False)
    assert torch.equal(a.add.call(x, timeout=30), x + 1.0)


def test_a_constant_that_cannot_be_pickled_fails_compile_and_the_actors_stay_usable(trio):
    a, b, _ = trio
    with InputNode() as inp:
        dag = b.add.bind(a.mul.bind(inp, factor=threading.Lock()))
    named = r"calc0\.mul: keyword argument 'factor' \(lock\) is a constant that cannot be pickled"
    with pytest.raises(tf.GraphCompileError, match=named):
        dag.compile()
    assert a.graph is None and b.graph is None
    x = torch.randn(4)
    with InputNode() as inp:
        graph = b.add.bind(a.mul.bind(inp, factor=3.0)).compile()
    try:
        assert torch.equal(graph.execute(x).get(timeout=30), x * 3.0 + 10.0)
    finally:
        graph.teardown(kill_actors=False)


def test_a_plan_that_cannot_be_sent_stops_the_actors_that_got_theirs(trio, monkeypatch):
    a, b, _ = trio
    real_send = type(b)._send

    def refuse_plans_to_b(handle, message, *deadline):
        if handle is b and message[0] == "run":
            raise TypeError("cannot pickle this plan (on purpose)")
        return real_send(handle, message, *deadline)

    monkeypatch.setattr(type(b), "_send", refuse_plans_to_b)
    with InputNode() as inp:
        dag = b.add.bind(a.mul.bind(inp))
    with pytest.raises(tf.GraphCompileError, match="plan could not be sent: cannot pickle this"):
        dag.compile()
    monkeypatch.undo()
    # a got its plan and ran it: it was stopped, and its replies are all read.
    assert a.graph is None and b.graph is None
    assert a.getpid.call() == a.pid and b.getpid.call() == b.pid
    x = torch.randn(4)
    with InputNode() as inp:
        graph = b.add.bind(a.mul.bind(inp)).compile()
    try:
        assert torch.equal(graph.execute(x).get(timeout=30), x * 2.0 + 10.0)
    finally:
        graph.teardown(kill_actors=False)


@pytest.mark.parametrize("profile", [False, True])
def test_shared_memory_that_cannot_be_made_fails_compile_and_leaves_no_segment(
    trio, monkeypatch, profile
):
    """The segments made before the failing one stayed in /dev/shm after the driver ended
    (a buffer_size_bytes too large for the machine, or a full /dev/shm)."""
    from tensorferry.graph import _executor_local

    a, b, _ = trio
    real_create = _executor_local.Channel.create
    made: list[str] = []

    def second_fails(name, **kwargs):
        if made:
            raise OSError(12, "Cannot allocate memory")
        made.append(name)
        return real_create(name, **kwargs)

    monkeypatch.setattr(_executor_local.Channel, "create", staticmethod(second_fails))
    with InputNode() as inp:
        dag = b.add.bind(a.mul.bind(inp))
    with pytest.raises(tf.GraphCompileError, match=r"Cannot allocate memory.*buffer_size_bytes"):
        dag.compile(profile=profile)
    monkeypatch.undo()
    assert no_segments(made[0].rsplit("e", 1)[0])  # the graph's prefix, then e<edge id>
    assert a.graph is None and b.graph is None
    x = torch.randn(4)
    graph = dag.compile(profile=profile)
    try:
        assert torch.equal(graph.execute(x).get(timeout=30), x * 2.0 + 10.0)
    finally:
        graph.teardown(kill_actors=False)


def test_a_message_shared_memory_has_no_room_for_fails_its_execution_only(monkeypatch):
    """A nearly full /dev/shm (64 MiB in a default Docker container): a large message's
    segment was made sparse, and the process writing into it died of SIGBUS, the driver
    itself for an input. Now its reader gets an error in its place."""
    from tensorferry.graph import _channel

    calc = CalcActor.spawn(1.0, name="cramped")
    try:
        calc.cramp_shared_memory.call(4 << 20)  # in the actor: its results
        monkeypatch.setattr(_channel, "_map", cramped_map(_channel._map, 4 << 20))  # inputs
        with InputNode() as inp:
            dag = MultiOutputNode([calc.ones.bind(inp[0]), calc.add.bind(inp[1])])
        graph = dag.compile(buffer_size_bytes=1 << 20)
        try:
            big, small = 2_000_000, 4  # 8 MB and 16 bytes of float32
            for n, x in ((big, torch.zeros(small)), (small, torch.zeros(big))):
                with pytest.raises(tf.ActorError, match=r"no room for a 80000\d\d-byte message"):
                    graph.execute(n, x).get(timeout=30)
                ones, plus_one = graph.execute(small, torch.zeros(small)).get(timeout=30)
                assert torch.equal(ones, torch.ones(small)) and torch.equal(plus_one, ones)
        finally:
            graph.teardown(kill_actors=False)
        assert calc.is_alive()
    finally:
        calc.kill()


def test_a_class_of_an_interactive_main_is_refused_before_anything_starts(monkeypatch):
    """A notebook's, the REPL's, ``python -c``'s: the actor process found no file to run as
    its ``__main__`` and died at start (``ActorDiedError``, the cause only in its stderr)."""
    import sys
    import types

    Notebook = type("Notebook", (), {"__module__": "__main__"})  # as a notebook cell makes it
    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))  # no __file__
    children = multiprocessing.active_children()
    with pytest.raises(TypeError, match="Notebook is defined in the __main__ of a notebook"):
        actor(Notebook).spawn()
    assert multiprocessing.active_children() == children


def test_spawn_with_an_argument_that_cannot_be_pickled_names_it_and_starts_nothing():
    fds = set(os.listdir("/proc/self/fd"))
    with pytest.raises(TypeError, match=r"Calc\.spawn\(\): argument 0 \(lock\) cannot be pickled"):
        CalcActor.spawn(threading.Lock())
    with pytest.raises(TypeError, match=r"keyword argument 'offset' \(function\)"):
        CalcActor.spawn(offset=lambda: 1.0)
    assert set(os.listdir("/proc/self/fd")) <= fds  # the pipe to the actor is closed again
    # A multiprocessing object pickles while the process is spawned: never the one blamed.
    event = multiprocessing.get_context("spawn").Event()
    with pytest.raises(TypeError, match=r"keyword argument 'offset' \(lock\)"):
        actor(Keeps).spawn(event, offset=threading.Lock())
    handle = CalcActor.spawn(2.0)
    try:
        assert torch.equal(handle.add.call(torch.ones(3)), torch.full((3,), 3.0))
    finally:
        handle.kill()


def spawn_pair():
    return CalcActor.spawn(1.0), CalcActor.spawn(2.0)


def test_killed_actor_fails_pending_and_later_gets_promptly():
    a, b = spawn_pair()
    with InputNode() as inp:
        dag = b.add.bind(a.slow.bind(inp, 1.0))
    graph = dag.compile(max_inflight=2)
    prefix = graph._executor.prefix
    try:
        assert torch.allclose(graph.execute(torch.ones(2)).get(timeout=10), torch.ones(2) + 2)
        pending = [graph.execute(torch.ones(2)) for _ in range(2)]
        os.kill(a.pid, signal.SIGKILL)
        start = time.monotonic()
        for ref in pending:
            with pytest.raises(tf.ActorDiedError, match="died"):
                ref.get(timeout=30)
        assert time.monotonic() - start < 3.0
        with pytest.raises(tf.ActorDiedError):
            graph.execute(torch.ones(2))
    finally:
        start = time.monotonic()
        graph.teardown(timeout=5.0)
        assert time.monotonic() - start < 6.0
    assert not a.is_alive() and not b.is_alive()
    assert no_segments(prefix)


def test_actor_exiting_inside_a_method_is_an_actor_died_error():
    a, b = spawn_pair()
    with InputNode() as inp:
        dag = b.add.bind(a.die_if.bind(inp[0], inp[1]))
    graph = dag.compile()
    try:
        assert torch.allclose(
            graph.execute(torch.zeros(1), False).get(timeout=10), torch.ones(1) * 2
        )
        with pytest.raises(tf.ActorDiedError, match="exit code 7"):
            graph.execute(torch.zeros(1), True).get(timeout=30)
    finally:
        graph.teardown(timeout=5.0)
    assert not a.is_alive() and not b.is_alive()


def test_teardown_finishes_in_time_with_a_stuck_method_and_leaves_nothing():
    a, b = spawn_pair()
    with InputNode() as inp:
        dag = MultiOutputNode([b.add.bind(a.slow.bind(inp, 60.0))])
    graph = dag.compile()
    prefix = graph._executor.prefix
    graph.execute(torch.ones(1))
    time.sleep(0.3)  # a is now inside its 60 s method
    start = time.monotonic()
    graph.teardown(timeout=3.0)
    assert time.monotonic() - start < 4.0
    assert not a.is_alive() and not b.is_alive()
    assert no_segments(prefix)
    graph.teardown()  # idempotent
    with pytest.raises(RuntimeError, match="torn down"):
        graph.execute(torch.ones(1))


def test_a_get_waiting_while_another_thread_tears_down_gets_a_clear_error():
    a, b = spawn_pair()
    with InputNode() as inp:
        dag = b.add.bind(a.slow.bind(inp, 5.0))
    graph = dag.compile()
    ref = graph.execute(torch.ones(1))
    outcome: list[BaseException] = []

    def wait() -> None:
        try:
            ref.get(30)
        except BaseException as exc:  # what the waiting user sees
            outcome.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.3)  # the waiter is inside get()
    graph.teardown(timeout=3.0)
    waiter.join(10)
    assert not waiter.is_alive()
    assert len(outcome) == 1 and type(outcome[0]) is RuntimeError, outcome
    assert "torn down before execution 0's result came" in str(outcome[0])


def test_an_input_that_cannot_be_sent_fails_alone_and_the_graph_goes_on(trio):
    a, b, c = trio
    with InputNode() as inp:
        dag = MultiOutputNode([a.add.bind(inp[0]), c.combine.bind(inp[0], b.add.bind(inp[1]))])
    graph = dag.compile()
    try:
        x, y = torch.randn(5), torch.randn(5)
        with pytest.raises(TypeError, match=r"inp\[1\] cannot be pickled"):
            graph.execute(x, threading.Lock())
        with pytest.raises(TypeError, match=r"inp\[1\] cannot be pickled"):
            graph.execute(x, (y, lambda: None))  # a tensor beside it does not help
        with pytest.raises(TypeError, match=r"inp\[1\] cannot be pickled"):
            graph.execute(x, unpicklable_tagged(y))  # a tensor subclass is pickled whole
        added, combined = graph.execute(x, y).get(timeout=10)
        assert torch.equal(added, x + 1.0)
        assert torch.equal(combined, Calc(100.0).combine(x, y + 10.0))
    finally:
        graph.teardown(kill_actors=False)


@pytest.mark.parametrize("method", ["lock_if", "tagged_if"])
@pytest.mark.parametrize("overlap", [False, True])
def test_a_result_that_cannot_be_sent_fails_its_execution_only(trio, overlap, method):
    # tagged_if: a tensor subclass, which the channels pickle whole (a check that left every
    # tensor out passed it, and the failed write ended the actor's loop)
    a, b, _ = trio
    with InputNode() as inp:
        sent = getattr(a, method).bind(inp[0], inp[1])
        dag = MultiOutputNode([sent, b.add.bind(sent)])  # to the driver and to another actor
    graph = dag.compile(overlap_communication=overlap)
    try:
        check_unsendable_results(graph, lambda x: x + 10.0, numel=4, timeout=10, method=method)
    finally:
        graph.teardown(kill_actors=False)


def test_a_killed_driver_leaves_no_actor_and_no_segment(tmp_path):
    kill_a_driver(tmp_path, gpu=False)


@pytest.mark.parametrize("overlap", [False, True])
def test_every_execution_s_spans_are_there_after_teardown(tmp_path, overlap):
    # An actor wrote its spans only where the driver had read the last batches (4 slots) and
    # kept the rest for its next execution: after 20 executions the driver had 0-3's, and
    # after teardown none at all (nothing was kept), so no timeline could be drawn.
    a, b = spawn_pair()
    with InputNode() as inp:
        dag = b.add.bind(a.add.bind(inp))
    with dag.compile(overlap_communication=overlap, profile=True) as graph:
        for i in range(20):
            got = graph.execute(torch.full((4,), float(i))).get(timeout=10)
            assert torch.equal(got, torch.full((4,), i + 3.0))
    records = graph.profile_records()
    for name in (a.name, b.name):
        ran = {r[1] for r in records if r[0] == name and r[3] == "COMPUTE"}
        assert ran == set(range(20)), (name, sorted(ran))
    assert graph.visualize_timeline(tmp_path / "timeline.png").stat().st_size > 10_000


def test_context_manager_tears_down(tmp_path, monkeypatch):
    monkeypatch.setenv("TENSORFERRY_VISUALIZE_SCHEDULE", "1")
    monkeypatch.chdir(tmp_path)
    a, b = spawn_pair()
    with InputNode() as inp:
        dag = b.add.bind(a.add.bind(inp))
    with dag.compile(overlap_communication=True, profile=True) as graph:
        for _ in range(5):
            x = torch.randn(16)
            assert torch.allclose(graph.execute(x).get(timeout=10), x + 3.0)
        time.sleep(0.1)
        records = graph.profile_records()
        kinds = {r[3] for r in records}
        assert kinds == {"READ", "COMPUTE", "WRITE"}
        assert {r[5] for r in records} == {"main", "recv", "send"}
        png = graph.visualize_timeline(tmp_path / "timeline.png")
        assert png.stat().st_size > 10_000
    assert not a.is_alive() and not b.is_alive()
    pictures = sorted(p.name for p in tmp_path.iterdir())
    assert any(n.startswith("tensorferry-schedule-") and n.endswith(".png") for n in pictures)
    assert any(n.startswith("tensorferry-schedule-") and n.endswith(".dot") for n in pictures)
