"""``tensorferry bench sendrecv``: NVLink kernels, copy engine and auto vs NCCL, two ranks.

Every transport moves the same messages in the same run. Each point is a CUDA graph holding
``reps`` back-to-back messages, replayed and timed with CUDA events after a barrier; the
per-message time is the median over replays, then the maximum over ranks.

Fairness caveats (also written into the Markdown report):
- NCCL runs through ``torch.distributed`` ``batch_isend_irecv`` captured in the same kind of
  graph; its host-side cost is gone, its device-side protocol cost is not.
- "nccl-4" limits NCCL to 4 CTAs (``ncclConfig`` min/max CTAs); "nvlink-4" gives our kernel a
  budget of 4 CTAs in total (2 per direction when both ways).
- Our one-way kernels move bytes sender → staging → output (two copies); "nvlink-zc" receives
  into a symmetric tensor (one copy), which NCCL cannot do through torch.distributed.
- Both ranks replay independently; the protocol itself keeps them in step.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from typing import Any

from tensorferry.bench._devices import require_cuda_devices
from tensorferry.cli._args import add_bench_output_arguments, positive_float

DEFAULT_SIZES = "256,4K,64K,1M,8M,64M,256M,1G"
DEFAULT_TRANSPORTS = "nccl,nccl-4,nvlink,nvlink-4,nvlink-zc,ce,auto"


def _parse_size(text: str) -> int:
    raw = text.strip().upper()
    try:
        for suffix, mult in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30)):
            if raw.endswith(suffix):
                value = int(float(raw[:-1]) * mult)
                break
        else:
            value = int(raw)
    except ValueError:
        raise ValueError(f"size {text!r} is not a byte count like 4096, 64K, 1M or 1G") from None
    if value <= 0:
        raise ValueError(f"size {text!r} must be positive")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help="message sizes (K/M/G suffixes)")
    parser.add_argument("--transports", default=DEFAULT_TRANSPORTS, help="comma-separated")
    parser.add_argument("--modes", default="one_way,both", help="one_way, both")
    parser.add_argument(
        "--tune", action="store_true", help="also write auto_table.json (needs both modes)"
    )
    parser.add_argument(
        "--table",
        default=None,
        help="the size table the 'auto' column follows (a JSON file written by --tune; "
        "default: the built-in one for this GPU)",
    )
    parser.add_argument(
        "--overlap",
        action="store_true",
        help="also time an 8192^3 bf16 matmul loop with 4 GiB arriving",
    )
    parser.add_argument(
        "--max-seconds-per-point",
        type=positive_float,
        default=1.0,
        help="time budget of one size and transport, which sets its iterations",
    )
    add_bench_output_arguments(
        parser,
        "sendrecv",
        needs="two CUDA GPUs on this machine; without torchrun it starts its two ranks under "
        "torchrun itself",
    )


def _check(args: argparse.Namespace) -> None:
    """The lists are checked before any rank starts: a bad entry is one line, not a traceback
    from each rank."""
    try:
        if not parse_sizes(args.sizes):
            raise ValueError("--sizes is empty")
    except ValueError as exc:
        raise SystemExit(f"tensorferry bench sendrecv: {exc}") from None
    for flag, given, known in (
        ("--transports", args.transports, DEFAULT_TRANSPORTS.split(",")),
        ("--modes", args.modes, ["one_way", "both"]),
    ):
        names = [name for name in given.split(",") if name]
        unknown = [name for name in names if name not in known]
        if unknown or not names:
            raise SystemExit(
                f"tensorferry bench sendrecv: {flag} {given!r}: choose from {','.join(known)}"
            )
    from tensorferry.p2p.nvlink._autotable import MODES, TRANSPORTS, AutoTable

    if args.tune:
        # The table has rules for every mode and names only its channels: a run that cannot
        # fill it says so now, not after measuring.
        modes = set(args.modes.split(","))
        channels = set(args.transports.split(",")) & set(TRANSPORTS)
        if modes != set(MODES) or not channels:
            raise SystemExit(
                f"tensorferry bench sendrecv: --tune needs --modes {','.join(MODES)} and at "
                f"least one of {', '.join(TRANSPORTS)} in --transports (given --modes "
                f"{args.modes!r}, --transports {args.transports!r})"
            )
    if args.table:
        try:
            AutoTable.load(args.table)
        except (OSError, ValueError) as exc:
            raise SystemExit(f"tensorferry bench sendrecv: --table {args.table!r}: {exc}") from None


def run(args: argparse.Namespace) -> int:
    _check(args)
    if "RANK" not in os.environ:
        require_cuda_devices(2, "tensorferry bench sendrecv")  # every variant moves CUDA tensors
        # Not under torchrun: start two ranks of ourselves.
        argv = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "tensorferry.cli.main",
            "bench",
            "sendrecv",
        ]
        argv += sys.argv[sys.argv.index("sendrecv") + 1 :] if "sendrecv" in sys.argv else []
        return subprocess.call(argv)
    return _main(args)


def parse_sizes(text: str) -> list[int]:
    """``"256,4K,1M"`` as byte counts. Raises ValueError naming a bad entry."""
    return [_parse_size(s) for s in text.split(",") if s.strip()]


def _fmt_size(n: int) -> str:
    for unit, mult in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= mult and n % mult == 0:
            return f"{n // mult} {unit}"
    return f"{n} B"


class _Bench:
    """Per-rank state: process groups, channels, buffers."""

    def __init__(self, args: Any) -> None:
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        self.device = torch.device("cuda", self.local_rank)
        dist.init_process_group("nccl", device_id=self.device)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if self.world != 2:
            raise SystemExit("bench sendrecv runs with exactly 2 ranks")
        self.peer = 1 - self.rank
        self.args = args
        self.sizes = parse_sizes(args.sizes)
        self.max_size = max(self.sizes)
        self._nccl4 = None
        self._nvlink = None
        self._ce = None
        self._zc = None
        self.send_buf = torch.randint(
            0, 255, (self.max_size,), dtype=torch.uint8, device=self.device
        )
        self.recv_buf = torch.empty(self.max_size, dtype=torch.uint8, device=self.device)
        from tensorferry.p2p.nvlink import _autotable

        self.table = _autotable.default_table(path=args.table)

    # ------------------------------------------------------------------ resources
    def nccl4(self) -> Any:
        if self._nccl4 is None:
            opts = self.dist.ProcessGroupNCCL.Options()
            opts.config.min_ctas = 4
            opts.config.max_ctas = 4
            self._nccl4 = self.dist.new_group(ranks=[0, 1], backend="nccl", pg_options=opts)
        return self._nccl4

    def nvlink(self) -> Any:
        if self._nvlink is None:
            from tensorferry.p2p.nvlink import NvlinkChannel

            self._nvlink = NvlinkChannel()
        return self._nvlink

    def ce(self) -> Any:
        if self._ce is None:
            from tensorferry.p2p.copy_engine import CopyEngineChannel

            self._ce = CopyEngineChannel()
        return self._ce

    def zc(self) -> Any:
        if self._zc is None:
            from tensorferry.p2p.nvlink import empty

            self._zc = empty(self.max_size, dtype=self.torch.uint8, device=self.device)
        return self._zc

    # ------------------------------------------------------------------ ops
    def make_op(self, transport: str, nbytes: int, both: bool) -> Any:
        """A closure issuing one message (both directions when ``both``) on the current stream."""
        dist = self.dist
        x = self.send_buf[:nbytes]
        y = self.recv_buf[:nbytes]
        sender = both or self.rank == 0
        receiver = both or self.rank == 1
        if transport == "auto":
            transport = self.table.choose(nbytes, bidirectional=both)
        if transport in ("nccl", "nccl-4"):
            group = self.nccl4() if transport == "nccl-4" else None

            def op() -> None:
                ops = []
                if sender:
                    ops.append(dist.P2POp(dist.isend, x, self.peer, group=group))
                if receiver:
                    ops.append(dist.P2POp(dist.irecv, y, self.peer, group=group))
                for work in dist.batch_isend_irecv(ops):
                    work.wait()

            return op
        if transport.startswith("nvlink"):
            ch = self.nvlink()
            ctas = 4 if transport == "nvlink-4" else None
            out = self.zc()[:nbytes] if transport == "nvlink-zc" else y

            def op() -> None:
                ch.sendrecv(
                    x if sender else None,
                    self.peer if sender else None,
                    out if receiver else None,
                    self.peer if receiver else None,
                    max_ctas=ctas,
                )

            return op
        if transport == "ce":
            ch = self.ce()

            def op() -> None:
                ch.sendrecv(
                    x if sender else None,
                    self.peer if sender else None,
                    y if receiver else None,
                    self.peer if receiver else None,
                )

            return op
        raise SystemExit(f"unknown transport {transport!r}")

    def time_op(self, op: Any, nbytes: int) -> float:
        """Seconds per message: graph of ``reps`` messages, median replay, max over ranks."""
        torch, dist = self.torch, self.dist
        reps = 10 if nbytes <= (1 << 20) else (2 if nbytes <= (64 << 20) else 1)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                op()  # warm up: compile, communicators, symmetric tables
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(reps):
                op()
        torch.cuda.synchronize()
        dist.barrier()
        graph.replay()
        torch.cuda.synchronize()
        # Iterations: enough for a stable median within the time budget.
        est = max(nbytes / 300e9, 10e-6) * reps
        iters = int(min(200, max(5, self.args.max_seconds_per_point / est)))
        iters_t = torch.tensor([iters], device=self.device)
        dist.all_reduce(iters_t, op=dist.ReduceOp.MIN)
        iters = int(iters_t.item())
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        dist.barrier()
        for i in range(iters):
            starts[i].record()
            graph.replay()
            ends[i].record()
        torch.cuda.synchronize()
        times = sorted(s.elapsed_time(e) * 1e-3 / reps for s, e in zip(starts, ends, strict=True))
        median = torch.tensor([times[len(times) // 2]], device=self.device, dtype=torch.float64)
        dist.all_reduce(median, op=dist.ReduceOp.MAX)
        del graph
        return float(median.item())

    def overlap(self) -> list[dict[str, Any]]:
        """8192^3 bf16 matmuls (20) on rank 1, alone and with 4 GiB arriving from rank 0."""
        torch, dist = self.torch, self.dist
        n = 8192
        a = torch.randn(n, n, device=self.device, dtype=torch.bfloat16)
        b = torch.randn(n, n, device=self.device, dtype=torch.bfloat16)
        chunk = min(self.max_size, 1 << 30)
        messages = (4 << 30) // chunk
        results = []
        for transport in ("none", "ce", "nvlink", "nccl"):
            op = None if transport == "none" else self.make_op(transport, chunk, False)
            comm = torch.cuda.Stream()
            samples = []
            for _ in range(3):
                torch.cuda.synchronize()
                dist.barrier()
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
                if op is not None:
                    # Every transport is issued from its own stream, before the matmuls: a
                    # transport orders its copies after the issuing stream's work (and that
                    # stream's later work after them), so issuing from the matmul stream would
                    # serialise the two instead of overlapping them.
                    comm.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(comm):
                        for _ in range(messages):
                            op()
                for _ in range(20):
                    a @ b
                end.record()
                torch.cuda.synchronize()
                samples.append(start.elapsed_time(end))
            ms = sorted(samples)[1]
            results.append({"transport": transport, "ms": ms})
        return results


def _main(args: Any) -> int:
    import torch

    bench = _Bench(args)
    transports = [t for t in args.transports.split(",") if t]
    modes = [m for m in args.modes.split(",") if m]
    rows = []
    for mode in modes:
        for nbytes in bench.sizes:
            for transport in transports:
                op = bench.make_op(transport, nbytes, mode == "both")
                seconds = bench.time_op(op, nbytes)
                chosen = (
                    bench.table.choose(nbytes, bidirectional=mode == "both")
                    if transport == "auto"
                    else transport
                )
                rows.append(
                    {
                        "mode": mode,
                        "nbytes": nbytes,
                        "transport": transport,
                        "chosen": chosen,
                        "us": seconds * 1e6,
                        "gbps": nbytes / seconds / 1e9,
                    }
                )
                if bench.rank == 0:
                    print(
                        f"{mode:8s} {_fmt_size(nbytes):>8s} {transport:10s} "
                        f"{seconds * 1e6:10.1f} us {nbytes / seconds / 1e9:8.1f} GB/s",
                        flush=True,
                    )
    if bench._nvlink is not None:
        bench._nvlink.check()
    overlap = bench.overlap() if args.overlap else []
    if bench.rank == 1 and overlap:
        for r in overlap:
            print(f"overlap {r['transport']:6s} {r['ms']:.2f} ms", flush=True)
    if bench.rank == 0 or (bench.rank == 1 and overlap):
        os.makedirs(args.out, exist_ok=True)
    if bench.rank == 1 and overlap:
        import json

        with open(os.path.join(args.out, "overlap.json"), "w") as f:
            json.dump(overlap, f, indent=2)
    if bench.rank == 0:
        _write_reports(rows, args)
        if args.tune:
            from tensorferry.p2p.nvlink._autotable import AutoTable

            times: dict = {}
            for r in rows:
                name = {"nvlink": "nvlink", "ce": "ce", "nccl": "nccl"}.get(r["transport"])
                if name:
                    times.setdefault((r["mode"], r["nbytes"]), {})[name] = r["us"]
            table = AutoTable.from_measurements(times, device=torch.cuda.get_device_name())
            table.save(os.path.join(args.out, "auto_table.json"))
    bench.dist.barrier()
    bench.dist.destroy_process_group()
    return 0


def _caveats() -> list[str]:
    """The module docstring's fairness caveats as Markdown bullets, each with all its lines."""
    bullets: list[str] = []
    for line in __doc__.split("Fairness caveats")[1].splitlines()[1:]:
        text = line.strip()
        if text.startswith("- "):
            bullets.append(text)
        elif text and bullets:
            bullets[-1] += " " + text
    return bullets


def _write_reports(rows: list[dict[str, Any]], args: Any) -> None:
    import csv

    from tensorferry.bench._report import environment_lines, record

    path = os.path.join(args.out, "sendrecv")
    with open(path + ".csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    transports = list(dict.fromkeys(r["transport"] for r in rows))
    lines = ["# tensorferry bench sendrecv", "", *environment_lines()]
    lines += [
        "- per-message µs (CUDA-graph replay, median, max over ranks) and GB/s per direction",
        "",
    ]
    for mode in dict.fromkeys(r["mode"] for r in rows):
        lines += [
            f"## {mode}",
            "",
            "| size | " + " | ".join(transports) + " |",
            "|---|" + "---|" * len(transports),
        ]
        for n in dict.fromkeys(r["nbytes"] for r in rows if r["mode"] == mode):
            cells = []
            for t in transports:
                r = next(
                    x
                    for x in rows
                    if x["mode"] == mode and x["nbytes"] == n and x["transport"] == t
                )
                extra = f" ({r['chosen']})" if t == "auto" else ""
                cells.append(f"{r['us']:.1f} µs / {r['gbps']:.0f}{extra}")
            lines.append(f"| {_fmt_size(n)} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["## Fairness caveats", ""]
    lines += _caveats()
    with open(path + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    files = [path + ".csv", path + ".md"]
    record("sendrecv", rows, title="tensorferry bench sendrecv", notes=_caveats(), files=files)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4.5), squeeze=False)
    for ax, mode in zip(axes[0], modes, strict=True):
        for t in transports:
            pts = [
                (r["nbytes"], r["gbps"]) for r in rows if r["mode"] == mode and r["transport"] == t
            ]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=t)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message bytes")
        ax.set_ylabel("GB/s per direction")
        ax.set_title(mode)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path + ".png", dpi=120)
