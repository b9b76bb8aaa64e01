"""Actors: ``tf.actor(cls)`` makes an actor class; ``.spawn(device=...)`` starts one process.

Each actor is one process (``multiprocessing`` spawn context, so CUDA works in it) pinned to its
device. The driver talks to it over a pipe for the slow, rare things — construct, direct calls,
start and stop a graph — and over shared-memory channels for every execution of a graph.

``.spawn(..., executor="ray")`` starts a Ray actor instead, placed by Ray on any node of the
cluster (:mod:`tensorferry.graph._actor_ray`).
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import multiprocessing
import os
import select
import signal
import socket
import struct
import sys
import threading
import time
import traceback
import weakref
from multiprocessing.reduction import ForkingPickler
from typing import Any

from tensorferry import envs
from tensorferry._seconds import checked_seconds
from tensorferry.errors import ActorDiedError, ActorError, TransferTimeoutError
from tensorferry.graph._dag import ClassMethodNode
from tensorferry.graph._methods import check_method_name, signature_mismatch
from tensorferry.graph._pipes import pipe_message, spawn_message
from tensorferry.runtime._devices import cuda_device_count, parse_device

log = logging.getLogger(__name__)

__all__ = ["actor", "ActorClass", "ActorHandle", "ActorMethod", "normalise_device"]

_names = itertools.count()
_live: weakref.WeakSet[ActorHandle] = weakref.WeakSet()


def normalise_device(device: Any) -> str:
    """``"cpu"`` or ``"cuda:N"`` from an int, a string or a ``torch.device``.

    Raises:
        ValueError: not a CPU or CUDA device, or a CUDA index this machine does not have.
        TypeError: not a device at all.
    """
    device = parse_device(device)  # actors run on "cpu" or "cuda:N"
    if device.type == "cpu":
        return "cpu"
    index = 0 if device.index is None else device.index
    count = cuda_device_count()
    if not 0 <= index < count:
        raise ValueError(f"cuda:{index} does not exist here ({count} CUDA device(s) visible)")
    return f"cuda:{index}"


class _NoAnswer(ActorDiedError):
    """An actor process did not answer in time. Still an :class:`ActorDiedError` for the start,
    graph set-up and teardown that wait for one (they treat the actor as lost); a direct call
    raises :class:`TransferTimeoutError` instead, since the actor goes on."""


class _NotSent(Exception):
    """Nothing of a message was written by its deadline: the pipe is as it was."""


def _unwritten(views: list[memoryview]) -> int:
    return sum(view.nbytes for view in views)


def _framed(data: bytes) -> list[memoryview]:
    """``data`` framed as ``multiprocessing.Connection.send_bytes`` frames it (the actor reads
    it with ``recv_bytes``): a 4-byte big-endian length, or -1 and an 8-byte one."""
    n = len(data)
    header = struct.pack("!i", n) if n <= 0x7FFFFFFF else struct.pack("!iQ", -1, n)
    return [memoryview(header), memoryview(data)]


def _unimportable(cls: type) -> str | None:
    """Why a local actor process could not import ``cls`` by name, or ``None``. A class of a
    script's ``__main__`` is found there: the process runs the script as its own main module
    (under ``if __name__ == "__main__":`` nothing starts twice). A notebook, the REPL,
    ``python -c`` and standard input have no file to run, and the process died at start."""
    if cls.__module__ != "__main__":
        return None
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    if path and os.path.isfile(path):
        return None
    return (
        f"{cls.__qualname__} is defined in the __main__ of a notebook, the REPL, python -c or "
        "standard input: a local actor process imports its class by name and cannot find it "
        "there. Define the class in a module file and import it, or spawn it with "
        "executor='ray', which sends classes by value"
    )


_GUARD = 'if __name__ == "__main__":'


def _importing_main() -> bool:
    """Whether this process is an actor process still importing the driver's main module (a
    spawned process runs it again, as ``__mp_main__``, before it starts its work)."""
    return bool(getattr(multiprocessing.process.current_process(), "_inheriting", False))


def _has_main_guard(path: str) -> bool:
    """Whether the script at ``path`` has an ``if __name__ == "__main__":`` block at its top
    level; ``True`` when that cannot be told (then nothing is claimed about it)."""
    import ast

    try:
        with open(path, "rb") as source:
            tree = ast.parse(source.read(), path)
    except (OSError, SyntaxError, ValueError):
        return True
    for node in tree.body:
        test = node.test if isinstance(node, ast.If) else None
        if isinstance(test, ast.Compare) and len(test.comparators) == 1:
            sides = (test.left, test.comparators[0])
            names = {side.id for side in sides if isinstance(side, ast.Name)}
            texts = {side.value for side in sides if isinstance(side, ast.Constant)}
            if names == {"__name__"} and texts == {"__main__"}:
                return True
    return False


def _main_import_hint(exitcode: int | None) -> str | None:
    """Why an actor process that ended before it answered its start most likely did, or
    ``None``. It ended by itself (an exit code, not a signal) before running any of
    tensorferry's code, which answers every failure of its own: the usual cause is the import
    of the driver's main module, which every actor process runs again."""
    if exitcode is None or exitcode < 0:  # still running, or killed: not a failed import
        return None
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    if not path or not os.path.isfile(path):
        return None
    if not _has_main_guard(path):
        return (
            f"every actor process imports the driver's script {path} again, and that script has "
            f"no `{_GUARD}` guard, so the import ran the whole script (starting actors of its "
            f"own) and failed. Put the code that starts actors and graphs under `{_GUARD}` and "
            "keep actor classes at the top level of the script"
        )
    return (
        f"it most likely failed to import the driver's script {path} again, as every actor "
        "process does (its traceback is on standard error): top-level code of that script runs "
        f"in every actor process. Keep what only the driver does under `{_GUARD}`, and actor "
        "classes at the top level of the script"
    )


def _class_lookup_hint(cls: type, remote_traceback: str) -> str | None:
    """What to change when the actor process could not find ``cls`` by name, or ``None``."""
    if "in resolve_class" not in remote_traceback:
        return None
    lines = remote_traceback.strip().splitlines()
    if lines and lines[-1].startswith("AttributeError"):
        return (
            f"the actor process imports {cls.__module__}.{cls.__qualname__} by name and did not "
            f"find it there: define actor classes at the top level of their module, not under "
            f"`{_GUARD}` or inside another block"
        )
    return (
        f"the actor process could not import {cls.__module__}, the module of "
        f"{cls.__qualname__}: it must be importable there too (installed, or on PYTHONPATH)"
    )


def actor(cls: type) -> ActorClass:
    """Makes ``cls`` an actor class; usable as a decorator or as ``tf.actor(Worker)``.

    The class must be defined at the top level of an importable module: the actor process
    imports it by name.
    """
    if not isinstance(cls, type):
        raise TypeError(f"tf.actor takes a class, got {cls!r}")
    if "<locals>" in cls.__qualname__:
        raise TypeError(
            f"{cls.__qualname__} is defined inside a function; actor classes must be defined at "
            "the top level of a module so the actor process can import them"
        )
    return ActorClass(cls)


class ActorClass:
    """An actor class: ``spawn(*args, device=..., **kwargs)`` starts one actor process."""

    def __init__(self, cls: type) -> None:
        self.cls = cls
        self.__name__ = cls.__name__
        self.__qualname__ = cls.__qualname__
        self.__module__ = cls.__module__
        self.__doc__ = cls.__doc__

    def spawn(
        self,
        *args: Any,
        device: Any = None,
        name: str | None = None,
        start_timeout: float = 120.0,
        executor: str = "local",
        num_cpus: float | None = None,
        num_gpus: float | None = None,
        resources: dict[str, float] | None = None,
        ray_options: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        """Starts an actor and constructs ``cls(*args, **kwargs)`` in it.

        Args:
            device: ``"cpu"``, a CUDA index or ``"cuda:N"``; the actor makes it current. Local
                actors: a device of this machine (default ``"cpu"``). Ray actors: one of the
                GPUs Ray gives the actor, numbered from 0 (default ``"cuda:0"`` with
                ``num_gpus``, else ``"cpu"``).
            name: the actor's name in schedules and pictures (default ``ClassName-N``); the
                actors of one graph need names of their own.
            start_timeout: seconds to wait for the actor to start and construct (for Ray
                actors this includes waiting for a node with the resources asked for).
            executor: ``"local"`` (a process on this machine) or ``"ray"`` (a Ray actor on any
                node of the Ray cluster; ``ray.init()`` is called first if needed).
            num_cpus, num_gpus, resources: Ray resources the actor asks for (Ray actors only).
            ray_options: other options for Ray's ``.options()`` (e.g. ``scheduling_strategy``,
                ``runtime_env``; Ray actors only).

        Returns:
            An :class:`ActorHandle` (local) or a ``RayActorHandle`` (Ray); both bind, call and
            kill the same way.

        Raises:
            TypeError: the arguments do not fit the constructor's signature (nothing started).
            ActorError: the constructor raised (with the remote traceback).
            ActorDiedError: the actor died or did not start in time.
            ValueError: an unknown executor, or Ray options for a local actor.
            ImportError: ``executor="ray"`` without Ray installed.
        """
        envs.apply_log_level()
        name = name or f"{self.cls.__name__}-{next(_names)}"
        start_timeout = checked_seconds(start_timeout, "start_timeout")
        problem = signature_mismatch(self.cls, "__init__", args, kwargs)
        if problem is not None:  # before a process starts (seconds) only to raise it there
            raise TypeError(f"{self.cls.__name__}.spawn(): {problem}")
        if executor == "ray":
            from tensorferry.graph._actor_ray import spawn_ray_actor

            return spawn_ray_actor(
                self.cls,
                args,
                kwargs,
                device=device,
                name=name,
                start_timeout=start_timeout,
                num_cpus=num_cpus,
                num_gpus=num_gpus,
                resources=resources,
                ray_options=ray_options,
            )
        if executor != "local":
            raise ValueError(f"executor must be 'local' or 'ray', got {executor!r}")
        ray_only = {"num_cpus": num_cpus, "num_gpus": num_gpus, "resources": resources,
                    "ray_options": ray_options}  # fmt: skip
        given = [key for key, value in ray_only.items() if value is not None]
        if given:
            raise ValueError(f"{', '.join(given)} only apply to Ray actors (executor='ray')")
        if _importing_main():
            # Said here, in the actor process's traceback on standard error; the driver's
            # error names the same cause (see _main_import_hint).
            raise RuntimeError(
                f"{self.cls.__qualname__}.spawn() ran while an actor process imported the "
                f"driver's main module: code that starts actors belongs under `{_GUARD}`"
            )
        problem = _unimportable(self.cls)
        if problem is not None:
            raise TypeError(problem)
        device = normalise_device("cpu" if device is None else device)
        handle = ActorHandle(self.cls, device, name)
        handle._start(args, kwargs, start_timeout)
        return handle

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"{self.__name__} is an actor class; start one with .spawn(device=...)")

    def __repr__(self) -> str:
        return f"tf.actor({self.cls.__module__}.{self.cls.__qualname__})"


class ActorMethod:
    """``handle.method``: bind it into a graph, or call it directly with :meth:`call`."""

    def __init__(self, handle: ActorHandle, name: str) -> None:
        self._handle = handle
        self._name = name

    def bind(self, *args: Any, **kwargs: Any) -> ClassMethodNode:
        """A graph node calling this method with ``args`` (nodes or constants)."""
        return ClassMethodNode(self._handle, self._name, args, kwargs)

    def call(self, *args: Any, timeout: float = 60.0, **kwargs: Any) -> Any:
        """Calls the method now, outside any graph, and returns its result (pickled).

        Raises:
            TypeError: the arguments do not fit the method's signature (nothing was sent).
            ActorError: the method raised.
            ActorDiedError: the actor is dead.
            TransferTimeoutError: no answer within ``timeout``. The actor goes on with the call
                (later calls wait for it) and its result is dropped.
            RuntimeError: a compiled graph is running on this actor.
        """
        where = f"{self._handle.name}.{self._name}.call()"
        timeout = checked_seconds(timeout, f"{where}: timeout")
        problem = signature_mismatch(self._handle.actor_class, self._name, args, kwargs)
        if problem is not None:
            raise TypeError(f"{where}: {problem}")
        return self._handle._request(("call", self._name, args, kwargs), timeout)


class ActorHandle:
    """One running actor. Attribute access gives its methods (:class:`ActorMethod`)."""

    executor = "local"
    """The executor that runs graphs of this actor."""

    def __init__(self, cls: type, device: str, name: str) -> None:
        self.actor_class = cls
        self.device = device
        self.name = name
        self._owner_pid = os.getpid()  # -1 in a process forked from the owner
        self._process: Any = None
        self._conn: Any = None
        self._out: socket.socket | None = None  # the pipe's socket, for writes with a deadline
        # Finishes writing a message a call gave up on part-way (see _send).
        self._finisher: threading.Thread | None = None
        self._lock = threading.Lock()
        # Answers still to come to requests given up on (timed out): see _receive.
        self._owed = 0
        self.graph: Any = None
        """The compiled graph running on this actor, if any."""

    @property
    def device_key(self) -> str:
        """What tells this actor's device apart from other actors' (the device string)."""
        return self.device

    # ------------------------------------------------------------------ methods
    def __getattr__(self, name: str) -> ActorMethod:
        if name.startswith("__"):  # a protocol's probe (pickle, copy): not a method
            raise AttributeError(name)
        check_method_name(self.actor_class, name)
        return ActorMethod(self, name)

    # ------------------------------------------------------------------ lifetime
    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def is_alive(self) -> bool:
        """Whether the actor runs (false in a process forked from its owner: not its actor)."""
        if self._owner_pid != os.getpid():
            return False
        return self._process is not None and self._process.is_alive()

    def _start(self, args: tuple, kwargs: dict, timeout: float) -> None:
        from tensorferry.graph import _worker

        context = multiprocessing.get_context("spawn")
        parent, child = context.Pipe()
        class_ref = (self.actor_class.__module__, self.actor_class.__qualname__)
        self._process = context.Process(
            target=_worker.actor_main,
            args=(
                child,
                class_ref,
                spawn_message((args, kwargs)),
                self.device,
                self.name,
            ),
            name=f"tensorferry-actor-{self.name}",
            daemon=True,
        )
        try:
            self._process.start()  # pickles the arguments before it starts anything
        except Exception as exc:
            parent.close()
            child.close()
            self._process = None
            if isinstance(exc, OSError):
                raise
            raise _unpicklable(f"{self.actor_class.__name__}.spawn()", args, kwargs, exc) from exc
        child.close()
        self._conn = parent
        self._out = socket.socket(fileno=os.dup(parent.fileno()))
        _live.add(self)
        try:
            reply = self._receive(timeout, what="start")
        except _NoAnswer:
            self.kill(timeout=1.0)
            raise ActorDiedError(
                f"actor {self.name} did not start within start_timeout={timeout:.3g} s (its "
                "constructor included) and was stopped; a constructor that takes longer (loading "
                "a model, say) needs a larger start_timeout"
            ) from None
        except ActorDiedError as exc:
            self._process.join(2.0)  # it is ending: its exit code tells a failed import apart
            hint = _main_import_hint(self._process.exitcode)
            self.kill(timeout=1.0)
            if hint is None:
                raise
            raise ActorDiedError(f"{exc}: {hint}") from None
        except BaseException:
            self.kill(timeout=1.0)
            raise
        if reply[0] == "error":
            self.kill(timeout=1.0)
            hint = _class_lookup_hint(self.actor_class, reply[1])
            raise ActorError(f"{self.name}: {reply[1]}" + (f"\n{hint}" if hint else ""))

    def _receive(self, timeout: float, *, what: str) -> tuple:
        """The actor's answer to the last request. The actor answers every request in order,
        so answers to requests given up on earlier (:attr:`_owed`) come first: they are read
        and dropped, within the same ``timeout``. Giving up on this one adds it to them."""
        deadline = time.monotonic() + timeout
        while True:
            reply = self._next_reply(deadline, timeout, what)
            if not self._owed:
                return reply
            self._owed -= 1

    def _await_answer(self, deadline: float, timeout: float, what: str) -> None:
        """Returns once an answer can be read. Raises ``ActorDiedError`` if the actor died,
        :class:`_NoAnswer` if nothing came by ``deadline`` (``timeout`` names it)."""
        while not self._conn.poll(0.05):
            if not self._process.is_alive():
                raise ActorDiedError(
                    f"actor {self.name} (pid {self.pid}) died during {what} "
                    f"(exit code {self._process.exitcode})"
                )
            if time.monotonic() > deadline:
                raise _NoAnswer(f"actor {self.name} did not answer {what} in {timeout:.3g} s")

    def _next_reply(self, deadline: float, timeout: float, what: str) -> tuple:
        try:
            self._await_answer(deadline, timeout, what)
        except BaseException as exc:
            # Given up on (a timeout), or interrupted (Ctrl-C) while waiting: the answer still
            # comes, and is not the next request's (every later call returned the one before's).
            if isinstance(exc, _NoAnswer) or not isinstance(exc, ActorDiedError):
                self._owed += 1
            raise
        try:
            data = self._conn.recv_bytes()
        except (EOFError, OSError):
            raise ActorDiedError(f"actor {self.name} (pid {self.pid}) died during {what}") from None
        except BaseException:
            self._read_cut_off()
            raise
        try:
            return ForkingPickler.loads(data)
        except Exception:  # read whole, so the pipe is in step: only this answer is lost
            return ("unloadable", traceback.format_exc())

    def _settle(self, deadline: float) -> bool:
        """Reads and drops the answers owed to calls given up on, and waits for a message still
        being written in the background, until ``deadline``. Whether the actor is idle now (it
        runs nothing, and its pipe holds nothing of ours). Raises ``ActorDiedError``."""
        if not self._written(deadline):
            return False
        while self._owed:
            try:
                self._await_answer(deadline, 0.0, "a call given up on")
            except _NoAnswer:
                return False
            try:
                self._conn.recv_bytes()  # an answer nobody waits for any more
            except (EOFError, OSError):
                raise ActorDiedError(f"actor {self.name} (pid {self.pid}) died") from None
            self._owed -= 1
        return True

    def _read_cut_off(self) -> None:
        """An answer was read part-way when an interrupt came: the rest would be read as the
        next answer. The actor cannot be used again. (A message written part-way is finished
        in the background instead: see :meth:`_send`.)"""
        log.warning(
            "actor %s: interrupted while reading an answer from it; it is stopped, since its "
            "pipe is no longer in step",
            self.name,
        )
        self.kill(timeout=1.0)

    def _request(self, message: tuple, timeout: float) -> Any:
        self._check_owner()
        if self.graph is not None:
            raise RuntimeError(
                f"actor {self.name} runs a compiled graph; tear it down before calling directly"
            )
        deadline = time.monotonic() + timeout
        # Another thread's call holds the pipe until it is answered: waited for within this
        # call's timeout too (it was not: a call of 1 s behind one of 5 s returned after 5).
        if not self._lock.acquire(timeout=timeout):
            raise TransferTimeoutError(
                f"actor {self.name}.{message[1]} was not called: for {timeout:.3g} s the actor "
                "was busy with another thread's call to it"
            )
        try:
            try:
                self._send(message, deadline)
                reply = self._receive(max(0.0, deadline - time.monotonic()), what=message[0])
            except _NotSent:
                raise TransferTimeoutError(
                    f"actor {self.name}.{message[1]} was not called: for {timeout:.3g} s the "
                    "actor took no new message (it is still busy with calls given up on)"
                ) from None
            except _NoAnswer:
                raise TransferTimeoutError(
                    f"actor {self.name}.{message[1]} did not answer in {timeout:.3g} s; the "
                    "actor goes on with the call, and its result will be dropped"
                ) from None
        finally:
            self._lock.release()
        if reply[0] == "error":
            raise ActorError(f"{self.name}.{message[1]} raised:\n{reply[1]}")
        if reply[0] == "unloadable":
            raise ActorError(
                f"{self.name}.{message[1]} returned a value that cannot be rebuilt in this "
                f"process (the actor goes on):\n{reply[1]}"
            )
        if reply[0] == "unsent":
            raise ActorError(
                f"{self.name}.{message[1]} returned a value that cannot be pickled, so it "
                f"cannot come back to the caller: {reply[1]}"
            )
        return reply[1]

    def _check_owner(self) -> None:
        if self._owner_pid != os.getpid():
            raise RuntimeError(
                f"actor {self.name} belongs to the process that spawned it; a process forked "
                "from that one cannot use it"
            )

    def _send(self, message: tuple, deadline: float | None = None) -> None:
        """Writes ``message``, by ``deadline`` if given.

        Raises:
            _NotSent: nothing of it was written by ``deadline`` (the actor reads no new message
                while it runs a call, and the pipe holds about 176 KiB).
            _NoAnswer: part of it was written by ``deadline``: the rest is written in the
                background, the actor will run it, and its answer is owed.
        """
        self._check_owner()
        if not self.is_alive():
            raise ActorDiedError(f"actor {self.name} is not running")
        try:
            data = ForkingPickler.dumps(pipe_message(message))  # all of it before a byte goes
        except Exception as exc:
            if message[0] != "call":
                raise
            _, method, args, kwargs = message
            raise _unpicklable(f"{self.name}.{method}()", args, kwargs, exc) from exc
        if not self._written(deadline):
            raise _NotSent()
        views = _framed(data)
        total = _unwritten(views)
        try:
            self._write(views, deadline)
        except BaseException:
            if _unwritten(views) == total:
                raise  # nothing of it went: the pipe is as it was
            # Part of it went (the deadline passed, or an interrupt came): the rest follows in
            # the background, so the pipe stays in step, and the actor will answer it.
            self._owed += 1
            self._finisher = threading.Thread(
                target=self._write_rest, args=(views,), name=f"{self.name}-writer", daemon=True
            )
            self._finisher.start()
            raise

    def _written(self, deadline: float | None) -> bool:
        """Waits until ``deadline`` (``None``: for good) for a message left part-written to be
        finished in the background; whether none is left."""
        finisher = self._finisher
        if finisher is None:
            return True
        finisher.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not finisher.is_alive()

    def _write(self, views: list[memoryview], deadline: float | None) -> None:
        """Writes ``views`` (consuming them) until all went or ``deadline`` passed: then raises
        :class:`_NotSent`, or :class:`_NoAnswer` if some went."""
        out = self._out
        assert out is not None
        total = _unwritten(views)
        while views:
            # An interrupt (Ctrl-C) between a write and its counting would lose what went:
            # SIGINT waits until both are done.
            masked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            try:
                try:
                    sent = out.sendmsg(views, [], socket.MSG_DONTWAIT)
                except BlockingIOError:
                    sent = 0
                except OSError:
                    raise ActorDiedError(f"actor {self.name} (pid {self.pid}) died") from None
                while sent and views:
                    if sent >= views[0].nbytes:
                        sent -= views.pop(0).nbytes
                    else:
                        views[0] = views[0][sent:]
                        sent = 0
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, masked)
            if not views:
                return
            left = 0.05 if deadline is None else min(0.05, deadline - time.monotonic())
            if left <= 0:
                if _unwritten(views) == total:
                    raise _NotSent()
                raise _NoAnswer(f"actor {self.name} took part of a message only")
            if not self._process.is_alive():
                raise ActorDiedError(f"actor {self.name} (pid {self.pid}) died")
            select.select([], [out], [], left)

    def _write_rest(self, views: list[memoryview]) -> None:
        with contextlib.suppress(Exception):  # the actor died, or was killed meanwhile
            self._write(views, None)

    def kill(self, timeout: float = 5.0) -> None:
        """Ends the actor process: asks it to exit, then terminates, then kills it.

        Returns within about ``timeout`` seconds, with the process gone.
        """
        process = self._process
        if process is None or self._owner_pid != os.getpid():
            return  # never started, or not this process's actor
        deadline = time.monotonic() + max(timeout, 0.0)
        if process.is_alive():
            if self._written(time.monotonic()):
                # Asked to exit only if the message goes at once: the pipe may be full.
                with contextlib.suppress(ActorDiedError, _NotSent, _NoAnswer, OSError):
                    self._write(_framed(ForkingPickler.dumps(("exit",))), time.monotonic())
            process.join(max(0.0, (deadline - time.monotonic()) * 0.6))
        if process.is_alive():
            process.terminate()
            process.join(max(0.05, (deadline - time.monotonic()) * 0.5))
        if process.is_alive():
            process.kill()
            process.join(1.0)
        self._conn.close()
        if self._out is not None:
            self._out.close()
        _live.discard(self)

    def __repr__(self) -> str:
        state = "alive" if self.is_alive() else "dead"
        return f"ActorHandle({self.name}, {self.device}, pid={self.pid}, {state})"


def _unpicklable(call: str, args: tuple, kwargs: dict, error: Exception) -> TypeError:
    """The error for a call whose arguments failed to pickle on their way to an actor's process,
    naming the first argument that does not pickle alone."""
    from tensorferry.graph._sendable import first_unpicklable, named_arguments

    culprit = first_unpicklable(named_arguments(args, kwargs.items()))
    if culprit is None:
        return TypeError(
            f"{call}: the arguments cannot be pickled for the actor's process: {error}"
        )
    what, value, problem = culprit
    return TypeError(
        f"{call}: {what} ({type(value).__name__}) cannot be pickled, so it cannot reach the "
        f"actor's process: {problem}"
    )


@atexit.register
def _kill_all() -> None:
    for handle in list(_live):
        handle.kill(timeout=1.0)


def _forget_actors_after_fork() -> None:
    """In a process forked from the driver (by ``os.fork``, not by ``multiprocessing``): its
    exit runs the driver's exit handlers, ours and ``multiprocessing``'s, which would stop the
    driver's actors (``multiprocessing`` terminates the daemon processes it knows of). The
    handles stay, but leave the actors alone from here."""
    children = getattr(multiprocessing.process, "_children", None)
    for handle in list(_live):
        handle._owner_pid = -1
        if children is not None and handle._process is not None:
            children.discard(handle._process)
    _live.clear()


os.register_at_fork(after_in_child=_forget_actors_after_fork)
