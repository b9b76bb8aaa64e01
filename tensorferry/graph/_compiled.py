"""``CompiledGraph``: what ``dag.compile()`` returns — execute, get, teardown, pictures."""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from tensorferry import envs
from tensorferry._seconds import checked_seconds
from tensorferry.errors import ActorDiedError, ActorError, GraphCompileError, TransferTimeoutError
from tensorferry.graph._channel import GraphStopped, RemoteError
from tensorferry.graph._dag import ClassMethodNode, DAGNode, MultiOutputNode
from tensorferry.graph._lower import lower
from tensorferry.graph._plan import DRIVER, GraphSpec, Schedules
from tensorferry.graph._schedule import build_schedules
from tensorferry.graph._sendable import check_sendable

if TYPE_CHECKING:
    from tensorferry.graph._actor import ActorHandle

__all__ = ["CompiledGraph", "CompiledGraphRef", "CompileOptions", "Executor"]

_graph_ids = itertools.count()
# This process's running graphs: a process forked from it must leave them alone.
_graphs: weakref.WeakSet[CompiledGraph] = weakref.WeakSet()


def _leave_graphs_after_fork() -> None:
    """In a process forked from the driver: the graphs' shared memory, pipes and connections
    are the parent's, so the child's exit must not tear them down (the parent's graph would
    stop) and the child cannot use them (its writes would land in the parent's executions)."""
    for graph in list(_graphs):
        graph._finalizer.detach()
        graph._foreign = graph._broken = RuntimeError(
            "this compiled graph belongs to the process that compiled it; a process forked "
            "from that one cannot use it"
        )
    _graphs.clear()


os.register_at_fork(after_in_child=_leave_graphs_after_fork)

EXECUTORS = ("auto", "local", "ray")


@dataclass(kw_only=True, slots=True, frozen=True)
class CompileOptions:
    """Options of :meth:`DAGNode.compile` (see there)."""

    overlap_communication: bool = False
    """Issue receives early and sends as soon as data is ready, on communication streams."""
    max_inflight: int = 1
    """Executions submitted but not yet read; channels hold this many messages."""
    submit_timeout: float = 60.0
    """Seconds ``execute`` waits for room when ``max_inflight`` executions are in flight."""
    get_timeout: float = 300.0
    """Default seconds ``ref.get()`` waits."""
    teardown_timeout: float = 10.0
    """Seconds ``teardown`` may take in all."""
    start_timeout: float = 180.0
    """Seconds every actor may take to set up (and to finish a direct call given up on)."""
    buffer_size_bytes: int = 1 << 20
    """Initial slot size of each shared-memory channel."""
    profile: bool = False
    """Record operation spans for :meth:`CompiledGraph.visualize_timeline`."""
    executor: str = "auto"
    """``"local"``: one process per actor on this machine; ``"ray"``: Ray actors on any node;
    ``"auto"``: whichever the graph's actors were spawned with."""

    def __post_init__(self) -> None:
        for name in ("overlap_communication", "profile"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("max_inflight", "buffer_size_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {value!r}")
        if self.max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {self.max_inflight}")
        for name in ("submit_timeout", "get_timeout", "teardown_timeout", "start_timeout"):
            checked_seconds(getattr(self, name), name)
        if self.buffer_size_bytes < 64:
            raise ValueError(f"buffer_size_bytes must be >= 64, got {self.buffer_size_bytes}")
        if self.executor not in EXECUTORS:
            raise ValueError(f"executor must be one of {EXECUTORS}, got {self.executor!r}")


class Executor(Protocol):
    """What runs compiled schedules: the local process executor and the Ray executor.

    Constructed as ``Executor(graph, schedules, handles, *, overlap, max_inflight,
    buffer_size_bytes, profile, start_timeout)``.
    """

    transports: frozenset[str]
    """Transports it can run between actors."""
    host_transport: str
    """Its buffered host channel: ``auto``'s choice without NCCL, and the driver's edges."""

    def start(self) -> None: ...

    def submit(self, payloads: dict[int, Any], *, timeout: float) -> None: ...

    def read_outputs(self, *, timeout: float) -> dict[int, Any]: ...

    def profile_records(self) -> list: ...

    def teardown(self, *, timeout: float, kill_actors: bool) -> list:
        """Stops the graph; returns the profile records its actors reported while stopping."""
        ...


def _check_p2p_transports(graph: GraphSpec) -> None:
    """Rejects a ``ce`` or ``nvlink`` edge that cannot run on this machine, naming why.

    Raises:
        GraphCompileError: e.g. one GPU only, no peer access, Triton missing for ``nvlink``.
    """
    wanted = {e.transport for e in graph.edges if e.transport in ("ce", "nvlink")}
    if not wanted:
        return
    from tensorferry.cli.doctor import transport_report

    report = transport_report()
    for edge in graph.edges:
        reason = report.get(edge.transport) if edge.transport in wanted else None
        if reason is not None:
            raise GraphCompileError(
                f"edge {edge.src_actor} -> {edge.dst_actor}: transport {edge.transport!r} cannot "
                f"run on this machine ({reason}); use 'auto' or 'nccl'"
            )


def _executor_class(name: str, handles: dict[str, Any]) -> type:
    """The executor that runs a graph of these actors, checked against what was asked for.

    Raises:
        GraphCompileError: the actors were spawned for another executor, or for two.
        ImportError: ``"ray"`` without Ray installed.
    """
    kinds: dict[str, list[str]] = {}
    for handle in handles.values():
        kinds.setdefault(getattr(handle, "executor", "local"), []).append(handle.name)
    if len(kinds) > 1:
        listing = "; ".join(f"{kind}: {', '.join(names)}" for kind, names in kinds.items())
        raise GraphCompileError(
            f"the graph mixes actors of several executors ({listing}); spawn them all with "
            "the same executor="
        )
    spawned = next(iter(kinds), None)
    if name == "auto":
        name = spawned or "local"
    elif spawned is not None and spawned != name:
        raise GraphCompileError(
            f"compile(executor={name!r}) but the actors were spawned with "
            f"executor={spawned!r}; spawn them with .spawn(..., executor={name!r})"
        )
    if name == "ray":
        from tensorferry.graph._executor_ray import RayExecutor

        return RayExecutor
    from tensorferry.graph._executor_local import LocalExecutor

    return LocalExecutor


def _collect_handles(output: DAGNode) -> dict[str, ActorHandle]:
    handles: dict[str, ActorHandle] = {}
    stack = [output]
    seen: set[int] = set()
    while stack:
        node = stack.pop()
        if node._node_id in seen:
            continue
        seen.add(node._node_id)
        if isinstance(node, ClassMethodNode):
            handles[node.actor.name] = node.actor
            stack.extend(node.upstream())
        elif isinstance(node, MultiOutputNode):
            stack.extend(node.outputs)
    return handles


class CompiledGraphRef:
    """The result of one :meth:`CompiledGraph.execute`; ``get()`` waits for it."""

    def __init__(self, graph: CompiledGraph, index: int) -> None:
        self._graph = graph
        self.index = index
        self._done = False
        self._value: Any = None
        self._error: BaseException | None = None

    def get(self, timeout: float | None = None) -> Any:
        """The execution's result: a list for a ``MultiOutputNode``, else the one value.

        Args:
            timeout: seconds to wait (the graph's ``get_timeout`` when ``None``).

        Raises:
            ActorError: a method of this execution raised (remote traceback in the message).
            ActorDiedError: an actor of the graph died.
            TransferTimeoutError: the result did not come within ``timeout``.
            RuntimeError: the graph was torn down (before the result came).
        """
        if timeout is not None:
            checked_seconds(timeout, "timeout", zero_ok=True)
        if not self._done:
            try:
                self._value = self._graph._result(self.index, timeout)
            except (ActorError, ActorDiedError) as exc:
                self._error = exc
            self._done = True
        if self._error is not None:
            raise self._error
        return self._value

    def __repr__(self) -> str:
        return f"CompiledGraphRef(execution {self.index})"

    def __del__(self) -> None:
        # Nobody can get() this result any more: the graph need not keep it (a loop that
        # executes and drops its refs would otherwise keep every result it never read).
        if not self._done:
            self._graph._forget(self.index)


class CompiledGraphFuture:
    """Awaitable result of :meth:`CompiledGraph.execute_async`."""

    def __init__(self, ref: CompiledGraphRef, timeout: float | None) -> None:
        self.ref = ref
        self._timeout = timeout

    def __await__(self):
        return asyncio.to_thread(self.ref.get, self._timeout).__await__()


class CompiledGraph:
    """A graph compiled into per-actor schedules, running on its actors.

    Made by ``node.compile(...)``. Use as a context manager to tear it down on exit.
    """

    def __init__(self, output: DAGNode, options: Any) -> None:
        self.options = options
        self.graph_id = next(_graph_ids)
        handles = _collect_handles(output)
        executor_class = _executor_class(options.executor, handles)
        self.graph: GraphSpec = lower(
            output,
            available_transports=executor_class.transports,
            host_transport=executor_class.host_transport,
        )
        _check_p2p_transports(self.graph)
        self.schedules: Schedules = build_schedules(
            self.graph,
            overlap=options.overlap_communication,
            capacity=options.max_inflight,
            max_inflight=options.max_inflight,
        )
        for handle in handles.values():
            if not handle.is_alive():
                raise ActorDiedError(f"actor {handle.name} is not running")
            if handle.graph is not None:
                raise RuntimeError(
                    f"actor {handle.name} already runs a compiled graph; tear that one down first"
                )
        self._handles = handles
        if envs.visualize_schedule():
            self.visualize_schedule(f"tensorferry-schedule-{self.graph_id}.png")
        self._executor: Executor = executor_class(
            self.graph,
            self.schedules,
            handles,
            overlap=options.overlap_communication,
            max_inflight=options.max_inflight,
            buffer_size_bytes=options.buffer_size_bytes,
            profile=options.profile,
            start_timeout=options.start_timeout,
        )
        self._lock = threading.Lock()
        self._submitted = 0
        self._read = 0
        self._results: dict[int, dict[int, Any]] = {}
        # Executions whose refs were dropped unread: their outputs are dropped once read (see
        # _forget). Added to without the lock (a ref's __del__ may run while this thread holds
        # it); set.add and set.discard are atomic.
        self._forgotten: set[int] = set()
        self._broken: BaseException | None = None
        self._closed = False
        self._profile: list = []
        self._input_edges = [e for e in self.graph.edges if e.src_actor == DRIVER]
        keys = {k for e in self._input_edges for k in e.input_keys}
        # What execute() may be given: positions up to the last one read, names read (a graph
        # that reads the InputNode itself takes exactly one argument, checked in _payloads).
        self._reads_whole = None in keys
        self._positions = 1 + max((k for k in keys if isinstance(k, int)), default=-1)
        self._names = frozenset(k for k in keys if isinstance(k, str))
        self._executor.start()
        # Tear down (and remove the shared memory, close the connections) even if the user
        # forgets.
        self._finalizer = weakref.finalize(
            self, self._executor.teardown, timeout=options.teardown_timeout, kill_actors=False
        )
        self._foreign: RuntimeError | None = None  # set in a process forked from this one
        _graphs.add(self)

    # ------------------------------------------------------------------ executions
    def _payloads(self, args: tuple, kwargs: dict) -> dict[int, Any]:
        """Each input edge's value; raises ``TypeError`` before anything is written when the
        arguments do not match what the graph reads or one cannot be sent (a half-written
        execution would end the graph)."""
        used: dict[Any, Any] = {}

        def value(key: Any) -> Any:
            if key not in used:
                used[key] = argument(key)
            return used[key]

        def argument(key: Any) -> Any:
            if key is None:
                if len(args) != 1 or kwargs:
                    raise TypeError(
                        "the graph reads the InputNode itself, so execute() takes exactly one "
                        f"positional argument (got {len(args)} and {len(kwargs)} keyword); "
                        "use inp[i] / inp.key for several"
                    )
                return args[0]
            if isinstance(key, int):
                if key >= len(args):
                    raise TypeError(
                        f"the graph reads inp[{key}] but execute() got {len(args)} args"
                    )
                return args[key]
            if key not in kwargs:
                raise TypeError(f"the graph reads inp.{key} but execute() got no {key}=")
            return kwargs[key]

        # One key: the bare value, so a tensor input takes the channel's no-pickle path.
        self._check_unread(args, kwargs)
        payloads = {
            e.edge_id: value(e.input_keys[0])
            if len(e.input_keys) == 1
            else tuple(value(k) for k in e.input_keys)
            for e in self._input_edges
        }
        for key, arg in used.items():
            check_sendable(arg, _input_name(key))
        return payloads

    def _check_unread(self, args: tuple, kwargs: dict) -> None:
        """Raises ``TypeError`` for arguments the graph never reads: a mistake, not a no-op."""
        if self._reads_whole:
            return
        if len(args) > self._positions:
            reads = f"inp[:{self._positions}]" if self._positions else "no positional argument"
            raise TypeError(
                f"execute() got {len(args)} positional arguments but the graph reads {reads}"
            )
        unread = [name for name in kwargs if name not in self._names]
        if unread:
            names = ", ".join(f"inp.{n}" for n in sorted(self._names)) or "no keyword argument"
            raise TypeError(
                f"execute() got {', '.join(f'{n}=' for n in unread)} but the graph reads {names}"
            )

    def execute(self, *args: Any, **kwargs: Any) -> CompiledGraphRef:
        """Submits one execution and returns at once with its ref.

        When ``max_inflight`` executions are already in flight, first waits (up to
        ``submit_timeout``) for the oldest to finish; its result is kept for its ref.

        Raises:
            TransferTimeoutError: no room within ``submit_timeout`` (the oldest execution in
                flight did not finish); nothing was submitted, and the graph goes on.
            TypeError: the arguments do not match what the graph reads, or one cannot be sent
                to the actors (it does not pickle). Nothing was submitted; the graph goes on.
            ActorDiedError: an actor of the graph died.
            RuntimeError: the graph was torn down.
        """
        payloads = self._payloads(args, kwargs)
        self._check_usable()
        timeout = self.options.submit_timeout
        if not self._lock.acquire(timeout=timeout):
            raise TransferTimeoutError(f"execute() waited {timeout:.3g} s for the graph's lock")
        try:
            self._check_usable()
            inflight = self.options.max_inflight
            try:
                while self._submitted - self._read >= inflight:
                    self._read_one(timeout)
            except TransferTimeoutError:
                raise TransferTimeoutError(
                    f"execute() waited {timeout:.3g} s (submit_timeout) for room: max_inflight="
                    f"{inflight} executions are in flight and execution {self._read} has not "
                    "finished; nothing was submitted, the graph goes on"
                ) from None
            try:
                self._executor.submit(payloads, timeout=timeout)
            except ActorDiedError as exc:
                self._broken = exc
                raise
            except BaseException as exc:
                # A half-written execution would shift every later result: the graph is done.
                self._broken = exc
                raise
            index = self._submitted
            self._submitted += 1
        except GraphStopped:  # teardown() on another thread while this one waited
            raise RuntimeError("this compiled graph was torn down") from None
        finally:
            self._lock.release()
        return CompiledGraphRef(self, index)

    async def execute_async(self, *args: Any, **kwargs: Any) -> CompiledGraphFuture:
        """Like :meth:`execute` for asyncio: ``fut = await dag.execute_async(x); await fut``."""
        ref = await asyncio.to_thread(self.execute, *args, **kwargs)
        return CompiledGraphFuture(ref, None)

    def _check_usable(self) -> None:
        if self._foreign is not None:
            raise self._foreign
        if self._closed:
            raise RuntimeError("this compiled graph was torn down")
        if self._broken is not None:
            raise self._broken

    def _read_one(self, timeout: float) -> None:
        try:
            outputs = self._executor.read_outputs(timeout=timeout)
        except ActorDiedError as exc:
            self._broken = exc
            raise
        self._results[self._read] = outputs
        self._read += 1
        if self._forgotten:
            self._drop_forgotten()

    def _forget(self, index: int) -> None:
        """Execution ``index``'s ref was dropped unread: its outputs are not kept. Never waits
        for the lock (a ref may be collected while this thread holds it, in the middle of
        ``execute``): what was read is dropped now if the lock is free, else at the next read."""
        self._forgotten.add(index)
        if self._lock.acquire(blocking=False):
            try:
                self._drop_forgotten()
            finally:
                self._lock.release()

    def _drop_forgotten(self) -> None:
        # Under the lock. list() copies the set in one step: a ref collected meanwhile (on
        # another thread, or on this one by the garbage collector) cannot change it under us.
        for gone in list(self._forgotten):
            if gone < self._read:
                self._forgotten.discard(gone)
                self._results.pop(gone, None)

    def _result(self, index: int, timeout: float | None) -> Any:
        timeout = self.options.get_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        if not self._lock.acquire(timeout=timeout):
            raise TransferTimeoutError(f"get() waited {timeout:.3g} s for the graph's lock")
        try:
            if index not in self._results:
                if self._broken is not None:
                    raise self._broken
                if self._closed:
                    raise RuntimeError("this compiled graph was torn down")
                try:
                    while self._read <= index:
                        self._read_one(max(0.0, deadline - time.monotonic()))
                except TransferTimeoutError:
                    raise TransferTimeoutError(
                        f"execution {index}'s result did not come within {timeout:.3g} s; the "
                        "graph goes on, and get() may be called again"
                    ) from None
                except GraphStopped:  # teardown() on another thread while this one waited
                    raise RuntimeError(
                        f"this compiled graph was torn down before execution {index}'s result came"
                    ) from None
            outputs = self._results.pop(index)
        finally:
            self._lock.release()
        values = []
        for task_id in self.graph.outputs:
            value = outputs[self.graph.output_edge(task_id).edge_id]
            if isinstance(value, RemoteError):
                trace = f"\n--- remote traceback ---\n{value.traceback}" if value.traceback else ""
                raise ActorError(f"{value.where} raised {value.message}{trace}")
            values.append(value)
        return values if self.graph.multi_output else values[0]

    # ------------------------------------------------------------------ lifetime
    def teardown(self, *, timeout: float | None = None, kill_actors: bool = True) -> None:
        """Stops the graph; by default also ends the actor processes. Idempotent.

        Args:
            timeout: seconds it may take in all (``teardown_timeout`` when ``None``); an actor
                that does not stop in time is killed.
            kill_actors: end the actor processes (off: they stay, ready for another graph).
        """
        if timeout is not None:
            checked_seconds(timeout, "timeout", zero_ok=True)
        if self._closed:
            return
        self._closed = True
        self._finalizer.detach()
        if self._foreign is not None:
            return  # a forked process: the graph and its shared memory are its parent's
        limit = self.options.teardown_timeout if timeout is None else timeout
        if self.options.profile:  # kept: the timeline is drawn after the graph ended, too
            self._profile.extend(self._executor.profile_records())
        last = self._executor.teardown(timeout=limit, kill_actors=kill_actors)
        if self.options.profile:
            self._profile.extend(last)

    def __enter__(self) -> CompiledGraph:
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    # ------------------------------------------------------------------ pictures
    def visualize_schedule(self, path: str | Path) -> tuple[Path, Path]:
        """Writes the schedules as DOT text and as a picture; returns (dot path, picture path).

        One cluster per actor with its operations in order; operations the overlap pass moved
        are red; data edges are coloured by transport.

        Args:
            path: ``s.png`` (or ``.svg``, ``.pdf``, ``.jpg``) gives that picture and ``s.dot``
                beside it; ``s.dot`` gives that and ``s.png``; any other name is a base:
                ``<path>.dot`` and ``<path>.png``.
        """
        from tensorferry.graph._visualize import write_schedule

        return write_schedule(self.graph, self.schedules, path)

    def profile_records(self) -> list:
        """Every recorded operation span so far (needs ``compile(profile=True)``). While the
        graph runs, an actor's spans of its last executions may come with its next one; after
        :meth:`teardown` every span is here."""
        if not self.options.profile:
            raise RuntimeError("compile the graph with profile=True to record its timeline")
        if not self._closed:
            self._profile.extend(self._executor.profile_records())
        return list(self._profile)

    def visualize_timeline(self, path: str | Path, *, last: int | None = None) -> Path:
        """Draws the measured timeline (Gantt per actor and stream) as a PNG.

        Args:
            path: the picture to write: PNG, or the format its suffix names (``.svg``,
                ``.pdf``, ``.jpg``); any other name gets ``.png`` added.
            last: draw only the last ``last`` executions recorded (all when ``None``).
        """
        from tensorferry.graph._visualize import write_timeline

        return write_timeline(self.profile_records(), path, last=last)

    def __repr__(self) -> str:
        state = "torn down" if self._closed else "running"
        return f"CompiledGraph({len(self._handles)} actors, {state})"


def _input_name(key: Any) -> str:
    """How an input is named in errors: the InputNode itself, ``inp[i]`` or ``inp.key``."""
    if key is None:
        return "the input"
    return f"inp[{key}]" if isinstance(key, int) else f"inp.{key}"
