"""The p2p layer's CUDA streams: one per direction of a pair.

A stream runs its work in order, and an NCCL kernel of a message larger than NCCL's buffers
finishes only once its peer's matching kernel runs. With one send stream per process, a send
issued ahead to rank 1 held every later send to another rank until rank 1 received: a program
in which rank 1 receives only after a message that follows a send to rank 2 waited for ever
(until its timeout), and so did receives issued ahead from two peers. Over NCCL on three ranks,
``send_behind_a_send_its_peer_receives_later`` and ``receive_behind_a_receive_its_peer_sends_later``
(tests/p2p/_cases.py) both timed out so. torch's ``isend``/``irecv`` run each pair on a stream of
its own.

Here each direction, ``(kind, peer)`` with kind ``"send"`` or ``"recv"``, has its own stream,
leased from the runtime's stream pool when it first carries a message (or at ``tf.prepare``)
and given back at shutdown. A message then waits on the device only for the earlier messages of
its own direction, which its peer issues in that same order anyway. A unit that spans several
directions (a batch) runs on its first direction's stream, ordered after the earlier work of
the others and they after it (:meth:`DirectionStreams.order_span`), so each direction's work
stays in issue order whichever stream carried it.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from tensorferry.runtime import stream_pool
from tensorferry.runtime._events import record_on_stream, recycle, stream_wait
from tensorferry.runtime._streams import Stream, StreamKey

__all__ = ["DirectionStreams"]


class DirectionStreams:
    """The streams of one device's directions. :meth:`get` is called under the engine's lock
    for every CUDA unit; leasing (the first use of a direction) takes a lock of its own, since
    ``tf.prepare`` leases from the caller's thread."""

    def __init__(self, device: torch.device) -> None:
        self._key = StreamKey(device.index)
        self._streams: dict[tuple[str, int], Any] = {}
        self._leases: list[Stream] = []
        self._lock = threading.Lock()

    def get(self, kind: str, peer: int) -> Any:
        """The ``torch`` stream of messages of ``kind`` with ``peer``."""
        stream = self._streams.get((kind, peer))
        return stream if stream is not None else self._lease(kind, peer)

    def _lease(self, kind: str, peer: int) -> Any:
        with self._lock:
            stream = self._streams.get((kind, peer))
            if stream is None:
                lease = stream_pool().acquire(self._key)
                self._leases.append(lease)
                stream = self._streams[(kind, peer)] = lease.torch
            return stream

    @staticmethod
    def order_span(stream: Any, others: list[Any]) -> None:
        """Before a unit spanning several directions is issued on ``stream``: orders it after
        the work already queued on the other directions' streams."""
        for other in others:
            event = record_on_stream(other)
            stream_wait(stream, event)
            recycle(event)  # its wait is enqueued

    @staticmethod
    def follow_span(done: torch.cuda.Event, others: list[Any]) -> None:
        """After it: the other directions' later work waits for the unit (``done``)."""
        for other in others:
            stream_wait(other, done)

    def close(self) -> None:
        """Gives every leased stream back to the pool (which waits for it to go idle)."""
        with self._lock:
            leases, self._leases = self._leases, []
            self._streams.clear()
        if leases:
            stream_pool().release_many(leases)
