"""Ray actors: ``Worker.spawn(..., executor="ray", num_gpus=1, resources={...})``.

Each actor is one Ray actor (:class:`~tensorferry.graph._ray_host.ActorHost` around the user's
object) with the resources it asks for, placed by Ray on any node of the cluster. The handle
binds, calls and kills like a local :class:`~tensorferry.graph.ActorHandle`, so the same graph
code runs on either; graphs of Ray actors compile onto the Ray executor.

Ray is an optional dependency: it is imported here, when a Ray actor is asked for, never when
tensorferry is imported.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from typing import Any

from tensorferry.errors import ActorDiedError, ActorError, TransferTimeoutError
from tensorferry.graph._actor import ActorMethod
from tensorferry.graph._methods import check_method_name
from tensorferry.runtime._devices import parse_device

__all__ = ["RayActorHandle", "require_ray", "spawn_ray_actor"]

_CONTROL_THREADS = 4
_host_class: Any = None  # ActorHost wrapped with ray.remote, made once per process


def require_ray() -> Any:
    """The ``ray`` module, initialised (``ray.init()`` when nothing is connected yet).

    Raises:
        ImportError: Ray is not installed.
    """
    try:
        import ray
    except ImportError:
        raise ImportError(
            "executor='ray' needs Ray: pip install 'tensorferry[ray]' (or pip install ray)"
        ) from None
    if not ray.is_initialized():
        ray.init()
    return ray


def _remote_host() -> Any:
    global _host_class
    if _host_class is None:
        import ray

        from tensorferry.graph._ray_host import CONTROL_GROUP, ActorHost

        _host_class = ray.remote(concurrency_groups={CONTROL_GROUP: _CONTROL_THREADS})(ActorHost)
    return _host_class


def _parse_device(device: Any, num_gpus: float | None) -> str:
    """``"cpu"`` or ``"cuda:N"`` (N among the GPUs Ray gives the actor), checked on the driver
    only for form: the driver may have no GPU at all."""
    if device is None:
        return "cuda:0" if num_gpus else "cpu"
    device = parse_device(device)
    if device.type == "cpu":
        return "cpu"
    if not num_gpus:
        raise ValueError(
            f"a Ray actor on {device} needs GPUs from Ray: pass num_gpus= (1 for one GPU)"
        )
    return f"cuda:{0 if device.index is None else device.index}"


def spawn_ray_actor(
    cls: type,
    args: tuple,
    kwargs: dict,
    *,
    device: Any,
    name: str,
    start_timeout: float,
    num_cpus: float | None,
    num_gpus: float | None,
    resources: dict[str, float] | None,
    ray_options: dict[str, Any] | None,
) -> RayActorHandle:
    """Starts a Ray actor for ``cls`` (see ``ActorClass.spawn``)."""
    device = _parse_device(device, num_gpus)
    if resources is not None and not isinstance(resources, dict):
        raise TypeError(f"resources must be a dict of name to amount, got {resources!r}")
    options: dict[str, Any] = dict(ray_options or {})
    for key in ("max_concurrency", "concurrency_groups"):
        if key in options:
            # The actor's object sees one call at a time (as in a local actor process); the
            # control methods have their own group.
            raise ValueError(f"ray_options may not set {key!r}: tensorferry sets it")
    ray = require_ray()
    for key, value in (("num_cpus", num_cpus), ("num_gpus", num_gpus), ("resources", resources)):
        if value is not None:
            options[key] = value
    ray_name = f"tensorferry-{name}-{uuid.uuid4().hex[:8]}"
    options.setdefault("name", ray_name)
    # Classes of an importable module travel by name (workers import them); a script's classes
    # (``__main__``) travel by value, pickled by Ray.
    target = cls if cls.__module__ == "__main__" else (cls.__module__, cls.__qualname__)
    actor = _remote_host().options(**options).remote(target, args, kwargs, device, name)
    handle = RayActorHandle(cls, device, name, actor, options["name"])
    try:
        reply = ray.get(actor.started.remote(), timeout=start_timeout)
    except ray.exceptions.GetTimeoutError:
        handle.kill(timeout=5.0)
        raise ActorDiedError(
            f"Ray actor {name} did not start in {start_timeout:.3g} s (does any node have the "
            f"resources it asks for: {options}?)"
        ) from None
    except ray.exceptions.RayError as exc:
        handle.kill(timeout=5.0)
        raise ActorDiedError(f"Ray actor {name} died while starting: {exc}") from None
    if reply[0] == "error":
        handle.kill(timeout=5.0)
        raise ActorError(f"{name}: constructor raised:\n{reply[1]}")
    handle._placed(reply[1])
    return handle


class RayActorHandle:
    """One running Ray actor. Attribute access gives its methods (``ActorMethod``).

    Attributes:
        ray_actor: the underlying Ray actor handle.
        ray_name: its name in Ray (``ray.get_actor(ray_name)`` finds it while it lives).
        node_id, node_ip: where Ray placed it.
        gpu_ids: the GPUs Ray gave it (as Ray numbers them on that node).
        device: ``"cpu"`` or ``"cuda:N"`` as the actor sees it.
        device_key: what tells two actors' devices apart across nodes.
    """

    executor = "ray"
    """The executor that runs graphs of this actor."""

    def __init__(self, cls: type, device: str, name: str, actor: Any, ray_name: str) -> None:
        self.actor_class = cls
        self.device = device
        self.name = name
        self.ray_actor = actor
        self.ray_name = ray_name
        self.node_id: str | None = None
        self.node_ip: str | None = None
        self.gpu_ids: list[str] = []
        self.pid: int | None = None
        self._device_key: Any = device
        self._killed = False
        self.graph: Any = None
        """The compiled graph running on this actor, if any."""

    def _placed(self, where: dict[str, Any]) -> None:
        self.node_id = where["node_id"]
        self.node_ip = where["node_ip"]
        self.gpu_ids = where["gpu_ids"]
        self.pid = where["pid"]
        if self.device != "cpu":
            index = int(self.device.split(":")[1])
            gpu = self.gpu_ids[index] if index < len(self.gpu_ids) else self.device
            self._device_key = (self.node_id, gpu)

    @property
    def device_key(self) -> Any:
        """What tells this actor's device apart across nodes: ``"cpu"``, or (node id, GPU id)."""
        return self._device_key

    # ------------------------------------------------------------------ methods
    def __getattr__(self, name: str) -> ActorMethod:
        if name.startswith("__"):  # a protocol's probe (pickle, copy): not a method
            raise AttributeError(name)
        check_method_name(self.actor_class, name)
        return ActorMethod(self, name)  # type: ignore[arg-type]

    def __reduce__(self) -> Any:
        # As a local handle: it stays with the process that spawned the actor (unpickled
        # elsewhere it recursed in __getattr__, and a graph took it for a dead actor).
        raise TypeError(
            f"the handle of actor {self.name} cannot be sent to another process; call that "
            "actor from the driver, or bind its method into the graph"
        )

    def _request(self, message: tuple, timeout: float) -> Any:
        import ray

        if self.graph is not None:
            raise RuntimeError(
                f"actor {self.name} runs a compiled graph; tear it down before calling directly"
            )
        _, method, args, kwargs = message
        try:
            reply = ray.get(self.ray_actor.call.remote(method, args, kwargs), timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise TransferTimeoutError(
                f"actor {self.name}.{method} did not answer in {timeout:.3g} s"
            ) from None
        except ray.exceptions.RayActorError as exc:
            raise ActorDiedError(f"actor {self.name} died: {exc}") from None
        except ray.exceptions.RayError as exc:
            # The call failed, not the actor: an argument the actor could not rebuild, or a
            # result this process cannot (it was reported as the actor's death).
            raise ActorError(f"{self.name}.{method} failed (the actor goes on): {exc}") from None
        if reply[0] == "error":
            raise ActorError(f"{self.name}.{method} raised:\n{reply[1]}")
        return reply[1]

    # ------------------------------------------------------------------ lifetime
    def is_alive(self, timeout: float = 10.0) -> bool:
        """Whether the Ray actor answers (a dead one, or one on a lost node, does not)."""
        import ray

        if self._killed:
            return False
        try:
            return bool(ray.get(self.ray_actor.ping.remote(), timeout=timeout))
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
            return False

    def kill(self, timeout: float = 5.0) -> None:
        """Kills the Ray actor and waits (up to ``timeout``) until Ray reports it dead."""
        import ray

        if not ray.is_initialized():
            return
        deadline = time.monotonic() + max(timeout, 0.1)
        with contextlib.suppress(Exception):  # already gone, or its node is lost
            ray.kill(self.ray_actor, no_restart=True)
        self._killed = True
        while time.monotonic() < deadline:
            left = max(0.05, deadline - time.monotonic())
            try:
                ray.get(self.ray_actor.ping.remote(), timeout=left)
            except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
                return
            time.sleep(0.02)

    def __repr__(self) -> str:
        where = f"node {self.node_ip}" if self.node_ip else "not placed"
        state = "killed" if self._killed else "alive"
        return f"RayActorHandle({self.name}, {self.device}, {where}, pid={self.pid}, {state})"
