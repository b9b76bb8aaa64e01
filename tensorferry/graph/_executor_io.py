"""What every executor does the same way on the driver's side: write one execution's inputs
and read the oldest execution's results over its channels.

An executor sets ``_inputs`` and ``_outputs`` (edge id to a channel with ``write(value,
timeout=)`` / ``read(timeout=)``), starts ``_partial`` empty, and defines
``dead_error(index)``; channels raise ``PeerDied`` when the actor at the other end is gone.
"""

from __future__ import annotations

import time
from typing import Any

from tensorferry.errors import ActorDiedError
from tensorferry.graph._channel import PeerDied

__all__ = ["DriverIO"]


class DriverIO:
    """Mixin: ``submit`` and ``read_outputs`` over the driver's channels."""

    _inputs: dict[int, Any]
    _outputs: dict[int, Any]
    _partial: dict[int, Any]

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
