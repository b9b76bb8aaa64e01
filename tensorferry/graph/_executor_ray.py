"""The Ray executor: runs the compiled schedules on Ray actors, wherever Ray placed them.

Each actor is a Ray actor (:mod:`tensorferry.graph._actor_ray`) running the same
:class:`~tensorferry.graph._runner.ScheduleRunner` as a local actor process; only the channels
differ. At compile time (paid once):

1. every actor opens a listener and reports its address (``open_graph``), as does the driver;
2. every actor gets its plan and the addresses (``setup_graph``), connects one TCP connection per
   edge it writes, accepts one per edge it reads (:mod:`tensorferry.graph._channel_net`), and
   sets up NCCL for GPU edges (rendezvous through a TCP store the driver hosts);
3. every actor starts its loop (``run_graph``, a Ray task that lasts as long as the graph).

Per execution the driver writes inputs to, and reads results from, its own connections — no Ray
call on the hot path. Control goes over Ray calls answered by a separate concurrency group:
``stop_graph`` at teardown, ``mark_dead`` when an actor died.

A watchdog thread waits on the actors' ``run_graph`` tasks: Ray fails them as soon as it knows
the actor is gone (``ray.kill``, a crash, a lost node), so the watchdog raises the graph's dead
flag in the driver and in every other actor, and pending and later results raise
:class:`~tensorferry.errors.ActorDiedError` promptly. A connection that ends without a goodbye
tells its reader the same, usually even sooner.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
import uuid
from typing import Any

from tensorferry.errors import ActorDiedError, GraphCompileError
from tensorferry.graph._actor_ray import require_ray
from tensorferry.graph._channel import GraphStopped
from tensorferry.graph._channel_net import Listener, NetControl, NetWiring, establish
from tensorferry.graph._executor_base import ExecutorBase, unpicklable_constant
from tensorferry.graph._plan import DRIVER, GraphSpec, Schedules
from tensorferry.graph._runner import ActorRunPlan

__all__ = ["RayExecutor"]

log = logging.getLogger(__name__)

_GRACE_S = 1.0  # how long a "a peer died" report waits for the dead actor's own report


class RayExecutor(ExecutorBase):
    """Runs schedules on Ray actors (see the module doc).

    Args:
        graph: the lowered graph.
        schedules: every actor's operations.
        handles: the ``RayActorHandle`` of every actor, by name.
        overlap: overlap communication with computation.
        max_inflight: executions in flight; readers receive this many messages ahead.
        buffer_size_bytes: unused (connections have no slots to size); kept for the interface.
        profile: actors record operation spans.
        start_timeout: seconds for every actor to wire up (NCCL included).
    """

    transports = frozenset({"tcp", "nccl"})
    """Transports this executor runs between actors."""
    host_transport = "tcp"
    """Driver inputs and outputs, and ``auto`` edges without NCCL, go over TCP."""

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
        self._ray = require_ray()
        super().__init__(
            graph,
            schedules,
            handles,
            overlap=overlap,
            max_inflight=max_inflight,
            profile=profile,
            start_timeout=start_timeout,
        )
        self.prefix = f"tfray{uuid.uuid4().hex[:8]}"
        self._hosts = [handles[name].ray_actor for name in self._names]
        self._control = NetControl()
        self._listener: Listener | None = None
        self._run_refs: dict[Any, int] = {}
        self._dead_known = threading.Event()
        self._torn_down = False

    # ------------------------------------------------------------------ start
    def _gather(self, refs: list, deadline: float, what: str) -> tuple[list, list[str]]:
        """Each actor's answer to ``refs`` (one per actor, in order), and what went wrong."""
        ray = self._ray
        answers: list = []
        failures: list[str] = []
        for name, ref in zip(self._names, refs, strict=True):
            try:
                answers.append(ray.get(ref, timeout=max(0.1, deadline - time.monotonic())))
            except ray.exceptions.GetTimeoutError:
                answers.append(None)
                failures.append(f"{name}: did not {what} in time")
            except ray.exceptions.RayError as exc:
                answers.append(None)
                failures.append(f"{name}: died during {what}: {_first_line(exc)}")
        return answers, failures

    def start(self) -> None:
        """Wires every edge, hands every actor its plan and starts the loops.

        Raises:
            GraphCompileError: an actor failed to set up the graph (its traceback in the
                message), or GPU edges need a store the NCCL link cannot reach.
        """
        ray = self._ray
        deadline = time.monotonic() + self._start_timeout
        driver_ip = ray.util.get_node_ip_address()
        nccl = self._nccl_setups(driver_ip)
        for name in self._names:
            self.handles[name].graph = self
        self._listener = Listener()
        addresses, failures = self._gather(
            [host.open_graph.remote() for host in self._hosts], deadline, "open the graph"
        )
        if failures:
            self._fail(failures)
        wiring = NetWiring(
            token=secrets.token_bytes(16),
            addresses={DRIVER: (driver_ip, self._listener.port)}
            | {name: tuple(address) for name, address in zip(self._names, addresses, strict=True)},
            indices={name: index for index, name in enumerate(self._names)},
            capacity=self._max_inflight,
            timeout_s=max(1.0, deadline - time.monotonic()),
        )
        setups = []
        try:
            for index, (name, host) in enumerate(zip(self._names, self._hosts, strict=True)):
                setups.append(
                    host.setup_graph.remote(self._plan(index, name, nccl.get(name)), wiring)
                )
        except Exception as exc:  # Ray cannot serialise a plan: a constant that does not pickle
            for host in self._hosts:
                host.stop_graph.remote()
            if setups:  # those that got their plan stop before the teardown asks them to
                ray.wait(setups, num_returns=len(setups), timeout=5.0)
            why = unpicklable_constant(self.graph) or _first_line(exc)
            self._fail([f"driver: the graph's plan could not be sent: {why}"])
        try:
            readers, writers = self._wire_driver(wiring, setups)
        except BaseException as exc:
            # The actors may wait for the driver's connections: stop them before asking why.
            for host in self._hosts:
                host.stop_graph.remote()
            failures = self._setup_failures(setups, time.monotonic() + 5.0)
            if not isinstance(exc, GraphStopped):  # not stopped because an actor failed
                failures.insert(0, f"driver: could not connect the graph's edges: {exc!r}")
            self._fail(failures)
        self._inputs, self._outputs = writers, readers
        failures = self._setup_failures(setups, deadline)
        if failures:
            self._fail(failures)
        self._listener.close()
        self._listener = None
        # Read results in edge order, the order the local executor reads them in.
        self._outputs = {
            e.edge_id: readers[e.edge_id] for e in self.graph.edges if e.edge_id in readers
        }
        self._run_refs = {host.run_graph.remote(): i for i, host in enumerate(self._hosts)}
        self._watchdog = threading.Thread(
            target=self._watch, name=f"tensorferry-ray-watchdog-{self.prefix}", daemon=True
        )
        self._watchdog.start()

    def _setup_failures(self, setups: list, deadline: float) -> list[str]:
        replies, failures = self._gather(setups, deadline, "set up the graph")
        return failures + [
            f"{name}:\n{reply[1]}"
            for name, reply in zip(self._names, replies, strict=True)
            if reply is not None and reply[0] == "error"
        ]

    def _wire_driver(self, wiring: NetWiring, setups: list) -> tuple[dict, dict]:
        """The driver's own connections, given up as soon as an actor's setup failed (rather
        than waiting out the start timeout for edges that actor will never connect)."""
        ray = self._ray
        outcome: dict[str, Any] = {}

        def wire() -> None:
            try:
                outcome["channels"] = establish(
                    DRIVER, self.graph, wiring, self._listener, self._control
                )
            except BaseException as exc:
                outcome["error"] = exc

        thread = threading.Thread(target=wire, name="tensorferry-ray-wiring", daemon=True)
        thread.start()
        pending = list(setups)
        while thread.is_alive():
            thread.join(0.05)
            if not pending:
                continue
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=0)
            for ref in done:
                try:
                    failed = ray.get(ref, timeout=1.0)[0] == "error"
                except ray.exceptions.RayError:
                    failed = True
                if failed:
                    self._control.stop()  # ends the driver's waits for connections
        if "error" in outcome:
            raise outcome["error"]
        return outcome["channels"]

    def _fail(self, failures: list[str]) -> None:
        # Actors that got through part of the setup hold it until run_graph, which sees the
        # stop and lets go: they stay usable for direct calls and other graphs.
        self._run_refs = {host.run_graph.remote(): i for i, host in enumerate(self._hosts)}
        self.teardown(timeout=10.0, kill_actors=False)
        raise GraphCompileError("actors failed to set up the graph:\n" + "\n".join(failures))

    def _plan(self, index: int, name: str, nccl: Any) -> ActorRunPlan:
        return ActorRunPlan(
            graph=self.graph,
            actor=name,
            index=index,
            device=self.graph.device_of(name),
            schedule=self.schedules[name],
            channels={},  # the actor's channels are the connections it opens itself
            control=self.prefix,
            overlap=self._overlap,
            max_inflight=self._max_inflight,
            profile_channel="ray" if self._profile else None,
            nccl=nccl,
        )

    def _nccl_setups(self, driver_ip: str) -> dict[str, Any]:
        edges = [e for e in self.graph.edges if e.transport == "nccl"]
        if not edges:
            return {}
        actors = sorted(
            {e.src_actor for e in edges} | {e.dst_actor for e in edges}, key=self._names.index
        )
        from tensorferry.graph._nccl import NcclSetup, host_store

        self._store, port = host_store()
        pairs = sorted(
            {tuple(sorted((actors.index(e.src_actor), actors.index(e.dst_actor)))) for e in edges}
        )
        return {
            name: NcclSetup(
                rank=rank,
                world_size=len(actors),
                ranks={n: r for r, n in enumerate(actors)},
                store_port=port,
                prefix=self.prefix,
                pairs=tuple(pairs),  # type: ignore[arg-type]
                timeout_s=self._start_timeout,
                store_host=driver_ip,
            )
            for rank, name in enumerate(actors)
        }

    # ------------------------------------------------------------------ watchdog
    def _outcome(self, ref: Any) -> tuple[int, str, bool]:
        """``(actor index, what happened, whether that actor itself is gone or broken)``."""
        ray = self._ray
        index = self._run_refs[ref]
        name = self._names[index]
        try:
            why = ray.get(ref, timeout=1.0)
        except ray.exceptions.RayActorError as exc:
            return index, f"actor {name} died ({_first_line(exc)})", True
        except ray.exceptions.RayError as exc:
            return index, f"actor {name} failed: {exc}", True
        if why == "peer died":
            return index, f"actor {name} stopped: another actor of the graph died", False
        return index, f"actor {name} stopped running the graph: {why}", True

    def _watch(self) -> None:
        try:
            self._watch_runs()
        except Exception:  # Ray shut down under a graph nobody tore down
            if not self._closing.is_set():
                log.exception("the Ray executor's watchdog stopped")

    def _watch_runs(self) -> None:
        ray = self._ray
        pending = list(self._run_refs)
        while pending and not self._closing.is_set():
            ready, pending = ray.wait(pending, num_returns=1, timeout=0.05)
            if not ready or self._closing.is_set():
                continue
            outcomes = [self._outcome(ref) for ref in ready]
            # An actor that stopped because a peer died says so first; the dead one's own report
            # names the actor to blame, and comes moments later.
            grace = time.monotonic() + _GRACE_S
            while not any(gone for *_, gone in outcomes) and pending:
                left = grace - time.monotonic()
                if left <= 0:
                    break
                more, pending = ray.wait(pending, num_returns=1, timeout=left)
                outcomes += [self._outcome(ref) for ref in more]
            if self._closing.is_set():
                return
            index, message, _ = next((o for o in outcomes if o[2]), outcomes[0])
            self._declare_dead(index, message)
            return

    def _declare_dead(self, index: int, message: str) -> None:
        self._dead = message
        self._dead_known.set()
        self._control.mark_dead(index)
        for other, host in enumerate(self._hosts):
            if other != index:
                with contextlib.suppress(Exception):
                    host.mark_dead.remote(index)

    def dead_error(self, index: int | None = None) -> ActorDiedError:
        if self._dead is None:
            # A connection's end is often seen before Ray's report; that report says which
            # actor died (the connection only says which neighbour stopped).
            self._dead_known.wait(_GRACE_S + 0.5)
        if self._dead is None and index is not None:
            self._dead = f"actor {self._names[index]} died"
        return ActorDiedError(self._dead or "an actor of the graph died")

    # ------------------------------------------------------------------ executions
    # submit() and read_outputs() come from ExecutorBase.

    def profile_records(self) -> list:
        """Every operation span the actors recorded so far (each host's monotonic clock)."""
        ray = self._ray
        refs = [host.take_profile.remote() for host in self._hosts]
        records: list = []
        for ref in refs:
            with contextlib.suppress(ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
                records.extend(ray.get(ref, timeout=10.0))
        return records

    # ------------------------------------------------------------------ teardown
    def teardown(self, *, timeout: float, kill_actors: bool) -> list:
        """Stops every actor's loop, optionally kills the actors, closes the connections;
        returns the profile records the actors kept as they stopped.

        Finishes within about ``timeout`` seconds: an actor whose loop does not end in time is
        killed.
        """
        if self._torn_down:
            return []
        self._torn_down = True
        deadline = time.monotonic() + timeout
        self._closing.set()
        self._control.stop()
        for channel in self._inputs.values():
            channel.close()  # a goodbye: actors reading inputs stop at once
        ray = self._ray
        alive = ray.is_initialized()
        stubborn: list[int] = []
        if alive:
            for host in self._hosts:
                with contextlib.suppress(Exception):
                    host.stop_graph.remote()
            refs = list(self._run_refs)
            if refs:
                left = max(0.05, (deadline - time.monotonic()) * 0.5)
                done, late = ray.wait(refs, num_returns=len(refs), timeout=left)
                for ref in done:
                    with contextlib.suppress(ray.exceptions.RayError):
                        why = ray.get(ref, timeout=1.0)
                        if why.startswith("failed"):
                            log.warning("actor %s ended with an error: %s",
                                        self._names[self._run_refs[ref]], why)  # fmt: skip
                stubborn = [self._run_refs[ref] for ref in late]
        last = self.profile_records() if alive and self._profile else []
        for name in self._names:
            if self.handles[name].graph is self:
                self.handles[name].graph = None
        victims = range(len(self._names)) if kill_actors else stubborn
        if alive:
            for index in victims:
                left = (deadline - time.monotonic()) / max(1, len(victims))
                self.handles[self._names[index]].kill(timeout=max(0.1, left))
        if self._watchdog is not None:
            self._watchdog.join(timeout=0.5)
        for channel in self._outputs.values():
            channel.close()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        self._store = None
        return last


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
