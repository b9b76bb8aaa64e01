"""Host time of each step of a GPU actor's operations in ``bench graph``'s NCCL case.

``compile(profile=True)`` records events around every operation, which doubles the time of an
execution here; this probe instead wraps the steps of :class:`tensorferry.graph._gpu.GpuOps`
(``read``, ``compute``, ``write``, ``_send``, ``_to_host``, ``_host.submit`` and the host
channels' ``write``) with ``perf_counter`` in the actor processes themselves, runs the echo
graph (overlap off, then on) without profiling, and prints each step's median µs per actor.
The wrappers add about a microsecond each.

The actors' class lives in this module, so importing it in an actor process (to unpickle the
class) installs the wrappers there. Usage (2 GPUs, from the repository root):
``PYTHONPATH=$PWD python scripts/graph_steps_probe.py [--iters N]``.
"""

import argparse
import collections
import glob
import json
import os
import statistics
import tempfile
import time

from tensorferry.bench.graph import Echo

_DIR = os.path.join(tempfile.gettempdir(), "tf-graph-steps")
_spent: dict[str, list[float]] = collections.defaultdict(list)
_calls = [0]


def _dump() -> None:
    path = os.path.join(_DIR, f"{os.getpid()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump({k: statistics.median(v) for k, v in _spent.items() if v}, f)
    os.replace(path + ".tmp", path)


def _timed(label, inner):
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            _spent[label].append((time.perf_counter() - start) * 1e6)
            _calls[0] += 1
            if _calls[0] % 2000 == 0:
                _dump()

    return timed


def _install() -> None:
    from tensorferry.graph import _channel, _gpu, _gpu_host

    for name in ("read", "compute", "write", "_send", "_to_host", "_snapshot", "settle"):
        setattr(_gpu.GpuOps, name, _timed(name, getattr(_gpu.GpuOps, name)))
    _gpu_host.HostWrites.submit = _timed("host submit", _gpu_host.HostWrites.submit)
    _gpu_host.HostWrites.pump = _timed("host pump", _gpu_host.HostWrites.pump)
    _channel.Channel.write = _timed("channel write", _channel.Channel.write)
    _channel.Channel.read = _timed("channel read (with its wait)", _channel.Channel.read)


class StepsEcho(Echo):
    """The bench's actor; constructing it marks the process as one to report."""

    def __init__(self, device: str = "cpu") -> None:
        super().__init__(device)
        os.makedirs(_DIR, exist_ok=True)
        _spent.clear()


if os.environ.get("TF_GRAPH_STEPS_PROBE") == "1":
    _install()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=3000)
    args = parser.parse_args()
    os.environ["TF_GRAPH_STEPS_PROBE"] = "1"  # inherited by the actor processes
    from tensorferry.graph import InputNode, actor

    Actor = actor(StepsEcho)
    for overlap in (False, True):
        for old in glob.glob(os.path.join(_DIR, "*.json")):
            os.remove(old)
        s = Actor.spawn("cuda:0", device=0, name="gpu0")
        r = Actor.spawn("cuda:1", device=1, name="gpu1")
        pids = {}
        try:
            with InputNode() as inp:
                made = s.make.bind(inp)
                node = made.with_transport("nccl", static_shape=True, direct_return=True)
                dag = r.first.bind(node)
            graph = dag.compile(overlap_communication=overlap)
            samples = []
            for i in range(args.iters):
                start = time.perf_counter()
                value = graph.execute(float(i % 7)).get(10)
                samples.append((time.perf_counter() - start) * 1e6)
                assert value.item() == float(i % 7)
            graph.teardown(kill_actors=False)
            pids = {name: h.pid for name, h in (("gpu0", s), ("gpu1", r))}
        finally:
            s.kill()
            r.kill()
        print(f"== overlap {'on' if overlap else 'off'}: execute().get() median "
              f"{statistics.median(samples):.0f} us")  # fmt: skip
        for name, pid in pids.items():
            path = os.path.join(_DIR, f"{pid}.json")
            if not os.path.exists(path):
                print(f"  {name}: no record (pid {pid})")
                continue
            with open(path) as f:
                steps = json.load(f)
            for step, us in sorted(steps.items(), key=lambda kv: -kv[1]):
                print(f"  {name} {step:30s} {us:7.1f} us")


if __name__ == "__main__":
    main()
