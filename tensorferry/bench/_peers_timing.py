"""How ``tensorferry bench peers`` times one row of one contender, the same way for each.

Each iteration: the contents are written and the receive buffers poisoned, the device is
synchronised, and both ranks meet at a barrier on a gloo group of their own (which also tells
each rank whether the other has failed). Then rank 0 (the sender) takes the start time, each
rank does its part, waits for it and synchronises the device (so the data is usable), and
takes its done time. The received bytes are checked after that, outside the timed region.
When all iterations ran, the ranks exchange their times: both run on one host, on the same
monotonic clock, so an iteration's time is the later done time of the two minus the sender's
start.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["Case", "Outcome", "iteration_times_ns", "median_us", "time_case"]

# Outcomes of one rank, agreed at every barrier (the largest wins).
_RUNNING, _FAILED, _WRONG_BYTES = 0, 1, 2


@dataclasses.dataclass
class Case:
    """One contender's part of one row on this rank.

    Attributes:
        prepare: writes iteration ``n``'s contents and poisons the receive buffers (untimed).
        run: does this rank's part of iteration ``n`` and waits for it (timed).
        check: what is wrong with iteration ``n``'s received bytes, or ``None`` (untimed).
    """

    prepare: Callable[[int], None]
    run: Callable[[int], None]
    check: Callable[[int], str | None]


@dataclasses.dataclass
class Outcome:
    """What one row of one contender came to, the same on both ranks.

    Attributes:
        times_ns: each timed iteration's time (empty unless every iteration ran).
        failure: why the contender did not finish the row, if it did not.
        wrong_bytes: what a check found wrong, if one did: this voids the whole run.
    """

    times_ns: list[int]
    failure: str | None = None
    wrong_bytes: str | None = None


def time_case(
    case: Case,
    *,
    rank: int,
    warmup: int,
    iters: int,
    sync_device: Callable[[], None],
    control: Any,
) -> Outcome:
    """Runs ``warmup`` then ``iters`` timed iterations of ``case`` on this rank (rank 0 sends),
    meeting the peer on the gloo group ``control`` before each; see the module docstring."""
    import torch.distributed as dist

    starts: list[int] = []
    dones: list[int] = []
    state, message = _RUNNING, ""
    for iteration in range(warmup + iters):
        if state == _RUNNING:
            try:
                case.prepare(iteration)
                sync_device()
            except Exception:
                state, message = _FAILED, _last_line(traceback.format_exc())
        if _worst(state, control) != _RUNNING:
            break
        start = time.perf_counter_ns()
        try:
            case.run(iteration)
            sync_device()
            done = time.perf_counter_ns()
            problem = case.check(iteration)
        except Exception:
            state, message = _FAILED, _last_line(traceback.format_exc())
            continue  # to the barrier, which tells the peer
        if problem is not None:
            state, message = _WRONG_BYTES, f"rank {rank}, iteration {iteration}: {problem}"
            continue
        if iteration >= warmup:
            starts.append(start)
            dones.append(done)
    # Both ranks are here after the same number of barriers: either every iteration ran on
    # both, or both saw the same failure at the same barrier. The states of the last runs
    # travel with the times.
    gathered: list[Any] = [None, None]
    dist.all_gather_object(gathered, (state, message, starts, dones), group=control)
    wrong = [m for s, m, _, _ in gathered if s == _WRONG_BYTES]
    if wrong:
        return Outcome([], wrong_bytes="; ".join(wrong))
    failed = [f"rank {r}: {m}" for r, (s, m, _, _) in enumerate(gathered) if s == _FAILED]
    if failed:
        return Outcome([], failure="; ".join(failed))
    sender, receiver = gathered[0], gathered[1]
    return Outcome(iteration_times_ns(sender[2], [sender[3], receiver[3]]))


def _worst(state: int, control: Any) -> int:
    """The barrier before an iteration: both ranks' states, the worst of them for both."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([state], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=control)
    return int(flag.item())


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "failed"


def iteration_times_ns(starts: Sequence[int], dones: Sequence[Sequence[int]]) -> list[int]:
    """Each iteration's time: the latest of the ranks' done times minus the sender's start.

    Args:
        starts: the sender's start of each timed iteration (ns, one host's monotonic clock).
        dones: per rank, its done time of each timed iteration.
    """
    return [max(ends) - start for start, *ends in zip(starts, *dones, strict=True)]


def median_us(times_ns: Sequence[int]) -> float:
    """The median of ``times_ns``, in microseconds."""
    if not times_ns:
        raise ValueError("no times to take the median of")
    return statistics.median(times_ns) / 1e3
