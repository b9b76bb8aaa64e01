"""Deadlock check: run every actor's schedule in a simulation with blocking semantics.

The simulation is deliberately pessimistic, so a schedule that passes cannot deadlock however the
real executor interleaves its work:

- a COMPUTE always completes;
- a READ over a buffered (``shm``, ``tcp``) edge blocks until the writer has written that
  execution's message; a WRITE blocks while the channel holds ``capacity`` unread messages;
- a READ or WRITE over a rendezvous transport (``nccl``, ``nvlink``, ``ce``) completes only
  together with its peer's matching operation, as a NCCL send of a large tensor does. Two actors
  whose rendezvous operations toward each other come in different orders wait for each other
  forever — the classic crossed send/send.

Each actor repeats its schedule for several executions, and the driver keeps up to
``max_inflight`` executions in flight, so blocking that only shows up across executions (full
channels) is found too. When no actor can move, the check follows "who waits for whom" from a
blocked actor until it comes back to one it has seen and reports that cycle.
"""

from __future__ import annotations

from dataclasses import dataclass

from tensorferry.errors import DeadlockError
from tensorferry.graph._plan import DRIVER, GraphSpec, Operation, OpKind, Schedules

__all__ = ["WaitStep", "check_deadlock", "find_deadlock"]


@dataclass(frozen=True, slots=True)
class WaitStep:
    """One link of a wait cycle: ``actor`` is stuck at ``operation``, waiting for ``waits_for``."""

    actor: str
    execution: int
    operation: str
    waits_for: str

    def __str__(self) -> str:
        return (
            f"{self.actor} waits at '{self.operation}' (execution {self.execution}) "
            f"for {self.waits_for}"
        )


# One step of an actor's run: an operation of one execution.
_Step = tuple[Operation, int]


def _unroll(
    graph: GraphSpec, schedules: Schedules, executions: int, max_inflight: int
) -> dict[str, tuple[tuple[Operation, ...], list[_Step] | None]]:
    """Each actor's run over ``executions`` executions, as ``(ops, steps)``.

    An actor repeats its ``ops``: its step ``p`` is ``ops[p % len(ops)]`` of execution
    ``p // len(ops)``, never listed (the overlap pass simulates once per move it tries, and
    listing every step was most of compile's time for long graphs). The driver keeps a window
    of executions open, so its ``steps`` are listed."""
    unrolled: dict[str, tuple[tuple[Operation, ...], list[_Step] | None]] = {}
    for actor, ops in schedules.items():
        if actor != DRIVER:
            unrolled[actor] = (tuple(ops), None)
    driver_ops = schedules.get(DRIVER, ())
    writes = [op for op in driver_ops if op.kind is OpKind.WRITE]
    reads = [op for op in driver_ops if op.kind is OpKind.READ]
    steps: list[_Step] = []
    # execute() submits execution e once fewer than max_inflight are unread; get() reads in order.
    next_read = 0
    for e in range(executions):
        while e - next_read >= max_inflight:
            steps.extend((op, next_read) for op in reads)
            next_read += 1
        steps.extend((op, e) for op in writes)
    for e in range(next_read, executions):
        steps.extend((op, e) for op in reads)
    unrolled[DRIVER] = (tuple(driver_ops), steps)
    return unrolled


def find_deadlock(
    graph: GraphSpec,
    schedules: Schedules,
    *,
    capacity: int = 1,
    max_inflight: int = 1,
    executions: int | None = None,
) -> list[WaitStep] | None:
    """Simulates the schedules; returns the wait cycle if they can deadlock, else ``None``.

    Args:
        graph: the tasks and edges the schedules refer to.
        schedules: every actor's (and the driver's) operations for one execution.
        capacity: messages a buffered channel holds before its writer blocks.
        max_inflight: executions the driver submits before it reads the oldest results.
        executions: how many executions to simulate (default ``max_inflight + 2``).

    Returns:
        ``None`` when every actor finishes; otherwise the cycle of waiting actors (or, when an
        actor waits for one that already finished, the chain ending at that actor).
    """
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    if max_inflight < 1:
        raise ValueError(f"max_inflight must be >= 1, got {max_inflight}")
    runs = executions if executions is not None else max_inflight + 2
    unrolled = _unroll(graph, schedules, runs, max_inflight)
    pos = dict.fromkeys(unrolled, 0)
    ends = {
        actor: len(steps) if steps is not None else len(ops) * runs
        for actor, (ops, steps) in unrolled.items()
    }
    # Messages written and read per (edge, execution) are counted per edge: channels are FIFO.
    written: dict[int, int] = {}
    read: dict[int, int] = {}
    # Looked up once here, not per simulated step (the overlap pass simulates once per move).
    rendezvous = {e.edge_id: e for e in graph.edges if e.rendezvous}

    def current(actor: str) -> _Step | None:
        at = pos.get(actor)
        if at is None or at >= ends[actor]:
            return None
        ops, steps = unrolled[actor]
        if steps is not None:
            return steps[at]
        return ops[at % len(ops)], at // len(ops)

    def try_fire(actor: str) -> bool:
        step = current(actor)
        if step is None:
            return False
        op, execution = step
        if op.kind is OpKind.COMPUTE:
            pos[actor] += 1
            return True
        edge_id = op.edge_id
        assert edge_id is not None
        edge = rendezvous.get(edge_id)
        if edge is not None:
            peer = edge.peer_of(actor)
            other = current(peer)
            wanted = OpKind.READ if op.kind is OpKind.WRITE else OpKind.WRITE
            if (
                other is not None
                and other[0].edge_id == edge_id
                and other[0].kind is wanted
                and other[1] == execution
            ):
                pos[actor] += 1
                pos[peer] += 1
                return True
            return False
        if op.kind is OpKind.WRITE:
            if written.get(edge_id, 0) - read.get(edge_id, 0) >= capacity:
                return False
            written[edge_id] = written.get(edge_id, 0) + 1
            pos[actor] += 1
            return True
        if written.get(edge_id, 0) > read.get(edge_id, 0):
            read[edge_id] = read.get(edge_id, 0) + 1
            pos[actor] += 1
            return True
        return False

    progress = True
    while progress:
        progress = False
        for actor in unrolled:
            while try_fire(actor):
                progress = True
    blocked = [a for a in unrolled if current(a) is not None]
    if not blocked:
        return None
    return _wait_chain(graph, blocked[0], current)


def _waits_for(graph: GraphSpec, actor: str, op: Operation) -> str:
    if op.kind is OpKind.COMPUTE:  # pragma: no cover - a COMPUTE never blocks
        raise AssertionError("a COMPUTE cannot block")
    assert op.edge_id is not None
    edge = graph.edge(op.edge_id)
    return edge.peer_of(actor)


def _wait_chain(graph: GraphSpec, start: str, current) -> list[WaitStep]:
    chain: list[WaitStep] = []
    seen: dict[str, int] = {}
    actor: str | None = start
    while actor is not None and actor not in seen:
        step = current(actor)
        if step is None:  # waits for an actor that finished: the chain ends there
            break
        op, execution = step
        seen[actor] = len(chain)
        target = _waits_for(graph, actor, op)
        chain.append(WaitStep(actor, execution, graph.describe(op), target))
        actor = target
    if actor is not None and actor in seen:
        return chain[seen[actor] :]
    return chain


def check_deadlock(
    graph: GraphSpec,
    schedules: Schedules,
    *,
    capacity: int = 1,
    max_inflight: int = 1,
    executions: int | None = None,
) -> None:
    """Raises :class:`DeadlockError` naming the wait cycle if the schedules can deadlock.

    Args: as :func:`find_deadlock`.

    Raises:
        DeadlockError: with ``cycle`` set to the list of :class:`WaitStep`.
    """
    cycle = find_deadlock(
        graph, schedules, capacity=capacity, max_inflight=max_inflight, executions=executions
    )
    if cycle is None:
        return
    names = " -> ".join([step.actor for step in cycle] + [cycle[-1].waits_for])
    closed = cycle[-1].waits_for == cycle[0].actor
    kind = "cycle" if closed else "chain (the last actor finished without the matching operation)"
    details = "; ".join(str(step) for step in cycle)
    error = DeadlockError(
        f"the schedules can deadlock under blocking semantics: wait {kind} {names}: {details}"
    )
    error.cycle = cycle  # type: ignore[attr-defined]
    raise error
