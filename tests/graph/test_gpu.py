"""GPU tier: graphs with CUDA actors (skipped without CUDA; run by tools/gpu-check.sh)."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from graph_actors import GpuCalc, check_unsendable_results
from killed_driver import kill_a_driver
from one_gpu import ONE_GPU_ACTORS, spawn_on_gpu

import tensorferry as tf
from tensorferry.graph import InputNode, MultiOutputNode, actor
from tensorferry.p2p._nccl_lib import library as nccl_library

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.timeout(180)
needs_one = pytest.mark.skipif(GPUS < 1, reason="needs a CUDA device")
needs_two = pytest.mark.skipif(GPUS < 2, reason="needs two CUDA devices")
# Two actors whose edges may be NCCL's: on two GPUs, or on one posing as two hosts (see
# one_gpu.py). Tests of ce or nvlink edges, or of a second device itself, keep needs_two.
two_devices = pytest.mark.gpu if ONE_GPU_ACTORS else pytest.mark.multigpu
CAN_PAIR = GPUS >= 2 or (ONE_GPU_ACTORS and GPUS == 1)
needs_two_or_posing = pytest.mark.skipif(
    not CAN_PAIR,
    reason="needs two CUDA devices (or one, with TF_TEST_ONE_GPU_ACTORS=1)",
)

Gpu = actor(GpuCalc)


def assert_same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Every element equal, and on a difference the elements that differ (a misrouted or
    half-written buffer shows as a run of them). ``want`` must come from the same float
    operations the actors ran: IEEE addition and multiplication round alike on CPU and GPU."""
    if torch.equal(got, want):
        return
    bad = (got != want).nonzero().flatten()
    raise AssertionError(
        f"{what}: {bad.numel()} of {want.numel()} elements differ, at {bad[:16].tolist()}; "
        f"got {got.flatten()[bad[:8]].tolist()}, want {want.flatten()[bad[:8]].tolist()}"
    )


@pytest.fixture(scope="module")
def pair():
    if not CAN_PAIR:
        pytest.skip("needs two CUDA devices")
    handles = [spawn_on_gpu(Gpu, i, name=f"gpu{i}") for i in range(2)]
    yield handles
    for handle in handles:
        handle.kill()


@two_devices
@needs_two_or_posing
@pytest.mark.parametrize(
    "transport, overlap, max_inflight",
    [
        ("nccl", False, 1),
        ("nccl", False, 3),
        ("nccl", True, 1),
        ("nccl", True, 3),
        pytest.param("ce", False, 1, marks=needs_two),  # the copy engine, through tensorferry.p2p
        pytest.param("ce", True, 3, marks=needs_two),
        # copy kernels over symmetric memory, through tensorferry.p2p
        pytest.param("nvlink", True, 3, marks=needs_two),
    ],
)
def test_gpu_edge_results(pair, transport, overlap, max_inflight):
    a, b = pair
    with InputNode() as inp:
        sent = a.make.bind(inp[0]).with_transport(transport)
        dag = MultiOutputNode([b.scale.bind(sent, inp[1])])
    graph = dag.compile(overlap_communication=overlap, max_inflight=max_inflight)
    try:
        inputs = [(torch.randn(257, 33), float(k)) for k in range(12)]
        refs = [graph.execute(x, k) for x, k in inputs]
        for (x, k), ref in zip(inputs, refs, strict=True):
            (got,) = ref.get(timeout=60)
            assert torch.allclose(got, x * 2 * k)
    finally:
        graph.teardown(kill_actors=False)


@pytest.mark.multigpu
@needs_two
@pytest.mark.parametrize("transport", ["nccl", "ce", "nvlink"])
def test_a_result_on_another_gpu_than_its_actors_crosses_a_gpu_edge(pair, transport):
    """The links move the actor's device's memory: a tensor of the other GPU went out as it
    was, read through the wrong device."""
    a, b = pair
    with InputNode() as inp:
        made = a.make_elsewhere.bind(inp[0])
        dag = MultiOutputNode([b.scale.bind(made.with_transport(transport), inp[1]), made])
    graph = dag.compile(overlap_communication=True, max_inflight=2)
    try:
        for k in range(6):
            x = torch.randn(4099)
            scaled, made_value = graph.execute(x, float(k)).get(timeout=60)
            assert_same(made_value, x * 2, "the result itself, at the driver")
            assert_same(scaled, x * 2 * float(k), f"scaled by {k} on the other actor")
    finally:
        graph.teardown(kill_actors=False)


@two_devices
@needs_two_or_posing
@pytest.mark.parametrize("transport", ["nccl", pytest.param("ce", marks=needs_two)])
def test_a_kept_tensor_changed_by_the_next_execution_arrives_as_it_was_returned(pair, transport):
    """With overlap on, a send runs on its own stream while the actor's next methods run: a
    tensor the actor keeps and fills again in place arrived mixed with the next execution's
    values (28-29 of 30 executions over ``nccl`` and ``ce``, three in flight)."""
    a, b = pair
    with InputNode() as inp:
        dag = b.extremes.bind(a.fill_kept.bind(inp, 32 << 20).with_transport(transport))
    graph = dag.compile(overlap_communication=True, max_inflight=3)
    try:
        refs = [graph.execute(float(k)) for k in range(1, 21)]
        got = [ref.get(timeout=120) for ref in refs]
        assert got == [(float(k), float(k)) for k in range(1, 21)]
    finally:
        graph.teardown(kill_actors=False)


@pytest.mark.multigpu
@needs_two
def test_nccl_and_copy_engine_edges_in_one_graph(pair):
    a, b = pair
    with InputNode() as inp:
        over_nccl = b.scale.bind(a.make.bind(inp[0]).with_transport("nccl"), 1.0)
        over_ce = a.scale.bind(b.make.bind(inp[0]).with_transport("ce"), 3.0)
        dag = MultiOutputNode([over_nccl, over_ce])
    graph = dag.compile(overlap_communication=True, max_inflight=2)
    try:
        for _ in range(5):
            x = torch.randn(1000)
            got_nccl, got_ce = graph.execute(x).get(timeout=60)
            assert torch.allclose(got_nccl, 2 * x) and torch.allclose(got_ce, 6 * x)
    finally:
        graph.teardown(kill_actors=False)


@two_devices
@needs_two_or_posing
@pytest.mark.parametrize(
    "transport, overlap",
    [
        ("nccl", False),
        ("nccl", True),
        pytest.param("ce", True, marks=needs_two),
        pytest.param("nvlink", True, marks=needs_two),
    ],
)
def test_conjugate_and_negative_views_cross_gpu_edges_as_their_values(pair, transport, overlap):
    """x.conj() keeps x's memory and a flag; GPU edges move bytes, so it has to be resolved
    first (a structure, and a lone tensor with direct_return)."""
    a, b = pair
    with InputNode() as inp:
        views = a.lazy_views.bind(inp).with_transport(transport)
        bare = a.conj.bind(inp).with_transport(transport, direct_return=True)
        dag = MultiOutputNode([b.host.bind(views), b.host.bind(bare)])
    graph = dag.compile(overlap_communication=overlap)
    try:
        for _ in range(3):
            x = torch.randn(64, dtype=torch.complex64)
            got, got_bare = graph.execute(x).get(timeout=60)
            want = {
                "conj": x.conj().resolve_conj(),
                "neg": x[:1].conj().imag.resolve_neg(),
                "both": [x.conj().resolve_conj(), x],
            }
            for key in ("conj", "neg"):
                assert not got[key].is_conj() and not got[key].is_neg(), key
                assert torch.equal(got[key], want[key]), key
            assert all(torch.equal(g, w) for g, w in zip(got["both"], want["both"], strict=True))
            assert not got_bare.is_conj() and torch.equal(got_bare, want["conj"])
    finally:
        graph.teardown(kill_actors=False)


@two_devices
@needs_two_or_posing
@pytest.mark.parametrize("overlap", [False, True])
def test_nccl_structures_static_shapes_and_errors(pair, overlap):
    a, b = pair
    with InputNode() as inp:
        structured = b.unpair.bind(a.make_pair.bind(inp[0]).with_transport("auto"))
        failing = b.scale.bind(
            a.fail_if.bind(inp[0], inp[1]).with_transport("nccl", static_shape=True), 1.0
        )
        resized = b.scale.bind(a.resize.bind(inp[0], inp[2]).with_transport(
            "nccl", static_shape=True, direct_return=True), 3.0)  # fmt: skip
        dag = MultiOutputNode([structured, failing, resized])
    graph = dag.compile(overlap_communication=overlap)
    try:
        x = torch.randn(64)
        # Here x + (x + 1) != 2x + 1 in float32 (x + 1 rounds off 2**-25, more than allclose
        # allows on a result this small): comparing against 2x + 1 once failed on random data.
        x[9] = -0.4995432198047638
        pair_sum, same, tripled = graph.execute(x, False, 64).get(timeout=60)
        assert_same(pair_sum, x + (x + 1), "structured value")
        assert_same(same, x * 1.0, "static edge")
        assert_same(tripled, x * 3.0, "direct return")
        with pytest.raises(tf.ActorError, match="gpu boom on purpose"):
            graph.execute(x, True, 64).get(timeout=60)
        with pytest.raises(tf.ActorError, match="static_shape"):
            graph.execute(x, False, 32).get(timeout=60)
        x = torch.randn(64)
        assert torch.allclose(graph.execute(x, False, 64).get(timeout=60)[2], 3 * x)
    finally:
        graph.teardown(kill_actors=False)


@two_devices
@needs_two_or_posing
@pytest.mark.parametrize("overlap, max_inflight", [(False, 1), (True, 1), (True, 3)])
def test_static_nccl_edge_receives_posted_early_with_failures_in_flight(
    pair, overlap, max_inflight
):
    # From the second execution the sender announces each send and the receiver posts its
    # receive before the sender's method ran; a failing method then sends stand-ins.
    a, b = pair
    with InputNode() as inp:
        sent = a.fail_if.bind(inp[0], inp[1]).with_transport("nccl", static_shape=True)
        dag = b.scale.bind(sent, 3.0)
    graph = dag.compile(overlap_communication=overlap, max_inflight=max_inflight)
    try:
        inputs = [(torch.randn(4099), k % 4 == 2) for k in range(16)]
        refs = [graph.execute(x, fail) for x, fail in inputs]
        for (x, fail), ref in zip(inputs, refs, strict=True):
            if fail:
                with pytest.raises(tf.ActorError, match="gpu boom on purpose"):
                    ref.get(timeout=60)
            else:
                assert torch.equal(ref.get(timeout=60), x * 3)
    finally:
        graph.teardown(kill_actors=False)


@two_devices
@needs_two_or_posing
@pytest.mark.parametrize("overlap", [False, True])
def test_a_gpu_result_that_cannot_be_sent_fails_its_execution_only(pair, overlap):
    a, b = pair
    with InputNode() as inp:
        sent = a.lock_if.bind(inp[0], inp[1]).with_transport("nccl")
        dag = MultiOutputNode([sent, b.scale.bind(sent, 10.0)])  # to the driver and to b
    graph = dag.compile(overlap_communication=overlap)
    try:
        check_unsendable_results(graph, lambda x: x * 10.0, numel=300, timeout=60)
    finally:
        graph.teardown(kill_actors=False)


@needs_one
def test_direct_calls_and_spawn_hand_over_cuda_copies_not_the_senders_memory(capfd):
    """torch's CUDA sharing hands the receiver the sender's own device memory: weights returned
    by a call changed in the driver as the actor filled them again, an actor could not return
    a CUDA tensor it had been given, and what the driver kept lived in the actor's memory, gone
    with the actor. CPU tensors travel as copies; so do these, owned by their receiver."""
    weights = torch.randn(5, device="cuda:0")
    handle = Gpu.spawn("cuda:0", weights, device=0, name="copies")
    try:
        sent = weights.clone()
        weights.add_(100.0)  # the driver changes what it gave spawn
        assert_same(handle.get_given.call(), sent, "spawn's argument")
        synced = handle.fill_kept.call(1.0, 4)  # a tensor the actor keeps, filled in place
        handle.fill_kept.call(2.0, 4)
        assert synced.is_cuda
        assert_same(synced, torch.ones(4, device=synced.device), "an earlier call's result")
        arg = torch.randn(1 << 20, device="cuda:0")
        before = arg.clone()
        handle.add_in_place.call(arg, 5.0)
        assert_same(arg, before, "the caller's argument")
        x = torch.randn(6, dtype=torch.complex64, device="cuda:0")
        assert_same(handle.make.call(x.conj()), x.conj() * 2, "a conjugate view")
        assert_same(handle.make.call(x[1::2]), x[1::2] * 2, "a strided view")
        param = torch.nn.Parameter(torch.randn(3, device="cuda:0"))
        got = handle.fail_if.call(param, False)  # returns its argument
        assert type(got) is torch.nn.Parameter and got.requires_grad and got.is_cuda
        expected = param.detach().clone()
        with torch.no_grad():
            param.add_(1.0)
        assert_same(got.detach(), expected, "a parameter sent and returned")
        with pytest.raises(TypeError, match="detach"):  # autograd stays home, as on the CPU
            handle.make.call(param * 2)
        assert_same(handle.make.call(torch.ones(2, device="cuda:0")), torch.full((2,), 2.0,
                    device="cuda:0"), "a call after the refused one")  # fmt: skip
        assert_same(handle.get_given.call(), sent, "spawn's argument, returned")
    finally:
        handle.kill()
    # The actor exited (asked to): nothing the driver keeps was in its memory. torch says so at
    # a producer's exit when a receiver still holds some of it.
    assert "Producer process has been terminated" not in capfd.readouterr().err
    assert_same(synced, torch.ones(4, device=synced.device), "a result kept after the actor")


@two_devices
@needs_two_or_posing
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("max_inflight", [1, 3])
def test_cuda_results_reach_the_driver_once_computed(pair, overlap, max_inflight):
    # The result is still being computed when the method returns (about a millisecond of GPU
    # time), so it is held and written from the actor's next wait.
    a, b = pair
    with InputNode() as inp:
        dag = b.late.bind(a.make.bind(inp).with_transport("nccl"), 2_000_000)
    graph = dag.compile(overlap_communication=overlap, max_inflight=max_inflight)
    try:
        inputs = [torch.randn(1000) for _ in range(10)]
        refs = [graph.execute(x) for x in inputs]
        for x, ref in zip(inputs, refs, strict=True):
            got = ref.get(timeout=60)
            assert got.device.type == "cpu" and torch.allclose(got, x * 6)
    finally:
        graph.teardown(kill_actors=False)


@pytest.mark.gpu
@needs_one
def test_two_actors_on_one_gpu_use_shared_memory_with_auto():
    a = Gpu.spawn("cuda:0", device=0)
    b = Gpu.spawn("cuda:0", device=0)
    with InputNode() as inp:
        dag = b.scale.bind(a.make.bind(inp).with_transport("auto"), 5.0)
    with dag.compile(overlap_communication=True) as graph:
        assert graph.graph.edges[1].transport == "shm"
        x = torch.randn(1000)
        assert torch.allclose(graph.execute(x).get(timeout=60), x * 10)
    with InputNode() as inp:
        dag = b.scale.bind(a.make.bind(inp).with_transport("nccl"), 5.0)
    with pytest.raises(tf.GraphCompileError, match="same device"):
        dag.compile()


@two_devices
@needs_two_or_posing
def test_killed_gpu_actor_is_reported():
    a = spawn_on_gpu(Gpu, 0)
    b = spawn_on_gpu(Gpu, 1)
    with InputNode() as inp:
        dag = b.scale.bind(a.make.bind(inp).with_transport("nccl"), 1.0)
    graph = dag.compile(overlap_communication=True)
    try:
        x = torch.randn(8)
        assert torch.allclose(graph.execute(x).get(timeout=60), 2 * x)
        os.kill(a.pid, signal.SIGKILL)
        with pytest.raises(tf.ActorDiedError):
            graph.execute(x).get(timeout=60)
    finally:
        graph.teardown(timeout=10.0)
    assert not a.is_alive() and not b.is_alive()


def announced_graph(method: str) -> tuple:
    """Two fresh actors, ``a.<method>(x, flag)`` → ``b.scale`` over a static NCCL edge, run
    twice with ``flag`` false: the next execution's send is announced (the receiver posts its
    receive when the sender's execution starts). Returns ``(a, b, graph, x)``."""
    a = spawn_on_gpu(Gpu, 0)
    b = spawn_on_gpu(Gpu, 1)
    with InputNode() as inp:
        sent = getattr(a, method).bind(inp[0], inp[1]).with_transport("nccl", static_shape=True)
        dag = b.scale.bind(sent, 1.0)
    graph = dag.compile(overlap_communication=True)
    x = torch.randn(1000)
    try:
        for _ in range(2):
            assert torch.equal(graph.execute(x, False).get(timeout=60), x)
    except BaseException:
        graph.teardown(timeout=10.0)
        raise
    return a, b, graph, x


def check_stopped_by_itself(b, x: torch.Tensor) -> None:
    """``b`` outlived a teardown with ``kill_actors=False`` and runs another graph; killed
    after."""
    try:
        assert b.is_alive(), "the receiver stopped by itself"
        with InputNode() as inp:
            again = b.scale.bind(b.make.bind(inp), 0.5).compile()
        with again:
            assert torch.equal(again.execute(x).get(timeout=60), x)
    finally:
        b.kill()


@two_devices
@needs_two_or_posing
def test_sender_dying_after_announcing_is_reported_and_torn_down():
    # The receiver has posted its receive on the announcement when the sender dies in its
    # method: the receive never completes, yet get() reports the death and teardown finishes.
    a, b, graph, x = announced_graph("die_if")
    try:
        with pytest.raises(tf.ActorDiedError):
            graph.execute(x, True).get(timeout=60)
    finally:
        started = time.monotonic()
        graph.teardown(timeout=10.0)
        assert time.monotonic() - started < 15.0
    assert not a.is_alive() and not b.is_alive()


@two_devices
@needs_two_or_posing
def test_teardown_with_an_announced_send_that_never_comes():
    # The receiver posted its receive on the announcement; the sender's method never returns,
    # so teardown has to kill the sender. The receiver must still stop cleanly: its close
    # gives up waiting on the receive and aborts its links, and the actor stays usable.
    a, b, graph, x = announced_graph("stall_if")
    try:
        graph.execute(x, True)
        time.sleep(1.0)  # the sender is in its method; the receiver has posted its receive
    finally:
        started = time.monotonic()
        graph.teardown(timeout=20.0, kill_actors=False)
        assert time.monotonic() - started < 25.0
    check_stopped_by_itself(b, x)
    assert not a.is_alive(), "the stalled sender is killed"


@two_devices
@needs_two_or_posing
def test_a_receiver_stuck_in_a_launch_behind_a_receive_from_a_killed_actor_stops(monkeypatch):
    """a's result is still being computed when a is killed; b, whose method already runs on
    it, has queued more kernels behind its receive than a stream takes, so b's thread waits
    inside a launch until the receive ends. The death is reported, teardown finishes in its
    time, and b stops by itself, usable again, without being killed."""
    # Over ProcessGroupNCCL (the fallback), torch's default error handling ended b once its
    # watchdog had waited for a debug dump after the failed receive (p2p/_torch_groups.py);
    # with that wait cut to 3 s, such an end comes before b is checked (below).
    monkeypatch.setenv("TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC", "3000")
    a = spawn_on_gpu(Gpu, 0)
    b = spawn_on_gpu(Gpu, 1)
    with InputNode() as inp:
        dag = b.count_up.bind(a.late.bind(inp[0], inp[1]).with_transport("nccl"), 3000)
    graph = dag.compile(overlap_communication=True)
    x = torch.randn(1000)
    want = x * 3
    for _ in range(3000):
        want.add_(1.0)
    try:
        assert_same(graph.execute(x, 1000).get(timeout=60), want, "counted up")
        ref = graph.execute(x, 10**10)  # seconds of GPU time before a's result exists
        time.sleep(1.5)  # b is in its method by now, waiting inside a launch
        os.kill(a.pid, signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(tf.ActorDiedError):
            ref.get(timeout=60)
    finally:
        started = time.monotonic()
        graph.teardown(timeout=20.0, kill_actors=False)
        took = time.monotonic() - started
    if nccl_library() is None:  # the links went through ProcessGroupNCCL
        # Past the time torch's watchdog took a process down, when it did: 17 s after the
        # failure with the wait cut to 3 s (one H100).
        time.sleep(max(0.0, killed + 25.0 - time.monotonic()))
    check_stopped_by_itself(b, x)
    assert took < 25.0, took
    assert not a.is_alive()


@pytest.mark.multigpu
@needs_two
def test_demo_on_two_gpus(tmp_path):
    from tensorferry.graph.demo import run_graph_demo

    result = run_graph_demo(tmp_path, size=4096, iterations=4, quiet=True)
    assert result["device"] == "2 GPUs"
    assert all((tmp_path / p).exists() for p in result["pictures"])


@pytest.mark.multigpu
@needs_two
def test_a_killed_driver_leaves_no_actor_and_no_segment_with_nccl_edges(tmp_path):
    # The receiver waits on a receive posted early when the driver dies: it must still stop
    # (GpuOps.close aborts its links after a short wait) and remove the segments.
    kill_a_driver(tmp_path, gpu=True, within_s=30.0)
