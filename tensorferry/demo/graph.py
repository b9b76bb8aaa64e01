"""The graph demo: senders produce tensors, one receiver multiplies each by a weight
(:mod:`tensorferry.demo.graph_actors`), compiled with overlap off and on.

With overlap off the receiver takes each tensor, multiplies it, then takes the next; with overlap
on it receives all of them up front (the overlap pass moves its READs ahead of its COMPUTEs),
so that on GPUs later transfers run while earlier products compute. Every result is checked
against a reference the driver computes; the schedules and the measured timelines are drawn.

How much communication overlapped compute is computed from the very records the timeline
picture is drawn from, by the picture's own rule, so the printed share and the picture agree.

On two GPUs: one sender actor with several branches on ``cuda:0``, the receiver on ``cuda:1``,
NCCL between them; both modes are timed. On the CPU: two senders and a receiver, sizes scaled
down, tensors over shared memory; there an actor reads, computes and writes one after another,
so the CPU run checks results and draws the pictures, and claims no speed-up.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch

from tensorferry.demo.graph_actors import DemoReceiver, DemoSender, check
from tensorferry.runtime._devices import cuda_device_count

__all__ = ["run_graph_demo", "overlap_shares", "TIMELINE_EXECUTIONS"]

TIMELINE_EXECUTIONS = 2
"""The timeline pictures show each actor's last this many executions."""


def overlap_shares(records: list, *, last: int | None = TIMELINE_EXECUTIONS) -> dict[str, float]:
    """Per actor with communication, the share of its communication time during which it also
    computed: the timeline picture's rule (device lanes only, a GPU actor's ``host`` lane left
    out; each actor's last ``last`` executions), applied to the same records."""
    from tensorferry.graph._visualize import _busy_union, _intersections

    if last is not None:
        newest: dict[str, int] = {}
        for r in records:
            newest[r[0]] = max(newest.get(r[0], -1), r[1])
        records = [r for r in records if r[1] > newest[r[0]] - last]
    actors = dict.fromkeys(r[0] for r in sorted(records, key=lambda r: r[6]))
    shares = {}
    for actor in actors:
        mine = [r for r in records if r[0] == actor and r[5] != "host"]
        compute = _busy_union([(r[6], r[7]) for r in mine if r[3] == "COMPUTE"])
        comm = _busy_union([(r[6], r[7]) for r in mine if r[3] != "COMPUTE"])
        comm_time = sum(end - start for start, end in comm)
        if comm_time > 0:
            hidden = _intersections(compute, comm)
            shares[actor] = sum(end - start for start, end in hidden) / comm_time
    return shares


def _shares_text(shares: dict[str, float]) -> str:
    listed = ", ".join(f"{actor} {share:.0%}" for actor, share in shares.items())
    return f"{listed} of communication overlapped compute"


def _spawn(on_gpu: bool, size: int, dtype: torch.dtype) -> tuple[list, Any]:
    from tensorferry.graph import actor

    if on_gpu:
        senders = [actor(DemoSender).spawn(size, dtype, "cuda:0", device=0, name="sender")]
        receiver = actor(DemoReceiver).spawn(size, dtype, "cuda:1", device=1, name="receiver")
    else:
        senders = [actor(DemoSender).spawn(size, dtype, "cpu", name=f"sender{i}") for i in range(2)]
        receiver = actor(DemoReceiver).spawn(size, dtype, "cpu", name="receiver")
    return senders, receiver


def _pictures(graph: Any, records: list, out: Path, mode: str) -> list[str]:
    """The schedule (DOT and picture) and the timeline of ``records``; none without
    matplotlib (the DOT text is written first, and kept)."""
    from tensorferry.graph._visualize import write_timeline

    dot, png = graph.visualize_schedule(out / f"schedule_overlap_{mode}")
    timeline = write_timeline(
        records, out / f"timeline_overlap_{mode}.png", last=TIMELINE_EXECUTIONS
    )
    return [str(dot), str(png), str(timeline)]


def run_graph_demo(
    out_dir: str | Path = "demo-out",
    *,
    size: int | None = None,
    branches: int = 3,
    iterations: int | None = None,
    quiet: bool = False,
    device: str = "auto",
) -> dict[str, Any]:
    """Runs the demo graph with overlap off and on; checks results; writes pictures.

    Args:
        out_dir: folder for ``schedule_overlap_{off,on}.{dot,png}`` and
            ``timeline_overlap_{off,on}.png``.
        size: matrix side (default 8192 on GPUs, 512 on the CPU).
        branches: tensors per execution.
        iterations: timed executions per mode, after one warm-up (default 10 on GPUs, 3 on
            the CPU).
        quiet: do not print.
        device: ``"auto"`` (two GPUs if there are, else the CPU), ``"cuda"`` or ``"cpu"``.

    Returns:
        ``{"device": "2 GPUs" or "cpu", "times_ms": {"off": ..., "on": ...} (median per
        execution), "overlap": {"off": {actor: share}, "on": ...} (what the timelines show),
        "checked": executions whose results were checked, "pictures": [...], "tf": version}``.

    Raises:
        ValueError: ``device="cuda"`` without two GPUs, or an unknown device.
        AssertionError: a result differs from the reference.
    """
    import tensorferry as tf
    from tensorferry.graph import InputNode, MultiOutputNode

    if device not in ("auto", "cuda", "cpu"):
        raise ValueError(f"device must be auto, cuda or cpu, got {device!r}")
    two_gpus = cuda_device_count() >= 2
    if device == "cuda" and not two_gpus:
        raise ValueError("device='cuda' needs two CUDA devices")
    on_gpu = device != "cpu" and two_gpus
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dtype = torch.float16 if on_gpu else torch.float32
    size = size or (8192 if on_gpu else 512)
    iterations = iterations or (10 if on_gpu else 3)
    say = (lambda *a: None) if quiet else print
    reference = "cuda:1" if on_gpu else "cpu"  # where the driver recomputes results
    where = (
        "a sender on cuda:0 to a receiver on cuda:1"
        if on_gpu
        else "2 senders to a receiver, all on the CPU"
    )
    dtype_name = str(dtype).removeprefix("torch.")
    say(f"graph: {branches} × {size}×{size} {dtype_name} per execution from {where}")
    senders, receiver = _spawn(on_gpu, size, dtype)
    times: dict[str, float] = {}
    shares: dict[str, dict[str, float]] = {}
    pictures: list[str] = []
    checked = 0
    no_pictures = None
    try:
        for overlap in (False, True):
            with InputNode() as inp:
                outs = []
                for branch in range(branches):
                    sender = senders[branch % len(senders)]
                    produced = sender.produce.bind(inp, branch).with_transport("auto")
                    outs.append(receiver.consume.bind(produced))
                dag = MultiOutputNode(outs)
            mode = "on" if overlap else "off"
            graph = dag.compile(overlap_communication=overlap, profile=True)
            try:
                check(graph.execute(0).get(timeout=120), 0, size, dtype, reference)
                checked += 1
                samples = []
                for step in range(1, iterations + 1):
                    start = time.perf_counter()
                    results = graph.execute(step).get(timeout=120)
                    samples.append(time.perf_counter() - start)
                    if not on_gpu or step in (1, iterations):  # a GPU check costs a matmul
                        check(results, step, size, dtype, reference)
                        checked += 1
                times[mode] = statistics.median(samples) * 1e3
                records = graph.profile_records()
                shares[mode] = overlap_shares(records)
                try:
                    pictures += _pictures(graph, records, out, mode)
                except ImportError as error:
                    no_pictures = str(error)
            finally:
                graph.teardown(kill_actors=False)
            timed = f"{times[mode]:8.2f} ms per execution" if on_gpu else "results checked"
            say(f"  overlap {mode:3s}: {timed}; timeline: {_shares_text(shares[mode])}")
    finally:
        for handle in (*senders, receiver):
            handle.kill()
    if on_gpu:
        off, on = times["off"], times["on"]
        verdict = f"{off / on:.2f}× faster" if on <= off else f"{on / off:.2f}× slower"
        say(
            f"  overlap on is {verdict} than off (median of {iterations} executions each); "
            f"results checked"
        )
    else:
        say(
            "  on the CPU this part checks results and draws the schedules: an actor there "
            "reads, computes and writes one after another, so no speed-up from overlap is "
            "claimed; between GPUs transfers run beside the products"
        )
    if no_pictures:
        say(f"  no pictures: {no_pictures}")
    else:
        say(f"  schedules and timelines (last {TIMELINE_EXECUTIONS} executions) in {out}/")
    return {
        "device": "2 GPUs" if on_gpu else "cpu",
        "times_ms": times,
        "overlap": shares,
        "checked": checked,
        "pictures": pictures,
        "tf": tf.__version__,
    }
