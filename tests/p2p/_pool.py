"""A pool of spawned worker processes, one per rank, reused by every test of a module.

Spawning a torch process costs ~2 s on the CI machine; each test module starts its world once
and sends it cases by name (functions of ``_cases.py``). Every wait has a timeout; a pool whose
worker missed one is torn down so later tests fail fast instead of hanging.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
import traceback
from typing import Any

from tensorferry.p2p._launch import reserved_port

_HERE = os.path.dirname(os.path.abspath(__file__))
# TF_TEST_ONE_GPU_RANKS=1: every rank on cuda:0 of a machine with one GPU, each posing to NCCL
# as a host of its own (NCCL_HOSTID), so NCCL passes its one-rank-per-GPU check and connects the
# ranks over its network transport. That runs the NCCL tier's correctness checks there; its
# timings say nothing about NVLink.
ONE_GPU_RANKS = os.environ.get("TF_TEST_ONE_GPU_RANKS") == "1"


def _worker(rank: int, world: int, port: int, timeout: float, backend: str, conn: Any) -> None:
    sys.path.insert(0, _HERE)
    import logging

    logging.basicConfig(
        level=os.environ.get("TENSORFERRY_LOG_LEVEL", "WARNING").upper(),
        format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s",
    )
    try:
        import _cases

        import tensorferry.p2p as p2p

        if ONE_GPU_RANKS:  # read by NCCL when it makes the rank's first communicator
            os.environ["NCCL_HOSTID"] = f"tensorferry-test-rank-{rank}"
        p2p.init(
            backend,
            rank=rank,
            world_size=world,
            init_method=f"tcp://127.0.0.1:{port}",
            timeout=timeout,
        )
        conn.send(("ready", None))
    except BaseException:
        conn.send(("err", traceback.format_exc()))
        return
    while True:
        job = conn.recv()
        if job is None:
            p2p.shutdown()
            conn.send(("bye", None))
            return
        name, args = job
        if os.environ.get("TF_TEST_DUMP_AFTER"):
            import faulthandler

            faulthandler.dump_traceback_later(float(os.environ["TF_TEST_DUMP_AFTER"]))
        try:
            result = getattr(_cases, name)(rank, world, *args)
            conn.send(("ok", result))
        except BaseException:
            conn.send(("err", traceback.format_exc()))


class WorkerPool:
    """``world`` ranks on loopback, each a spawned process with ``tf.init(backend)`` done:
    ``"gloo"`` keeps them on the CPU on any machine (the CPU tier), ``"auto"`` puts them on
    their GPUs where there are some (the GPU tier)."""

    def __init__(
        self,
        world: int,
        *,
        transfer_timeout: float = 10.0,
        start_timeout: float = 60,
        backend: str = "auto",
    ):
        self.world = world
        self.broken: str | None = None
        self._conns, self._procs = [], []
        self._settings = (transfer_timeout, start_timeout, backend)
        self._begin()

    def _begin(self) -> None:
        with reserved_port() as port:  # until every rank is in: pools may start side by side
            self._start(port, *self._settings)

    def renew(self, why: str) -> None:
        """A fresh world: after a failed case, what it left in flight (a transfer, a static
        agreement) would otherwise fail the cases after it, hiding which one failed first."""
        self.close()
        self._conns, self._procs = [], []
        try:
            self._begin()
        except Exception as exc:
            self.broken = f"{why}, and a fresh world could not start: {exc}"

    def _start(
        self, port: int, transfer_timeout: float, start_timeout: float, backend: str
    ) -> None:
        ctx = mp.get_context("spawn")
        world = self.world
        for rank in range(world):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker,
                args=(rank, world, port, transfer_timeout, backend, child),
                daemon=True,
            )
            proc.start()
            self._conns.append(parent)
            self._procs.append(proc)
        for rank in range(world):
            status, detail = self._receive(rank, start_timeout)
            if status != "ready":
                self.close()
                raise RuntimeError(f"rank {rank} failed to start:\n{detail}")

    def _receive(self, rank: int, timeout: float) -> tuple[str, Any]:
        conn = self._conns[rank]
        if not conn.poll(timeout):
            self.broken = f"rank {rank} did not answer within {timeout} s"
            raise TimeoutError(self.broken)
        return conn.recv()

    def run(self, name: str, *args: Any, ranks: list[int] | None = None, timeout: float = 30):
        """Runs case ``name`` on ``ranks`` (default all) at once; returns their results.

        Raises:
            AssertionError: a rank raised (its traceback is in the message).
            TimeoutError: a rank did not finish in ``timeout`` (the pool is then torn down).
        """
        if self.broken:
            raise RuntimeError(f"worker pool is broken: {self.broken}")
        ranks = list(range(self.world)) if ranks is None else ranks
        for rank in ranks:
            self._conns[rank].send((name, args))
        deadline = time.monotonic() + timeout
        results, errors = {}, []
        for rank in ranks:
            try:
                status, value = self._receive(rank, max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                self.close()
                raise
            if status == "ok":
                results[rank] = value
            else:
                errors.append(f"--- rank {rank} ---\n{value}")
        if errors:
            self.renew(f"case {name} failed")
            raise AssertionError(f"case {name} failed:\n" + "\n".join(errors))
        return [results[r] for r in ranks]

    def kill(self, rank: int) -> None:
        """SIGKILLs a worker (a peer that dies without saying goodbye)."""
        self._procs[rank].kill()
        self._procs[rank].join(5)

    def close(self) -> None:
        for rank, (conn, proc) in enumerate(zip(self._conns, self._procs, strict=True)):
            if proc.is_alive():
                try:
                    conn.send(None)
                    if conn.poll(5):
                        conn.recv()
                except (OSError, EOFError):
                    pass
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
            del rank
