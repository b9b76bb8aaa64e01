"""``tensorferry bench lifecycle``: what a Client's create+close cycle costs, pooled vs unpooled.

Test suites and serving processes make and drop clients thousands of times. With the stream pool
a cycle leases and returns streams; with pooling off it creates and destroys them.
"""

from __future__ import annotations

import argparse
import statistics
import time

from tensorferry.cli._args import add_bench_output_arguments, positive_int

__all__ = ["add_arguments", "run"]


def _streams_per_device(text: str) -> int:
    from tensorferry.runtime.client import STREAM_ROLES

    count = positive_int(text)
    if count < len(STREAM_ROLES):
        raise argparse.ArgumentTypeError(
            f"must be at least {len(STREAM_ROLES)} (one stream per role), got {text!r}"
        )
    return count


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cycles", type=positive_int, default=1000, help="create+close cycles per mode"
    )
    parser.add_argument(
        "--streams-per-device",
        type=_streams_per_device,
        default=14,
        help="streams each client holds (at least one per stream role: 6)",
    )
    parser.add_argument(
        "--devices", default="all", help="'all' (every CUDA device, else the CPU) or e.g. '0,1'"
    )
    add_bench_output_arguments(parser, "lifecycle")


def _devices(spec: str) -> list:
    from tensorferry.bench._devices import cuda_device_count

    if spec == "all":
        count = cuda_device_count()
        return list(range(count)) or ["cpu"]
    return [int(d) if d.isdigit() else d for d in spec.split(",")]


def _measure(devices: list, config, cycles: int, *, use_streams: bool) -> dict[str, float]:
    import tensorferry as tf

    create_s, close_s = [], []
    for _ in range(cycles):
        t0 = time.perf_counter()
        client = tf.Client(devices, config=config)
        t1 = time.perf_counter()
        if use_streams:  # hand every stream out, so close() must check each one is idle
            for device in client.devices:
                for streams in client.streams(device).values():
                    for stream in streams:
                        _ = stream.torch
        t_close = time.perf_counter()
        client.close()
        t2 = time.perf_counter()
        create_s.append(t1 - t0)
        close_s.append(t2 - t_close)
    total = [a + b for a, b in zip(create_s, close_s, strict=True)]
    return {
        "create_us": statistics.median(create_s) * 1e6,
        "close_us": statistics.median(close_s) * 1e6,
        "cycle_us": statistics.median(total) * 1e6,
        "mean_cycle_us": statistics.fmean(total) * 1e6,
    }


def run(args: argparse.Namespace) -> int:
    import tensorferry as tf
    from tensorferry.bench._report import environment, report

    if args.cycles < 1:
        raise SystemExit("--cycles must be >= 1")
    devices = _devices(args.devices)
    try:
        tf.Client(devices).close()  # the devices are checked before anything is timed
    except (TypeError, ValueError) as exc:
        raise SystemExit(f"--devices {args.devices!r}: {exc}") from None
    rows = []
    modes = (
        ("pooled, streams unused", True, False),
        ("pooled, every stream used", True, True),
        ("unpooled", False, False),
    )
    for mode, pooled, used in modes:
        config = tf.ClientConfig(streams_per_device=args.streams_per_device, pool_streams=pooled)
        # Warm-up (CUDA context, first streams), then one cycle on an empty pool to refill it,
        # so pooled cycles measure reuse.
        _measure(devices, config, min(10, args.cycles), use_streams=used)
        tf.runtime.clear()
        _measure(devices, config, 1, use_streams=used)
        timing = _measure(devices, config, args.cycles, use_streams=used)
        rows.append({"mode": mode, "cycles": args.cycles, **timing})
    unpooled_us = rows[-1]["cycle_us"]
    for row in rows:
        row["speedup"] = unpooled_us / max(row["cycle_us"], 1e-9)
    columns = ["mode", "cycles", "create_us", "close_us", "cycle_us", "mean_cycle_us", "speedup"]
    env = environment()
    cpu_only = all(d == "cpu" for d in devices)
    per_device = f"{args.streams_per_device} streams/device"
    notes = [
        "Median host time per cycle (create = tf.Client(...), close = client.close()).",
        "Pooled: streams leased from the process pool and reset on close (completion drain; an "
        "idle query for each stream the client handed out). 'every stream used': each cycle reads "
        "every stream's torch handle, so close() queries all of them. Unpooled: every cycle "
        "creates and destroys its streams.",
    ]
    if cpu_only:
        notes.append("CPU only: a CPU client holds no streams, so every mode measures bookkeeping.")
    title = f"Client lifecycle over {devices} ({env['devices']}), {per_device}"
    report(args.out, "lifecycle", rows, title=title, notes=notes, columns=columns)
    for row in rows[:-1]:
        print(f"{row['mode']}: a cycle takes {1 / row['speedup']:.2f}x the time of an unpooled one")
    return 0
