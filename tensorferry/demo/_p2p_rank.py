"""One rank of the p2p demo: round trips timed with tensorferry and with torch.distributed.

Both libraries move the same buffers between the same two ranks, in the same run, timed the
same way: the payloads are made on the device before any clock starts; every timed round trip
starts after a barrier and ends once the device finished it; the libraries take turns, each
going first every other round, so that neither always inherits the other's leftovers.
Every received buffer is poisoned before its round trip and compared, word for word, after it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["LIBRARIES", "POISON", "exchange", "payload"]

LIBRARIES = ("tensorferry", "torch")
POISON = -1
"""What a receive buffer holds before each transfer: never a payload word (those are >= 0)."""


def payload(numel: int, rank: int, device: torch.device) -> torch.Tensor:
    """``numel`` int32 words that only ``rank`` sends: the two ranks' payloads differ in every
    word, so a buffer that got its own rank's data, or none, fails the check."""
    index = torch.arange(numel, dtype=torch.int64, device=device)
    return ((index * 2_654_435_761 + (rank + 1) * 40_503) % (2**31 - 1)).to(torch.int32)


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def _tf_round_trip(rank: int, peer: int, mine: torch.Tensor, inbox: torch.Tensor) -> None:
    import tensorferry as tf

    if rank == 0:
        sent = tf.send(mine, peer)
        tf.recv(inbox, peer).wait()
        sent.wait()
        return
    got = tf.recv(inbox, peer)
    if mine.is_cuda:
        # The reply is ordered after the receive on the device, as NCCL orders torch's reply
        # after its receive on one stream: no host round trip in between for either library.
        got.wait_stream()
    else:
        got.wait()
    tf.send(mine, peer).wait()


def _torch_round_trip(rank: int, peer: int, mine: torch.Tensor, inbox: torch.Tensor) -> None:
    import torch.distributed as dist

    if rank == 0:
        dist.send(mine, peer)
        dist.recv(inbox, peer)
    else:
        dist.recv(inbox, peer)
        dist.send(mine, peer)


_ROUND_TRIPS: dict[str, Callable[[int, int, torch.Tensor, torch.Tensor], None]] = {
    "tensorferry": _tf_round_trip,
    "torch": _torch_round_trip,
}


def _timed_round_trip(library: str, rank: int, mine: torch.Tensor, inbox: torch.Tensor) -> float:
    """Seconds of one round trip, from a barrier (both ranks ready, nothing queued on the
    device) to the device's end of it."""
    import torch.distributed as dist

    cuda = mine.is_cuda
    inbox.fill_(POISON)
    _sync(cuda)
    dist.barrier()
    _sync(cuda)
    start = time.perf_counter()
    _ROUND_TRIPS[library](rank, 1 - rank, mine, inbox)
    _sync(cuda)
    return time.perf_counter() - start


def _check(library: str, inbox: torch.Tensor, expect: torch.Tensor, size: int, rank: int) -> None:
    if not torch.equal(inbox, expect):
        bad = int((inbox != expect).sum())
        raise RuntimeError(
            f"{library}: {bad} of {inbox.numel()} received words differ from what the peer sent "
            f"({size} bytes, rank {rank})"
        )


def _one_size(
    rank: int, size: int, device: torch.device, repeats: int, warmups: int, advance: Callable
) -> dict[str, Any]:
    numel = size // 4
    mine = payload(numel, rank, device)
    expect = payload(numel, 1 - rank, device)
    inbox = torch.empty(numel, dtype=torch.int32, device=device)
    times: dict[str, list[float]] = {name: [] for name in LIBRARIES}
    row: dict[str, Any] = {"bytes": size}
    for library in LIBRARIES:
        row[f"{library}_checked_bytes"] = 0
    for round_index in range(warmups + repeats):
        order = LIBRARIES if round_index % 2 == 0 else LIBRARIES[::-1]
        for library in order:
            seconds = _timed_round_trip(library, rank, mine, inbox)
            _check(library, inbox, expect, size, rank)  # warm-ups too
            if round_index >= warmups:
                times[library].append(seconds)
                row[f"{library}_checked_bytes"] += size
        advance()
    for library in LIBRARIES:
        one_way = statistics.median(times[library]) / 2
        row[f"{library}_us"] = one_way * 1e6
        row[f"{library}_gb_per_s"] = size / one_way / 1e9
    return row


def exchange(
    rank: int,
    world: int,
    sizes: list[int],
    repeats: int,
    warmups: int,
    cuda: bool,
    timeout_s: float,
) -> dict[str, Any]:
    """Runs on every rank after ``tf.init`` (``p2p._launch.run_world``); the world is 2 ranks,
    on the CPU or (``cuda``) on the GPU ``tf.init`` made current.

    Returns ``{"rank", "rows"}``: per size the one-way time (half the median round trip,
    rank 0's clock) and GB/s of each library, and the bytes each library moved and were checked
    in the timed round trips, both ranks' together (``<library>_checked_bytes``).
    """
    import torch.distributed as dist

    from tensorferry.demo._progress import ProgressBar
    from tensorferry.demo._sizes import human_size
    from tensorferry.p2p._launch import torch_group

    if world != 2:
        raise ValueError(f"the p2p demo runs on 2 ranks, got {world}")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    bar = ProgressBar(len(sizes) * (warmups + repeats)) if rank == 0 else None
    rows = []
    with torch_group("tensorferry-demo/torch", timeout_s):
        for size in sizes:
            label = human_size(size)
            advance = (lambda label=label: bar.advance(label)) if bar else (lambda: None)
            rows.append(_one_size(rank, size, device, repeats, warmups, advance))
        keys = [f"{library}_checked_bytes" for library in LIBRARIES]
        counts = torch.tensor([[row[key] for key in keys] for row in rows], device=device)
        dist.all_reduce(counts)  # the peer's checks count too
    for row, both in zip(rows, counts.tolist(), strict=True):
        row.update(zip(keys, both, strict=True))
    return {"rank": rank, "rows": rows}
