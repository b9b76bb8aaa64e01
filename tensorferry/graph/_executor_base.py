"""What every executor shares on the driver's side: the state it starts with, writing one
execution's inputs and reading the oldest execution's results over its channels.

An executor fills ``_inputs`` and ``_outputs`` (edge id to a channel with ``write(value,
timeout=)`` / ``read(timeout=)``) when it starts and defines ``dead_error(index)``; channels
raise ``PeerDied`` when the actor at the other end is gone.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from tensorferry.errors import ActorDiedError
from tensorferry.graph._channel import PeerDied
from tensorferry.graph._plan import GraphSpec, Schedules
from tensorferry.graph._sendable import first_unpicklable, named_arguments

__all__ = ["ExecutorBase", "unpicklable_constant"]


def unpicklable_constant(graph: GraphSpec) -> str | None:
    """What is wrong when a constant bound into the graph does not pickle (constants reach their
    actors pickled, in the graph's plan), naming it; ``None`` when every one pickles."""
    for task in graph.tasks:
        named = named_arguments(task.args, task.kwargs)
        culprit = first_unpicklable((what, ref.value) for what, ref in named if ref.kind == "const")
        if culprit is not None:
            what, value, problem = culprit
            return (
                f"{task.actor}.{task.method}: {what} ({type(value).__name__}) is a constant that "
                f"cannot be pickled, so it cannot reach the actor's process: {problem}"
            )
    return None


class ExecutorBase:
    """State and driver-side I/O shared by the local and the Ray executor.

    Args:
        graph: the lowered graph.
        schedules: every actor's operations (from the scheduler).
        handles: the actor handles by actor name.
        overlap: overlap communication with computation.
        max_inflight: executions in flight.
        profile: actors record operation spans.
        start_timeout: seconds for every actor to set up (NCCL included).
    """

    def __init__(
        self,
        graph: GraphSpec,
        schedules: Schedules,
        handles: dict[str, Any],
        *,
        overlap: bool,
        max_inflight: int,
        profile: bool,
        start_timeout: float,
    ) -> None:
        self.graph = graph
        self.schedules = schedules
        self.handles = handles
        self._overlap = overlap
        self._max_inflight = max_inflight
        self._profile = profile
        self._start_timeout = start_timeout
        self._names = [spec.name for spec in graph.actors]
        self._inputs: dict[int, Any] = {}
        self._outputs: dict[int, Any] = {}
        self._partial: dict[int, Any] = {}
        self._store: Any = None
        self._closing = threading.Event()
        self._watchdog: threading.Thread | None = None
        self._dead: str | None = None

    def dead_error(self, index: int | None = None) -> ActorDiedError:
        raise NotImplementedError

    def submit(self, payloads: dict[int, Any], *, timeout: float) -> None:
        """Writes one execution's inputs (edge id to the tuple of input values)."""
        try:
            for edge_id, channel in self._inputs.items():
                channel.write(payloads[edge_id], timeout=timeout)
        except PeerDied as exc:
            raise self.dead_error(exc.index) from None

    def read_outputs(self, *, timeout: float) -> dict[int, Any]:
        """Reads the oldest unread execution's results (edge id to value).

        A timeout part-way keeps what was read, so the next call continues where this stopped.
        """
        deadline = time.perf_counter() + timeout
        try:
            for edge_id, channel in self._outputs.items():
                if edge_id not in self._partial:
                    left = max(0.0, deadline - time.perf_counter())
                    self._partial[edge_id] = channel.read(timeout=left)
        except PeerDied as exc:
            raise self.dead_error(exc.index) from None
        outputs, self._partial = self._partial, {}
        return outputs
