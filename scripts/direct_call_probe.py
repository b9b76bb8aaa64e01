"""What a direct call (``handle.method.call``) costs with CPU tensors of several sizes.

One local CPU actor (the tests' ``Calc``). For each size, 40 calls of each kind, median ms:

- ``echo``: a new tensor goes to the actor and comes back (two tensors travel);
- ``arg only``: a new tensor goes to the actor, two floats come back.

Usage: ``python scripts/direct_call_probe.py`` (run it with ``PYTHONPATH`` set to another
checkout to compare two trees on the same machine).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "graph"))

import torch
from graph_actors import Calc

import tensorferry as tf

CalcActor = tf.actor(Calc)
SIZES = (16, 1 << 12, 1 << 14, 1 << 16, 1 << 20)  # float32 elements
CALLS = 40


def main() -> None:
    handle = CalcActor.spawn(1.0, name="probe")
    try:
        print(f"tensorferry from {Path(tf.__file__).parent}")
        print("    size KB   echo ms   arg only ms")
        for numel in SIZES:
            echo, arg_only = [], []
            for _ in range(CALLS):
                x = torch.randn(numel)
                start = time.perf_counter()
                handle.echo.call(x)
                echo.append(time.perf_counter() - start)
                x = torch.randn(numel)
                start = time.perf_counter()
                handle.extremes.call(x)
                arg_only.append(time.perf_counter() - start)
            print(
                f"{numel * 4 / 1e3:11.1f} {statistics.median(echo) * 1e3:9.2f} "
                f"{statistics.median(arg_only) * 1e3:13.2f}"
            )
    finally:
        handle.kill()


if __name__ == "__main__":
    main()
