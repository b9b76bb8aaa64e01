"""Per-actor schedules: pure functions from a :class:`GraphSpec` to :data:`Schedules`.

Default schedule (overlap off)
    Tasks are visited in bind order, a topological order. Before a task computes, each edge it
    needs that has not arrived yet is transferred *just in time*: the producer's WRITE and the
    consumer's READ are appended to both actors' lists at the same point. Every actor's list is
    therefore a subsequence of one global sequence in which each rendezvous send sits right next
    to its receive, so sends and receives between any two actors come in the same order on both
    sides and the schedules cannot deadlock, whatever the transports. Results for the driver are
    written right after they are computed. Then each WRITE over a buffered channel (``shm``,
    ``tcp``) moves up to right after its COMPUTE where the deadlock simulation allows (as
    below), so a result leaves as it was returned, not as the actor's later methods left it.

Overlap schedule (``overlap_communication=True``)
    Starting from the default schedule, every WRITE moves up to right after the COMPUTE that made
    its data, and every READ moves up as far as it can (keeping reads in their order), so the
    executor issues receives before the computation that does not need them and sends as soon
    as data is ready. Each move is kept only if the deadlock simulation still passes: moving a
    rendezvous receive ahead of a send its peer waits for would cross the two. Moves are tried
    in runs, kept when the whole run passes; a failed run is tried again a move at a time. A
    READ that would wait for data made from a COMPUTE it moves ahead of is refused without a
    simulation. Operations that moved ahead of a COMPUTE they used to follow are flagged
    ``moved`` (drawn red).
"""

from __future__ import annotations

from dataclasses import replace

from tensorferry.graph._deadlock import check_deadlock, find_deadlock
from tensorferry.graph._plan import DRIVER, GraphSpec, Operation, OpKind, Schedules

__all__ = [
    "build_schedules",
    "default_schedules",
    "early_buffered_writes",
    "overlap_schedules",
    "moved_operations",
]


def default_schedules(graph: GraphSpec) -> Schedules:
    """The schedule without overlap: just-in-time transfers in bind order (see module doc)."""
    lists: dict[str, list[Operation]] = {spec.name: [] for spec in graph.actors}
    driver: list[Operation] = []
    for edge in graph.edges:
        if edge.src_actor == DRIVER:
            driver.append(Operation(DRIVER, OpKind.WRITE, edge_id=edge.edge_id))
    transferred: set[int] = set()
    for task in graph.tasks:
        for edge in graph.edges_into(task):
            if edge.edge_id in transferred:
                continue
            transferred.add(edge.edge_id)
            if edge.src_actor != DRIVER:
                lists[edge.src_actor].append(
                    Operation(edge.src_actor, OpKind.WRITE, edge_id=edge.edge_id)
                )
            lists[task.actor].append(Operation(task.actor, OpKind.READ, edge_id=edge.edge_id))
        lists[task.actor].append(Operation(task.actor, OpKind.COMPUTE, task_id=task.task_id))
        for edge in graph.edges:
            if edge.src_task == task.task_id and edge.dst_actor == DRIVER:
                lists[task.actor].append(Operation(task.actor, OpKind.WRITE, edge_id=edge.edge_id))
    seen_outputs: set[int] = set()
    for task_id in graph.outputs:
        if task_id in seen_outputs:
            continue
        seen_outputs.add(task_id)
        driver.append(Operation(DRIVER, OpKind.READ, edge_id=graph.output_edge(task_id).edge_id))
    schedules: Schedules = {name: tuple(ops) for name, ops in lists.items()}
    schedules[DRIVER] = tuple(driver)
    return schedules


def _write_target(graph: GraphSpec, ops: list[Operation], index: int) -> int:
    """Where a WRITE goes when sent as soon as its data is ready: after its COMPUTE and any
    WRITEs already placed there (their order is kept)."""
    op = ops[index]
    assert op.edge_id is not None
    src_task = graph.edge(op.edge_id).src_task
    target = 0
    for i in range(index):
        if ops[i].kind is OpKind.COMPUTE and ops[i].task_id == src_task:
            target = i + 1
    while target < index and ops[target].kind is OpKind.WRITE:
        target += 1
    return target


def _read_target(ops: list[Operation], index: int) -> int:
    """Where a READ goes when issued as early as possible: right after the previous READ."""
    target = 0
    for i in range(index):
        if ops[i].kind is OpKind.READ:
            target = i + 1
    return target


def _ancestors(graph: GraphSpec) -> dict[int, int]:
    """Each task's ancestors within an execution (the tasks whose results it needs, however
    indirectly), as a bit set of task ids. Tasks come in bind order, producers first."""
    bits: dict[int, int] = {}
    for task in graph.tasks:
        mask = 0
        for producer in task.arg_tasks():
            mask |= bits[producer] | (1 << producer)
        bits[task.task_id] = mask
    return bits


def _waits_on_itself(
    graph: GraphSpec, ancestors: dict[int, int], ops: list[Operation], index: int, target: int
) -> bool:
    """Whether the READ at ``index``, moved to ``target``, would wait for data made from a
    COMPUTE it moves ahead of: a deadlock whatever the transports and buffers, so the move is
    refused without a simulation (nearly every move of a long chain was one)."""
    edge_id = ops[index].edge_id
    assert edge_id is not None
    source = graph.edge(edge_id).src_task
    if source is None:
        return False  # the driver's input
    needs = ancestors[source] | (1 << source)
    return any(op.kind is OpKind.COMPUTE and needs >> op.task_id & 1 for op in ops[target:index])


def overlap_schedules(
    graph: GraphSpec, base: Schedules, *, capacity: int = 1, max_inflight: int = 1
) -> Schedules:
    """Moves sends and receives as early as the deadlock simulation allows (see module doc).

    Args:
        graph: the tasks and edges.
        base: the default schedules (:func:`default_schedules`).
        capacity: messages a buffered channel holds (the simulation's limit).
        max_inflight: executions the driver keeps in flight (the simulation's window).

    Returns:
        New schedules; ``moved`` marks operations that now come before computation they
        followed in ``base``.
    """
    moves = (
        (OpKind.WRITE, lambda ops, i: _write_target(graph, ops, i)),
        (OpKind.READ, lambda ops, i: _read_target(ops, i)),
    )
    return _moved_early(graph, base, moves, capacity=capacity, max_inflight=max_inflight)


def early_buffered_writes(
    graph: GraphSpec, base: Schedules, *, capacity: int = 1, max_inflight: int = 1
) -> Schedules:
    """The schedule without overlap: ``base`` with each write over a buffered channel (``shm``,
    ``tcp``) moved up to right after the method that made it, where the deadlock simulation
    allows. A result then leaves as it was returned, as with overlap on: sent at its
    consumer's turn, it carried whatever the actor's later methods changed in place (its
    weights) first. A write to a buffer waits for nobody, so the move costs no time."""

    def target(ops: list[Operation], index: int) -> int:
        edge_id = ops[index].edge_id
        assert edge_id is not None
        return index if graph.edge(edge_id).rendezvous else _write_target(graph, ops, index)

    moves = ((OpKind.WRITE, target),)
    return _moved_early(graph, base, moves, capacity=capacity, max_inflight=max_inflight)


def _moved_early(
    graph: GraphSpec, base: Schedules, moves: tuple, *, capacity: int, max_inflight: int
) -> Schedules:
    """``base`` with the operations of each ``(kind, target_of)`` of ``moves`` moved to
    ``target_of(ops, index)`` in turn, each kept where the deadlock simulation passes."""
    work: dict[str, list[Operation]] = {actor: list(ops) for actor, ops in base.items()}
    ancestors = _ancestors(graph)

    def deadlock_free() -> bool:
        frozen = {actor: tuple(ops) for actor, ops in work.items()}
        found = find_deadlock(graph, frozen, capacity=capacity, max_inflight=max_inflight)
        return found is None

    def moved(ops: list[Operation], kind: OpKind, target_of, start: int, count: int) -> int:
        """Makes the next ``count`` moves from position ``start`` on: each ``kind`` operation
        whose target is earlier goes there, in turn. Keeps them if the simulation passes and
        returns the position after the last; else undoes them and returns ``-1 - that``. (A
        move reorders positions from its target to its own only: later ones stay put.)"""
        before = list(ops)
        index, left = start, count
        while index < len(ops) and left:
            if ops[index].kind is kind:
                target = target_of(ops, index)
                if target < index and not (
                    kind is OpKind.READ and _waits_on_itself(graph, ancestors, ops, index, target)
                ):
                    ops.insert(target, ops.pop(index))
                    left -= 1
            index += 1
        if left == count or deadlock_free():  # nothing moved, or what moved is safe
            return index
        ops[:] = before
        return -1 - index

    def move_all(ops: list[Operation], kind: OpKind, target_of) -> None:
        """Tries every move, in order, in runs that double while they pass, and again one by
        one after a run failed: one simulation per move made compile time grow with the
        square of a graph's size (a fan of 800 calls: 5 s), though most moves pass there."""
        index, run = 0, 1
        while index < len(ops):
            stop = moved(ops, kind, target_of, index, run)
            if stop >= 0:
                index, run = stop, run * 2
            elif run == 1:
                index = -1 - stop  # this move alone deadlocks: it is not made
            else:
                run = 1  # again from the same place, a move at a time

    for kind, target_of in moves:
        for actor in work:
            if actor == DRIVER:
                continue  # the driver writes inputs first and reads results as get() asks
            move_all(work[actor], kind, target_of)
    return moved_operations(base, {actor: tuple(ops) for actor, ops in work.items()})


def moved_operations(base: Schedules, changed: Schedules) -> Schedules:
    """``changed`` with ``moved`` set on operations that now precede a COMPUTE they followed."""
    result: Schedules = {}
    for actor, ops in changed.items():
        # How many COMPUTEs come before each step, in the old order and in the new: counted
        # once per schedule, not once per step (quadratic for graphs of hundreds of steps).
        computes_before_old = {}
        computes = 0
        for op in base.get(actor, ()):
            computes_before_old.setdefault(op.step_key(), computes)
            computes += op.kind is OpKind.COMPUTE
        marked = []
        computes = 0
        for op in ops:
            moved = computes < computes_before_old[op.step_key()]
            marked.append(replace(op, moved=moved))
            computes += op.kind is OpKind.COMPUTE
        result[actor] = tuple(marked)
    return result


def build_schedules(
    graph: GraphSpec,
    *,
    overlap: bool,
    capacity: int = 1,
    max_inflight: int = 1,
) -> Schedules:
    """Every actor's schedule, checked for deadlock.

    Args:
        graph: the tasks and edges.
        overlap: move sends and receives early (see module doc).
        capacity: messages a buffered channel holds.
        max_inflight: executions the driver keeps in flight.

    Returns:
        Schedules for every actor and the driver.

    Raises:
        DeadlockError: the schedules can deadlock (names the wait cycle).
    """
    move = overlap_schedules if overlap else early_buffered_writes
    schedules = move(graph, default_schedules(graph), capacity=capacity, max_inflight=max_inflight)
    check_deadlock(graph, schedules, capacity=capacity, max_inflight=max_inflight)
    return schedules
