"""The local executor: runs the compiled schedules on actor processes of this machine.

At compile time (paid once) it creates one shared-memory channel per edge plus a control block,
sets up NCCL among the GPU actors that need it, and hands each actor its schedule; the actors
then loop on their schedules. Per execution the driver only copies the inputs into the input
channels and the results out of the output channels.

A watchdog thread waits on the actor processes' sentinels: when one dies it raises the graph's
dead flag, which ends every wait in every process of the graph at once, so pending and later
results raise :class:`ActorDiedError` promptly instead of timing out.

This module is the executor interface's local implementation; the Ray executor
(:mod:`tensorferry.graph._executor_ray`) implements the same five methods: ``start``,
``submit``, ``read_outputs``, ``profile_records`` and ``teardown``.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import threading
import time
import uuid
from typing import Any

from tensorferry.errors import ActorDiedError, ActorError, GraphCompileError
from tensorferry.graph._actor import _NoAnswer, _NotSent
from tensorferry.graph._channel import Channel, Control, unlink_prefix
from tensorferry.graph._executor_base import ExecutorBase, unpicklable_constant
from tensorferry.graph._plan import DRIVER, RENDEZVOUS_TRANSPORTS, GraphSpec, Schedules
from tensorferry.graph._runner import ActorRunPlan

__all__ = ["LocalExecutor"]

log = logging.getLogger(__name__)

_META_SLOT = 64 << 10  # metadata of rendezvous edges: shapes, dtypes, error flags
_PROFILE_SLOT = 256 << 10


class LocalExecutor(ExecutorBase):
    """Runs schedules on local actor processes.

    Args:
        graph: the lowered graph.
        schedules: every actor's operations (from the scheduler).
        handles: the actor handles by actor name.
        max_inflight: executions in flight; every channel holds this many messages.
        buffer_size_bytes: initial slot size of each data channel.
        profile: actors record operation spans.
        start_timeout: seconds for every actor to set up (NCCL included).
    """

    transports = frozenset({"shm", "nccl", "ce", "nvlink"})
    """Transports this executor runs (``ce`` and ``nvlink`` through tensorferry.p2p)."""
    host_transport = "shm"
    """Driver inputs and outputs, and ``auto`` edges without NCCL, go over shared memory."""

    def __init__(
        self,
        graph: GraphSpec,
        schedules: Schedules,
        handles: dict[str, Any],
        *,
        overlap: bool,
        max_inflight: int,
        buffer_size_bytes: int,
        profile: bool,
        start_timeout: float = 180.0,
    ) -> None:
        super().__init__(
            graph,
            schedules,
            handles,
            overlap=overlap,
            max_inflight=max_inflight,
            profile=profile,
            start_timeout=start_timeout,
        )
        self._buffer = buffer_size_bytes
        self.prefix = f"tf{os.getpid()}x{uuid.uuid4().hex[:8]}"
        self._control: Control | None = None
        self._profiles: list[Channel] = []
        self._torn_down = False

    # ------------------------------------------------------------------ start
    def _channel_name(self, edge_id: int) -> str:
        return f"{self.prefix}e{edge_id}"

    def start(self) -> None:
        """Creates the channels, hands every actor its plan and waits until all are ready.

        Raises:
            GraphCompileError: an actor failed to set up (its traceback in the message).
            ActorDiedError: an actor died while setting up.
        """
        problem = unpicklable_constant(self.graph)
        if problem is not None:  # before anything is created or sent
            raise GraphCompileError(problem)
        deadline = time.monotonic() + self._start_timeout
        for name in self._names:
            # An actor still running a direct call given up on reads no plan until that call
            # ends: compile waited out its whole start timeout, then stopped the actor.
            if not self.handles[name]._settle(deadline):
                raise GraphCompileError(
                    f"actor {name} is still running a direct call given up on earlier (its "
                    f"timeout passed), {self._start_timeout:.3g} s on; compile once it has "
                    "finished, or kill the actor. Nothing was started, and the actor goes on."
                )
        try:
            profile_channels = self._make_segments()
            nccl = self._nccl_setups()
        except BaseException as exc:
            # Nothing was sent yet: what was made goes (segments outlive this process).
            self.teardown(timeout=10.0, kill_actors=False)
            if isinstance(exc, OSError):
                raise GraphCompileError(
                    f"the graph's shared-memory channels could not be made: {exc} (each data "
                    f"edge takes {self._max_inflight} slot(s) of buffer_size_bytes="
                    f"{self._buffer}; /dev/shm holds them)"
                ) from exc
            raise
        sent: list[str] = []
        unsent: Exception | None = None
        for index, name in enumerate(self._names):
            profile_channel = profile_channels[index] if self._profile else None
            plan = ActorRunPlan(
                graph=self.graph,
                actor=name,
                index=index,
                device=self.graph.device_of(name),
                schedule=self.schedules[name],
                channels={e.edge_id: self._channel_name(e.edge_id) for e in self.graph.edges},
                control=self._control.name,
                overlap=self._overlap,
                max_inflight=self._max_inflight,
                profile_channel=profile_channel,
                nccl=nccl.get(name),
                segments=self.prefix,
            )
            handle = self.handles[name]
            try:
                handle._send(("run", plan), deadline)
            except (_NotSent, _NoAnswer):  # only a plan larger than the pipe can wait here
                unsent = GraphCompileError(
                    f"actor {name} did not take its part of the graph's plan in "
                    f"{self._start_timeout:.3g} s"
                )
                break
            except Exception as exc:  # the actor died, or the plan does not pickle
                unsent = exc
                break
            handle.graph = self
            sent.append(name)
        failures = []
        for name in sent:  # every actor that has the plan answers before anything else
            handle = self.handles[name]
            try:
                reply = handle._receive(max(0.1, deadline - time.monotonic()), what="graph setup")
            except ActorDiedError as exc:
                failures.append(str(exc))
                continue
            if reply[0] == "error":
                failures.append(f"{name}:\n{reply[1]}")
        if failures or unsent is not None:
            self.teardown(timeout=10.0, kill_actors=False)
        if unsent is not None:
            if isinstance(unsent, ActorDiedError):
                raise unsent
            raise GraphCompileError(f"the graph's plan could not be sent: {unsent}") from unsent
        if failures:
            raise GraphCompileError("actors failed to set up the graph:\n" + "\n".join(failures))
        for edge in self.graph.edges:
            if edge.src_actor == DRIVER:
                self._inputs[edge.edge_id] = Channel(
                    self._channel_name(edge.edge_id), self._control
                )
            elif edge.dst_actor == DRIVER:
                self._outputs[edge.edge_id] = Channel(
                    self._channel_name(edge.edge_id), self._control
                )
        self._watchdog = threading.Thread(
            target=self._watch, name=f"tensorferry-watchdog-{self.prefix}", daemon=True
        )
        self._watchdog.start()

    def _make_segments(self) -> list[str]:
        """Creates the control block and every channel; returns the profile channels' names
        (one per actor, when profiling)."""
        self._control = Control(f"{self.prefix}c", create=True)
        for edge in self.graph.edges:
            size = _META_SLOT if edge.rendezvous else self._buffer
            # A static GPU edge carries two messages per execution (the sender's announcement,
            # then its outcome; see tensorferry.graph._gpu).
            slots = self._max_inflight * (2 if edge.rendezvous and edge.static_shape else 1)
            Channel.create(self._channel_name(edge.edge_id), slots=slots, slot_size=size + 256)
        names = []
        if self._profile:
            for index in range(len(self._names)):
                names.append(f"{self.prefix}p{index}")
                Channel.create(names[-1], slots=4, slot_size=_PROFILE_SLOT)
                self._profiles.append(Channel(names[-1], self._control))
        return names

    def _nccl_setups(self) -> dict[str, Any]:
        gpu_edges = [e for e in self.graph.edges if e.transport in RENDEZVOUS_TRANSPORTS]
        actors = sorted(
            {e.src_actor for e in gpu_edges} | {e.dst_actor for e in gpu_edges},
            key=self._names.index,
        )
        if not actors:
            return {}
        from tensorferry.graph._nccl import NcclSetup, host_store

        self._store, port = host_store()

        def pair(edge: Any) -> tuple[int, int]:
            low, high = sorted((actors.index(edge.src_actor), actors.index(edge.dst_actor)))
            return low, high

        pairs = sorted({pair(e) for e in gpu_edges if e.transport == "nccl"})
        p2p_pairs = sorted({(e.transport, *pair(e)) for e in gpu_edges if e.transport != "nccl"})
        return {
            name: NcclSetup(
                rank=rank,
                world_size=len(actors),
                ranks={n: r for r, n in enumerate(actors)},
                store_port=port,
                prefix=self.prefix,
                pairs=tuple(pairs),
                timeout_s=self._start_timeout,
                p2p_pairs=tuple(p2p_pairs),
            )
            for rank, name in enumerate(actors)
        }

    # ------------------------------------------------------------------ watchdog
    def _watch(self) -> None:
        sentinels = {self.handles[n]._process.sentinel: i for i, n in enumerate(self._names)}
        while not self._closing.is_set():
            ready = multiprocessing.connection.wait(list(sentinels), timeout=0.1)
            if ready and not self._closing.is_set():
                index = sentinels[ready[0]]
                handle = self.handles[self._names[index]]
                handle._process.join(timeout=1.0)  # reap it so its exit code is known
                self._dead = (
                    f"actor {handle.name} (pid {handle.pid}) died "
                    f"(exit code {handle._process.exitcode})"
                )
                assert self._control is not None
                self._control.mark_dead(index)
                return

    def dead_error(self, index: int | None = None) -> ActorDiedError:
        if self._dead is None and index is not None:
            name = self._names[index]
            self._dead = (
                f"actor {name} died"
                if not self.handles[name].is_alive()
                else f"actor {name} stopped running the graph: its loop failed (teardown logs "
                "the traceback)"
            )
        return ActorDiedError(self._dead or "an actor of the graph died")

    # ------------------------------------------------------------------ executions
    # submit() and read_outputs() come from ExecutorBase.

    def profile_records(self) -> list:
        """Every operation span the actors reported so far (see ``ProfileRecord``)."""
        records: list = []
        for channel in self._profiles:
            while channel.readable():
                records.extend(channel.read(timeout=1.0))
        return records

    # ------------------------------------------------------------------ teardown
    def teardown(self, *, timeout: float, kill_actors: bool) -> list:
        """Stops every actor's loop, optionally ends the processes, removes the channels;
        returns the profile records the actors wrote as they stopped.

        Finishes within about ``timeout`` seconds: an actor that does not stop in time is
        killed.
        """
        if self._torn_down:
            return []
        self._torn_down = True
        deadline = time.monotonic() + timeout
        self._closing.set()
        if self._control is not None:
            self._control.stop()
        stubborn = []
        for name in self._names:
            handle = self.handles[name]
            if handle.graph is not self:
                continue
            handle.graph = None
            if not handle.is_alive():
                continue
            left = (deadline - time.monotonic()) * 0.5
            try:
                reply = handle._receive(max(0.05, left), what="teardown")
                if reply[0] == "stopped" and reply[1].startswith("failed"):
                    log.warning("actor %s ended its loop with an error: %s", name, reply[1])
            except (ActorDiedError, ActorError):
                stubborn.append(handle)
        for handle in stubborn:
            handle.kill(timeout=max(0.1, (deadline - time.monotonic()) * 0.5))
        if kill_actors:
            for name in self._names:
                left = (deadline - time.monotonic()) / max(1, len(self._names))
                self.handles[name].kill(timeout=max(0.1, left))
        if self._watchdog is not None:
            self._watchdog.join(timeout=0.5)
        last = self.profile_records()  # what the actors wrote as they stopped
        for channel in (*self._inputs.values(), *self._outputs.values(), *self._profiles):
            channel.close()
        if self._control is not None:
            self._control.close()
        unlink_prefix(self.prefix)
        self._store = None
        return last
