"""Plain data that the compiler passes around: tasks, edges, operations, schedules.

Nothing here knows about processes, tensors or devices beyond their names, so the scheduler and
the deadlock check run on the CPU with fake actors, and every executor (local processes, Ray
actors) receives exactly these objects.

Vocabulary:
    task       one bound actor method call (``actor.method.bind(...)``), numbered in bind order.
    edge       one transfer per execution: a task's result going to another actor or to the
               driver, or the driver's inputs going to an actor.
    operation  one step of an actor's schedule: READ an edge, COMPUTE a task, WRITE an edge.
    schedule   each actor's operations in the order it issues them, one execution's worth; the
               actor repeats it for every execution.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "DRIVER",
    "RENDEZVOUS_TRANSPORTS",
    "TRANSPORTS",
    "ActorSpec",
    "ArgRef",
    "EdgeSpec",
    "GraphSpec",
    "OpKind",
    "Operation",
    "Schedules",
    "TaskSpec",
]

DRIVER = "driver"
"""Name of the pseudo-actor that writes the inputs and reads the outputs."""

TRANSPORTS = ("auto", "nccl", "nvlink", "ce", "shm", "tcp")
"""Transport hints a node accepts; ``auto`` is resolved at compile time.

``shm`` (host shared memory, local executor) and ``tcp`` (a TCP connection per edge, Ray
executor) are the buffered host channels; the driver's inputs and outputs use the executor's.
"""

RENDEZVOUS_TRANSPORTS = frozenset({"nccl", "nvlink", "ce"})
"""Transports whose send completes only together with the matching receive (no buffering).

``shm`` and ``tcp`` channels buffer up to their capacity, so a write returns before the read
happens.
"""


class OpKind(enum.StrEnum):
    READ = "READ"
    COMPUTE = "COMPUTE"
    WRITE = "WRITE"


@dataclass(frozen=True, slots=True)
class ArgRef:
    """Where one argument of a task comes from.

    ``kind`` is ``"const"`` (``value`` is the constant), ``"input"`` (``value`` is the input key:
    ``None`` for the whole input, an ``int`` for ``inp[i]``, a ``str`` for ``inp.key``) or
    ``"task"`` (``value`` is the producing task id).
    """

    kind: str
    value: Any = None


@dataclass(frozen=True, slots=True)
class ActorSpec:
    name: str
    """Unique name of the actor in the graph (its schedule key)."""
    device: str
    """``"cpu"`` or ``"cuda:N"``."""


@dataclass(frozen=True, slots=True)
class TaskSpec:
    task_id: int
    """Bind order; tasks of one actor compute in this order."""
    actor: str
    method: str
    args: tuple[ArgRef, ...] = ()
    kwargs: tuple[tuple[str, ArgRef], ...] = ()
    returns_tensor: bool | None = None
    """What the method's return annotation says (``None``: not annotated)."""

    @property
    def label(self) -> str:
        return f"{self.method}#{self.task_id}"

    def arg_tasks(self) -> list[int]:
        """Ids of the tasks whose results this task consumes, in argument order, no repeats."""
        refs = [*self.args, *(ref for _, ref in self.kwargs)]
        seen: list[int] = []
        for ref in refs:
            if ref.kind == "task" and ref.value not in seen:
                seen.append(ref.value)
        return seen

    def input_keys(self) -> list[Any]:
        refs = [*self.args, *(ref for _, ref in self.kwargs)]
        keys: list[Any] = []
        for ref in refs:
            if ref.kind == "input" and ref.value not in keys:
                keys.append(ref.value)
        return keys


@dataclass(frozen=True, slots=True)
class EdgeSpec:
    """One transfer per execution from ``src_actor`` to ``dst_actor``.

    Driver input edges have ``src_task=None`` and carry ``input_keys``; output edges have
    ``dst_actor == DRIVER``.
    """

    edge_id: int
    src_actor: str
    dst_actor: str
    src_task: int | None
    transport: str
    """Resolved: ``"shm"``, ``"tcp"``, ``"nccl"``, ``"nvlink"`` or ``"ce"``."""
    static_shape: bool = False
    direct_return: bool = False
    input_keys: tuple[Any, ...] = ()

    @property
    def rendezvous(self) -> bool:
        return self.transport in RENDEZVOUS_TRANSPORTS

    def peer_of(self, actor: str) -> str:
        return self.dst_actor if actor == self.src_actor else self.src_actor


@dataclass(frozen=True, slots=True)
class GraphSpec:
    actors: tuple[ActorSpec, ...]
    tasks: tuple[TaskSpec, ...]
    """In bind order."""
    edges: tuple[EdgeSpec, ...]
    outputs: tuple[int, ...]
    """Task id of each output, in ``MultiOutputNode`` order (a task may appear twice)."""
    multi_output: bool = True
    """``execute`` returns a list (``MultiOutputNode``) rather than one value."""
    _by_task: dict[int, TaskSpec] = field(default_factory=dict, compare=False, repr=False)
    _by_edge: dict[int, EdgeSpec] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        self._by_task.update({t.task_id: t for t in self.tasks})
        self._by_edge.update({e.edge_id: e for e in self.edges})

    def task(self, task_id: int) -> TaskSpec:
        return self._by_task[task_id]

    def edge(self, edge_id: int) -> EdgeSpec:
        return self._by_edge[edge_id]

    def device_of(self, actor: str) -> str:
        if actor == DRIVER:
            return "cpu"
        for spec in self.actors:
            if spec.name == actor:
                return spec.device
        raise KeyError(actor)

    def output_edge(self, task_id: int) -> EdgeSpec:
        for edge in self.edges:
            if edge.src_task == task_id and edge.dst_actor == DRIVER:
                return edge
        raise KeyError(task_id)

    def edges_into(self, task: TaskSpec) -> list[EdgeSpec]:
        """Edges a task reads from other actors or the driver, in edge order."""
        wanted = set(task.arg_tasks())
        found = []
        for edge in self.edges:
            if edge.dst_actor != task.actor:
                continue
            if (edge.src_task is None and task.input_keys()) or edge.src_task in wanted:
                found.append(edge)
        return found

    def describe(self, op: Operation) -> str:
        """A short human label of an operation, used in errors and pictures."""
        if op.kind is OpKind.COMPUTE:
            assert op.task_id is not None
            return f"COMPUTE {self.task(op.task_id).label}"
        assert op.edge_id is not None
        edge = self.edge(op.edge_id)
        what = "input" if edge.src_task is None else self.task(edge.src_task).label
        if op.kind is OpKind.READ:
            return f"READ {what} from {edge.src_actor} [{edge.transport}]"
        return f"WRITE {what} to {edge.dst_actor} [{edge.transport}]"


@dataclass(frozen=True, slots=True)
class Operation:
    actor: str
    kind: OpKind
    task_id: int | None = None
    """The task computed (COMPUTE)."""
    edge_id: int | None = None
    """The edge read or written (READ/WRITE)."""
    moved: bool = False
    """The overlap pass moved this operation ahead of computation it used to follow."""

    def step_key(self) -> tuple:
        """Which step of the actor's schedule this is, whatever its place or marks."""
        return (self.actor, self.kind, self.task_id, self.edge_id)

    def same_step(self, other: Operation) -> bool:
        return self.step_key() == other.step_key()


Schedules = dict[str, tuple[Operation, ...]]
"""Actor name (and :data:`DRIVER`) to its operations for one execution, in issue order."""
