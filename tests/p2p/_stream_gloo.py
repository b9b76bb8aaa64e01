"""Gloo with NCCL's stream order, on the CPU: a test transport that hangs where NCCL does.

NCCL's kernels run in the order they were queued on their CUDA stream, and the p2p layer
queues all of a process's sends on one stream and all its receives on another
(``P2PContext.issue``). A send does not finish before its peer posted the matching receive, so
a send issued ahead to one peer holds up every later send of the process, to any peer, until
that peer receives. ``docs/transfers.md`` ("Sends and receives issued ahead, with several
peers") describes the hang that follows; it was measured with three ranks over NCCL on one
GPU.

``gloo-stream`` reproduces that order over gloo: each process has one lane for units with a
send and one for units that only receive, as ``P2PContext.issue`` picks streams, and a lane
starts a unit's gloo work only once the unit before it on the lane finished. A gloo send, like
NCCL's, finishes only once the peer posted the receive. Agreed static messages are issued
ahead of the peer's header, as over NCCL (``static_speculates``); ``gloo-stream-not-ahead``
waits for it, as NCCL does with ``TENSORFERRY_NCCL_SPECULATE=0``.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from tensorferry import envs
from tensorferry.p2p._gloo import GlooTransport
from tensorferry.p2p._transport import P2POp, PendingOps, TransportContext

__all__ = ["StreamOrderedGloo", "StreamOrderedGlooAhead"]

_POLL_S = 1e-3


class _Queued(PendingOps):
    """A unit's gloo work, started by its lane once the lane's previous unit finished."""

    def __init__(self, begin: Callable[[], PendingOps], after: list[_Queued]) -> None:
        self._begin = begin
        self._after = after
        self._inner: PendingOps | None = None
        self._error: BaseException | None = None
        self._aborted = False
        self._finished = threading.Event()

    def run(self) -> None:
        """On the lane's thread: starts the work, once the units it comes ``after`` (on its
        communicators) finished, and returns once it finished or failed."""
        try:
            for unit in self._after:
                while not (self._aborted or unit._finished.wait(_POLL_S)):
                    pass
            self._after = []  # (or every unit would keep the ones before it alive)
            if self._aborted:
                return
            self._inner = self._begin()
            while not self._aborted and not self._inner.ready():
                time.sleep(_POLL_S)
        except BaseException as exc:  # the transfer's error, reported by ready()
            self._error = exc
        finally:
            self._finished.set()

    def ready(self) -> bool:
        if self._error is not None:
            raise self._error
        return self._finished.is_set() and self._inner is not None and self._inner.ready()

    def abort(self) -> None:
        self._aborted = True
        inner = self._inner
        if inner is not None:
            inner.abort()


class _Lane:
    """Runs queued units one after another on a thread of its own: one CUDA stream's order."""

    def __init__(self, name: str) -> None:
        self._units: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name=f"test-lane-{name}", daemon=True).start()

    def submit(self, unit: _Queued) -> None:
        self._units.put(unit)

    def _run(self) -> None:
        while True:
            self._units.get().run()


_lanes: dict[str, _Lane] = {}
_lanes_lock = threading.Lock()
_last: dict[tuple[int, str], _Queued] = {}  # the last unit of each (peer, kind) direction


def _lane(name: str) -> _Lane:
    with _lanes_lock:
        lane = _lanes.get(name)
        if lane is None:
            lane = _lanes[name] = _Lane(name)
        return lane


class StreamOrderedGloo(GlooTransport):
    """Gloo whose units go one after another per lane, as NCCL's do on their streams."""

    name = "gloo-stream"
    static_skips_headers = False

    def __init__(self, ctx: TransportContext) -> None:
        super().__init__(ctx)
        self.static_speculates = self._speculates(ctx.world_size)

    @staticmethod
    def _speculates(world_size: int) -> bool:
        return envs.nccl_speculate(world_size)  # as NcclTransport decides

    def start(self, ops: Sequence[P2POp], *, stream: Any = None) -> PendingOps:
        # The stream P2PContext.issue would pick for a CUDA unit: one with a send goes on the
        # send stream. And a unit starts only after the last one on each of its directions (a
        # pair's direction is a communicator of its own): gloo matches a direction's posts in
        # the order they are made, and an NCCL communicator runs its operations in the order
        # they were issued, whatever streams they went on (what tensorferry/graph/_nccl.py's
        # one communicator per direction rests on too). Without this, a receive in a batch
        # with a send (send lane) and the next lone receive from that peer (receive lane) took
        # each other's bytes.
        kind = "send" if any(op.kind == "send" for op in ops) else "recv"
        directions = {(op.peer, op.kind) for op in ops}
        with _lanes_lock:
            after = [_last[d] for d in directions if d in _last]
            unit = _Queued(lambda: GlooTransport.start(self, ops, stream=stream), after)
            for direction in directions:
                _last[direction] = unit
        _lane(kind).submit(unit)
        return unit


class StreamOrderedGlooAhead(StreamOrderedGloo):
    """``gloo-stream`` issuing agreed static messages ahead of the peer's header whatever the
    world's size."""

    name = "gloo-stream-ahead"

    @staticmethod
    def _speculates(world_size: int) -> bool:
        return True
