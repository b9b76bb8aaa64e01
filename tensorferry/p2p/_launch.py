"""Run a function on a small local world: under torchrun as is, else in spawned processes.

Used by the p2p demo and the p2p benchmarks: ``tensorferry bench toy`` works both as
``torchrun --nproc-per-node 2 -m tensorferry.cli.main bench toy`` and as a plain command that
starts its own two processes.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import socket
import time
import traceback
from collections.abc import Callable, Iterator
from queue import Empty
from typing import Any

__all__ = ["under_torchrun", "reserved_port", "run_world", "torch_group"]

# How often the parent looks whether a rank's process ended without its result (seconds).
_LOOK_S = 0.2


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


@contextlib.contextmanager
def reserved_port() -> Iterator[int]:
    """A free TCP port for a rendezvous store on this host, kept from others while the block
    runs.

    A port found free and let go at once can be taken before rank 0's store binds it: by another
    world's store picking ports the same way, or as the local end of any outgoing connection
    (both draw from the kernel's free ports). Held bound but not listening, with
    ``SO_REUSEADDR``, the port is never handed out by the kernel, while a store binding it with
    ``SO_REUSEADDR`` (torch's ``TCPStore`` does) still can.

    Held on every local address (the wildcard), not only loopback: the store listens on every
    address, so a listener on any one of them makes it fail (``EADDRINUSE``), and a port held
    on loopback alone was still handed out to listeners on other addresses, such as NCCL's on
    a network card's address in another process of the host.
    """
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("0.0.0.0", 0))
        yield sock.getsockname()[1]


def _entry(
    fn: Callable[..., Any],
    rank: int,
    world: int,
    port: int,
    backend: str,
    timeout: float,
    args: tuple,
    queue: Any,
) -> None:
    import tensorferry.p2p as p2p

    try:
        p2p.init(
            backend,
            rank=rank,
            world_size=world,
            init_method=f"tcp://127.0.0.1:{port}",
            timeout=timeout,
        )
        try:
            result = fn(rank, world, *args)
        finally:
            p2p.shutdown()
        # Pickled here: the queue pickles on a thread of its own, where a failure is only
        # printed, and the parent would wait for a result that never comes.
        try:
            pickle.dumps(result)
        except Exception as exc:
            raise TypeError(
                f"rank {rank}'s result ({type(result).__name__}) cannot be sent back to the "
                f"parent process: {exc}"
            ) from None
        queue.put((rank, "ok", result))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))


def run_world(
    fn: Callable[..., Any],
    *args: Any,
    world: int = 2,
    backend: str = "auto",
    timeout: float = 60.0,
    join_timeout: float = 600.0,
) -> list[Any]:
    """Runs ``fn(rank, world, *args)`` on every rank after ``tf.init``; returns the results.

    Under torchrun, this process is one rank: it runs ``fn`` once and returns ``[result]``
    (``tf.init`` from the environment). Otherwise it spawns ``world`` processes on this machine
    (``fn`` must be importable: a module-level function).

    Raises:
        RuntimeError: a rank raised (with its traceback; a result that cannot be pickled back
            raises there too), its process ended without returning (a crash, a kill: said
            within a fraction of a second), or it did not finish in ``join_timeout``.
    """
    import tensorferry.p2p as p2p

    if under_torchrun():
        p2p.init(backend, timeout=timeout)
        try:
            return [fn(p2p.get_rank(), p2p.get_world_size(), *args)]
        finally:
            p2p.shutdown()
    with reserved_port() as port:
        return _spawn_world(fn, args, world, port, backend, timeout, join_timeout)


def _spawn_world(
    fn: Callable[..., Any],
    args: tuple,
    world: int,
    port: int,
    backend: str,
    timeout: float,
    join_timeout: float,
) -> list[Any]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(
            target=_entry,
            args=(fn, rank, world, port, backend, timeout, args, queue),
            daemon=True,
        )
        for rank in range(world)
    ]
    for proc in procs:
        proc.start()
    results: dict[int, Any] = {}
    errors = []
    until = time.monotonic() + join_timeout
    try:
        while len(results) < world and not errors:
            try:
                rank, status, value = queue.get(timeout=_LOOK_S)
            except Empty:
                errors.extend(_ended_without_a_result(procs, results, queue))
                if not errors and time.monotonic() > until:
                    raise RuntimeError(f"a rank did not finish within {join_timeout} s") from None
                continue
            if status == "ok":
                results[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
    finally:
        for proc in procs:
            proc.join(timeout=5 if not errors else 1)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world)]


def _ended_without_a_result(procs: list, results: dict[int, Any], queue: Any) -> list[str]:
    """Why ranks whose process ended have no result (it crashed, or was killed), as errors;
    a result still on its way through the queue is taken into ``results`` first."""
    ended = [rank for rank, proc in enumerate(procs) if rank not in results and not proc.is_alive()]
    if not ended:
        return []
    with contextlib.suppress(Empty):  # what an ended process put is in the pipe by now
        while True:
            rank, status, value = queue.get(timeout=_LOOK_S)
            if status != "ok":
                return [f"rank {rank}:\n{value}"]
            results[rank] = value
    return [
        f"rank {rank}: its process ended (exit code {procs[rank].exitcode}) without returning"
        for rank in ended
        if rank not in results
    ]


@contextlib.contextmanager
def torch_group(name: str, timeout_s: float) -> Iterator[None]:
    """``torch.distributed``'s default process group beside this rank's p2p context, for a
    benchmark to compare with: same ranks, same store (under ``name``), NCCL on a GPU rank and
    gloo on a CPU one. Destroyed on exit."""
    import datetime

    import torch.distributed as dist

    from tensorferry.p2p import _context

    ctx = _context.current()
    cuda = ctx.device.type == "cuda"
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        store=dist.PrefixStore(name, ctx.store),
        rank=ctx.rank,
        world_size=ctx.world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        **({"device_id": ctx.device} if cuda else {}),
    )
    try:
        yield
    finally:
        dist.destroy_process_group()
