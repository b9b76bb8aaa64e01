"""The p2p demo: two local processes exchange tensors, every byte is checked, and a small
size / latency / bandwidth table is printed (NCCL between two GPUs, gloo on a CPU-only machine).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

__all__ = ["run_p2p_demo", "ProgressBar"]

_KIB = 1 << 10
_MIB = 1 << 20


class ProgressBar:
    """A one-line text progress bar (``[#####.....] 5/10 label``), redrawn in place on a
    terminal. Elsewhere (a log file, a pipe) it writes one plain line per new label and one at
    the end, since redrawing would leave every frame on a single line there."""

    def __init__(self, total: int, *, width: int = 30, stream: TextIO | None = None) -> None:
        if total < 1:
            raise ValueError(f"total must be >= 1, got {total}")
        self.total = total
        self.width = width
        self.done = 0
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self.redraws = bool(isatty()) if callable(isatty) else False
        self._label: str | None = None

    def advance(self, label: str = "") -> None:
        self.done = min(self.total, self.done + 1)
        filled = round(self.width * self.done / self.total)
        line = f"[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} {label}"
        if self.redraws:
            self.stream.write(f"\r{line:<{self.width + 40}}")
            if self.done == self.total:
                self.stream.write("\n")
        elif label != self._label or self.done == self.total:
            self.stream.write(line.rstrip() + "\n")
        self._label = label
        self.stream.flush()


def run_p2p_demo(
    *,
    device: str = "auto",
    sizes: Sequence[int] | None = None,
    iters: int = 5,
    timeout: float = 60.0,
    stream: TextIO | None = None,
) -> list[dict[str, Any]]:
    """Starts two local worker processes and exchanges tensors between them.

    Each size is sent rank 0 → rank 1 and back ``iters`` times, with fresh rank-encoded random
    data each time into poisoned buffers; every byte is compared. The table shows the median
    one-way time (half a round trip) and the bandwidth it implies.

    Args:
        device: ``"auto"`` (two GPUs if there are, else CPU), ``"cuda"`` or ``"cpu"``.
        sizes: message sizes in bytes (default 4 KiB … 64 MiB on GPU, … 4 MiB on CPU).
        iters: round trips per size.
        timeout: seconds for every transfer.
        stream: where the table goes (default stdout); the progress bar goes to stderr.

    Returns:
        One dict per size: ``bytes``, ``one_way_us``, ``gb_per_s``, ``checked_bytes``.

    Raises:
        ValueError: bad arguments (no two GPUs for ``"cuda"``, empty sizes, iters < 1).
        RuntimeError: a worker failed (a byte differed, a transfer failed); the message
            carries its traceback.
    """
    from tensorferry.p2p._launch import run_world
    from tensorferry.runtime._devices import cuda_device_count

    if device not in ("auto", "cuda", "cpu"):
        raise ValueError(f"device must be auto, cuda or cpu, got {device!r}")
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    two_gpus = cuda_device_count() >= 2
    if device == "cuda" and not two_gpus:
        raise ValueError("device='cuda' needs two CUDA devices")
    use_cuda = device == "cuda" or (device == "auto" and two_gpus)
    if sizes is None:
        top = 64 * _MIB if use_cuda else 4 * _MIB
        sizes = [4 * _KIB, 64 * _KIB]
        while sizes[-1] < top:
            sizes.append(sizes[-1] * 16 if sizes[-1] * 16 <= top else top)
    sizes = [int(s) for s in sizes]
    if not sizes or any(s < 4 or s % 4 for s in sizes):
        raise ValueError(f"sizes must be positive multiples of 4 bytes, got {sizes}")
    out = stream if stream is not None else sys.stdout
    backend = "nccl" if use_cuda else "gloo"
    print(f"p2p demo: 2 processes, {backend} on {'2 GPUs' if use_cuda else 'CPU'}", file=out)
    rows = run_world(_worker, list(sizes), iters, backend=backend, timeout=timeout)[0]
    header = f"{'size':>10}  {'one-way':>12}  {'bandwidth':>12}  checked"
    print(header, file=out)
    for row in rows:
        print(
            f"{_human(row['bytes']):>10}  {row['one_way_us']:>9.1f} µs  "
            f"{row['gb_per_s']:>7.3f} GB/s  {_human(row['checked_bytes'])} ok",
            file=out,
        )
    return rows


def _human(nbytes: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", _MIB), ("KiB", _KIB)):
        if nbytes >= size:
            return f"{nbytes / size:g} {unit}"
    return f"{nbytes} B"


def _worker(rank: int, world: int, sizes: list[int], iters: int) -> list[dict[str, Any]]:
    import statistics

    import torch

    import tensorferry.p2p as tf

    device = tf._context.current().device
    peer = 1 - rank
    bar = ProgressBar(len(sizes) * iters) if rank == 0 else None
    rows = []
    for size in sizes:
        numel = size // 4
        inbox = torch.empty(numel, dtype=torch.int32, device=device)
        times, checked = [], 0
        for it in range(iters + 1):  # the first round trip warms the pair up (not timed)
            gen = torch.Generator().manual_seed(size * 131 + it)
            data = torch.randint(-(2**31), 2**31 - 1, (numel,), generator=gen, dtype=torch.int32)
            mine = (data ^ rank).to(device)  # rank-encoded: a mirrored buffer cannot pass
            expect = (data ^ peer).to(device)
            inbox.fill_(-1)  # poisoned
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            if rank == 0:
                tf.send(mine, peer).wait()
                tf.recv(inbox, peer).wait()
            else:
                tf.recv(inbox, peer).wait()
                tf.send(mine, peer).wait()
            elapsed = time.perf_counter() - t0
            if not torch.equal(inbox, expect):
                bad = int((inbox != expect).sum())
                raise RuntimeError(f"{bad} of {numel} words differ at size {size} (rank {rank})")
            if it:
                times.append(elapsed / 2)
                checked += size
                if bar is not None:
                    bar.advance(_human(size))
        one_way = statistics.median(times)
        rows.append(
            {
                "bytes": size,
                "one_way_us": one_way * 1e6,
                "gb_per_s": size / one_way / 1e9,
                "checked_bytes": checked * 2,
            }
        )
    return rows
