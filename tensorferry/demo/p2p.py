"""The p2p demo: two local processes exchange tensors with tensorferry and with
torch.distributed, same sizes, same timing, in the same run; every byte is checked.

NCCL between two GPUs when there are, gloo over loopback on the CPU otherwise. How a round trip
is timed and checked: :mod:`tensorferry.demo._p2p_rank`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from tensorferry.demo._p2p_rank import LIBRARIES, exchange
from tensorferry.demo._sizes import human_size

__all__ = ["run_p2p_demo", "CPU_MEANING"]

_KIB = 1 << 10
_MIB = 1 << 20

CPU_MEANING = (
    "CPU numbers: both libraries move bytes with gloo over loopback TCP between two processes "
    "of this host, so they show each library's cost per call, not a GPU link's speed; GPU "
    "numbers come from this demo on a machine with 2 GPUs."
)


def _default_sizes(cuda: bool) -> list[int]:
    if cuda:
        return [4 * _KIB, 64 * _KIB, _MIB, 16 * _MIB, 64 * _MIB, 256 * _MIB]
    return [4 * _KIB, 64 * _KIB, _MIB, 4 * _MIB]


def run_p2p_demo(
    *,
    device: str = "auto",
    sizes: Sequence[int] | None = None,
    iters: int | None = None,
    warmups: int | None = None,
    timeout: float = 120.0,
    stream: TextIO | None = None,
    chart: str | Path | None = None,
) -> list[dict[str, Any]]:
    """Starts two local worker processes; times and checks round trips of each size with
    tensorferry (``tf.send``/``tf.recv``, transport ``auto``) and with ``torch.distributed``
    (``send``/``recv`` on its default group); prints the table.

    Args:
        device: ``"auto"`` (two GPUs if there are, else CPU), ``"cuda"`` or ``"cpu"``.
        sizes: message sizes in bytes (default 4 KiB … 256 MiB on GPUs, … 4 MiB on the CPU).
        iters: timed round trips per size and library (default 50 on GPUs, 20 on the CPU).
        warmups: untimed round trips before them (default 5 on GPUs, 3 on the CPU).
        timeout: seconds for every transfer.
        stream: where the table goes (default stdout); the progress bar goes to stderr.
        chart: a PNG to draw the table into (needs matplotlib; without it a line says so).

    Returns:
        One dict per size: ``bytes``; ``tensorferry_us``, ``torch_us`` (one way: half the
        median round trip); ``tensorferry_gb_per_s``, ``torch_gb_per_s``;
        ``tensorferry_checked_bytes``, ``torch_checked_bytes`` (bytes each library moved in the
        timed round trips, both ranks' together, every one compared); ``one_way_us``,
        ``gb_per_s`` and ``checked_bytes``: tensorferry's again.

    Raises:
        ValueError: bad arguments (no two GPUs for ``"cuda"``, sizes not multiples of 4 bytes,
            iters < 1).
        RuntimeError: a worker failed (a byte differed, a transfer failed); the message
            carries its traceback.
    """
    from tensorferry.p2p._launch import run_world
    from tensorferry.runtime._devices import cuda_device_count

    if device not in ("auto", "cuda", "cpu"):
        raise ValueError(f"device must be auto, cuda or cpu, got {device!r}")
    two_gpus = cuda_device_count() >= 2
    if device == "cuda" and not two_gpus:
        raise ValueError("device='cuda' needs two CUDA devices")
    cuda = device == "cuda" or (device == "auto" and two_gpus)
    sizes = _default_sizes(cuda) if sizes is None else [int(s) for s in sizes]
    if not sizes or any(s < 4 or s % 4 for s in sizes):
        raise ValueError(f"sizes must be positive multiples of 4 bytes, got {sizes}")
    iters = iters if iters is not None else (50 if cuda else 20)
    warmups = warmups if warmups is not None else (5 if cuda else 3)
    if iters < 1 or warmups < 0:
        raise ValueError(f"iters must be >= 1 and warmups >= 0, got {iters} and {warmups}")
    out = stream if stream is not None else sys.stdout
    backend = "nccl" if cuda else "gloo"
    where = "2 GPUs" if cuda else "the CPU"
    print(
        f"p2p: 2 processes on {where}; tensorferry (tf.send/tf.recv, transport auto) beside "
        f"torch.distributed (send/recv, {backend})",
        file=out,
        flush=True,
    )
    args = (list(sizes), iters, warmups, cuda, timeout)
    results = run_world(exchange, *args, backend=backend, timeout=timeout)
    mine = results[0]
    if mine["rank"] != 0:  # under torchrun: rank 0 prints
        return []
    rows = [_with_compat_keys(row) for row in mine["rows"]]
    _print_table(rows, iters, warmups, out)
    if not cuda:
        print(CPU_MEANING, file=out)
    if chart is not None:
        _draw(rows, Path(chart), f"one way, 2 processes on {where} ({backend})", out)
    return rows


def _with_compat_keys(row: dict[str, Any]) -> dict[str, Any]:
    """The row with the keys the first version of this demo returned: tensorferry's."""
    return {
        **row,
        "one_way_us": row["tensorferry_us"],
        "gb_per_s": row["tensorferry_gb_per_s"],
        "checked_bytes": row["tensorferry_checked_bytes"],
    }


def _faster(tf_us: float, torch_us: float) -> str:
    if tf_us <= torch_us:
        return f"tensorferry {torch_us / tf_us:.2f}×"
    return f"torch {tf_us / torch_us:.2f}×"


def _print_table(rows: list[dict[str, Any]], iters: int, warmups: int, out: TextIO) -> None:
    print(
        f"one way = half the median of {iters} round trips (after {warmups} warm-ups), each "
        "timed from a barrier to the device's end of it",
        file=out,
    )
    print(
        f"{'size':>9}  {'tensorferry':>12}  {'torch':>12}  {'tf GB/s':>8}  {'torch GB/s':>10}"
        f"  {'faster':<17}  bytes",
        file=out,
    )
    for row in rows:
        print(
            f"{human_size(row['bytes']):>9}  {row['tensorferry_us']:>9.1f} µs  "
            f"{row['torch_us']:>9.1f} µs  {row['tensorferry_gb_per_s']:>8.3f}  "
            f"{row['torch_gb_per_s']:>10.3f}  "
            f"{_faster(row['tensorferry_us'], row['torch_us']):<17}  checked ok",
            file=out,
        )
    checked = {name: sum(row[f"{name}_checked_bytes"] for row in rows) for name in LIBRARIES}
    print(
        f"bytes checked: {human_size(checked['tensorferry'])} moved by tensorferry and "
        f"{human_size(checked['torch'])} by torch, every word compared with what the peer sent "
        "(receive buffers poisoned before each transfer, each rank's payload its own; "
        "warm-ups checked too)",
        file=out,
    )


def _draw(rows: list[dict[str, Any]], path: Path, title: str, out: TextIO) -> None:
    from tensorferry.demo._chart import write_p2p_chart

    try:
        written = write_p2p_chart(rows, path, title)
    except ImportError:
        print("chart: matplotlib is not installed, so no chart is drawn", file=out)
        return
    print(f"chart: {written}", file=out)
