"""The graph-building API: ``InputNode``, ``actor.method.bind(...)``, ``MultiOutputNode``.

Binding builds a static graph of nodes; nothing runs until the graph is compiled. Every node
bound inside ``with InputNode() as inp:`` (or bound on a node of that graph) is remembered by the
input node, so compilation can tell a node whose result nobody reads (a lost leaf) from one that
was never part of the graph.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tensorferry.graph._plan import TRANSPORTS
from tensorferry.graph._sendable import named_arguments

if TYPE_CHECKING:
    from tensorferry.graph._actor import ActorHandle
    from tensorferry.graph._compiled import CompiledGraph

__all__ = [
    "DAGNode",
    "InputNode",
    "InputAttributeNode",
    "ClassMethodNode",
    "MultiOutputNode",
    "TransportHint",
]

_node_ids = itertools.count()
_context = threading.local()


@dataclass(frozen=True, slots=True)
class TransportHint:
    """How a node's result travels to the actors that consume it."""

    transport: str = "auto"
    """``"auto"``, ``"nccl"``, ``"nvlink"``, ``"ce"`` or ``"shm"``."""
    static_shape: bool = False
    """Shape and dtype are the same every execution: metadata is sent once, not per execution."""
    direct_return: bool = False
    """The result is one tensor, not a structure holding tensors: nothing is pickled."""


class DAGNode:
    """A node of a graph. Subclasses: input, input attribute, method call, multi-output."""

    def __init__(self, upstream: list[Any]) -> None:
        self._node_id = next(_node_ids)
        self._hint: TransportHint | None = None
        self._owner: InputNode | None = _active_input()
        for value in upstream:
            if self._owner is None and isinstance(value, DAGNode):
                self._owner = value._owner
        if self._owner is not None and not isinstance(self, InputNode):
            self._owner._bound.append(self)

    # ------------------------------------------------------------------ transport
    def with_transport(
        self,
        transport: str = "auto",
        *,
        static_shape: bool = False,
        direct_return: bool = False,
    ) -> DAGNode:
        """Chooses how this node's result travels to other actors; returns the node.

        Args:
            transport: ``"auto"`` (NCCL between GPUs, the executor's host channel
                otherwise), ``"nccl"``, ``"nvlink"`` (copy kernels over symmetric memory),
                ``"ce"`` (copy engine), ``"shm"`` (host shared memory, local executor; GPU
                tensors are staged through the host) or ``"tcp"`` (a TCP connection, Ray
                executor; GPU tensors are staged through the host).
            static_shape: the result has the same shapes and dtypes every execution, so the
                receiver learns them once.
            direct_return: the result is a single tensor (not a list or dict of them).

        Raises:
            ValueError: an unknown transport.
            TypeError: ``static_shape`` or ``direct_return`` is not a bool.
        """
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        for flag, value in (("static_shape", static_shape), ("direct_return", direct_return)):
            if not isinstance(value, bool):  # "no" is true: a promise nobody meant to make
                raise TypeError(f"{flag} must be a bool, got {value!r}")
        self._hint = TransportHint(transport, static_shape, direct_return)
        return self

    # ------------------------------------------------------------------ compile
    def compile(
        self,
        *,
        overlap_communication: bool = False,
        max_inflight: int = 1,
        submit_timeout: float = 60.0,
        get_timeout: float = 300.0,
        teardown_timeout: float = 10.0,
        start_timeout: float = 180.0,
        buffer_size_bytes: int = 1 << 20,
        profile: bool = False,
        executor: str = "auto",
    ) -> CompiledGraph:
        """Compiles the graph ending at this node into per-actor schedules and starts them.

        Args:
            overlap_communication: issue receives as early as their dependencies allow and
                sends as soon as data is ready, on communication streams (threads on CPU), so
                transfers hide behind computation.
            max_inflight: executions that may be submitted before the oldest result is read;
                above 1, execution i+1's transfers overlap execution i's computation.
            submit_timeout: seconds ``execute`` may wait for room when ``max_inflight``
                executions are in flight.
            get_timeout: default seconds ``ref.get()`` waits.
            teardown_timeout: seconds ``teardown`` may take in all.
            start_timeout: seconds every actor may take to set up its part (NCCL included),
                and to finish a direct call given up on that it still runs.
            buffer_size_bytes: initial slot size of each shared-memory channel (channels grow
                when a larger message comes).
            profile: record each operation's start and end for :meth:`visualize_timeline`.
            executor: ``"local"`` (a process per actor on this machine), ``"ray"`` (Ray
                actors on any node of a Ray cluster; spawn the actors with
                ``.spawn(..., executor="ray")``) or ``"auto"``: the one the actors were
                spawned with.

        Returns:
            A :class:`~tensorferry.graph.CompiledGraph`, already running.

        Raises:
            GraphCompileError: the graph is malformed (see the message).
            DeadlockError: the schedules can deadlock.
        """
        from tensorferry.graph._compiled import CompiledGraph, CompileOptions

        options = CompileOptions(
            overlap_communication=overlap_communication,
            max_inflight=max_inflight,
            submit_timeout=submit_timeout,
            get_timeout=get_timeout,
            teardown_timeout=teardown_timeout,
            start_timeout=start_timeout,
            buffer_size_bytes=buffer_size_bytes,
            profile=profile,
            executor=executor,
        )
        return CompiledGraph(self, options)


def _active_input() -> InputNode | None:
    stack = getattr(_context, "stack", None)
    return stack[-1] if stack else None


class InputNode(DAGNode):
    """The graph's input: ``execute(*args, **kwargs)`` feeds it.

    Used directly it stands for the single positional argument; ``inp[i]`` is ``args[i]`` and
    ``inp.key`` (or ``inp["key"]``) is ``kwargs["key"]``. Use it as a context manager so every
    node bound inside belongs to this graph.
    """

    def __init__(self) -> None:
        self._bound: list[DAGNode] = []
        super().__init__([])
        self._owner = self

    def __enter__(self) -> InputNode:
        stack = getattr(_context, "stack", None)
        if stack is None:
            stack = _context.stack = []
        stack.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _context.stack.remove(self)

    def __getitem__(self, key: int | str) -> InputAttributeNode:
        if isinstance(key, bool) or not isinstance(key, (int, str)):
            raise TypeError(f"input keys are ints (positional) or strs (keyword), got {key!r}")
        return InputAttributeNode(self, key)

    def __getattr__(self, name: str) -> InputAttributeNode:
        if name.startswith("_"):
            raise AttributeError(name)
        return InputAttributeNode(self, name)

    def __repr__(self) -> str:
        return "InputNode()"


class InputAttributeNode(DAGNode):
    """One positional (``inp[i]``) or keyword (``inp.key``) argument of ``execute``."""

    def __init__(self, input_node: InputNode, key: int | str) -> None:
        super().__init__([input_node])
        self.input_node = input_node
        self.key = key

    def __repr__(self) -> str:
        return f"inp[{self.key!r}]"


class ClassMethodNode(DAGNode):
    """One call of an actor method, made by ``actor.method.bind(*args, **kwargs)``."""

    def __init__(
        self, actor: ActorHandle, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        for what, value in named_arguments(args, kwargs.items()):
            if not isinstance(value, DAGNode) and _holds_a_node(value):
                raise TypeError(
                    f"{actor.name}.{method}.bind(): {what} holds a graph node inside a "
                    f"{type(value).__name__}; a node is resolved only when it is an argument "
                    "itself: bind each node as its own argument"
                )
        super().__init__([*args, *kwargs.values()])
        self.actor = actor
        self.method = method
        self.args = args
        self.kwargs = kwargs

    def upstream(self) -> list[DAGNode]:
        return [v for v in (*self.args, *self.kwargs.values()) if isinstance(v, DAGNode)]

    def __repr__(self) -> str:
        return f"{self.actor.name}.{self.method}.bind(...)"


class MultiOutputNode(DAGNode):
    """Several results returned together: ``execute(...).get()`` gives a list."""

    def __init__(self, outputs: list[DAGNode] | tuple[DAGNode, ...]) -> None:
        if not isinstance(outputs, (list, tuple)):
            raise TypeError(f"MultiOutputNode takes a list of nodes, got {type(outputs).__name__}")
        self.outputs = list(outputs)
        for i, node in enumerate(self.outputs):
            if not isinstance(node, DAGNode):
                raise TypeError(
                    f"MultiOutputNode output {i} is a {type(node).__name__}, not a graph node "
                    "(an actor method's .bind(...))"
                )
        super().__init__(self.outputs)

    def __repr__(self) -> str:
        return f"MultiOutputNode({self.outputs!r})"


def _holds_a_node(value: Any) -> bool:
    """Whether a graph node sits inside the lists, tuples, sets and dicts of ``value`` (where
    nothing would resolve it: it would travel as the node object itself). Looks at the first
    ``_SCAN_LIMIT`` items only: a constant of a million numbers is bound once, but should not
    cost a second to bind."""
    walks: list[Iterator[Any]] = [iter((value,))]
    seen: set[int] = set()
    looked = 0
    while walks and looked < _SCAN_LIMIT:
        item = next(walks[-1], _DONE)
        if item is _DONE:
            walks.pop()
            continue
        looked += 1
        if isinstance(item, DAGNode):
            return True
        if isinstance(item, (list, tuple, set, frozenset, dict)) and id(item) not in seen:
            seen.add(id(item))  # a container that holds itself is looked through once
            parts = (item.keys(), item.values()) if isinstance(item, dict) else (item,)
            walks.append(itertools.chain(*parts))
    return False


_SCAN_LIMIT = 10_000
_DONE = object()
