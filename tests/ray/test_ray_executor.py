"""The Ray executor on a two-node local Ray cluster (CPU): placement, results, errors, deaths.

One cluster for the whole module (``ray_cluster`` in conftest.py); actors are reused across
tests where a test does not kill them.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
import torch
from ray_actors import Broken, Calc, FailsSetup, Unbuildable, on_node

import tensorferry as tf
from tensorferry.graph import InputNode, MultiOutputNode, actor
from tensorferry.graph.demo import DemoReceiver, DemoSender

pytestmark = pytest.mark.timeout(120)

CalcActor = actor(Calc)
SIZE, BRANCHES, STEPS = 48, 3, 4


def test_importing_tensorferry_never_imports_ray():
    code = (
        "import sys, tensorferry, tensorferry.graph, tensorferry.graph.demo\n"
        "from tensorferry.graph import _executor_ray, _actor_ray, _ray_host\n"
        "assert 'ray' not in sys.modules, 'ray was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_ray_executor_without_ray_is_a_clear_error():
    code = (
        "import sys\n"
        "sys.modules['ray'] = None  # as if Ray were not installed\n"
        "import tensorferry as tf\n"
        "from tensorferry.graph.demo import DemoSender\n"
        "try:\n"
        "    tf.actor(DemoSender).spawn(8, None, 'cpu', executor='ray')\n"
        "except ImportError as exc:\n"
        '    assert "tensorferry[ray]" in str(exc), exc\n'
        "else:\n"
        "    raise SystemExit('no ImportError')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.fixture(scope="module")
def calcs(ray_cluster):
    """Three Calc actors: one on node_a, two on node_b."""
    handles = [
        CalcActor.spawn(1.0, name="calc_a", **on_node("node_a")),
        CalcActor.spawn(10.0, name="calc_b", **on_node("node_b")),
        CalcActor.spawn(100.0, name="calc_b2", **on_node("node_b")),
    ]
    yield handles
    for handle in handles:
        handle.kill()


def _demo_graph(senders: list, receiver: object) -> MultiOutputNode:
    with InputNode() as inp:
        outs = []
        for branch in range(BRANCHES):
            produced = senders[branch % len(senders)].produce.bind(inp, branch)
            outs.append(receiver.consume.bind(produced.with_transport("auto")))
        return MultiOutputNode(outs)


def _run_local_demo() -> list[list[torch.Tensor]]:
    senders = [
        actor(DemoSender).spawn(SIZE, torch.float32, "cpu", name=f"local_sender{i}")
        for i in range(2)
    ]
    receiver = actor(DemoReceiver).spawn(SIZE, torch.float32, "cpu", name="local_receiver")
    graph = _demo_graph(senders, receiver).compile()
    try:
        return [graph.execute(step).get(timeout=60) for step in range(STEPS)]
    finally:
        graph.teardown()


def test_demo_graph_across_two_nodes_matches_the_local_executor(ray_cluster):
    import ray

    senders = [
        actor(DemoSender).spawn(SIZE, torch.float32, "cpu", name="sender_a", **on_node("node_a")),
        actor(DemoSender).spawn(SIZE, torch.float32, "cpu", name="sender_b", **on_node("node_b")),
    ]
    receiver = actor(DemoReceiver).spawn(
        SIZE, torch.float32, "cpu", name="receiver_b", **on_node("node_b")
    )
    try:
        nodes = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
        assert "node_a" in nodes[senders[0].node_id]
        assert "node_b" in nodes[senders[1].node_id]
        assert "node_b" in nodes[receiver.node_id]
        assert senders[0].node_id != senders[1].node_id
        expected = _run_local_demo()
        dag = _demo_graph(senders, receiver)
        for overlap, inflight in ((False, 1), (True, 2)):
            graph = dag.compile(overlap_communication=overlap, max_inflight=inflight, profile=True)
            try:
                assert {e.transport for e in graph.graph.edges} == {"tcp"}
                refs = [graph.execute(step) for step in range(STEPS)]
                for step, ref in enumerate(refs):
                    got = ref.get(timeout=60)
                    assert len(got) == BRANCHES
                    for branch in range(BRANCHES):
                        assert torch.equal(got[branch], expected[step][branch]), (step, branch)
                actors_seen = {record[0] for record in graph.profile_records()}
                assert actors_seen == {"sender_a", "sender_b", "receiver_b"}
            finally:
                graph.teardown(kill_actors=False)
            assert all(h.is_alive() for h in (*senders, receiver))
    finally:
        for handle in (*senders, receiver):
            handle.kill()


@pytest.mark.parametrize("overlap", [False, True])
def test_chain_fan_in_and_keywords_across_nodes(calcs, overlap):
    a, b, c = calcs
    with InputNode() as inp:
        left = a.add.bind(inp[0])
        right = b.add.bind(inp.y)
        joined = c.combine.bind(left, right)
        dag = MultiOutputNode([joined, left])
    graph = dag.compile(overlap_communication=overlap, max_inflight=2)
    try:
        for _ in range(20):
            x, y = torch.randn(3, 5), torch.randn(3, 5)
            joined, left = graph.execute(x, y=y).get(timeout=30)
            assert torch.equal(left, x + 1.0)
            assert torch.equal(joined, (x + 1.0) + (y + 10.0))
    finally:
        graph.teardown(kill_actors=False)


def test_structures_and_large_tensors_travel(calcs):
    a, b, _ = calcs
    with InputNode() as inp:
        dag = b.unpack.bind(a.structure.bind(inp))
    graph = dag.compile()
    try:
        for shape in ((4,), (700, 1000), (0, 3)):  # 2.8 MB crosses many socket buffers
            # Whole numbers: the sum is exact whatever order each process adds them in.
            x = torch.randint(-1000, 1000, shape).float()
            got = graph.execute(x).get(timeout=60)
            assert torch.equal(got, x * 2 + x.sum())
        ints = torch.randint(-5, 5, (6, 2), dtype=torch.int64)
        assert torch.equal(graph.execute(ints).get(timeout=30), ints * 2 + ints.sum())
    finally:
        graph.teardown(kill_actors=False)


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_tensors_of_every_dtype_travel_bit_for_bit_across_nodes(calcs):
    from channel_values import LoadsBadly, every_raw_dtype, same_bytes

    a, b, _ = calcs  # on node_a and node_b: the edge between them is a TCP connection
    with InputNode() as inp:
        graph = b.echo.bind(a.echo.bind(inp)).compile()
    try:
        tensors = every_raw_dtype()
        for tensor in tensors:
            assert same_bytes(graph.execute(tensor).get(timeout=30), tensor), tensor.dtype
        got = graph.execute({"all": tensors}).get(timeout=30)["all"]
        assert all(same_bytes(g, t) for g, t in zip(got, tensors, strict=True))
        # Ray's workers cannot even import its module: rebuilding it fails either way.
        with pytest.raises(tf.ActorError, match="rebuilding a value that arrived"):
            graph.execute([LoadsBadly()]).get(timeout=30)
        assert same_bytes(graph.execute(tensors[0]).get(timeout=30), tensors[0])
    finally:
        graph.teardown(kill_actors=False)


def test_method_error_reaches_get_and_the_graph_keeps_working(calcs):
    a, b, _ = calcs
    with InputNode() as inp:
        dag = b.add.bind(a.fail_if.bind(inp[0], inp[1]))
    graph = dag.compile()
    try:
        x = torch.randn(4)
        with pytest.raises(tf.ActorError, match="boom on purpose") as info:
            graph.execute(x, True).get(timeout=30)
        assert "Traceback" in str(info.value) and "fail_if" in str(info.value)
        for _ in range(3):
            x = torch.randn(4)
            assert torch.equal(graph.execute(x, False).get(timeout=30), x + 10.0)
    finally:
        graph.teardown(kill_actors=False)


def _check_a_chain_runs(a, b, x: torch.Tensor, method: str = "add") -> None:
    """``b.method(a.method(x))`` compiles and runs once (offsets 1 and 10): the actors are free."""
    with InputNode() as inp:
        graph = getattr(b, method).bind(getattr(a, method).bind(inp)).compile()
    try:
        assert torch.equal(graph.execute(x).get(timeout=30), (x + 1.0) + 10.0)
    finally:
        graph.teardown(kill_actors=False)


def test_direct_calls_constructor_errors_and_executor_checks(calcs):
    a, b, _ = calcs
    x = torch.randn(5)
    assert torch.equal(a.add.call(x), x + 1.0)
    assert torch.equal(a.add_later.call(x), x + 1.0)  # an async method, run to completion
    _check_a_chain_runs(a, b, x, method="add_later")
    with pytest.raises(tf.ActorError, match="boom"):
        a.fail_if.call(x, True)
    # A value the other side cannot rebuild fails its call only (it was called the actor's death).
    with pytest.raises(tf.ActorError, match=r"(?s)echo failed \(the actor goes on\).*on purpose"):
        a.echo.call(Unbuildable())
    with pytest.raises(tf.ActorError, match=r"(?s)unbuildable failed .*on purpose"):
        a.unbuildable.call()
    assert torch.equal(a.add.call(x), x + 1.0)
    with pytest.raises(tf.ActorError, match="cannot start"):
        actor(Broken).spawn(**on_node("node_b"))
    with InputNode() as inp:
        dag = a.add.bind(inp)
    with pytest.raises(tf.GraphCompileError, match="spawned with executor='ray'"):
        dag.compile(executor="local")
    with InputNode() as inp:
        bad = b.combine.bind(inp, a.add.bind(inp).with_transport("shm"))
    with pytest.raises(tf.GraphCompileError, match="not available"):
        bad.compile()
    with pytest.raises(ValueError, match="only apply to Ray actors"):
        CalcActor.spawn(num_gpus=1)


def test_failed_setup_is_a_compile_error_and_frees_the_actors(calcs):
    a, b, _ = calcs
    failing = actor(FailsSetup).spawn(name="fails_setup", **on_node("node_a"))
    try:
        with InputNode() as inp:
            dag = b.add.bind(failing.work.bind(inp))
        with pytest.raises(tf.GraphCompileError, match="cannot be looked up"):
            dag.compile()
        x = torch.randn(3)
        assert torch.equal(b.add.call(x), x + 10.0)  # b let go of the failed graph
        _check_a_chain_runs(a, b, x)
    finally:
        failing.kill()


def test_a_constant_ray_cannot_send_is_a_compile_error_and_frees_the_actors(calcs):
    a, b, _ = calcs
    with InputNode() as inp:
        dag = b.add.bind(a.combine.bind(inp, threading.Lock()))
    named = r"plan could not be sent: \w+\.combine: argument 1 \(lock\) is a constant"
    with pytest.raises(tf.GraphCompileError, match=named):
        dag.compile()
    x = torch.randn(3)
    assert torch.equal(a.combine.call(x, x), x + x)  # a let go of the failed graph
    _check_a_chain_runs(a, b, x)


def test_killed_actor_fails_pending_and_later_gets(ray_cluster):
    import ray

    a = CalcActor.spawn(1.0, name="victim_a", **on_node("node_a"))
    b = CalcActor.spawn(2.0, name="survivor_b", **on_node("node_b"))
    with InputNode() as inp:
        dag = b.add.bind(a.slow.bind(inp[0], inp[1]))
    graph = dag.compile(teardown_timeout=10)
    try:
        x = torch.randn(3)
        assert torch.equal(graph.execute(x, 0.0).get(timeout=30), x + 2.0)
        pending = graph.execute(x, 30.0)  # a sleeps: the result is pending when it dies
        time.sleep(0.5)
        killed_at = time.monotonic()
        ray.kill(a.ray_actor)
        with pytest.raises(tf.ActorDiedError, match="victim_a"):
            pending.get(timeout=60)
        assert time.monotonic() - killed_at < 5.0
        with pytest.raises(tf.ActorDiedError):
            graph.execute(x, 0.0).get(timeout=30)
    finally:
        started = time.monotonic()
        graph.teardown()
        assert time.monotonic() - started < 10.0
    for handle in (a, b):
        assert not handle.is_alive()
        with pytest.raises(ValueError):
            ray.get_actor(handle.ray_name)


def test_teardown_leaves_no_actors(ray_cluster):
    import ray

    handles = [
        CalcActor.spawn(1.0, name="short_a", **on_node("node_a")),
        CalcActor.spawn(2.0, name="short_b", **on_node("node_b")),
    ]
    with InputNode() as inp:
        dag = handles[1].add.bind(handles[0].slow.bind(inp, 0.0))
    graph = dag.compile(max_inflight=3, teardown_timeout=5)
    refs = [graph.execute(torch.ones(2) * i) for i in range(3)]  # left unread on purpose
    assert torch.equal(refs[0].get(timeout=30), torch.zeros(2) + 2.0)
    started = time.monotonic()
    graph.teardown()
    assert time.monotonic() - started < 5.0
    for handle in handles:
        assert not handle.is_alive()
        with pytest.raises(ValueError):
            ray.get_actor(handle.ray_name)
    with pytest.raises(RuntimeError, match="torn down"):
        graph.execute(torch.ones(2))


def test_lost_node_fails_gets(ray_cluster):
    import ray

    node = ray_cluster.add_node(num_cpus=1, resources={"node_c": 1}, object_store_memory=80 << 20)
    a = CalcActor.spawn(1.0, name="on_lost_node", **on_node("node_c"))
    b = CalcActor.spawn(2.0, name="on_kept_node", **on_node("node_a"))
    with InputNode() as inp:
        dag = b.add.bind(a.add.bind(inp))
    graph = dag.compile()
    try:
        x = torch.randn(3)
        assert torch.equal(graph.execute(x).get(timeout=30), (x + 1.0) + 2.0)
        lost_at = time.monotonic()
        ray_cluster.remove_node(node)
        with pytest.raises(tf.ActorDiedError):
            graph.execute(x).get(timeout=60)
        assert time.monotonic() - lost_at < 15.0
    finally:
        graph.teardown()
    assert not a.is_alive()
    with pytest.raises(ValueError):
        ray.get_actor(b.ray_name)
