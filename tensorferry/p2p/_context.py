"""The process's p2p context: ``init``/``shutdown``, transports, streams, issuing.

One process per device: the CUDA device is the local rank's when CUDA is present (else the
CPU). The context holds a :class:`tensorferry.Client` for its ``send``/``recv`` streams (exclusive
streams from the runtime's pool, not ``torch.cuda.Stream()``'s shared round-robin ones), the
world store, the transports made so far and the issuing :class:`~._engine.Engine`.

Thread-safety: ``init``/``shutdown`` hold a module lock; the context's transport table has its
own lock; everything else is read-only after ``init``.
"""

from __future__ import annotations

import datetime
import importlib
import importlib.util
import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

import torch

from tensorferry import _native, envs
from tensorferry._seconds import checked_seconds
from tensorferry.p2p import _link, _piece_copy, _trace
from tensorferry.p2p._spec import Descriptor, describe
from tensorferry.p2p._transport import (
    Transport,
    TransportContext,
    registered_transports,
    registry_version,
)
from tensorferry.runtime._devices import cuda_device_count
from tensorferry.runtime._events import (
    record_on_stream,
    record_when_issued,
    recycle,
    stream_wait,
)
from tensorferry.runtime._stream_switch import on_stream

__all__ = ["P2PContext", "init", "shutdown", "current", "get_rank", "get_world_size"]

log = logging.getLogger(__name__)

BACKENDS = ("auto", "nccl", "gloo")
# Modules of transports built beside this layer; imported at init so they register themselves
# (and take part in transport="auto"). A module that is missing or fails to import is skipped.
OPTIONAL_TRANSPORT_MODULES = [
    "tensorferry.p2p.nvlink.transport",
    "tensorferry.p2p.copy_engine.transport",
]

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
        from tensorferry.runtime import Client, completion_pool

        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.device_index = device.index  # read on every lone tensor's issue
        self.backend = backend
        self.timeout_s = timeout_s
        self.store = store
        # Read once: transport="auto" consults it for every message.
        self.auto_transports = envs.auto_transports()
        self._rankings: dict[tuple, tuple[str, ...]] = {}  # see choose()
        self.host = _link.advertised_host(master_addr)
        self.completions = completion_pool()
        self.client = Client(devices=[device]) if device.type == "cuda" else None
        self.send_stream = self.client.stream(device, "send") if self.client else None
        self.recv_stream = self.client.stream(device, "recv") if self.client else None
        self._transports: dict[str, Transport] = {}
        self._transports_lock = threading.Lock()
        from tensorferry.p2p._engine import Engine

        _trace.configure(envs.p2p_trace_events())
        self.engine = Engine(self)
        self.transport_ctx = TransportContext(
            rank=rank,
            world_size=world_size,
            device=device,
            store=store,
            timeout=datetime.timedelta(seconds=timeout_s),
            epoch_of=lambda peer: self.engine._peer(peer).epoch,
        )

    # ------------------------------------------------------------------ set-up
    def start(self) -> None:
        self.store.set(f"addr/{self.rank}", self.engine.address)
        self.engine.start()

    def bind_device(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def peer_address(self, rank: int) -> str:
        # Own client connection: this wait must not queue behind a pair's rendezvous.
        store = self.store.clone() if hasattr(self.store, "clone") else self.store
        return store.get(f"addr/{rank}").decode()

    # ------------------------------------------------------------------ transports
    def transport(self, name: str) -> Transport:
        """The process's instance of transport ``name`` (made on first use).

        Raises:
            ValueError: ``name`` is not registered.
        """
        transport = self._transports.get(name)  # made already: no lock (several per call)
        if transport is not None:
            return transport
        with self._transports_lock:
            transport = self._transports.get(name)
            if transport is not None:
                return transport
            factory = registered_transports().get(name)
            if factory is None:
                known = ", ".join(["auto", *registered_transports()])
                raise ValueError(f"unknown transport {name!r}; registered: {known}")
            transport = factory(self.transport_ctx)
            if not isinstance(transport, Transport):
                raise TypeError(f"transport factory {name!r} returned {type(transport).__name__}")
            self._transports[name] = transport
            return transport

    def choose(
        self,
        requested: str,
        peer: int,
        tensors: Sequence[torch.Tensor],
        desc: Descriptor | None = None,
    ) -> str:
        """The transport for one message (on the caller's thread, before anything moves);
        ``desc`` is the tensors' descriptor, when the caller has it.

        Raises:
            TypeError: ``requested`` is not a string.
            ValueError: unknown transport, or it cannot carry these tensors.
        """
        if not isinstance(requested, str):
            raise TypeError(f"transport must be a str, got {type(requested).__name__}")
        device_type = tensors[0].device.type
        if requested != "auto":
            transport = self.transport(requested)
            reason = transport.unsupported_reason(peer=peer, tensors=tensors)
            if reason is not None:
                raise ValueError(f"transport {requested!r} cannot carry this message: {reason}")
            return requested
        # Estimates are pure functions of (peer, size, count): rank the candidates once per
        # layout, then only ask the front runners whether they can carry this message. Keyed
        # by the descriptor, which remembers its hash, rather than by a sum over the tensors.
        if desc is None:
            desc = describe(tensors)
        shape = (peer, device_type, desc, registry_version())
        ranking = self._rankings.get(shape)
        if ranking is None:
            nbytes = sum(t.nbytes for t in tensors)
            ranking = self._rank(peer, device_type, nbytes, len(tensors))
            if len(self._rankings) < 4096:
                self._rankings[shape] = ranking
        reasons = []
        for name in ranking:
            reason = self.transport(name).unsupported_reason(peer=peer, tensors=tensors)
            if reason is None:
                return name
            reasons.append(f"{name}: {reason}")
        detail = "; ".join(reasons) or f"none registered for {device_type} tensors"
        raise ValueError(f"no transport can carry this message ({detail})")

    def _rank(self, peer: int, device_type: str, nbytes: int, count: int) -> tuple[str, ...]:
        """Auto candidates for this device type, fastest estimate first."""
        timed = []
        for order, name in enumerate(registered_transports()):
            if name not in self.auto_transports:
                continue
            transport = self.transport(name)
            if transport.device_type != device_type:
                continue
            estimate = transport.estimate_seconds(peer=peer, nbytes=nbytes, num_tensors=count)
            if estimate is not None:
                timed.append((estimate, order, name))
        return tuple(name for _, _, name in sorted(timed))

    # ------------------------------------------------------------------ issuing
    def issue(self, unit: Any) -> Any:
        """Starts a unit's transports (under the engine's lock); returns the CUDA done event."""
        messages = unit.messages
        lane = unit.lane
        if lane is not None and lane.cuda:  # a lone tensor whose transport is known already
            transport = lane.transport
        elif len(messages) == 1 and messages[0].op.tensors[0].is_cuda:  # the commonest unit
            transport = self.transport(messages[0].transport)
        else:
            return self._issue_several(unit, messages)
        message = messages[0]
        op = message.op
        stream = self.send_stream if op.kind == "send" else self.recv_stream
        if len(op.tensors) == 1:
            done = self._start_lone_between(transport, op, stream, unit)
            if done is not None:
                return done
        self._after_caller(stream, unit)
        pending = transport.start_lone(op, stream) if len(op.tensors) == 1 else None
        if pending is None:
            if not transport.makes_stream_current:
                return self._issue_on(stream, unit, {message.transport: [op]})
            pending = transport.start([op], stream=stream)
        unit.pending.append(pending)
        return record_on_stream(stream)  # the Transfer recycles it

    def _issue_several(self, unit: Any, messages: list[Any]) -> Any:
        """:meth:`issue` of a unit of several messages, or of host tensors."""
        on_host: list[Any] = []
        cuda_groups: dict[str, list[Any]] = {}
        for message in messages:
            if message.op.tensors[0].is_cuda:
                cuda_groups.setdefault(message.transport, []).append(message.op)
            else:
                on_host.append(message)
        if on_host:
            self.issue_on_host(unit, on_host)
        if not cuda_groups:
            return None
        has_send = any(op.kind == "send" for ops in cuda_groups.values() for op in ops)
        stream = self.send_stream if has_send else self.recv_stream
        return self._issue_on(stream, unit, cuda_groups)

    def _start_lone_between(self, transport: Transport, op: Any, stream: Any, unit: Any) -> Any:
        """``unit``'s one tensor started by ``transport`` with the stream's wait for the caller
        and the completion event in the same step (``Transport.start_lone_between``): that
        event (the Transfer recycles it), or ``None``, having done nothing, where it has no such
        way or the calling thread is on another device (the general way then)."""
        index = self.device_index
        if torch._C._cuda_getDevice() != index:
            return None
        started = transport.start_lone_between(op, stream, unit.caller_event, unit.caller_stream)
        if started is None:
            return None
        pending, done = started
        recycle(unit.caller_event, index)  # recorded and waited for: free to record again
        unit.caller_event = unit.caller_stream = None
        unit.pending.append(pending)
        return done

    def issue_on_host(self, unit: Any, messages: list[Any]) -> None:
        """Starts ``messages`` of ``unit`` (all of them, or one peer's part) that travel on
        host transports: no stream, no event."""
        groups: dict[str, list[Any]] = {}
        for message in messages:
            groups.setdefault(message.transport, []).append(message.op)
        for name, ops in groups.items():
            unit.pending.append(self.transport(name).start(ops, stream=None))

    def _issue_on(self, stream: Any, unit: Any, cuda_groups: dict[str, list[Any]]) -> Any:
        """Starts the CUDA transports of ``unit`` on ``stream``, after the caller's event;
        returns the event recorded after them."""
        self._after_caller(stream, unit)
        # Loops, not a comprehension and all() of a generator: each of those is a call, and
        # nearly every unit has one transport.
        transports = []
        switch = False
        for name, ops in cuda_groups.items():
            transport = self.transport(name)
            transports.append((transport, ops))
            switch = switch or not transport.makes_stream_current
        if not switch:
            for transport, ops in transports:
                unit.pending.append(transport.start(ops, stream=stream))
        else:
            with on_stream(stream):
                for transport, ops in transports:
                    unit.pending.append(transport.start(ops, stream=stream))
        return record_on_stream(stream)  # the Transfer recycles it (Transfer.__del__)

    def _after_caller(self, stream: Any, unit: Any) -> None:
        """Makes ``stream`` wait for the caller's work (``unit``'s caller event), on the rank's
        device; once per unit."""
        index = self.device_index
        if torch._C._cuda_getDevice() != index:
            self._own_thread_to_device()
        if unit.caller_stream is not None:
            self.record_caller(unit)
        event = unit.caller_event
        if event is not None:
            stream_wait(stream, event)
            recycle(event, index)  # the wait is enqueued: free to record again
            unit.caller_event = None

    def record_caller(self, unit: Any) -> None:
        """Records ``unit``'s caller event where it was put off to (``Unit.caller_stream``):
        on the caller's thread, before its call returns."""
        record_when_issued(unit.caller_event, self.device_index, unit.caller_stream)
        unit.caller_stream = None

    def _own_thread_to_device(self) -> None:
        """Makes this rank's device current on a thread of the library's own that issues
        transfers with another device current (the completion pool's poller, when it drives
        the engine: a thread starts on device 0).

        Issued from there, the stream switch goes to the device and back on every issue, and
        the event calls take torch's way, which on the second GPU made a CUDA context on device
        0 in rank 1's process (hundreds of MiB of another rank's GPU; most of a second with the
        GIL held). A user's thread keeps its current device: that is the caller's to choose.
        """
        if threading.current_thread().name.startswith("tensorferry-"):
            torch.cuda.set_device(self.device)

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        # A rendezvous still waiting for its peer on a helper thread gives up now (see
        # TransportContext.meet); the helpers are daemons, left to end with the process.
        self.transport_ctx.stopping.set()
        try:
            self.engine.stop()
        finally:
            with self._transports_lock:
                transports = list(self._transports.values())
                self._transports.clear()
            for transport in transports:
                try:
                    transport.close()
                except Exception:
                    log.exception("p2p: closing transport %s failed", transport.name)
            if self.client is not None:
                try:
                    self.client.close()
                except Exception:
                    log.exception("p2p: closing the client failed")
            # The context sits in reference cycles (engine, transfers) that only the cyclic
            # collector frees: its store, with its connections (and, on the rank that serves
            # it, its server), stayed open until that ran, about ten descriptors per init and
            # shutdown. The store is kept, but only the last world's (see _keep_store).
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
        _import_optional_transports()
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
        if device.type == "cuda":
            _piece_copy.prepare(device.index)  # the packed messages' copy kernel, compiled ahead
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
        text = str(exc).strip()
        first = text.splitlines()[0] if text else type(exc).__name__
        raise type(exc)(f"tf.init: the rendezvous at {method} failed: {first}") from None
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


def _import_optional_transports() -> None:
    for module in OPTIONAL_TRANSPORT_MODULES:
        try:
            if importlib.util.find_spec(module) is None:
                continue
            importlib.import_module(module)
        except Exception:
            log.warning("p2p: could not import transport module %s", module, exc_info=True)
