"""Which CUDA calls block while a stream waits on a flag (``cuStreamWaitValue32``) that nobody
has set yet: creating a stream (cuda.bindings runtime, driver), creating and recording an
event, allocating, synchronising another stream.

The copy-engine transport leaves such waits queued until the peer posts its half. A call that
blocks behind them can deadlock two ranks that each wait for the other to get past set-up.

One GPU. Each call runs on a helper thread, bounded at 3 s; then the flag is set from the host
(a pinned-memory copy on a fresh stream) and the probe checks whether the call finished.
Usage: ``python scripts/stream_create_probe.py``
"""

import os
import threading
import time

import torch
from cuda.bindings import driver, runtime

from tensorferry.p2p.copy_engine import _streamops


def _bindings_stream() -> None:
    err, _ = runtime.cudaStreamCreateWithPriority(1, 0)
    assert int(err) == 0, err


def _driver_stream() -> None:
    runtime.cudaSetDevice(0)  # makes the primary context current on this thread
    err, _ = driver.cuStreamCreate(1)
    assert int(err) == 0, err


def _event() -> None:
    torch.cuda.Event().record(torch.cuda.Stream())


def _alloc() -> None:
    torch.empty(1 << 30, dtype=torch.uint8, device="cuda").fill_(1)
    torch.cuda.current_stream().synchronize()


def _fresh_alloc_free() -> None:
    torch.cuda.empty_cache()  # cudaFree: documented to synchronise the device


def probe(name, call) -> str:
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    waiter = torch.cuda.Stream()
    _streamops.wait_value32(waiter, flag.data_ptr(), 1, _streamops.WAIT_GEQ)
    done = torch.cuda.Event()
    done.record(waiter)
    errors: list = []

    def run() -> None:
        try:
            call()
        except Exception as exc:  # reported below
            errors.append(exc)

    t0 = time.perf_counter()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(3.0)
    blocked = thread.is_alive()
    one = torch.ones(1, dtype=torch.int32).pin_memory()
    release = torch.cuda.Stream()

    def set_flag() -> None:
        with torch.cuda.stream(release):
            flag.copy_(one, non_blocking=True)

    releaser = threading.Thread(target=set_flag, daemon=True)  # may block too
    releaser.start()
    releaser.join(5.0)
    thread.join(10.0)
    finished = not thread.is_alive()
    deadline = time.monotonic() + (10 if not releaser.is_alive() else 0)
    while not releaser.is_alive() and not done.query() and time.monotonic() < deadline:
        time.sleep(1e-3)
    took = time.perf_counter() - t0
    issued = not releaser.is_alive()
    drained = issued and done.query()
    return (
        f"{name:28s} release issued: {issued!s:5s}  blocked while waiting: {blocked!s:5s}  "
        f"finished after release: {finished!s:5s}  waiter drained: {drained!s:5s}  "
        f"({took:.2f} s) {errors or ''}"
    )


def main() -> None:
    torch.cuda.init()
    torch.empty(1, device="cuda")
    for name, call in [
        ("nothing", lambda: None),
        ("cudaStreamCreateWithPriority", _bindings_stream),
        ("cuStreamCreate", _driver_stream),
        ("event create + record", _event),
        ("empty_cache (cudaFree)", _fresh_alloc_free),
        ("allocate 1 GiB + fill", _alloc),
    ]:
        line = probe(name, call)
        print(line, flush=True)
        if "release issued: False" in line:
            print("the device is stuck behind the wait: stopping here", flush=True)
            os._exit(0)


if __name__ == "__main__":
    main()
