"""How a GPU actor runs READ, COMPUTE and WRITE operations.

Streams (exclusive, from the runtime's pool through a :class:`tensorferry.Client`):
``compute`` runs the methods; with overlap on, ``recv`` and ``send`` carry the transfers.

Overlap on — no host synchronisation on the critical path:
    READ   reads the edge's metadata (shapes, dtypes, or an upstream error) from shared memory,
           allocates the buffers and issues the receive on the ``recv`` stream, then records an
           event there. The host moves on at once.
    COMPUTE makes ``compute`` wait for the events of the tensors it consumes, calls the method
           on ``compute`` and records a done event.
    WRITE  writes the metadata (the host knows it as soon as the method returned), makes
           ``send`` wait for the done event and issues the send there.
Overlap off — the baseline: transfers run on the ``compute`` stream itself and each receive is
waited for on the host (by polling an event, so a stop or a dead peer still ends the wait) before
the actor goes on, so nothing overlaps.

Results for host channels — the driver's outputs, and shared-memory edges to an actor on the same
GPU — go into their channel once the compute event that made them fired. A CUDA tensor for the
driver is first copied into pinned memory on the ``device_to_host`` stream, so no host thread
waits for that copy. The actor's own thread writes the channel, never a helper thread: handing a
value to another thread costs a wake-up and a turn at the GIL (tens to hundreds of microseconds,
more while this thread spin-waits) on the critical path of every execution. When the event has
already fired the write happens at once; otherwise the value waits in
:class:`._gpu_host.HostWrites` and the thread writes it from its next wait (for an input, a
receive, room in a channel), so it never blocks on the GPU for it. With channels that cannot be
polled (the Ray executor's TCP channels) a writer thread (:class:`._gpu_host.HostWriter`) does
it instead.

An upstream error travels in the metadata in place of shapes; both ends then skip the NCCL
operation, so their sequences of sends and receives stay matched.
"""

from __future__ import annotations

import io
import logging
import pickle
import time
from typing import TYPE_CHECKING, Any

import torch

from tensorferry.graph._channel import (
    Channel,
    RemoteError,
    resolved,
    wait_until,
)
from tensorferry.graph._gpu_host import (
    EVENT_PAUSE_S,
    FOREVER,
    HostWriter,
    HostWrites,
    PinnedResults,
)
from tensorferry.graph._link_watch import LinkWatch
from tensorferry.graph._plan import DRIVER, EdgeSpec, Operation, OpKind, TaskSpec

if TYPE_CHECKING:
    from tensorferry.graph._runner import ScheduleRunner

__all__ = ["GpuOps"]

log = logging.getLogger(__name__)

# Results for the driver up to this size are staged in pinned memory (the allocator caches those
# blocks for good, so huge ones are copied by the plain blocking path instead).
_PIN_MAX_BYTES = 256 << 20
# What a sender writes on a static edge's channel when an execution starts (see GpuOps.announce).
_ANNOUNCED = "announced"
# How long closing waits for the actor's GPU work before it aborts the links (teardown's own
# limit is 10 s by default; the links' abort takes about half a second).
_DRAIN_S = 2.0


class _Arrived:
    """A value received on the ``recv`` stream: usable once ``event`` fired on the device.

    ``outcome_from``: for a receive posted on the sender's announcement, the channel its outcome
    comes through (read by :meth:`GpuOps.settle`); ``error``: that outcome, if the sender failed.
    """

    __slots__ = ("buffers", "error", "event", "outcome_from", "value")

    def __init__(
        self,
        value: Any,
        event: torch.cuda.Event,
        buffers: list[torch.Tensor],
        outcome_from: Any = None,
    ) -> None:
        self.value = value
        self.event = event
        self.buffers = buffers
        self.outcome_from = outcome_from
        self.error: RemoteError | None = None


class _CudaPickler(pickle.Pickler):
    """Pickles a structure's skeleton; its CUDA tensors are taken out to go over NCCL."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=5)
        self.tensors: list[torch.Tensor] = []

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and obj.is_cuda:
            self.tensors.append(obj)
            return len(self.tensors) - 1
        return None


class _CudaUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, tensors: list[torch.Tensor]) -> None:
        super().__init__(io.BytesIO(data))
        self._tensors = tensors

    def persistent_load(self, pid: Any) -> Any:
        return self._tensors[pid]


class GpuOps:
    """The GPU side of a :class:`ScheduleRunner` (see the module doc)."""

    def __init__(self, runner: ScheduleRunner) -> None:
        from tensorferry.runtime import Client

        self.runner = runner
        plan = runner.plan
        self.device = runner.device
        torch.cuda.set_device(self.device)
        self.overlap = plan.overlap
        self.client = Client(devices=[self.device])
        self.compute_stream = self.client.stream(self.device, "compute")
        self.send_stream = self.client.stream(self.device, "send")
        self.recv_stream = self.client.stream(self.device, "recv")
        self.d2h_stream = self.client.stream(self.device, "device_to_host")
        self.links: dict[str, Any] = {}  # transport -> GpuLink
        self._link_owners: list[Any] = []
        self._ranks: dict[str, int] = {}
        if plan.nccl is not None:
            from tensorferry.graph._nccl import make_links

            self.links, self._link_owners = make_links(plan.nccl, self.device)
            self._ranks = plan.nccl.ranks
        self._done: dict[int, torch.cuda.Event] = {}
        # Tasks whose done event someone waits for: a host channel's writer (the driver, a
        # same-GPU actor), or with overlap a send stream. Without overlap a GPU edge's send
        # follows its method on the compute stream itself and needs none.
        self._needs_done = {
            e.src_task
            for e in plan.graph.edges
            if e.src_actor == plan.actor and (self.overlap or not e.rendezvous)
        }
        # The stream this thread last made current (see _use); None: unknown (a method ran).
        self._current: Any = None
        self._static: dict[int, Any] = {}
        self._control = runner.control
        pollable = all(hasattr(c, "readable") for c in runner.readers.values()) and all(
            hasattr(c, "writable") for c in runner.writers.values()
        )
        self._host: HostWrites | HostWriter = (
            HostWrites() if pollable else HostWriter(self.device, runner.control)
        )
        self._pinned = PinnedResults()
        # Outgoing edges that announce sends (see announce), the execution each last announced,
        # and the zeros sent in place of a failed value after an announcement.
        self._announcing = self._announcing_edges()
        self._announced: dict[int, int] = {}
        self._stand_ins: dict[int, list[torch.Tensor]] = {}
        self._profiling = plan.profile_channel is not None
        self._spans: list[tuple[int, Operation, str, Any, Any]] = []
        if self._profiling:
            self._anchor = torch.cuda.Event(enable_timing=True)
            self._anchor.record(self.compute_stream)
            self._anchor.synchronize()
            self._anchor_time = time.perf_counter()
        self._watch = self._start_link_watch(runner.control)  # last: nothing fails after it

    # ------------------------------------------------------------------ profiling
    def _span_start(self, stream: Any) -> Any:
        if not self._profiling:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def _span_end(self, execution: int, op: Operation, lane: str, start: Any, stream: Any) -> None:
        if start is None:
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record(stream)
        self._spans.append((execution, op, lane, start, end))

    def collect_profile(self) -> None:
        """Turns finished spans' events into times on the host's monotonic clock."""
        waiting = []
        for execution, op, lane, start, end in self._spans:
            if not end.query():
                waiting.append((execution, op, lane, start, end))
                continue
            begin = self._anchor_time + self._anchor.elapsed_time(start) / 1e3
            finish = self._anchor_time + self._anchor.elapsed_time(end) / 1e3
            self.runner.record_span(execution, op, lane, begin, finish)
        self._spans = waiting

    # ------------------------------------------------------------------ waiting
    def _pump_until(self, ready: Any, what: str) -> None:
        """Writes held results while waiting for ``ready()`` (returns early once none are left:
        the caller's own wait takes over)."""
        host = self._host
        host.pump()
        if not host.pending or ready():
            return
        wait_until(
            lambda: not host.pending or ready(),
            control=self._control,
            timeout=FOREVER,
            what=f"{self.runner.plan.actor}: {what}",
            idle=host.pump,
            max_pause_s=EVENT_PAUSE_S,
        )

    def _wait_event(self, event: torch.cuda.Event, what: str) -> None:
        """Waits on the host for ``event``, polling: a stop or a dead peer ends the wait."""
        if event.query():
            return
        wait_until(
            event.query,
            control=self._control,
            timeout=FOREVER,
            what=f"{self.runner.plan.actor}: {what}",
            idle=self._host.pump,
            max_pause_s=EVENT_PAUSE_S,
        )

    # ------------------------------------------------------------------ streams
    def _use(self, stream: torch.cuda.Stream) -> None:
        """Makes ``stream`` current on this thread for the work enqueued next.

        Nothing restores the previous one: every operation here names its stream before it
        enqueues anything, so what is current between operations does not matter. That is one
        call into torch per switch, and none when the stream is current already, where
        ``on_stream`` makes four (3.3 µs on an H200 host), several times per execution on the
        critical path. A method may switch streams itself, so after one ran the current stream
        counts as unknown."""
        if self._current is not stream:
            torch._C._cuda_setStream(
                stream_id=stream.stream_id,
                device_index=stream.device_index,
                device_type=stream.device_type,
            )
            self._current = stream

    # ------------------------------------------------------------------ operations
    def read(self, execution: int, op: Operation, edge: EdgeSpec) -> Any:
        channel = self.runner.readers[edge.edge_id]
        if self._host.pending:
            self._pump_until(channel.readable, f"read edge {edge.edge_id}")
        if not edge.rendezvous:
            # Host data (driver inputs, or a same-GPU actor's staged result): copies it makes to
            # this GPU must be ordered before the compute that uses them.
            self._use(self.compute_stream)
            return channel.read(timeout=FOREVER)
        meta = channel.read(timeout=FOREVER)
        if isinstance(meta, RemoteError):
            return meta
        announced = meta == _ANNOUNCED
        if edge.static_shape:
            if meta is True or announced:
                meta = self._static[edge.edge_id]
            else:
                self._static[edge.edge_id] = meta
        skeleton, specs = meta
        stream = self.recv_stream if self.overlap else self.compute_stream
        peer, link = self._ranks[edge.src_actor], self.links[edge.transport]
        self._use(stream)
        start = self._span_start(stream)
        buffers = [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in specs]
        for buffer in buffers:
            link.recv(buffer, peer).wait()  # the stream waits, not the host
        self._span_end(execution, op, "recv" if self.overlap else "compute", start, stream)
        value = buffers[0] if skeleton is None else _CudaUnpickler(skeleton, buffers).load()
        event = torch.cuda.Event()
        event.record(stream)
        if not self.overlap:
            self._wait_event(event, f"receive on edge {edge.edge_id}")  # no overlap: host waits
            if announced:
                outcome = channel.read(timeout=FOREVER)  # written before the send: here now
                return value if outcome is None else outcome
            return value
        return _Arrived(value, event, buffers, channel if announced else None)

    def settle(self, value: Any) -> Any:
        """``value``, or the sender's error in its place: the outcome of a receive posted on an
        announcement is read here, before any method sees the value (waits for the sender to
        have finished its method)."""
        if not isinstance(value, _Arrived):
            return value
        channel = value.outcome_from
        if channel is not None:
            value.outcome_from = None  # several tasks may take the value: read it once
            if self._host.pending:
                self._pump_until(channel.readable, "outcome of a received value")
            value.error = channel.read(timeout=FOREVER)
        return value if value.error is None else value.error

    # ------------------------------------------------------------------ announcements
    @property
    def announces(self) -> bool:
        """Whether this actor sends on edges whose receivers post their receives early."""
        return bool(self._announcing)

    def announce(self, execution: int) -> None:
        """Tells the receivers of this actor's static GPU edges that execution ``execution``'s
        send will come, so they post their receives now, while this actor computes. Called once
        per execution, as soon as it is known to run (after its first read). An edge qualifies
        once its layout is known (after its first send)."""
        for edge in self._announcing:
            if edge.edge_id not in self._static:
                continue
            channel = self.runner.writers[edge.edge_id]
            if self._host.pending:
                self._pump_until(channel.writable, f"announce on edge {edge.edge_id}")
            channel.write(_ANNOUNCED, timeout=FOREVER)
            self._announced[edge.edge_id] = execution

    def _announcing_edges(self) -> list[EdgeSpec]:
        """This actor's outgoing static NCCL edges, in the order it writes them, whose channel
        holds two messages per execution in flight (the local executor makes them so)."""
        plan = self.runner.plan
        edges: list[EdgeSpec] = []
        for op in plan.schedule:
            if op.kind is not OpKind.WRITE or op.edge_id is None:
                continue
            edge = plan.graph.edge(op.edge_id)
            channel = self.runner.writers.get(edge.edge_id)
            if (
                edge.rendezvous
                and edge.static_shape
                and edge.transport == "nccl"
                and isinstance(channel, Channel)
                and channel.slots >= 2 * plan.max_inflight
            ):
                edges.append(edge)
        return edges

    def compute(
        self,
        execution: int,
        op: Operation,
        task: TaskSpec,
        method: Any,
        args: list[Any],
        kwargs: dict[str, Any],
    ) -> Any:
        from tensorferry.graph._runner import remote_error

        self._host.pump()
        stream = self.compute_stream
        args = [self._arrive(v) for v in args]
        kwargs = {k: self._arrive(v) for k, v in kwargs.items()}
        self._use(stream)
        start = self._span_start(stream)
        try:
            result = method(*args, **kwargs)
        except BaseException as exc:  # SystemExit too: see ScheduleRunner._compute
            result = remote_error(task.actor, task.label, exc)
        finally:
            self._current = None  # the method may have switched streams
        self._span_end(execution, op, "compute", start, stream)
        if task.task_id in self._needs_done:
            done = torch.cuda.Event()
            done.record(stream)
            self._done[task.task_id] = done
        return result

    def _arrive(self, value: Any) -> Any:
        if not isinstance(value, _Arrived):
            return value
        self.compute_stream.wait_event(value.event)
        for buffer in value.buffers:
            # Allocated on the recv stream, used on compute: the allocator must not hand the
            # memory out again before compute is done with it.
            buffer.record_stream(self.compute_stream)
        return value.value

    def write(self, execution: int, op: Operation, edge: EdgeSpec, value: Any) -> None:
        from tensorferry.graph._runner import edge_check, static_shape_error

        channel = self.runner.writers[edge.edge_id]
        assert edge.src_task is not None
        done = self._done.get(edge.src_task)
        if not edge.rendezvous:
            if (
                edge.dst_actor == DRIVER
                and type(value) is torch.Tensor
                and value.device == self.device
                and value.numel() * value.element_size() <= _PIN_MAX_BYTES
            ):
                reuse = isinstance(channel, Channel)  # copies what it is given when written
                value, done = self._to_host(value, done, reuse=reuse)
                if reuse:
                    self._host.submit(channel, value, done, self._pinned.give_back)
                    return
            self._host.submit(channel, value, done)
            return
        if self._host.pending:
            self._pump_until(channel.writable, f"write edge {edge.edge_id}")
        announced = self._announced.pop(edge.edge_id, None) == execution
        graph = self.runner.plan.graph
        problem = value if isinstance(value, RemoteError) else edge_check(graph, edge, value)
        if problem is not None:
            self._fail_send(execution, op, edge, problem, announced, done)
            return
        if isinstance(value, torch.Tensor):
            skeleton, tensors = None, [value]
        else:
            buffer = io.BytesIO()
            pickler = _CudaPickler(buffer)
            pickler.dump(value)
            skeleton, tensors = buffer.getvalue(), pickler.tensors
        device = self.device
        if self.overlap:
            # Sent from its own stream while this actor's next methods run: a tensor the actor
            # keeps (its weights) and changes in place later would be read mid-change.
            tensors, done = self._snapshot(tensors)
        elif any(t.device != device for t in tensors):
            # Host tensors, or another GPU's (a method may use more devices than its actor's):
            # the links move this device's memory. Copied on the sending stream, so the send
            # below follows the copy; a tensor of another GPU sent as it was read the wrong
            # device's memory.
            self._use(self._sending_stream)
            tensors = [t if t.device == device else t.to(device) for t in tensors]
        meta = (skeleton, [(tuple(t.shape), t.dtype) for t in tensors])
        if edge.static_shape and edge.edge_id in self._static:
            if self._static[edge.edge_id][1] != meta[1]:
                before = self._static[edge.edge_id][1]
                problem = static_shape_error(graph, edge, before, meta[1])
                self._fail_send(execution, op, edge, problem, announced, done)
                return
            # After an announcement: its outcome (none went wrong); else the layout is as agreed.
            channel.write(None if announced else True, timeout=FOREVER)
        else:
            self._static[edge.edge_id] = meta
            channel.write(meta, timeout=FOREVER)
        self._send(execution, op, edge, tensors, done)

    def _snapshot(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.cuda.Event]:
        """Copies of ``tensors`` on this device, made on the compute stream: after the method
        that made them, before this actor's next methods, which may change the originals while
        the send stream is still reading them (without the copies, with three executions in
        flight, 28-29 of 30 arrived mixed). One device copy per tensor sent;
        returns the copies and the event after them."""
        stream = self.compute_stream
        self._use(stream)
        copies = []
        for tensor in tensors:
            copy = torch.empty(tensor.shape, dtype=tensor.dtype, device=self.device)
            copy.copy_(tensor)  # its values: from any device, conjugate views resolved
            copies.append(copy)
        copied = torch.cuda.Event()
        copied.record(stream)
        return copies, copied

    def _fail_send(
        self,
        execution: int,
        op: Operation,
        edge: EdgeSpec,
        problem: RemoteError,
        announced: bool,
        done: torch.cuda.Event | None,
    ) -> None:
        """Sends ``problem`` in place of the value. Without an announcement neither end moves
        tensors; after one, the receiver has posted its receive, so stand-ins of the agreed
        layout go instead (never read: the outcome tells the receiver to drop them)."""
        self.runner.writers[edge.edge_id].write(problem, timeout=FOREVER)
        if not announced:
            return
        stand_ins = self._stand_ins.get(edge.edge_id)
        if stand_ins is None:
            specs = self._static[edge.edge_id][1]
            self._use(self._sending_stream)  # filled before the send reads them
            stand_ins = [
                torch.zeros(shape, dtype=dtype, device=self.device) for shape, dtype in specs
            ]
            self._stand_ins[edge.edge_id] = stand_ins
        self._send(execution, op, edge, stand_ins, done)

    def _send(
        self,
        execution: int,
        op: Operation,
        edge: EdgeSpec,
        tensors: list[torch.Tensor],
        done: torch.cuda.Event | None,
    ) -> None:
        stream = self._sending_stream
        peer, link = self._ranks[edge.dst_actor], self.links[edge.transport]
        self._use(stream)
        if self.overlap and done is not None:
            stream.wait_event(done)
        start = self._span_start(stream)
        for tensor in tensors:
            # Links move bytes: a conjugate or negative view's are not its values.
            tensor = resolved(tensor).contiguous()
            tensor.record_stream(stream)
            link.send(tensor, peer).wait()
        self._span_end(execution, op, "send" if self.overlap else "compute", start, stream)

    @property
    def _sending_stream(self) -> torch.cuda.Stream:
        return self.send_stream if self.overlap else self.compute_stream

    def _to_host(
        self, tensor: torch.Tensor, done: torch.cuda.Event | None, *, reuse: bool
    ) -> tuple[torch.Tensor, torch.cuda.Event]:
        """Starts copying a result for the driver into pinned memory; returns the host tensor
        and the event after which it holds the data. The driver receives host tensors anyway
        (its channel ends have no device), so nothing changes for it. ``reuse``: into one of
        :class:`PinnedResults` (given back once written), else a fresh one."""
        stream = self.d2h_stream
        self._use(stream)
        if done is not None:
            stream.wait_event(done)
        tensor = tensor.detach()
        if reuse:
            host = self._pinned.take(tuple(tensor.shape), tensor.dtype)
        else:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        # Made on the compute stream, read here: its memory must not be handed out again
        # before the copy is done.
        tensor.record_stream(stream)
        copied = torch.cuda.Event()
        copied.record(stream)
        return host, copied

    def _drained(self, timeout_s: float) -> bool:
        """Whether the work queued on this actor's streams finished within ``timeout_s``."""
        streams = (self.compute_stream, self.send_stream, self.recv_stream, self.d2h_stream)
        events = []
        for stream in streams:
            event = torch.cuda.Event()
            event.record(stream)
            events.append(event)
        deadline = time.monotonic() + timeout_s
        while not all(event.query() for event in events):
            if time.monotonic() >= deadline:
                log.warning(
                    "actor on %s: its GPU work has not finished %.1f s into closing (a receive "
                    "whose send never came); aborting its links",
                    self.device,
                    timeout_s,
                )
                return False
            time.sleep(EVENT_PAUSE_S * 10)
        return True

    def _start_link_watch(self, control: Any) -> LinkWatch | None:
        """A watch that aborts the links a method's thread, stuck behind a receive, cannot
        (see :mod:`._link_watch`): for links whose ``close`` may run on any thread."""
        watched = [o for o in self._link_owners if getattr(o, "closes_on_any_thread", False)]
        if not watched:
            return None

        def abort() -> None:
            for owner in watched:
                owner.close()

        return LinkWatch(control, abort, drain_s=_DRAIN_S, what=f"actor on {self.device}")

    @property
    def links_aborted_by_watch(self) -> bool:
        """Whether the link watch aborted the links (the graph was ending)."""
        return self._watch is not None and self._watch.fired

    def close(self, *, peer_died: bool = False) -> None:
        """Waits for this actor's GPU work, then closes its links.

        A receive posted for an announced send that never comes (the sender died, or stopped at
        teardown before sending) would keep the device busy forever, and aborting the links is
        what ends it. So: no wait at all after a peer died, and at most :data:`_DRAIN_S`
        otherwise, before the links are closed either way.
        """
        if self._watch is not None:
            self._watch.finish()  # this thread closes the links now
        self._host.close()
        try:
            if not peer_died and self._drained(_DRAIN_S):
                torch.cuda.synchronize(self.device)
        finally:
            for owner in reversed(self._link_owners):
                try:
                    owner.close()
                except Exception:
                    log.warning("closing a GPU link failed", exc_info=True)
            self.client.close()
