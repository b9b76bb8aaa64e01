"""The actor side of every executor: runs one actor's schedule, execution after execution.

Where the channels come from is the executor's business (:class:`Endpoints`): shared-memory
rings named in the plan for the local executor (:class:`ShmEndpoints`, the default), TCP
connections opened beforehand for the Ray executor. The loop below is the same for both.

The loop walks the schedule's operations in order. How an operation runs depends on the device
and on overlap:

- CPU actor, overlap off: everything on the actor's thread; a READ blocks until its message is
  there, a WRITE copies into the channel.
- CPU actor, overlap on: a receive thread walks the schedule's READs ahead of the compute thread
  (up to ``max_inflight`` executions ahead) and a send thread writes results while the next
  computation runs — the CPU counterpart of communication streams.
- GPU actor: see :mod:`tensorferry.graph._gpu` (dedicated streams ordered with events).

An exception in a method becomes a :class:`RemoteError` that flows along the graph's edges in
place of the result, so every downstream task of that execution skips and the driver raises
``ActorError`` for it; the next execution runs normally.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from tensorferry.graph._channel import (
    Channel,
    Control,
    GraphStopped,
    PeerDied,
    RemoteError,
)
from tensorferry.graph._methods import actor_method
from tensorferry.graph._plan import DRIVER, ArgRef, EdgeSpec, GraphSpec, Operation, OpKind
from tensorferry.graph._sendable import check_sendable, tensor_layout

__all__ = ["ActorRunPlan", "Endpoints", "ScheduleRunner", "ShmEndpoints", "ProfileRecord"]

_FOREVER = 1e9  # actors wait for their next input as long as the graph lives (stop-aware)


@dataclass(kw_only=True, slots=True, frozen=True)
class ActorRunPlan:
    """Everything an actor process needs to run its part of a compiled graph."""

    graph: GraphSpec
    actor: str
    index: int
    """Position of this actor in the graph (reported in the control block when it dies)."""
    device: str
    schedule: tuple[Operation, ...]
    channels: dict[int, str]
    """Edge id to shared-memory channel name (the metadata channel for rendezvous edges);
    empty when the executor hands the runner its channels (:class:`Endpoints`)."""
    control: str
    """Name of the shared-memory control block (local executor)."""
    overlap: bool
    max_inflight: int
    profile_channel: str | None = None
    """Where profile records go; ``None``: the actor does not record them."""
    nccl: Any = None
    """:class:`tensorferry.graph._nccl.NcclSetup` when this actor has NCCL edges."""
    segments: str | None = None
    """Name prefix of the graph's shared-memory segments (local executor): an actor whose
    driver died without tearing the graph down removes them, or they would outlive everyone."""


ProfileRecord = tuple[str, int, int, str, str, str, float, float]
"""(actor, execution, op index, kind, label, lane, start s, end s) on the monotonic clock."""


class Endpoints(Protocol):
    """Where a runner's channels come from; every wait on them checks ``control``.

    Channels have ``read(timeout=)``, ``write(value, timeout=)``, ``ready_at`` and ``close()``;
    ``control`` has ``check()`` (raises ``GraphStopped`` or ``PeerDied``) and ``close()``.
    """

    control: Any

    def reader(self, edge_id: int, device: torch.device | None) -> Any: ...

    def writer(self, edge_id: int) -> Any: ...

    def profile_sink(self) -> Any:
        """Where profile records go (``writable()``, ``write(records, timeout=)``), or ``None``."""
        ...


class ShmEndpoints:
    """The local executor's channels: shared-memory segments named in the plan."""

    def __init__(self, plan: ActorRunPlan) -> None:
        self._plan = plan
        self.control = Control(plan.control, create=False)
        self.control.watch_parent()

    def reader(self, edge_id: int, device: torch.device | None) -> Channel:
        return Channel(self._plan.channels[edge_id], self.control, device=device)

    def writer(self, edge_id: int) -> Channel:
        return Channel(self._plan.channels[edge_id], self.control)

    def profile_sink(self) -> Channel | None:
        name = self._plan.profile_channel
        return Channel(name, self.control) if name else None


class _CpuComm:
    """Receive and send threads of a CPU actor with overlap on."""

    def __init__(self, runner: ScheduleRunner) -> None:
        self._runner = runner
        self._reads = [op for op in runner.plan.schedule if op.kind is OpKind.READ]
        self._arrived: dict[tuple[int, int], Any] = {}
        self._cond = threading.Condition()
        self._consumed = 0  # executions the compute thread has finished
        self._failure: BaseException | None = None
        self._sends: queue.SimpleQueue = queue.SimpleQueue()
        # Results handed to the send thread, and written by it (see sent_all).
        self._queued = 0
        self._written = 0
        self._threads = [
            threading.Thread(target=self._guard(self._receive_loop), name="tf-recv", daemon=True),
            threading.Thread(target=self._guard(self._send_loop), name="tf-send", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def _guard(self, loop: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                loop()
            except BaseException as exc:
                with self._cond:
                    self._failure = exc
                    self._cond.notify_all()

        return run

    def _receive_loop(self) -> None:
        runner = self._runner
        execution = 0
        while True:
            with self._cond:
                while execution - self._consumed >= runner.plan.max_inflight:
                    self._check()
                    self._cond.wait(0.01)
            for op in self._reads:
                assert op.edge_id is not None
                channel = runner.readers[op.edge_id]
                value = channel.read(timeout=_FOREVER)
                runner.record(execution, op, "recv", channel.ready_at)
                with self._cond:
                    self._arrived[(execution, op.edge_id)] = value
                    self._cond.notify_all()
            execution += 1

    def _send_loop(self) -> None:
        runner = self._runner
        while True:
            item = self._sends.get()
            if item is None:
                return
            execution, op, value = item
            channel = runner.writers[op.edge_id]
            channel.write(value, timeout=_FOREVER)
            runner.record(execution, op, "send", channel.ready_at)
            del value, item  # the method's object: the compute thread may change it now
            with self._cond:
                self._written += 1
                self._cond.notify_all()

    def _check(self) -> None:
        if self._failure is not None:
            raise self._failure
        self._runner.control.check()

    def take(self, execution: int, edge_id: int) -> Any:
        key = (execution, edge_id)
        with self._cond:
            while key not in self._arrived:
                self._check()
                self._cond.wait(0.01)
            return self._arrived.pop(key)

    def send(self, execution: int, op: Operation, value: Any) -> None:
        if self._failure is not None:
            raise self._failure
        self._queued += 1
        self._sends.put((execution, op, value))

    def sent_all(self) -> None:
        """Waits until every result handed over so far has been written. Called before each
        method: a result the actor keeps (its weights) and changes in place in a later method
        was written mid-change otherwise (4 of 20 executions arrived mixed with three in
        flight). The receive thread still reads ahead."""
        if self._written == self._queued:
            return
        with self._cond:
            while self._written != self._queued:
                self._check()
                self._cond.wait(0.01)

    def finished(self, execution: int) -> None:
        with self._cond:
            self._consumed = execution + 1
            self._cond.notify_all()

    def close(self) -> None:
        self._sends.put(None)


class ScheduleRunner:
    """Runs ``plan.schedule`` for ``instance`` until the graph stops.

    Args:
        instance: the actor's object, whose methods the schedule calls.
        plan: the actor's part of the graph.
        endpoints: its channels (default: the local executor's shared-memory ones).
    """

    def __init__(
        self, instance: Any, plan: ActorRunPlan, endpoints: Endpoints | None = None
    ) -> None:
        endpoints = endpoints if endpoints is not None else ShmEndpoints(plan)
        self.instance = instance
        self.plan = plan
        self.graph = plan.graph
        self.control = endpoints.control
        self.device = torch.device(plan.device)
        reader_device = self.device if self.device.type == "cuda" else None
        self.readers: dict[int, Any] = {}
        self.writers: dict[int, Any] = {}
        for edge in self.graph.edges:
            if edge.dst_actor == plan.actor:
                self.readers[edge.edge_id] = endpoints.reader(edge.edge_id, reader_device)
            elif edge.src_actor == plan.actor:
                self.writers[edge.edge_id] = endpoints.writer(edge.edge_id)
        mine = [t for t in self.graph.tasks if t.actor == plan.actor]
        self._methods = {t.task_id: actor_method(instance, t.method) for t in mine}
        self._sources = {t.task_id: self._arg_sources(t.task_id) for t in mine}
        # Tasks whose results leave this process (to another actor or the driver): they must
        # pickle, or their error goes in their place (see _sendable).
        self._sent = {e.src_task for e in self.graph.edges if e.src_actor == plan.actor}
        # Host edges (shared memory, TCP) whose node promised a tensor or a fixed layout: the
        # promise is checked here as GPU edges check it (GpuOps.write), so a graph behaves the
        # same whichever transport "auto" picked. Per task: one edge stands for all of them.
        self._promised = {
            e.src_task: e
            for e in self.graph.edges
            if e.src_actor == plan.actor
            and not e.rendezvous
            and (e.static_shape or e.direct_return)
        }
        self._layouts: dict[int, list] = {}  # task -> its first result's tensor layout
        self._profile: list[ProfileRecord] = []
        self._profile_channel = endpoints.profile_sink() if plan.profile_channel else None
        self.gpu: Any = None
        if self.device.type == "cuda":
            from tensorferry.graph._gpu import GpuOps

            self.gpu = GpuOps(self)
        self._comm: _CpuComm | None = None

    # ------------------------------------------------------------------ profiling
    def record(self, execution: int, op: Operation, lane: str, start: float) -> None:
        if self._profile_channel is None:
            return
        end = time.perf_counter()
        self.record_span(execution, op, lane, start, end)

    def record_span(
        self, execution: int, op: Operation, lane: str, start: float, end: float
    ) -> None:
        index = next(i for i, o in enumerate(self.plan.schedule) if o is op)
        label = self.graph.describe(op)
        self._profile.append(
            (self.plan.actor, execution, index, op.kind.value, label, lane, start, end)
        )

    def _flush_profile(self) -> None:
        if self._profile_channel is None:
            return
        if self.gpu is not None:
            self.gpu.collect_profile()
        if self._profile and self._profile_channel.writable():
            records, self._profile = self._profile, []
            self._profile_channel.write(records, timeout=1.0)

    # ------------------------------------------------------------------ the loop
    def run(self) -> str:
        """Runs until teardown (returns ``"stopped"``) or a peer's death (``"peer died"``)."""
        if self.plan.overlap and self.gpu is None:
            self._comm = _CpuComm(self)
        peer_died = False
        try:
            execution = 0
            while True:
                self._run_once(execution)
                if self._comm is not None:
                    self._comm.finished(execution)
                self._flush_profile()
                execution += 1
        except GraphStopped:
            with contextlib.suppress(Exception):  # the last spans, where the channel has room
                self._flush_profile()
            return "stopped"
        except PeerDied:
            peer_died = True
            return "peer died"
        except Exception:
            if self.gpu is None or not self.gpu.links_aborted_by_watch:
                raise
            # The link watch aborted the links under a method held up behind a receive, as
            # the graph ended (see graph/_link_watch.py): what failed since, failed for that.
            peer_died = self.control.dead_index() is not None
            return "peer died" if peer_died else "stopped"
        finally:
            if self._comm is not None:
                self._comm.close()
            if self.gpu is not None:
                self.gpu.close(peer_died=peer_died)

    def _run_once(self, execution: int) -> None:
        values: dict[int, Any] = {}
        inbox: dict[int, Any] = {}
        comm = self._comm
        gpu = self.gpu
        # A GPU actor announces its sends once the execution is known to run: after its first
        # read, or before its first operation if that is not a read (see GpuOps.announce).
        announce = gpu is not None and gpu.announces
        for op in self.plan.schedule:
            if announce and op.kind is not OpKind.READ:
                gpu.announce(execution)
                announce = False
            if op.kind is OpKind.READ:
                assert op.edge_id is not None
                edge = self.graph.edge(op.edge_id)
                if gpu is not None:
                    start = time.perf_counter()
                    inbox[op.edge_id] = gpu.read(execution, op, edge)
                    # From when its data (or metadata) arrived: the wait is not drawn.
                    arrived = getattr(self.readers[op.edge_id], "ready_at", start)
                    self.record(execution, op, "host", max(start, arrived))
                    if announce:
                        gpu.announce(execution)
                        announce = False
                elif comm is not None:
                    inbox[op.edge_id] = comm.take(execution, op.edge_id)
                else:
                    channel = self.readers[op.edge_id]
                    inbox[op.edge_id] = channel.read(timeout=_FOREVER)
                    self.record(execution, op, "main", channel.ready_at)
            elif op.kind is OpKind.COMPUTE:
                assert op.task_id is not None
                if comm is not None:
                    comm.sent_all()
                values[op.task_id] = self._compute(execution, op, inbox, values)
            else:
                assert op.edge_id is not None
                edge = self.graph.edge(op.edge_id)
                assert edge.src_task is not None
                value = values[edge.src_task]
                if gpu is not None:
                    start = time.perf_counter()
                    gpu.write(execution, op, edge, value)
                    self.record(execution, op, "host", start)
                elif comm is not None:
                    comm.send(execution, op, value)
                else:
                    channel = self.writers[op.edge_id]
                    channel.write(value, timeout=_FOREVER)
                    self.record(execution, op, "main", channel.ready_at)

    def _arg_sources(self, task_id: int) -> tuple[list, list]:
        """How to fetch each argument of a task, worked out once: ``(where, key, index)``."""
        task = self.graph.task(task_id)

        def source(ref: ArgRef) -> tuple:
            if ref.kind == "const":
                return ("const", ref.value, None)
            if ref.kind == "input":
                edge = next(
                    e
                    for e in self.graph.edges
                    if e.src_actor == DRIVER and e.dst_actor == task.actor
                )
                index = None if len(edge.input_keys) == 1 else edge.input_keys.index(ref.value)
                return ("inbox", edge.edge_id, index)
            producer = self.graph.task(ref.value)
            if producer.actor == task.actor:
                return ("local", ref.value, None)
            edge = next(
                e for e in self.graph.edges if e.src_task == ref.value and e.dst_actor == task.actor
            )
            return ("inbox", edge.edge_id, None)

        return [source(r) for r in task.args], [(k, source(r)) for k, r in task.kwargs]

    @staticmethod
    def _fetch(source: tuple, inbox: dict, values: dict) -> Any:
        where, key, index = source
        if where == "const":
            return key
        if where == "local":
            return values[key]
        value = inbox[key]
        # The driver's inputs for this actor travel as one tuple, or as the error that took
        # its place (one /dev/shm had no room for): then every input is that error.
        return value if index is None or isinstance(value, RemoteError) else value[index]

    def _compute(self, execution: int, op: Operation, inbox: dict, values: dict) -> Any:
        task = self.graph.task(op.task_id)
        arg_sources, kwarg_sources = self._sources[op.task_id]
        fetch = self._fetch
        args = [fetch(src, inbox, values) for src in arg_sources]
        kwargs = {k: fetch(src, inbox, values) for k, src in kwarg_sources}
        if self.gpu is not None:  # received values whose sender may yet have failed
            settle = self.gpu.settle
            args = [settle(value) for value in args]
            kwargs = {k: settle(value) for k, value in kwargs.items()}
        for value in (*args, *kwargs.values()):
            if isinstance(value, RemoteError):
                return value  # an upstream task failed: skip, pass its error on
        if self.gpu is not None:
            start = time.perf_counter()
            method = self._methods[task.task_id]
            result = self.gpu.compute(execution, op, task, method, args, kwargs)
            self.record(execution, op, "host", start)  # the host's part; the device's has a lane
            return self._sendable(task, result)
        start = time.perf_counter()
        try:
            result = self._methods[task.task_id](*args, **kwargs)
        except BaseException as exc:
            # SystemExit and KeyboardInterrupt from a method are its errors too: raised out of
            # here they ended the actor's loop, and get() waited out its whole timeout.
            result = remote_error(task.actor, task.label, exc)
        self.record(execution, op, "main", start)
        return self._sendable(task, result)

    def _sendable(self, task: Any, result: Any) -> Any:
        """``result``, or the error that replaces it when it must leave this process but does
        not pickle: a write that failed part-way would end the actor's loop, and the reader
        would wait for a value that never comes."""
        if task.task_id in self._sent and not isinstance(result, RemoteError):
            try:
                check_sendable(result, f"the result of {task.label}")
            except TypeError as exc:
                return remote_error(task.actor, task.label, exc)
            edge = self._promised.get(task.task_id)
            if edge is not None:
                return self._kept_promise(edge, result)
        return result

    def _kept_promise(self, edge: EdgeSpec, result: Any) -> Any:
        """``result``, or the error that replaces it when it breaks its node's
        ``direct_return`` or ``static_shape`` promise."""
        problem = edge_check(self.graph, edge, result)
        if problem is not None:
            return problem
        if not edge.static_shape:
            return result
        layout = tensor_layout(result)
        first = self._layouts.setdefault(edge.src_task, layout)
        return result if layout == first else static_shape_error(self.graph, edge, first, layout)

    def close(self) -> None:
        for channel in (*self.readers.values(), *self.writers.values()):
            channel.close()
        if self._profile_channel is not None:
            self._profile_channel.close()
        self.control.close()


def remote_error(actor: str, label: str, exc: BaseException) -> RemoteError:
    """The error value that replaces a result when a method raised."""
    return RemoteError(
        f"{actor}.{label}",
        f"{type(exc).__name__}: {exc}",
        "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
    )


def node_of(graph: GraphSpec, edge: EdgeSpec) -> str:
    """The node whose result ``edge`` carries, as errors name it (``actor.method#n``)."""
    return f"{edge.src_actor}.{graph.task(edge.src_task).label}"


def edge_check(graph: GraphSpec, edge: EdgeSpec, value: Any) -> RemoteError | None:
    """An edge whose node promised ``direct_return`` carries one tensor: anything else breaks
    the promise (and over a rendezvous edge could not travel at all)."""
    if edge.direct_return and not isinstance(value, torch.Tensor):
        node = node_of(graph, edge)
        return RemoteError(
            node,
            f"TypeError: the result of {node} goes over {edge.transport} with "
            f"direct_return=True but is a {type(value).__name__}, not a tensor",
            "",
        )
    return None


def static_shape_error(graph: GraphSpec, edge: EdgeSpec, before: Any, now: Any) -> RemoteError:
    """The error that replaces a result whose tensors left the layout its node promised."""
    node = node_of(graph, edge)
    return RemoteError(
        node,
        f"ValueError: {node} was compiled with static_shape=True but its result's tensors "
        f"changed from {before} to {now}",
        "",
    )
