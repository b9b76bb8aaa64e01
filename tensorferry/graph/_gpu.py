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
waited for on the host before the actor goes on, so nothing overlaps.

Results for the driver (and shared-memory edges to an actor on the same GPU) are copied to the
host by a writer thread once the compute event fired, so the actor's thread never blocks on them.

An upstream error travels in the metadata in place of shapes; both ends then skip the NCCL
operation, so their sequences of sends and receives stay matched.
"""

from __future__ import annotations

import io
import pickle
import queue
import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from tensorferry.graph._channel import GraphStopped, PeerDied, RemoteError
from tensorferry.graph._plan import EdgeSpec, Operation, TaskSpec

if TYPE_CHECKING:
    from tensorferry.graph._runner import ScheduleRunner

__all__ = ["GpuOps"]

_FOREVER = 1e9


class _Arrived:
    """A value received on the ``recv`` stream: usable once ``event`` fired on the device."""

    __slots__ = ("buffers", "event", "value")

    def __init__(self, value: Any, event: torch.cuda.Event, buffers: list[torch.Tensor]) -> None:
        self.value = value
        self.event = event
        self.buffers = buffers


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


class _HostWriter:
    """Writes GPU results into shared-memory channels once their compute event fired."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.failure: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="tf-host-writer", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        torch.cuda.set_device(self._device)
        try:
            while True:
                item = self._queue.get()
                if item is None:
                    return
                channel, value, event = item
                if event is not None:
                    while not event.query():  # poll rather than block: stop stays prompt
                        time.sleep(20e-6)
                channel.write(value, timeout=_FOREVER)
        except (GraphStopped, PeerDied):
            return
        except BaseException as exc:
            self.failure = exc

    def submit(self, channel: Any, value: Any, event: torch.cuda.Event | None) -> None:
        if self.failure is not None:
            raise self.failure
        self._queue.put((channel, value, event))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=2.0)


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
        self.link: Any = None
        self._ranks: dict[str, int] = {}
        if plan.nccl is not None:
            from tensorferry.graph._nccl import make_link

            self.link = make_link(plan.nccl, self.device)
            self._ranks = plan.nccl.ranks
        self._done: dict[int, torch.cuda.Event] = {}
        self._static: dict[int, Any] = {}
        self._writer = _HostWriter(self.device)
        self._profiling = plan.profile_channel is not None
        self._spans: list[tuple[int, Operation, str, Any, Any]] = []
        if self._profiling:
            self._anchor = torch.cuda.Event(enable_timing=True)
            self._anchor.record(self.compute_stream)
            self._anchor.synchronize()
            self._anchor_time = time.perf_counter()

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

    # ------------------------------------------------------------------ operations
    def read(self, execution: int, op: Operation, edge: EdgeSpec) -> Any:
        channel = self.runner.readers[edge.edge_id]
        if not edge.rendezvous:
            # Host data (driver inputs, or a same-GPU actor's staged result): copies it makes to
            # this GPU must be ordered before the compute that uses them.
            with torch.cuda.stream(self.compute_stream):
                return channel.read(timeout=_FOREVER)
        meta = channel.read(timeout=_FOREVER)
        if isinstance(meta, RemoteError):
            return meta
        if edge.static_shape:
            if meta is True:
                meta = self._static[edge.edge_id]
            else:
                self._static[edge.edge_id] = meta
        skeleton, specs = meta
        stream = self.recv_stream if self.overlap else self.compute_stream
        peer = self._ranks[edge.src_actor]
        with torch.cuda.stream(stream):
            start = self._span_start(stream)
            buffers = [
                torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in specs
            ]
            for buffer in buffers:
                self.link.recv(buffer, peer).wait()  # the stream waits, not the host
            self._span_end(execution, op, "recv" if self.overlap else "compute", start, stream)
        value = buffers[0] if skeleton is None else _CudaUnpickler(skeleton, buffers).load()
        if not self.overlap:
            stream.synchronize()  # no overlap: the host waits for the data
            return value
        event = torch.cuda.Event()
        event.record(stream)
        return _Arrived(value, event, buffers)

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

        stream = self.compute_stream
        args = [self._arrive(v) for v in args]
        kwargs = {k: self._arrive(v) for k, v in kwargs.items()}
        with torch.cuda.stream(stream):
            start = self._span_start(stream)
            try:
                result = method(*args, **kwargs)
            except Exception as exc:
                result = remote_error(task.actor, task.label, exc)
            self._span_end(execution, op, "compute", start, stream)
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
        from tensorferry.graph._runner import edge_check

        channel = self.runner.writers[edge.edge_id]
        assert edge.src_task is not None
        done = self._done.get(edge.src_task)
        if not edge.rendezvous:
            self._writer.submit(channel, value, done)
            return
        problem = value if isinstance(value, RemoteError) else edge_check(edge, value)
        if problem is not None:
            channel.write(problem, timeout=_FOREVER)
            return
        if isinstance(value, torch.Tensor):
            skeleton, tensors = None, [value]
        else:
            buffer = io.BytesIO()
            pickler = _CudaPickler(buffer)
            pickler.dump(value)
            skeleton, tensors = buffer.getvalue(), pickler.tensors
        tensors = [t if t.is_cuda else t.to(self.device) for t in tensors]
        meta = (skeleton, [(tuple(t.shape), t.dtype) for t in tensors])
        if edge.static_shape and edge.edge_id in self._static:
            if self._static[edge.edge_id][1] != meta[1]:
                problem = RemoteError(
                    edge.src_actor,
                    f"ValueError: edge {edge.edge_id} was compiled with static_shape=True but its "
                    f"tensors changed from {self._static[edge.edge_id][1]} to {meta[1]}",
                    "",
                )
                channel.write(problem, timeout=_FOREVER)
                return
            channel.write(True, timeout=_FOREVER)
        else:
            self._static[edge.edge_id] = meta
            channel.write(meta, timeout=_FOREVER)
        stream = self.send_stream if self.overlap else self.compute_stream
        peer = self._ranks[edge.dst_actor]
        with torch.cuda.stream(stream):
            if self.overlap and done is not None:
                stream.wait_event(done)
            start = self._span_start(stream)
            for tensor in tensors:
                tensor = tensor.contiguous()
                tensor.record_stream(stream)
                self.link.send(tensor, peer).wait()
            self._span_end(execution, op, "send" if self.overlap else "compute", start, stream)

    def close(self) -> None:
        self._writer.close()
        try:
            torch.cuda.synchronize(self.device)
        finally:
            if self.link is not None:
                self.link.close()
            self.client.close()
