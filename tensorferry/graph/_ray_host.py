"""What runs inside a Ray actor of a graph: the user's object, and its part of compiled graphs.

:class:`ActorHost` is wrapped with ``ray.remote`` by :mod:`tensorferry.graph._actor_ray`; this
module imports nothing of Ray at import time. Its methods fall in two Ray concurrency groups:

- the default group (one thread, so the user's object sees one call at a time, as in a local
  actor process): ``started``, ``call``, ``open_graph``, ``setup_graph``, ``run_graph`` — the
  last one runs the schedule until the graph stops;
- ``control`` (its own threads, answered while a graph runs): ``ping``, ``stop_graph``,
  ``mark_dead``, ``take_profile``.

A compiled graph on this actor goes through: ``open_graph`` (a listener for its incoming edges;
returns the address) → ``setup_graph`` (connects every edge, builds the
:class:`~tensorferry.graph._runner.ScheduleRunner`, sets up NCCL) → ``run_graph`` (returns why
it ended: ``"stopped"``, ``"peer died"`` or ``"failed:"`` and a traceback). When the graph
fails to start, ``run_graph`` is still called: it lets go of whatever was opened.
"""

from __future__ import annotations

import contextlib
import os
import threading
import traceback
from typing import Any

from tensorferry.graph._channel import GraphStopped
from tensorferry.graph._channel_net import (
    Listener,
    NetControl,
    NetReader,
    NetWiring,
    NetWriter,
    establish,
)
from tensorferry.graph._methods import actor_method
from tensorferry.graph._worker import resolve_class

__all__ = ["ActorHost", "CONTROL_GROUP"]

CONTROL_GROUP = "control"
"""Ray concurrency group of the methods that must answer while a graph runs."""


def _control(method: Any) -> Any:
    """Puts a method in :data:`CONTROL_GROUP`: what ``@ray.method(concurrency_group=...)``
    records, written out so this module does not import Ray."""
    method.__ray_concurrency_group__ = CONTROL_GROUP
    return method


class _ProfileSink:
    """Profile records of this actor, kept until the driver takes them (thread-safe)."""

    def __init__(self) -> None:
        self._records: list = []
        self._lock = threading.Lock()

    def writable(self) -> bool:
        return True

    def write(self, records: list, *, timeout: float) -> None:
        with self._lock:
            self._records.extend(records)

    def take(self) -> list:
        with self._lock:
            records, self._records = self._records, []
        return records

    def close(self) -> None:
        pass


class _NetEndpoints:
    """A runner's channels: connections :func:`establish` opened (see ``Endpoints``)."""

    def __init__(
        self,
        control: NetControl,
        readers: dict[int, NetReader],
        writers: dict[int, NetWriter],
        profile: _ProfileSink | None,
    ) -> None:
        self.control = control
        self._readers = readers
        self._writers = writers
        self._profile = profile

    def reader(self, edge_id: int, device: Any) -> NetReader:
        reader = self._readers[edge_id]
        reader.device = device
        return reader

    def writer(self, edge_id: int) -> NetWriter:
        return self._writers[edge_id]

    def profile_sink(self) -> _ProfileSink | None:
        return self._profile


class _Session:
    """One compiled graph on this actor, from ``open_graph`` to the end of ``run_graph``."""

    def __init__(self) -> None:
        self.control = NetControl()
        self.listener: Listener | None = Listener()
        self.runner: Any = None
        self.profile: _ProfileSink | None = None
        self.channels: list[Any] = []

    def close_channels(self) -> None:
        if self.listener is not None:
            self.listener.close()
            self.listener = None
        for channel in self.channels:
            with contextlib.suppress(Exception):
                channel.close()
        self.channels = []


def _local_device(device: str) -> str:
    """Checks a Ray actor's device against the GPUs Ray made visible to it."""
    if device == "cpu":
        return device
    import torch

    from tensorferry.runtime._devices import cuda_device_count

    index = int(device.split(":")[1])
    count = cuda_device_count()
    if index >= count:
        raise ValueError(
            f"device {device} does not exist in this actor: Ray gave it {count} GPU(s) "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); ask for more "
            "with num_gpus="
        )
    torch.cuda.set_device(index)
    return device


def _pin(device: str) -> None:
    """Makes ``device`` current in the calling thread (Ray may run methods on other threads
    than the constructor's, and the current CUDA device is per thread)."""
    if device != "cpu":
        import torch

        torch.cuda.set_device(int(device.split(":")[1]))


class ActorHost:
    """The Ray actor behind a ``RayActorHandle`` (see the module doc).

    Args:
        cls_or_ref: the actor class, or ``(module, qualname)`` to import it by.
        args, kwargs: the constructor's arguments.
        device: ``"cpu"`` or ``"cuda:N"``, N counting the GPUs Ray gave this actor.
        name: the actor's name in graphs.
    """

    def __init__(self, cls_or_ref: Any, args: tuple, kwargs: dict, device: str, name: str) -> None:
        self._name = name
        self._device = device
        self._instance: Any = None
        self._error: str | None = None
        self._session: _Session | None = None
        try:
            cls = resolve_class(cls_or_ref) if isinstance(cls_or_ref, tuple) else cls_or_ref
            self._device = _local_device(device)
            self._instance = cls(*args, **kwargs)
        except BaseException:
            # Reported by ``started`` so the driver raises ActorError with this traceback.
            self._error = traceback.format_exc()

    # ------------------------------------------------------------------ default group
    def started(self) -> tuple:
        """``("started", where)`` or ``("error", traceback)`` if the constructor raised."""
        if self._error is not None:
            return ("error", self._error)
        import ray

        gpu_ids = [str(g) for g in ray.get_gpu_ids()]
        return (
            "started",
            {
                "pid": os.getpid(),
                "node_id": ray.get_runtime_context().get_node_id(),
                "node_ip": ray.util.get_node_ip_address(),
                "gpu_ids": gpu_ids,
                "device": self._device,
            },
        )

    def call(self, method: str, args: tuple, kwargs: dict) -> tuple:
        """Calls a method now: ``("ok", result)`` or ``("error", traceback)``."""
        if self._session is not None:
            return ("error", f"actor {self._name} runs a compiled graph; tear it down first")
        try:
            _pin(self._device)
            return ("ok", actor_method(self._instance, method)(*args, **kwargs))
        except BaseException:
            return ("error", traceback.format_exc())

    def open_graph(self) -> tuple[str, int]:
        """Starts wiring a new graph: returns the address its incoming edges connect to."""
        import ray

        if self._session is not None:
            raise RuntimeError(f"actor {self._name} already runs a compiled graph")
        self._session = _Session()
        assert self._session.listener is not None
        return (ray.util.get_node_ip_address(), self._session.listener.port)

    def setup_graph(self, plan: Any, wiring: NetWiring) -> tuple:
        """Connects the graph's edges and builds the runner: ``("ready",)`` or an error."""
        from tensorferry.graph._runner import ScheduleRunner

        session = self._session
        if session is None or session.listener is None:
            return ("error", "setup_graph without open_graph")
        try:
            _pin(self._device)
            readers, writers = establish(
                plan.actor, plan.graph, wiring, session.listener, session.control
            )
            session.channels = [*readers.values(), *writers.values()]
            session.listener.close()
            session.listener = None
            session.profile = _ProfileSink() if plan.profile_channel else None
            endpoints = _NetEndpoints(session.control, readers, writers, session.profile)
            session.runner = ScheduleRunner(self._instance, plan, endpoints)
        except GraphStopped:  # the driver gave up on this graph (another actor failed)
            session.close_channels()
            self._session = None
            return ("stopped",)
        except BaseException:
            session.close_channels()
            self._session = None
            return ("error", traceback.format_exc())
        return ("ready",)

    def run_graph(self) -> str:
        """Runs the schedule until the graph stops; returns why it ended.

        Without a complete setup (the graph failed to start) it only lets go of what was
        opened and returns ``"no graph"``.
        """
        session = self._session
        if session is None:
            return "no graph"
        runner = session.runner
        try:
            if runner is None:
                return "no graph"
            _pin(self._device)
            why = runner.run()
        except BaseException:
            why = "failed:\n" + traceback.format_exc()
        finally:
            if runner is not None:
                with contextlib.suppress(Exception):
                    runner.close()
            session.close_channels()
            self._session = None
        return why

    # ------------------------------------------------------------------ control group
    @_control
    def ping(self) -> bool:
        return True

    @_control
    def stop_graph(self) -> None:
        """Asks the running graph (or one being wired) to stop; its loop ends promptly."""
        session = self._session
        if session is not None:
            session.control.stop()

    @_control
    def mark_dead(self, index: int) -> None:
        """Tells this actor that the graph's actor ``index`` died: its waits end at once."""
        session = self._session
        if session is not None:
            session.control.mark_dead(index)

    @_control
    def take_profile(self) -> list:
        """Profile records since the last call (empty when not profiling)."""
        session = self._session
        if session is None or session.profile is None:
            return []
        return session.profile.take()
