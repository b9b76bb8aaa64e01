"""A driver killed while its graph runs: its actors must stop and remove the graph's segments.

Shared by the CPU tier and the GPU tier (an NCCL edge with receives posted early).
"""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

# Runs a graph a few times, prints its actors' pids and segment prefix, then kills itself: it
# never tears the graph down.
_DRIVER = """
import os, signal, sys
import torch
from graph_actors import Calc, GpuCalc
from tensorferry.graph import InputNode, actor

if __name__ == "__main__":
    gpu = sys.argv[1] == "gpu"
    if gpu:
        a, b = (actor(GpuCalc).spawn(f"cuda:{i}", device=i) for i in range(2))
    else:
        a, b = actor(Calc).spawn(1.0), actor(Calc).spawn(10.0)
    with InputNode() as inp:
        if gpu:
            sent = a.make.bind(inp).with_transport("nccl", static_shape=True)
            dag = b.scale.bind(sent, 1.0)
        else:
            dag = b.add.bind(a.add.bind(inp))
    graph = dag.compile(overlap_communication=True)
    for _ in range(3):  # from the second on, the NCCL receive is posted before the send
        x = torch.randn(1000)
        want = x * 2 if gpu else (x + 1.0) + 10.0  # the actors' float32 steps
        assert torch.equal(graph.execute(x).get(timeout=60), want)
    print(a.pid, b.pid, graph._executor.prefix, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def no_segments(prefix: str) -> bool:
    """Whether no shared-memory segment of the graph named ``prefix`` is left."""
    return not glob.glob(f"/dev/shm/{prefix}*")


def running(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie no one reaped does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


def kill_a_driver(tmp_path: Path, *, gpu: bool, within_s: float = 20.0) -> None:
    script = tmp_path / "driver.py"
    script.write_text(_DRIVER)
    path = [str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
    done = subprocess.run(
        [sys.executable, str(script), "gpu" if gpu else "cpu"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    a_pid, b_pid, prefix = done.stdout.split()
    pids = (int(a_pid), int(b_pid))
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not any(map(running, pids)) and no_segments(prefix):
            break
        time.sleep(0.1)
    assert not any(map(running, pids)), "an actor outlived its driver"
    assert no_segments(prefix), "the graph's segments outlived it"
