"""The graph demo: senders produce tensors, one receiver multiplies each by a weight.

With overlap off the receiver takes each tensor, multiplies it, then takes the next; with overlap
on it receives all of them up front (the overlap pass moves its READs ahead of its COMPUTEs),
so later transfers hide behind earlier matrix products. Both modes run, every result is checked
against a reference computed in the driver, the times are printed, and the schedule and timeline
pictures go to the output folder.

On two GPUs: one sender actor with several branches on ``cuda:0``, the receiver on ``cuda:1``,
NCCL between them. Without two GPUs: two CPU senders and a CPU receiver, sizes scaled down,
tensors over shared memory.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from tensorferry.runtime._devices import cuda_device_count

__all__ = ["DemoSender", "DemoReceiver", "run_graph_demo", "expected_result"]


def _data(seed: int, step: int, size: int, dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    # Generated where it is used (a 10000 x 10000 randn on the host takes seconds); the same
    # seed on the same kind of device gives the same numbers, so the driver can recompute it.
    generator = torch.Generator(device=device).manual_seed(seed * 100_003 + step)
    return torch.randn(size, size, generator=generator, device=device).to(dtype)


def _weight(size: int, dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    generator = torch.Generator(device=device).manual_seed(7)
    return (torch.randn(size, size, generator=generator, device=device) / size**0.5).to(dtype)


class DemoSender:
    """Produces one ``size x size`` tensor per branch per execution, from a known seed."""

    def __init__(self, size: int, dtype: torch.dtype, device: str) -> None:
        self.size, self.dtype, self.device = size, dtype, torch.device(device)

    def produce(self, step: int, branch: int) -> torch.Tensor:
        return _data(branch, step, self.size, self.dtype, str(self.device))


class DemoReceiver:
    """Multiplies each tensor it receives by a fixed weight; returns the column sums."""

    def __init__(self, size: int, dtype: torch.dtype, device: str) -> None:
        self.device = torch.device(device)
        self.weight = _weight(size, dtype, device)

    def consume(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.weight).float().sum(dim=0)


def expected_result(
    step: int, branch: int, size: int, dtype: torch.dtype, device: str = "cpu"
) -> torch.Tensor:
    """What ``consume(produce(step, branch))`` must return, recomputed by the driver.

    On the host in float64; for GPU data (``device`` a CUDA device of the same kind as the
    sender's) in float32 on that device.
    """
    wide = torch.float64 if device == "cpu" else torch.float32
    x = _data(branch, step, size, dtype, device).to(wide)
    return (x @ _weight(size, dtype, device).to(wide)).sum(dim=0).double().cpu()


def _check(results: list, step: int, size: int, dtype: torch.dtype, device: str = "cpu") -> None:
    for branch, got in enumerate(results):
        want = expected_result(step, branch, size, dtype, device)
        tolerance = 1e-3 if dtype == torch.float32 else 3e-2
        scale = want.abs().max().item() + 1.0
        error = (got.double().cpu() - want).abs().max().item() / scale
        if error > tolerance:
            raise AssertionError(
                f"step {step} branch {branch}: result differs from the reference "
                f"(relative error {error:.2e} > {tolerance:.0e})"
            )


def run_graph_demo(
    out_dir: str | Path = "graph-demo",
    *,
    size: int | None = None,
    branches: int = 3,
    iterations: int = 6,
    quiet: bool = False,
) -> dict[str, Any]:
    """Runs the demo graph with overlap off and on; checks results; writes pictures.

    Args:
        out_dir: folder for ``schedule_overlap_{off,on}.{dot,png}`` and
            ``timeline_overlap_{off,on}.png``.
        size: matrix side (default 8192 on GPUs, 512 on CPU).
        branches: tensors per execution.
        iterations: timed executions per mode (after one warm-up).
        quiet: do not print.

    Returns:
        ``{"device": ..., "times_ms": {"off": ..., "on": ...}, "pictures": [...]}``.

    Raises:
        AssertionError: a result differs from the reference.
    """
    import tensorferry as tf
    from tensorferry.graph import InputNode, MultiOutputNode, actor

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    gpus = cuda_device_count()
    on_gpu = gpus >= 2
    dtype = torch.float16 if on_gpu else torch.float32
    size = size or (8192 if on_gpu else 512)
    say = (lambda *a: None) if quiet else print
    reference = "cuda:1" if on_gpu else "cpu"  # where the driver recomputes results
    if on_gpu:
        senders = [actor(DemoSender).spawn(size, dtype, "cuda:0", device=0, name="sender")]
        receiver = actor(DemoReceiver).spawn(size, dtype, "cuda:1", device=1, name="receiver")
    else:
        senders = [actor(DemoSender).spawn(size, dtype, "cpu", name=f"sender{i}") for i in range(2)]
        receiver = actor(DemoReceiver).spawn(size, dtype, "cpu", name="receiver")
    say(f"graph demo: {branches} x {size}x{size} {dtype} on {'2 GPUs' if on_gpu else 'CPU'}")
    times: dict[str, float] = {}
    pictures: list[str] = []
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
                _check(graph.execute(0).get(timeout=120), 0, size, dtype, reference)
                samples = []
                for step in range(1, iterations + 1):
                    start = time.perf_counter()
                    results = graph.execute(step).get(timeout=120)
                    samples.append(time.perf_counter() - start)
                    if not on_gpu or step in (1, iterations):  # GPU checks cost a matmul
                        _check(results, step, size, dtype, reference)
                times[mode] = statistics.median(samples) * 1e3
                dot, png = graph.visualize_schedule(out / f"schedule_overlap_{mode}")
                timeline = graph.visualize_timeline(out / f"timeline_overlap_{mode}.png", last=2)
                pictures += [str(dot), str(png), str(timeline)]
            finally:
                graph.teardown(kill_actors=False)
            say(f"  overlap {mode:3s}: {times[mode]:8.2f} ms per execution, results checked")
    finally:
        for handle in (*senders, receiver):
            handle.kill()
    say(f"  speed-up from overlap: {times['off'] / times['on']:.2f}x; pictures in {out}/")
    if not on_gpu:
        say(
            f"  (on the CPU the three actors share {os.cpu_count()} cores, and each copy through "
            "shared memory needs a core as the matmuls do: with few cores overlap gains little "
            "or nothing; between GPUs it hides the transfers behind the matmuls)"
        )
    device = "2 GPUs" if on_gpu else "cpu"
    return {"device": device, "times_ms": times, "pictures": pictures, "tf": tf.__version__}
