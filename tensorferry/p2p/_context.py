"""The process's p2p context: ``init``/``shutdown``, its pairs and its routes.

One process per device: the CUDA device is the local rank's when CUDA is present (else the
CPU). The context holds the world store, the control links (:mod:`._links`), one
:class:`~._pair.Pair` per peer (made on first use) and one route per transport name:
``ce`` (one host, CUDA: one-sided copy-engine writes), ``gloo`` (CPU), and ``nccl`` and
``nvlink`` (two-sided, :data:`TWO_SIDED`).

Thread-safety: ``init``/``shutdown`` hold a module lock; the pair and route tables have their
own lock; everything else is read-only after ``init``.
"""

from __future__ import annotations

import datetime
import importlib
import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from tensorferry import _native, envs
from tensorferry._seconds import checked_seconds
from tensorferry.errors import TensorFerryError
from tensorferry.p2p import _link
from tensorferry.p2p._links import Links, first_line
from tensorferry.p2p._pair import Pair
from tensorferry.p2p._transport import TransportContext
from tensorferry.p2p._two_sided import TwoSidedRoute
from tensorferry.runtime._devices import cuda_device_count

__all__ = ["P2PContext", "init", "shutdown", "current", "get_rank", "get_world_size"]

log = logging.getLogger(__name__)

BACKENDS = ("auto", "nccl", "gloo")
ONE_SIDED = "ce"
# How often the idle-pair watcher wakes to step the pairs nobody stepped meanwhile (seconds).
_IDLE_READ_S = 0.02
# How long tf.shutdown() waits for threads still making pairs to leave their rendezvous (a
# wait for an absent peer ends within milliseconds once shutdown began; one inside a library's
# own rendezvous may take longer, and is then left behind).
_MAKINGS_END_S = 2.0
# The two-sided transports: name -> (module, class), imported when a message first names one.
TWO_SIDED = {
    "nccl": ("tensorferry.p2p._nccl", "NcclTransport"),
    "nvlink": ("tensorferry.p2p.nvlink.transport", "NvlinkTransport"),
}
TRANSPORTS = ("auto", ONE_SIDED, "gloo", *TWO_SIDED)

_lock = threading.Lock()
_context: P2PContext | None = None
_incarnation = 0  # inits in this process: keeps store keys of successive inits apart


class P2PContext:
    """Everything ``tf.init`` set up. Reached through :func:`current`."""

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        backend: str,
        store: Any,
        timeout_s: float,
        master_addr: str | None,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.backend = backend
        self.timeout_s = timeout_s
        self.store = store
        self.host = _link.advertised_host(master_addr)
        self._lock = threading.Lock()
        self._pairs: dict[int, Pair] = {}
        self._routes: dict[str, Any] = {}
        self._same_host: dict[int, bool] = {}
        self.transport_ctx = TransportContext(
            rank=rank,
            world_size=world_size,
            device=device,
            store=store,
            timeout=datetime.timedelta(seconds=timeout_s),
            epoch_of=lambda peer: self.pair(peer).epoch,
        )
        self.links = Links(rank, self.host, store, self._incoming)
        self._stopping = threading.Event()
        self._watcher = threading.Thread(target=self._watch_idle_pairs, name="tensorferry-idle")
        self._watcher.daemon = True

    # ------------------------------------------------------------------ set-up
    def start(self) -> None:
        self.links.start()
        self._watcher.start()

    def _watch_idle_pairs(self) -> None:
        """Steps the pairs nobody stepped in the last half ``_IDLE_READ_S``: a rank that makes no
        call still answers its peers' faults (their next calls wait for that answer), and a
        transfer nobody waits for still moves. A pair a caller drives is left to it: a step
        here would take the GIL and the pair's lock from under its wait."""
        while not self._stopping.wait(_IDLE_READ_S):
            for pair in list(self._pairs.values()):
                if time.monotonic() - pair.stepped_at < _IDLE_READ_S / 2:
                    continue
                if pair.lock.acquire(blocking=False):
                    try:
                        pair.progress()
                    except Exception:
                        log.debug("p2p: reading an idle pair failed", exc_info=True)
                    finally:
                        pair.lock.release()

    def bind_device(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def _incoming(self, peer: int, link: Any) -> None:
        if 0 <= peer < self.world_size and peer != self.rank:
            self.pair(peer).attach_incoming(link)
        else:
            link.close()

    # ------------------------------------------------------------------ pairs and routes
    def pair(self, peer: int) -> Pair:
        pair = self._pairs.get(peer)
        if pair is None:
            with self._lock:
                pair = self._pairs.get(peer)
                if pair is None:
                    pair = self._pairs[peer] = Pair(self, peer)
        return pair

    def busy_pairs(self, besides: list[Pair]) -> list[Pair]:
        """Pairs other than ``besides`` with messages open: a waiter moves them on too (a
        gloo receive is posted only once its header is read, and a peer's send may wait on
        it)."""
        if len(self._pairs) <= len(besides):  # (two ranks: the one pair is the waiter's)
            return []
        return [p for p in self._pairs.values() if p.busy and p not in besides]

    def route(self, name: str) -> Any:
        """The route of transport ``name`` (made on first use).

        Raises:
            ValueError: ``name`` is not a known transport.
        """
        route = self._routes.get(name)
        if route is not None:
            return route
        with self._lock:
            route = self._routes.get(name)
            if route is None:
                route = self._routes[name] = self._make_route(name)
        return route

    def _make_route(self, name: str) -> Any:
        if name == ONE_SIDED:
            if self.device.type != "cuda":
                raise ValueError("transport 'ce' moves CUDA tensors, and this rank has no GPU")
            from tensorferry.p2p.copy_engine.one_sided import OneSidedRoute

            return OneSidedRoute(self.device)
        if name == "gloo":
            from tensorferry.p2p._gloo import GlooRoute

            return GlooRoute(self.transport_ctx)
        where = TWO_SIDED.get(name)
        if where is None:
            raise ValueError(f"unknown transport {name!r}; known: {', '.join(TRANSPORTS)}")
        module, cls = where
        try:
            transport = getattr(importlib.import_module(module), cls)(self.transport_ctx)
        except ImportError as exc:
            raise ValueError(f"transport {name!r} cannot run here: {first_line(exc)}") from None
        return TwoSidedRoute(transport)

    def choose(self, requested: str, peer: int, tensors: Sequence[torch.Tensor]) -> str:
        """The route for one message (on the caller's thread, before anything moves).

        Raises:
            TypeError: ``requested`` is not a string.
            ValueError: unknown transport, or it cannot carry these tensors.
        """
        if not isinstance(requested, str):
            raise TypeError(f"transport must be a str, got {type(requested).__name__}")
        cuda = tensors[0].is_cuda
        if requested == "auto":
            return self.default_route(peer) if cuda else "gloo"
        route = self.route(requested)
        if route.one_sided:
            if not cuda:
                raise ValueError(
                    f"transport 'ce' cannot carry this message: it moves CUDA tensors, got a "
                    f"tensor on {tensors[0].device} (use transport='gloo')"
                )
            return requested
        if route.name == "gloo":
            if cuda:
                raise ValueError(
                    f"transport 'gloo' cannot carry this message: it moves CPU tensors, got a "
                    f"tensor on {tensors[0].device}"
                )
            return requested
        reason = route.transport.unsupported_reason(peer=peer, tensors=tensors)
        if reason is not None:
            raise ValueError(f"transport {requested!r} cannot carry this message: {reason}")
        return requested

    def default_route(self, peer: int) -> str:
        """What ``transport="auto"`` picks for CUDA tensors with ``peer``: the copy engine
        between GPUs of one host, NCCL otherwise (both sides pick alike)."""
        if self.device.type != "cuda":
            return "gloo"
        return ONE_SIDED if self._on_this_host(peer) else "nccl"

    def _on_this_host(self, peer: int) -> bool:
        same = self._same_host.get(peer)
        if same is None:
            try:
                address = bytes(self.store.get(f"addr/{peer}")).decode()
            except Exception as exc:
                raise TensorFerryError(
                    f"cannot read rank {peer}'s address from the rendezvous store: {exc}"
                ) from None
            _, _, unix = address.partition(" unix=")
            here = _link.local_host_id()
            same = self._same_host[peer] = bool(here) and unix.partition("/")[0] == here
        return same

    def prepare(self, peer: int, name: str) -> None:
        """Makes the pair with ``peer`` for route ``name`` now (blocking)."""
        route = self.route(name)
        pair = self.pair(peer)
        with pair.lock:
            pair.connect()
        if not route.one_sided:
            route.prepare(pair)

    def evict_routes(self, pair: Pair, *, reason: str) -> None:
        """A fault or a lost peer: every route lets go of the pair's resources."""
        for route in list(self._routes.values()):
            try:
                route.evict(pair, reason)
            except Exception:
                log.exception("p2p: a route failed to let go of the pair with %d", pair.peer)

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        self.transport_ctx.stopping.set()
        self._stopping.set()
        if self._watcher.is_alive():
            self._watcher.join(1.0)
        self.transport_ctx.end_makings(_MAKINGS_END_S)
        reason = TensorFerryError("tf.shutdown() was called")
        for pair in list(self._pairs.values()):
            try:
                pair.close(reason)
            except Exception:
                log.exception("p2p: closing the pair with rank %d failed", pair.peer)
        self.links.close()
        for route in list(self._routes.values()):
            try:
                route.close()
            except Exception:
                log.exception("p2p: closing route %s failed", route.name)
        self._routes.clear()
        # The store stays referenced (see _keep_store): other ranks may still need it.
        _keep_store(self.store)
        self.transport_ctx.drop_store_clients()
        self.store = self.transport_ctx.store = None


# The last world's store, kept after tf.shutdown: the other ranks may still need it (to make
# pairs among themselves), and on the rank that serves it, it ends with its last reference. The
# next shutdown replaces it, so init and shutdown again and again keep one, not one each.
_last_store: Any = None


def _keep_store(store: Any) -> None:
    global _last_store
    _last_store = store


def _forget_after_fork() -> None:
    """A process forked from an initialised one shares its sockets and communicators but has
    none of its threads: using them would steal the parent's frames. It starts uninitialised
    (``tf.init`` makes its own layer); the parent's context is left alone."""
    global _context, _lock
    _lock = threading.Lock()
    _context = None


os.register_at_fork(after_in_child=_forget_after_fork)


# ---------------------------------------------------------------------- module API
def current() -> P2PContext:
    """The initialised context.

    Raises:
        RuntimeError: ``tf.init()`` was not called (or ``tf.shutdown()`` was).
    """
    context = _context
    if context is None:
        raise RuntimeError("tensorferry p2p is not initialised: call tf.init() first")
    return context


def is_initialized() -> bool:
    return _context is not None


def get_rank() -> int:
    """This process's rank. Raises RuntimeError before ``tf.init()``."""
    return current().rank


def get_world_size() -> int:
    """Number of ranks. Raises RuntimeError before ``tf.init()``."""
    return current().world_size


def init(
    backend: str = "auto",
    *,
    rank: int | None = None,
    world_size: int | None = None,
    init_method: str | None = None,
    timeout: float | None = None,
    store: Any = None,
    device: Any = None,
) -> None:
    """Sets up point-to-point transfers for this process (one process per device).

    Rank and world size come from the arguments, else from torchrun's environment (``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``, ``LOCAL_RANK``). With CUDA present the device
    is ``cuda:LOCAL_RANK`` (made current); without, the CPU. If ``torch.distributed`` is already
    initialised and no ``init_method`` is given, its store, rank and world size are reused.
    No collective runs: communicators are made later, per pair, by the two ranks involved.

    Args:
        backend: ``"auto"`` (NCCL with CUDA, else gloo), ``"nccl"`` or ``"gloo"`` — the default
            device of this process: ``"gloo"`` keeps a CUDA machine's process on the CPU.
        rank: this process's rank (default: ``$RANK``).
        world_size: number of processes (default: ``$WORLD_SIZE``).
        init_method: rendezvous URL (``env://``, ``tcp://host:port``, ``file://…``); default
            ``env://``.
        timeout: seconds; default timeout of every transfer and bound of every rendezvous
            (default ``TENSORFERRY_TRANSFER_TIMEOUT_S``).
        store: a ``torch.distributed`` store every rank reaches (for processes that already
            share one, e.g. actors of a compiled graph); needs ``rank`` and ``world_size``, and
            excludes ``init_method``. Give each world a store (or ``PrefixStore``) of its own:
            its keys are used as they are. Its ranks must share one host (links listen on
            loopback).
        device: this process's device (``"cuda:1"``, a ``torch.device``); default as above.
            Must match ``backend``: a CUDA device with ``"auto"``/``"nccl"``, the CPU with
            ``"gloo"``.

    Raises:
        TypeError / ValueError: bad arguments (unknown backend, rank out of range, NCCL without
            CUDA, missing environment).
        RuntimeError: already initialised with different settings (call ``tf.shutdown()``).
        torch.distributed.DistError: the rendezvous failed (no rank 0 store within the
            timeout, say); it is a ``RuntimeError`` naming ``init_method``.
    """
    global _context, _incarnation
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    for name, value in (("rank", rank), ("world_size", world_size)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    timeout_s = (
        checked_seconds(timeout, "timeout") if timeout is not None else envs.transfer_timeout_s()
    )
    envs.apply_log_level()
    _native.start()  # the compiled validation loop, loaded or built in the background
    with _lock:
        if _context is not None:
            same = (
                (rank is None or rank == _context.rank)
                and (world_size is None or world_size == _context.world_size)
                and backend in ("auto", _context.backend)
            )
            if same:
                return  # idempotent
            raise RuntimeError(
                f"tensorferry p2p is already initialised (rank {_context.rank} of "
                f"{_context.world_size}, {_context.backend}); call tf.shutdown() first"
            )
        # Successive inits in one process meet under fresh keys of the rendezvous store; a
        # given store is the caller's namespace (every rank's incarnation count may differ,
        # e.g. actors that joined different graphs before).
        namespace = "tensorferry/p2p"
        if store is not None:
            _check_given_store(store, rank, world_size, init_method)
            master_addr = None  # no rendezvous host known: links advertise loopback
        else:
            namespace = f"tensorferry/p2p/{_incarnation + 1}"
            store, rank, world_size, master_addr = _rendezvous(
                rank, world_size, init_method, timeout_s
            )
        assert rank is not None and world_size is not None
        device, backend = (
            _given_device(device, backend) if device is not None else (_pick_device(backend, rank))
        )
        _incarnation += 1
        import torch.distributed as dist

        prefixed = dist.PrefixStore(namespace, store)
        context = P2PContext(
            rank=rank,
            world_size=world_size,
            device=device,
            backend=backend,
            store=prefixed,
            timeout_s=timeout_s,
            master_addr=master_addr,
        )
        context.bind_device()
        context.start()
        _context = context
        log.info("p2p: rank %d of %d on %s (%s)", rank, world_size, device, backend)


def shutdown() -> None:
    """Stops the p2p layer: in-flight transfers fail, peers are told, communicators closed.

    Calling it when not initialised does nothing.
    """
    global _context
    with _lock:
        context, _context = _context, None
    if context is not None:
        context.close()


def _rendezvous(
    rank: int | None, world_size: int | None, init_method: str | None, timeout_s: float
) -> tuple[Any, int, int, str | None]:
    import torch.distributed as dist

    if init_method is None and dist.is_available() and dist.is_initialized():
        store = dist.distributed_c10d._get_default_store()
        return store, dist.get_rank(), dist.get_world_size(), os.environ.get("MASTER_ADDR")
    method = init_method or "env://"
    if rank is None:
        rank = _env_int("RANK", method)
    if world_size is None:
        world_size = _env_int("WORLD_SIZE", method)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is out of range for world size {world_size}")
    if method.startswith("env://"):
        for var in ("MASTER_ADDR", "MASTER_PORT"):
            if var not in os.environ:
                raise ValueError(
                    f"init_method env:// needs ${var} (run under torchrun, or pass "
                    "init_method='tcp://host:port')"
                )
        master = os.environ["MASTER_ADDR"]
    elif method.startswith("tcp://"):
        master = method[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
    else:
        master = None
    try:
        store, rank, world_size = next(
            dist.rendezvous(method, rank, world_size, timeout=datetime.timedelta(seconds=timeout_s))
        )
    except dist.DistError as exc:  # its text ends in a C++ backtrace: keep the first line
        raise type(exc)(f"tf.init: the rendezvous at {method} failed: {first_line(exc)}") from None
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    return store, rank, world_size, master


def _check_given_store(
    store: Any, rank: int | None, world_size: int | None, init_method: Any
) -> None:
    """Checks the arguments that go with ``store=``."""
    if init_method is not None:
        raise ValueError("pass either store= or init_method=, not both")
    if rank is None or world_size is None:
        raise ValueError("store= needs rank= and world_size= as well")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is out of range for world size {world_size}")
    if not all(hasattr(store, name) for name in ("set", "get", "wait")):
        raise TypeError(f"store must be a torch.distributed Store, got {type(store).__name__}")


def _given_device(device: Any, backend: str) -> tuple[torch.device, str]:
    try:
        device = torch.device(device)
    except (TypeError, RuntimeError) as exc:
        raise ValueError(f"device {device!r} is not a device: {exc}") from None
    if device.type == "cuda":
        if backend == "gloo":
            raise ValueError(f"backend='gloo' keeps this process on the CPU, got device {device}")
        count = cuda_device_count()
        index = 0 if device.index is None else device.index
        if not 0 <= index < count:
            raise ValueError(f"device {device} does not exist: this process sees {count} GPU(s)")
        return torch.device("cuda", index), "nccl"
    if device.type == "cpu":
        if backend == "nccl":
            raise ValueError("backend='nccl' needs a CUDA device, got device cpu")
        return device, "gloo"
    raise ValueError(f"device must be a CUDA device or the CPU, got {device}")


def _env_int(name: str, method: str) -> int:
    raw = os.environ.get(name)
    if raw is None:
        raise ValueError(
            f"${name} is not set: run under torchrun or pass {name.lower()}= (init_method {method})"
        )
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"${name}={raw!r} is not an integer") from None


def _pick_device(backend: str, rank: int) -> tuple[torch.device, str]:
    count = cuda_device_count()
    if backend == "nccl" and not count:
        raise ValueError("backend='nccl' needs CUDA, and this process sees no CUDA device")
    if backend == "gloo" or not count:
        return torch.device("cpu"), "gloo"
    local = int(os.environ.get("LOCAL_RANK", rank % count))
    if not 0 <= local < count:
        raise ValueError(f"LOCAL_RANK={local} but this process sees {count} CUDA device(s)")
    return torch.device("cuda", local), "nccl"
