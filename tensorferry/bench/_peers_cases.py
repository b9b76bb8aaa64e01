"""The buffers of each row of ``tensorferry bench peers`` and what torch.distributed and
tensorferry do with them.

Rank 0 sends, rank 1 receives (in the round trip rank 1 sends the received tensor back; in
the pipeline rank 0 is stage 0). Each row's buffers are made once and shared by every
contender, so all of them move the very same memory. tensorferry is used through its public
calls only: ``tf.send``, ``tf.recv``, ``tf.batch`` and the :class:`~tensorferry.Transfer` they
return. The floor rows run here too: the pipeline's compute alone, and the timing alone (no
buffers at all).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from tensorferry.bench._peers_payload import Payload, poison
from tensorferry.bench._peers_plan import NOTHING_MOVED, Row
from tensorferry.bench._peers_timing import Case

__all__ = [
    "Workspace",
    "compute_only_case",
    "consume",
    "nothing_moved_case",
    "produce",
    "tensorferry_case",
    "torch_case",
]

# The pipeline's activations, stage 0's inputs and every other row's payload are written by
# rank 0; the round trip's echo is checked against what rank 0 sent too.
_SENDER = 0


class Workspace:
    """One row's buffers on this rank (rank 0 sends), shared by every contender.

    Attributes:
        row: the row.
        out: the tensors this rank sends (rank 0; in the round trip rank 1 sends ``into``).
        into: the tensors this rank receives into (rank 1; in the round trip rank 0 too).
        inputs: stage 0's microbatches, made into ``out`` by matmuls (pipeline rows).
        weight: the pipeline's square weight: the identity, so activations stay checkable.
        arenas: the flat buffers ``out`` and ``into`` are views of (for registration).
        payload: writes and checks the contents (``None`` for the timing alone: no buffers).
    """

    def __init__(self, row: Row, rank: int, device: Any) -> None:
        import torch

        self.row, self.rank = row, rank
        dtype = torch.bfloat16 if row.dtype == "bfloat16" else torch.uint8
        numel = math.prod(row.shape)
        pipeline = row.weight_side > 0
        # The timing alone moves nothing, so it needs no buffers (nor anything to register).
        moves = row.floor != NOTHING_MOVED
        self.payload = Payload(row.count, numel, dtype, device, values=pipeline) if moves else None
        sends = moves and rank == _SENDER
        receives = moves and (rank != _SENDER or row.key == "roundtrip")
        self._out = self._arena(sends, row, dtype, device)
        self._into = self._arena(receives, row, dtype, device)
        self._inputs = self._arena(pipeline and sends, row, dtype, device)
        self.out, self.into, self.inputs = (
            self._views(a) for a in (self._out, self._into, self._inputs)
        )
        self.weight = torch.eye(row.weight_side, dtype=dtype, device=device) if pipeline else None
        self.arenas = [a for a in (self._out, self._into) if a is not None]

    @staticmethod
    def _arena(needed: bool, row: Row, dtype: Any, device: Any) -> Any:
        """A flat buffer for all of the row's tensors, or ``None`` where this rank needs none."""
        import torch

        if not needed:
            return None
        return torch.empty(row.count * math.prod(row.shape), dtype=dtype, device=device)

    def _views(self, arena: Any) -> list[Any]:
        """The row's tensors in ``arena``: contiguous, one after another."""
        if arena is None:
            return []
        return list(arena.view(self.row.count, *self.row.shape).unbind(0))

    def prepare(self, iteration: int) -> None:
        """Writes rank 0's contents of ``iteration`` and poisons the buffers it lands in."""
        if self.payload is None:
            return  # the timing alone: no buffers to write or poison
        pipeline = self.row.weight_side > 0
        if self.rank == _SENDER:
            self.payload.write(self._inputs if pipeline else self._out, _SENDER, iteration)
            if pipeline:
                poison(self._out)  # made by the matmuls: a send before them shows as poison
        if self._into is not None:
            if self.row.compute_only:  # stage 1 of the floor computes as if it had received
                self.payload.write(self._into, _SENDER, iteration)
            else:
                poison(self._into)

    def check(self, iteration: int) -> str | None:
        """What is wrong with this rank's received bytes of ``iteration`` (``None``: nothing).
        The pipeline's floor checks stage 0's matmul outputs instead: the identity must keep
        them."""
        if self.payload is None:
            return None  # the timing alone received nothing, so there is nothing to check
        if self.row.compute_only:
            arena = self._out if self.rank == _SENDER else None
        else:
            arena = self._into
        return None if arena is None else self.payload.problem(arena, _SENDER, iteration)


def produce(ws: Workspace, microbatch: int) -> None:
    """Stage 0's compute of one microbatch: its matmuls, the last one into ``ws.out``."""
    import torch

    hidden = ws.inputs[microbatch]
    for _ in range(ws.row.matmuls - 1):
        hidden = hidden @ ws.weight
    torch.matmul(hidden, ws.weight, out=ws.out[microbatch])


def consume(ws: Workspace, microbatch: int) -> None:
    """Stage 1's compute of one received microbatch (its result is not needed)."""
    hidden = ws.into[microbatch]
    for _ in range(ws.row.matmuls):
        hidden = hidden @ ws.weight


def _case(ws: Workspace, run: Callable[[int], None]) -> Case:
    return Case(prepare=ws.prepare, run=run, check=ws.check)


def compute_only_case(ws: Workspace) -> Case:
    """The pipeline's floor: each stage's matmuls of every microbatch, no transfer at all."""

    def run(iteration: int) -> None:
        for microbatch in range(ws.row.count):
            (produce if ws.rank == _SENDER else consume)(ws, microbatch)

    return _case(ws, run)


def nothing_moved_case(ws: Workspace) -> Case:
    """The floor of the 4 KiB rows: each rank's timed part does nothing. What is left is what
    the timing itself costs (barrier exit skew between the ranks, the device sync, the clock
    reads), which every contender's time includes too."""

    def run(iteration: int) -> None:
        pass  # the harness syncs the device and reads the clock around this, as for any case

    return _case(ws, run)


def torch_case(ws: Workspace, settle: Callable[[], None]) -> Case:
    """``torch.distributed`` on its default group (NCCL on GPUs, gloo on the CPU).

    Args:
        ws: the row's buffers.
        settle: synchronises the device (between the round trip's two calls).
    """
    import torch.distributed as dist

    key, peer, sends = ws.row.key, 1 - ws.rank, ws.rank == _SENDER

    def wait_all(works: list[Any]) -> None:
        for work in works:
            work.wait()

    def one_group(it: int) -> None:
        op, tensors = (dist.isend, ws.out) if sends else (dist.irecv, ws.into)
        wait_all(dist.batch_isend_irecv([dist.P2POp(op, t, peer) for t in tensors]))

    def one_tensor(it: int) -> None:
        (dist.isend(ws.out[0], peer) if sends else dist.irecv(ws.into[0], peer)).wait()

    def separate(it: int) -> None:
        if sends:
            wait_all([dist.isend(t, peer) for t in ws.out])
        else:
            wait_all([dist.irecv(t, peer) for t in ws.into])

    def round_trip(it: int) -> None:
        if sends:
            dist.isend(ws.out[0], peer).wait()
            settle()
            dist.irecv(ws.into[0], peer).wait()
        else:
            dist.irecv(ws.into[0], peer).wait()
            settle()
            dist.isend(ws.into[0], peer).wait()

    def pipeline(it: int) -> None:
        count = ws.row.count
        if sends:
            works = []
            for microbatch in range(count):
                produce(ws, microbatch)
                works.append(dist.isend(ws.out[microbatch], peer))
            wait_all(works)
            return
        pending = dist.irecv(ws.into[0], peer)
        for microbatch in range(count):
            ahead = dist.irecv(ws.into[microbatch + 1], peer) if microbatch + 1 < count else None
            pending.wait()
            consume(ws, microbatch)
            pending = ahead

    runs = {"kv": one_group, "batch": one_group, "large": one_tensor, "small": one_tensor}
    runs |= {"separate": separate, "roundtrip": round_trip, "pipeline": pipeline}
    return _case(ws, runs[key])


def tensorferry_case(ws: Workspace, settle: Callable[[], None], timeout_s: float) -> Case:
    """tensorferry's public calls, default transport (``"auto"``), ``static=False``.

    Args:
        ws: the row's buffers.
        settle: synchronises the device (between the round trip's two calls).
        timeout_s: bound of each wait.
    """
    import tensorferry as tf

    key, peer, sends = ws.row.key, 1 - ws.rank, ws.rank == _SENDER

    def wait_all(transfers: list[Any]) -> None:
        for transfer in transfers:
            transfer.wait(timeout_s)

    def one_message(it: int) -> None:  # a list is one message
        if sends:
            tf.send(ws.out if key == "kv" else ws.out[0], peer).wait(timeout_s)
        else:
            tf.recv(ws.into if key == "kv" else ws.into[0], peer).wait(timeout_s)

    def separate(it: int) -> None:
        if sends:
            wait_all([tf.send(t, peer) for t in ws.out])
        else:
            wait_all([tf.recv(t, peer) for t in ws.into])

    def batch(it: int) -> None:
        with tf.batch() as group:
            for tensor in ws.out if sends else ws.into:
                if sends:
                    group.send(tensor, peer)
                else:
                    group.recv(tensor, peer)
        group.wait(timeout_s)

    def round_trip(it: int) -> None:
        if sends:
            tf.send(ws.out[0], peer).wait(timeout_s)
            settle()
            tf.recv(ws.into[0], peer).wait(timeout_s)
        else:
            tf.recv(ws.into[0], peer).wait(timeout_s)
            settle()
            tf.send(ws.into[0], peer).wait(timeout_s)

    def pipeline(it: int) -> None:
        count = ws.row.count
        if sends:
            transfers = []
            for microbatch in range(count):
                produce(ws, microbatch)
                transfers.append(tf.send(ws.out[microbatch], peer))
            wait_all(transfers)
            return
        pending = tf.recv(ws.into[0], peer)
        for microbatch in range(count):
            ahead = tf.recv(ws.into[microbatch + 1], peer) if microbatch + 1 < count else None
            # On GPUs the compute stream waits, not this thread (as torch's NCCL wait()); on
            # the CPU this is wait().
            pending.wait_stream(timeout=timeout_s)
            consume(ws, microbatch)
            pending = ahead

    runs = {"kv": one_message, "large": one_message, "small": one_message, "batch": batch}
    runs |= {"separate": separate, "roundtrip": round_trip, "pipeline": pipeline}
    return _case(ws, runs[key])
