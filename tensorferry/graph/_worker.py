"""The main function of an actor process.

Commands arrive over a pipe from the driver:

- ``("call", method, args, kwargs)``: call a method now, reply ``("ok", result)``,
  ``("error", traceback)``, or ``("unsent", why)`` when the result does not pickle.
- ``("run", ActorRunPlan)``: set up the graph's channels (and NCCL), reply ``("ready",)``, then
  run the schedule until the graph is torn down; reply ``("stopped", why)``.
- ``("exit",)``: leave.

The process also leaves when the driver's end of the pipe closes. A driver killed while a graph
ran never tears it down: its actors stop by themselves (their waits watch the driver) and
remove the graph's shared-memory segments, which nothing else would.
"""

from __future__ import annotations

import contextlib
import importlib
import signal
import traceback
from multiprocessing.reduction import ForkingPickler
from typing import Any

from tensorferry.graph._methods import actor_method
from tensorferry.graph._pipes import Unloaded, pipe_message

__all__ = ["actor_main", "resolve_class"]


def resolve_class(class_ref: tuple[str, str]) -> type:
    """The class named ``(module, qualname)``; unwraps a ``tf.actor`` class."""
    module_name, qualname = class_ref
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    from tensorferry.graph._actor import ActorClass

    return obj.cls if isinstance(obj, ActorClass) else obj


def _pin(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.set_device(torch.device(device))


def _leave_to_the_driver(signum: int, frame: Any) -> None:
    """SIGINT in an actor: nothing (see :func:`actor_main`)."""


def actor_main(
    conn: Any,
    class_ref: tuple[str, str],
    arguments: Unloaded,
    device: str,
    name: str,
) -> None:
    """Entry point of the actor process (see module doc). ``arguments``: the constructor's
    ``(args, kwargs)``."""
    from tensorferry.runtime._spin import precise_sleeps

    # Ctrl-C in a terminal reaches the whole job, actors included: their graph loops ended with
    # KeyboardInterrupt while the driver, which caught it, went on. The driver decides: it
    # stops its actors (and they end when it does). A handler that does nothing, not SIG_IGN,
    # which programs a method starts would inherit.
    signal.signal(signal.SIGINT, _leave_to_the_driver)
    precise_sleeps()  # this process's waits sleep in short steps (see graph._channel)
    try:
        args, kwargs = arguments.load()
    except BaseException:
        why = "the constructor's arguments could not be rebuilt in the actor:\n"
        conn.send(("error", why + traceback.format_exc()))
        return
    try:
        _pin(device)
        instance = resolve_class(class_ref)(*args, **kwargs)
    except BaseException:
        conn.send(("error", "constructor raised:\n" + traceback.format_exc()))
        return
    conn.send(("started",))
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            return  # the driver is gone
        try:
            message = ForkingPickler.loads(data)
        except BaseException:
            # An argument this process cannot rebuild (its class is not importable here, say):
            # that call fails, and the actor goes on, the message having been read whole.
            conn.send(
                (
                    "error",
                    "the message could not be rebuilt in the actor:\n" + traceback.format_exc(),
                )
            )
            continue
        command = message[0]
        if command == "exit":
            return
        if command == "call":
            _, method, call_args, call_kwargs = message
            try:
                result = actor_method(instance, method)(*call_args, **call_kwargs)
            except BaseException:
                conn.send(("error", traceback.format_exc()))
            else:
                _reply_result(conn, result)
        elif command == "run":
            _run_graph(conn, instance, message[1])


def _reply_result(conn: Any, result: Any) -> None:
    """Replies with a direct call's result; one that does not pickle becomes the caller's error,
    and the actor goes on (the pipe pickles the whole reply before it writes a byte)."""
    try:
        conn.send(pipe_message(("ok", result)))
    except OSError:
        raise  # the driver is gone: the process ends
    except Exception as exc:
        conn.send(("unsent", f"{type(result).__name__}: {exc}"))


def _run_graph(conn: Any, instance: Any, plan: Any) -> None:
    from tensorferry.graph._channel import unlink_prefix
    from tensorferry.graph._runner import ScheduleRunner

    try:
        runner = ScheduleRunner(instance, plan)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready",))
    try:
        why = runner.run()
    except BaseException:
        why = "failed:\n" + traceback.format_exc()
        # This actor's part of the graph is over: the driver's and the other actors' waits
        # end now (ActorDiedError), not at their timeouts. Teardown logs why.
        runner.control.mark_dead(plan.index)
    finally:
        orphaned = runner.control.driver_gone
        runner.close()
    if orphaned and plan.segments:
        unlink_prefix(plan.segments)  # every actor of the graph may: it ignores what is gone
    with contextlib.suppress(BrokenPipeError, OSError):
        conn.send(("stopped", why))
