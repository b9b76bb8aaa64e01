"""Compiler tests on plain data with fake actors: orders, overlap moves, deadlock detection."""

from __future__ import annotations

import pytest
from graph_fakes import FakeActor

from tensorferry.errors import DeadlockError
from tensorferry.graph import (
    InputNode,
    MultiOutputNode,
    Operation,
    OpKind,
    build_schedules,
    check_deadlock,
    default_schedules,
    find_deadlock,
    overlap_schedules,
)
from tensorferry.graph._lower import lower


def labels(graph, ops):
    return [graph.describe(op) for op in ops]


def fan_in_graph(transport="nccl", branches=3):
    """One sender with ``branches`` producers, one receiver consuming each (the bench shape)."""
    sender, receiver = FakeActor("S", "cuda:0"), FakeActor("R", "cuda:1")
    with InputNode() as inp:
        outs = [
            receiver.consume.bind(sender.produce.bind(inp).with_transport(transport))
            for _ in range(branches)
        ]
        dag = MultiOutputNode(outs)
    return lower(dag)


def crossed_graph():
    """A sends to B and B sends to A within one execution (rendezvous both ways)."""
    a, b = FakeActor("A", "cuda:0"), FakeActor("B", "cuda:1")
    with InputNode() as inp:
        a1 = a.produce.bind(inp).with_transport("nccl")
        b1 = b.produce.bind(inp).with_transport("nccl")
        a2 = a.consume.bind(b1)
        b2 = b.consume.bind(a1)
        dag = MultiOutputNode([a2, b2])
    return lower(dag)


def test_default_schedule_orders_match_on_both_sides():
    graph = fan_in_graph()
    schedules = default_schedules(graph)
    assert labels(graph, schedules["S"]) == [
        "READ input from driver [shm]",
        "COMPUTE produce#0",
        "WRITE produce#0 to R [nccl]",
        "COMPUTE produce#2",
        "WRITE produce#2 to R [nccl]",
        "COMPUTE produce#4",
        "WRITE produce#4 to R [nccl]",
    ]
    assert labels(graph, schedules["R"]) == [
        "READ produce#0 from S [nccl]",
        "COMPUTE consume#1",
        "WRITE consume#1 to driver [shm]",
        "READ produce#2 from S [nccl]",
        "COMPUTE consume#3",
        "WRITE consume#3 to driver [shm]",
        "READ produce#4 from S [nccl]",
        "COMPUTE consume#5",
        "WRITE consume#5 to driver [shm]",
    ]
    sends = [op.edge_id for op in schedules["S"] if op.kind is OpKind.WRITE]
    recvs = [op.edge_id for op in schedules["R"] if op.kind is OpKind.READ]
    assert sends == recvs  # rendezvous order identical on both ends
    assert not any(op.moved for ops in schedules.values() for op in ops)
    assert find_deadlock(graph, schedules) is None


def test_overlap_moves_receives_ahead_of_compute_and_marks_them():
    graph = fan_in_graph()
    schedules = build_schedules(graph, overlap=True)
    assert [op.kind for op in schedules["R"][:4]] == [OpKind.READ] * 3 + [OpKind.COMPUTE]
    moved = [graph.describe(op) for op in schedules["R"] if op.moved]
    assert moved == ["READ produce#2 from S [nccl]", "READ produce#4 from S [nccl]"]
    # The sender already sends right after computing: nothing to move there.
    assert not any(op.moved for op in schedules["S"])
    # Every op is still there exactly once.
    base = default_schedules(graph)
    for actor in base:
        assert sorted(
            map(
                repr, [o.__class__(o.actor, o.kind, o.task_id, o.edge_id) for o in schedules[actor]]
            )
        ) == sorted(map(repr, base[actor]))


def test_overlap_moves_sends_right_after_their_compute():
    sender, receiver = FakeActor("S", "cuda:0"), FakeActor("R", "cuda:1")
    with InputNode() as inp:
        produced = [sender.produce.bind(inp).with_transport("nccl") for _ in range(3)]
        dag = MultiOutputNode([receiver.consume.bind(p) for p in produced])
    graph = lower(dag)
    base = default_schedules(graph)
    # Bound all producers first: the default schedule sends after the third compute.
    assert [op.kind for op in base["S"]][1:4] == [OpKind.COMPUTE] * 3
    schedules = build_schedules(graph, overlap=True)
    kinds = [op.kind for op in schedules["S"]]
    assert kinds == [OpKind.READ] + [OpKind.COMPUTE, OpKind.WRITE] * 3
    assert [graph.describe(op) for op in schedules["S"] if op.moved] == [
        "WRITE produce#0 to R [nccl]",
        "WRITE produce#1 to R [nccl]",
    ]


def test_crossed_graph_default_schedule_is_deadlock_free():
    graph = crossed_graph()
    schedules = build_schedules(graph, overlap=False)
    assert find_deadlock(graph, schedules) is None

    # Just-in-time: the NCCL transfers between A and B come in the same order on both sides.
    def rendezvous(actor):
        return [op.edge_id for op in schedules[actor]
                if op.edge_id is not None and graph.edge(op.edge_id).rendezvous]  # fmt: skip

    assert rendezvous("A") == rendezvous("B")
    assert len(rendezvous("A")) == 2


def test_overlap_pass_refuses_moves_that_would_cross_rendezvous():
    graph = crossed_graph()
    base = default_schedules(graph)
    schedules = overlap_schedules(graph, base)
    assert find_deadlock(graph, schedules) is None
    # Sending A's result right after computing it would cross the two NCCL transfers, so the
    # WRITE stays after the READ of B's result.
    a_ops = labels(graph, schedules["A"])
    assert a_ops.index("READ produce#1 from B [nccl]") < a_ops.index("WRITE produce#0 to B [nccl]")


def test_crossed_sends_deadlock_and_the_cycle_is_named():
    graph = crossed_graph()
    base = default_schedules(graph)

    # Hand-written eager schedule: each actor sends first, then receives.
    def eager(actor):
        ops = list(base[actor])
        writes = [op for op in ops if op.kind is OpKind.WRITE and graph.edge(op.edge_id).rendezvous]
        rest = [op for op in ops if op not in writes]
        first_compute = next(i for i, op in enumerate(rest) if op.kind is OpKind.COMPUTE)
        return tuple(rest[: first_compute + 1] + writes + rest[first_compute + 1 :])

    schedules = {**base, "A": eager("A"), "B": eager("B")}
    cycle = find_deadlock(graph, schedules)
    assert cycle is not None
    assert {step.actor for step in cycle} == {"A", "B"}
    assert all("WRITE" in step.operation and "[nccl]" in step.operation for step in cycle)
    with pytest.raises(DeadlockError) as info:
        check_deadlock(graph, schedules)
    message = str(info.value)
    assert "cycle" in message
    assert "A waits at 'WRITE produce#0 to B [nccl]'" in message
    assert "B waits at 'WRITE produce#1 to A [nccl]'" in message
    assert [s.actor for s in info.value.cycle] in (["A", "B"], ["B", "A"])


def test_three_actor_ring_of_receives_first_deadlocks():
    x, y, z = FakeActor("X", "cuda:0"), FakeActor("Y", "cuda:1"), FakeActor("Z", "cuda:2")
    with InputNode() as inp:
        px = x.produce.bind(inp).with_transport("nccl")
        py = y.produce.bind(inp).with_transport("nccl")
        pz = z.produce.bind(inp).with_transport("nccl")
        dag = MultiOutputNode([y.consume.bind(px), z.consume.bind(py), x.consume.bind(pz)])
    graph = lower(dag)
    schedules = build_schedules(graph, overlap=True)  # the compiler's schedules are fine
    assert find_deadlock(graph, schedules) is None

    def receive_first(actor):
        ops = list(schedules[actor])
        reads = [op for op in ops if op.kind is OpKind.READ and graph.edge(op.edge_id).rendezvous]
        return tuple(reads + [op for op in ops if op not in reads])

    bad = {**schedules, **{a: receive_first(a) for a in "XYZ"}}
    with pytest.raises(DeadlockError) as info:
        check_deadlock(graph, bad)
    assert sorted(step.actor for step in info.value.cycle) == ["X", "Y", "Z"]
    assert all(step.operation.startswith("READ") for step in info.value.cycle)


@pytest.mark.parametrize("transport", ["shm", "nccl"])
def test_receives_in_the_opposite_order_deadlock_only_without_buffering(transport):
    a, b = FakeActor("A", "cuda:0"), FakeActor("B", "cuda:1")
    with InputNode() as inp:
        first = a.produce.bind(inp).with_transport(transport)
        second = a.produce.bind(inp).with_transport(transport)
        dag = MultiOutputNode([b.combine.bind(first, second)])
    graph = lower(dag)
    schedules = default_schedules(graph)
    reads = [op for op in schedules["B"] if op.kind is OpKind.READ]
    rest = [op for op in schedules["B"] if op.kind is not OpKind.READ]
    swapped = {**schedules, "B": (reads[1], reads[0], *rest)}
    cycle = find_deadlock(graph, swapped, capacity=1)
    if transport == "shm":
        assert cycle is None  # the first message waits in its channel
    else:
        assert cycle is not None
        assert {step.actor for step in cycle} == {"A", "B"}


def test_missing_peer_operation_is_reported_as_a_chain():
    graph = fan_in_graph(branches=1)
    schedules = default_schedules(graph)
    # Drop the sender's WRITE: the receiver waits for S, which finishes without sending.
    truncated = {
        **schedules,
        "S": tuple(op for op in schedules["S"] if op.kind is not OpKind.WRITE),
    }
    with pytest.raises(DeadlockError) as info:
        check_deadlock(graph, truncated)
    steps = {step.actor: step for step in info.value.cycle}
    assert steps["R"].operation == "READ produce#0 from S [nccl]"
    assert steps["R"].waits_for == "S"


def test_a_wait_on_a_finished_actor_is_reported_as_a_chain():
    graph = fan_in_graph(branches=1)
    schedules = default_schedules(graph)
    # The receiver reads once more than the sender ever sends, in its last execution.
    extra = schedules["R"] + (schedules["R"][0],)
    with pytest.raises(DeadlockError, match="finished without the matching operation"):
        check_deadlock(graph, {**schedules, "R": extra}, executions=1)


def test_shm_edges_are_not_rendezvous_and_tolerate_eager_sends():
    graph = fan_in_graph(transport="shm")
    base = default_schedules(graph)
    assert all(not e.rendezvous for e in graph.edges)
    schedules = overlap_schedules(graph, base, capacity=1)
    assert find_deadlock(graph, schedules, capacity=1) is None


def random_dag(rng):
    """A graph of 2 to 8 calls over 2 to 4 GPU actors, edges over nccl, shm or auto."""
    actors = [FakeActor(f"G{i}", f"cuda:{i}") for i in range(rng.randint(2, 4))]
    with InputNode() as inp:
        nodes = []
        for _ in range(rng.randint(2, 8)):
            actor = rng.choice(actors)
            if nodes and rng.random() < 0.8:
                args = rng.sample(nodes, k=min(len(nodes), rng.choice([1, 2])))
            else:
                args = [inp]
            method = actor.combine if len(args) == 2 else actor.consume
            node = method.bind(*args).with_transport(rng.choice(["nccl", "shm", "auto"]))
            nodes.append(node)
        used = {id(a) for n in nodes for a in n.upstream()}
        leaves = [n for n in nodes if id(n) not in used]
        return lower(MultiOutputNode(leaves))


def test_random_dags_always_get_deadlock_free_schedules():
    import random

    rng = random.Random(1234)
    for trial in range(40):
        graph = random_dag(rng)
        for overlap in (False, True):
            for inflight in (1, 3):
                schedules = build_schedules(
                    graph, overlap=overlap, capacity=inflight, max_inflight=inflight
                )
                assert find_deadlock(graph, schedules, capacity=inflight,
                                     max_inflight=inflight) is None, trial  # fmt: skip
                computes = [op.task_id for ops in schedules.values() for op in ops
                            if op.kind is OpKind.COMPUTE]  # fmt: skip
                assert sorted(computes) == [t.task_id for t in graph.tasks]


def one_move_at_a_time(graph, base, *, capacity, max_inflight):
    """The overlap pass as first written, the reference: every move simulated on its own.
    Returns the schedules and how many moves it refused."""
    from tensorferry.graph._plan import DRIVER
    from tensorferry.graph._schedule import _read_target, _write_target, moved_operations

    work = {actor: list(ops) for actor, ops in base.items()}
    refused = 0
    for kind, target_of in (
        (OpKind.WRITE, lambda ops, i: _write_target(graph, ops, i)),
        (OpKind.READ, _read_target),
    ):
        for actor, ops in work.items():
            if actor == DRIVER:
                continue
            for index in range(len(ops)):
                target = target_of(ops, index) if ops[index].kind is kind else index
                if target >= index:
                    continue
                before = list(ops)
                ops.insert(target, ops.pop(index))
                frozen = {a: tuple(o) for a, o in work.items()}
                if find_deadlock(graph, frozen, capacity=capacity, max_inflight=max_inflight):
                    ops[:] = before
                    refused += 1
    return moved_operations(base, {actor: tuple(ops) for actor, ops in work.items()}), refused


def test_overlap_pass_makes_the_moves_one_simulation_per_move_made():
    """Moves are tried in runs (one simulation per move made compile time grow with the
    square of a graph's size); the schedules are those of trying each move on its own, also
    for graphs where many moves deadlock and are refused."""
    import random

    rng = random.Random(99)
    refused = 0
    for trial in range(60):
        graph = random_dag(rng)
        base = default_schedules(graph)
        for inflight in (1, 3):
            options = {"capacity": inflight, "max_inflight": inflight}
            got = overlap_schedules(graph, base, **options)
            want, refusals = one_move_at_a_time(graph, base, **options)
            assert got == want and all(  # the moved flags too
                [op.moved for op in got[a]] == [op.moved for op in want[a]] for a in got
            ), trial
            refused += refusals > 0
    assert refused > 20, refused  # most graphs here have moves that would deadlock


def test_overlap_pass_simulates_once_per_run_of_moves_and_not_for_certain_deadlocks(monkeypatch):
    import tensorferry.graph._schedule as schedule

    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return find_deadlock(*args, **kwargs)

    monkeypatch.setattr(schedule, "find_deadlock", counted)
    actors = [FakeActor(f"a{i}") for i in range(3)]
    with InputNode() as inp:
        branches = [actors[i % 3].consume.bind(inp) for i in range(200)]
        pairs = zip(branches[0::2], branches[1::2], strict=True)
        dag = MultiOutputNode([actors[0].combine.bind(a, b) for a, b in pairs])
    schedules = build_schedules(lower(dag), overlap=True)
    moved = sum(op.moved for ops in schedules.values() for op in ops)
    assert moved > 100 and len(calls) < 40, (moved, len(calls))  # one per move: ~moved
    # A chain: every read would wait for what its own actor computes after it, so every move
    # is refused, without a simulation each (there were ~200).
    calls.clear()
    with InputNode() as inp:
        node = inp
        for i in range(200):
            node = actors[i % 3].consume.bind(node)
    schedules = build_schedules(lower(node), overlap=True)
    assert not any(op.moved for ops in schedules.values() for op in ops)
    assert len(calls) < 10, len(calls)


def test_operation_equality_ignores_moved_flag():
    a = Operation("A", OpKind.READ, edge_id=3)
    assert a.same_step(Operation("A", OpKind.READ, edge_id=3, moved=True))
    assert not a.same_step(Operation("A", OpKind.WRITE, edge_id=3))
