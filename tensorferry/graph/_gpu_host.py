"""Results of a GPU actor on their way to host channels (see :mod:`._gpu`): written by the
actor's own thread once their compute event fired (:class:`HostWrites`), or by a writer
thread where channels cannot be polled (:class:`HostWriter`); and the pinned tensors that CUDA
results for the driver are copied into, reused per shape and dtype (:class:`PinnedResults`).
"""

from __future__ import annotations

import collections
import queue
import threading
from collections.abc import Callable
from typing import Any

import torch

from tensorferry.graph._channel import GraphStopped, PeerDied, wait_until

__all__ = ["EVENT_PAUSE_S", "FOREVER", "HostWriter", "HostWrites", "PinnedResults"]

FOREVER = 1e9
# Longest sleep while GPU work is in flight (after the spin): its end is expected soon, and each
# sleep adds its length to the latency of the result.
EVENT_PAUSE_S = 100e-6
# Reused pinned result tensors: per shape and dtype, and how many shapes and dtypes.
_PINNED_PER_LAYOUT = 4
_PINNED_LAYOUTS = 16


def _fired(event: torch.cuda.Event | None) -> bool:
    return event is None or event.query()


class HostWrites:
    """Results for host channels that wait for their compute event; written by the actor's thread.

    Only the actor's thread calls it (``submit`` and ``pump``), so a channel never has two writers
    and no lock is needed. Values keep their order per channel; channels are independent, so a
    full one (a same-GPU reader that is behind) holds back only its own values.
    """

    def __init__(self) -> None:
        self._queues: dict[Any, collections.deque] = {}
        self.pending = 0
        """Values not written yet, over all channels."""

    def submit(
        self,
        channel: Any,
        value: Any,
        event: torch.cuda.Event | None,
        written: Callable[[Any], None] | None = None,
    ) -> None:
        """``written(value)`` is called once the channel holds its own copy of ``value``."""
        held = self._queues.get(channel)
        if not held and _fired(event) and channel.writable():
            channel.write(value, timeout=FOREVER)  # a free slot: does not wait
            if written is not None:
                written(value)
            return
        if held is None:
            held = self._queues[channel] = collections.deque()
        held.append((value, event, written))
        self.pending += 1

    def pump(self) -> None:
        """Writes every value whose event fired and whose channel has room; never waits."""
        if not self.pending:
            return
        for channel, held in self._queues.items():
            while held:
                value, event, written = held[0]
                if not (_fired(event) and channel.writable()):
                    break
                held.popleft()
                self.pending -= 1
                channel.write(value, timeout=FOREVER)
                if written is not None:
                    written(value)

    def close(self) -> None:
        self._queues.clear()
        self.pending = 0


class HostWriter:
    """Writes GPU results into channels that cannot be polled, once their event fired.

    Same interface as :class:`HostWrites`; ``pending`` stays 0 because the actor's thread has
    nothing to pump.
    """

    pending = 0

    def __init__(self, device: torch.device, control: Any) -> None:
        self._device = device
        self._control = control
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
                if event is not None and not event.query():
                    # No spin: this thread would take turns at the GIL with the actor's thread.
                    wait_until(
                        event.query,
                        control=self._control,
                        timeout=FOREVER,
                        what="result for a host channel",
                        spin_s=0.0,
                        max_pause_s=EVENT_PAUSE_S,
                    )
                channel.write(value, timeout=FOREVER)
        except (GraphStopped, PeerDied):
            return
        except BaseException as exc:
            self.failure = exc

    def submit(
        self,
        channel: Any,
        value: Any,
        event: torch.cuda.Event | None,
        written: Callable[[Any], None] | None = None,
    ) -> None:
        # ``written`` is ignored: these channels may keep the value after their write returns.
        if self.failure is not None:
            raise self.failure
        self._queue.put((channel, value, event))

    def pump(self) -> None:
        pass

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=2.0)


class PinnedResults:
    """Pinned host tensors for CUDA results going to the driver, reused once written.

    A fresh pinned tensor per result (``torch.empty(pin_memory=True)``) cost the actor's thread
    more than the copy it serves: torch's pinned allocator looks at the events of its cached
    blocks on every request. A shared-memory channel copies a value into its slot when written,
    so the tensor is free again right after; other channels may keep it, so they get fresh ones.
    """

    def __init__(self) -> None:
        self._free: dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] = {}

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        free = self._free.get((shape, dtype))
        if free:
            return free.pop()
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def give_back(self, tensor: torch.Tensor) -> None:
        layout = (tuple(tensor.shape), tensor.dtype)
        if len(self._free) >= _PINNED_LAYOUTS and layout not in self._free:
            self._free.clear()  # results of ever new shapes: keep only the recent ones
        free = self._free.setdefault(layout, [])
        if len(free) < _PINNED_PER_LAYOUT:
            free.append(tensor)
