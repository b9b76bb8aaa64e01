"""How long a process outlives a ``ProcessGroupNCCL`` receive whose peer was killed.

Two processes on one GPU, each posing to NCCL as a host of its own (``NCCL_HOSTID``); rank 1
posts a receive from rank 0, rank 0 is SIGKILLed, and rank 1 aborts its group as the library
does, then reports every second that it is still alive, up to ``--watch`` seconds. Each
setting in ``--settings`` runs side by side, in its own pair of processes, with its
environment for torch (``NAME=VALUE,NAME=VALUE``; ``default`` for none).

    python3 scripts/torch_group_error_probe.py --watch 80 \\
        --settings default TORCH_NCCL_ASYNC_ERROR_HANDLING=0

Prints, per setting, when the error came and how long rank 1 lived after it.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import signal
import time


def _rank(rank: int, port: int, env: dict[str, str], started: mp.Queue, report: mp.Queue) -> None:
    os.environ.update(env)
    os.environ["NCCL_HOSTID"] = f"torch-group-error-probe-{rank}"
    import torch
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0)
    group = dist.ProcessGroupNCCL(store, rank, 2, dist.ProcessGroupNCCL.Options())
    probe = torch.ones(1, device="cuda:0")
    (group.send if rank == 0 else group.recv)([probe], 1 - rank, 0).wait()
    torch.cuda.synchronize()
    if rank == 0:
        started.put(os.getpid())
        time.sleep(3600)  # killed
    work = group.recv([torch.empty(1, device="cuda:0")], 0, 0)
    started.put(os.getpid())
    while not work.is_completed():  # completed with an error once the watchdog saw it
        time.sleep(0.05)
    failed = time.monotonic()
    report.put(("failed", failed))
    group.abort()  # as the library's links do on a lost peer
    keep = group  # noqa: F841 (kept: its destructor waits for torch's watchdog)
    while True:
        report.put(("alive", time.monotonic() - failed))
        time.sleep(1.0)


def _parse(setting: str) -> dict[str, str]:
    if setting == "default":
        return {}
    return dict(item.split("=", 1) for item in setting.split(","))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--watch", type=float, default=80.0)
    parser.add_argument("--settings", nargs="+", default=["default"])
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    runs = []
    for i, setting in enumerate(args.settings):
        started, report = ctx.Queue(), ctx.Queue()
        port = 29600 + i
        procs = [
            ctx.Process(target=_rank, args=(r, port, _parse(setting), started, report))
            for r in (0, 1)
        ]
        for p in procs:
            p.start()
        runs.append((setting, procs, started, report))
    for setting, procs, started, _report in runs:
        pids = [started.get(timeout=120), started.get(timeout=120)]
        victim = procs[0].pid
        assert victim in pids, (setting, pids)
    time.sleep(1.0)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%H:%M:%S")
    for _, procs, _, _ in runs:
        os.kill(procs[0].pid, signal.SIGKILL)
    print(f"rank 0 of every pair killed at {stamp} UTC", flush=True)
    deadline = time.monotonic() + args.watch + 15.0
    lived = {setting: None for setting, *_ in runs}
    failed_at = {}
    while time.monotonic() < deadline:
        for setting, _procs, _, report in runs:
            while not report.empty():
                kind, value = report.get()
                if kind == "failed":
                    failed_at[setting] = value
                else:
                    lived[setting] = value
        if all(v is not None and v >= args.watch for v in lived.values()):
            break
        if all(not procs[1].is_alive() for _, procs, _, _ in runs):
            break
        time.sleep(0.5)
    for setting, procs, _, _ in runs:
        alive = procs[1].is_alive()
        print(
            f"{setting}: receive failed {'yes' if setting in failed_at else 'no'}; rank 1 "
            f"{'alive' if alive else f'gone (exit code {procs[1].exitcode})'}, "
            f"last seen {lived[setting] or 0:.0f} s after the failure",
            flush=True,
        )
        for p in procs:
            if p.is_alive():
                p.kill()


if __name__ == "__main__":
    main()
