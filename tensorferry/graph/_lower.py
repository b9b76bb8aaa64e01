"""Lowering: a graph of nodes becomes a :class:`GraphSpec`, with every compile-time check.

Checks (each a :class:`GraphCompileError` with what to change):
- the output is a method call or a ``MultiOutputNode`` of method calls;
- the graph has exactly one ``InputNode``;
- every bound call matches its method's signature (no missing or unknown arguments);
- every call takes a node as an argument (the input, or another call's result), so that every
  call runs once per ``execute()``;
- no call bound in the graph is left out of the outputs (its result would be lost);
- no two actors share a name (the name is an actor's identity in the graph);
- transport hints sit only on method calls, and not on a method annotated to return no tensor;
- each actor-to-actor edge gets a transport that works between the two devices: ``nccl``,
  ``nvlink`` and ``ce`` need two different CUDA devices; ``auto`` picks NCCL there and the
  executor's host channel otherwise (two actors on one GPU, or a CPU at either end): shared
  memory (``shm``) for local processes, ``tcp`` for Ray actors.

Two actors are on "the same device" when their handles' ``device_key`` match: the device string
for local actors; node, GPU id for Ray actors (whose device strings are local to each actor, so
two Ray actors on different GPUs may both say ``cuda:0``).
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Iterable
from typing import Any

from tensorferry.errors import GraphCompileError
from tensorferry.graph._dag import (
    ClassMethodNode,
    DAGNode,
    InputAttributeNode,
    InputNode,
    MultiOutputNode,
    TransportHint,
)
from tensorferry.graph._methods import signature_mismatch
from tensorferry.graph._plan import (
    DRIVER,
    ActorSpec,
    ArgRef,
    EdgeSpec,
    GraphSpec,
    TaskSpec,
)

__all__ = ["lower", "resolve_transport", "returns_tensor"]


def _ancestors(output: DAGNode) -> list[DAGNode]:
    seen: dict[int, DAGNode] = {}
    stack = [output]
    while stack:
        node = stack.pop()
        if node._node_id in seen:
            continue
        seen[node._node_id] = node
        if isinstance(node, ClassMethodNode):
            stack.extend(node.upstream())
        elif isinstance(node, MultiOutputNode):
            stack.extend(node.outputs)
        elif isinstance(node, InputAttributeNode):
            stack.append(node.input_node)
    return sorted(seen.values(), key=lambda n: n._node_id)


# Return annotations that can never carry a tensor; anything else might.
_NO_TENSOR_TYPES = (type(None), bool, int, float, complex, str, bytes)
_NO_TENSOR_NAMES = {"None", "bool", "int", "float", "complex", "str", "bytes"}


def returns_tensor(cls: type, method: str) -> bool | None:
    """What ``cls.method``'s return annotation says: ``True`` for a tensor type, ``False`` for a
    type that cannot hold one (``None``, numbers, strings), ``None`` when unknown — no
    annotation, or a container that may hold tensors (checked at run time instead)."""
    func = getattr(cls, method)
    try:
        hints = typing.get_type_hints(func)
    except Exception:  # unresolvable string annotations: fall back to the raw text
        hints = {"return": inspect.signature(func).return_annotation}
    annotation = hints.get("return", inspect.Signature.empty)
    if annotation is inspect.Signature.empty:
        return None
    if annotation is None or annotation in _NO_TENSOR_TYPES:
        return False
    text = annotation if isinstance(annotation, str) else repr(annotation)
    if text in _NO_TENSOR_NAMES:
        return False
    # Containers (dict, list, tuple, dataclasses, Any) may hold tensors: known at run time.
    return True if "Tensor" in text else None


def resolve_transport(
    hint: str,
    src_device: str,
    dst_device: str,
    *,
    where: str,
    same_device: bool | None = None,
    host_transport: str = "shm",
) -> str:
    """The transport an actor-to-actor edge uses.

    Args:
        hint: the node's transport hint.
        src_device, dst_device: the two actors' devices (``"cpu"`` or ``"cuda:N"``).
        where: the edge, for error messages.
        same_device: whether both actors use one device (default: the device strings match).
        host_transport: what ``auto`` picks when NCCL cannot connect the two.

    Raises:
        GraphCompileError: ``hint`` cannot work between these devices.
    """
    both_cuda = src_device.startswith("cuda") and dst_device.startswith("cuda")
    if same_device is None:
        same_device = src_device == dst_device
    if hint in ("shm", "tcp"):
        return hint
    if hint == "auto":
        return "nccl" if both_cuda and not same_device else host_transport
    if not both_cuda:
        raise GraphCompileError(
            f"{where}: transport {hint!r} needs CUDA devices at both ends, got {src_device} -> "
            f"{dst_device}; use 'auto' or 'shm'"
        )
    if same_device:
        raise GraphCompileError(
            f"{where}: transport {hint!r} cannot connect two actors on the same device "
            f"({src_device}); use 'auto' (picks a host channel there) or {host_transport!r}"
        )
    return hint


def _device_key(handle: Any) -> Any:
    """What tells the handle's device apart from other actors' (its device string by default).

    Looked up statically: handles answer unknown attributes with actor methods.
    """
    if inspect.getattr_static(handle, "device_key", None) is None:
        return handle.device
    return handle.device_key


def _check_signature(node: ClassMethodNode) -> None:
    cls = node.actor.actor_class
    func = inspect.getattr_static(cls, node.method, None)
    if func is None or not callable(getattr(cls, node.method)):
        raise GraphCompileError(f"{node!r}: {cls.__name__} has no method {node.method!r}")
    problem = signature_mismatch(cls, node.method, node.args, node.kwargs)
    if problem is not None:
        raise GraphCompileError(f"{node.actor.name}.{node.method}: {problem}")


def _check_follows_a_node(node: ClassMethodNode) -> None:
    """A call with no node among its arguments waits for nothing: it would run on its own,
    ahead of every ``execute()``, as often as its output has room."""
    nodes = (InputNode, InputAttributeNode, ClassMethodNode)
    if not any(isinstance(v, nodes) for v in (*node.args, *node.kwargs.values())):
        raise GraphCompileError(
            f"{node!r} takes no node as an argument (the InputNode, an input's key or another "
            "call's result), so nothing would make it wait for execute(): it would run ahead, "
            "on its own; bind it to the input or to a result it should follow"
        )


def _arg_ref(value: Any, task_ids: dict[int, int], where: str) -> ArgRef:
    if isinstance(value, InputNode):
        return ArgRef("input", None)
    if isinstance(value, InputAttributeNode):
        return ArgRef("input", value.key)
    if isinstance(value, ClassMethodNode):
        return ArgRef("task", task_ids[value._node_id])
    if isinstance(value, DAGNode):
        raise GraphCompileError(f"{where}: {value!r} cannot be an argument of a method call")
    return ArgRef("const", value)


def lower(
    output: DAGNode,
    *,
    available_transports: Iterable[str] | None = None,
    host_transport: str = "shm",
) -> GraphSpec:
    """Turns the graph ending at ``output`` into plain data, checking it on the way.

    Args:
        output: a method-call node or a :class:`MultiOutputNode` of them.
        available_transports: transports the executor can run (all when ``None``).
        host_transport: the executor's buffered host channel (``"shm"`` or ``"tcp"``): what
            ``auto`` picks when NCCL cannot connect two actors, and what carries the driver's
            inputs and outputs.

    Returns:
        The :class:`GraphSpec`: actors, tasks in bind order, edges with resolved transports.

    Raises:
        GraphCompileError: see the module docstring for what is checked.
    """
    if isinstance(output, MultiOutputNode):
        out_nodes = output.outputs
        multi = True
    elif isinstance(output, ClassMethodNode):
        out_nodes = [output]
        multi = False
    else:
        raise GraphCompileError(
            f"compile() must be called on a method call or a MultiOutputNode, not {output!r}"
        )
    if not out_nodes:
        raise GraphCompileError("MultiOutputNode has no outputs")
    for node in out_nodes:
        if not isinstance(node, ClassMethodNode):
            raise GraphCompileError(
                f"outputs must be actor method calls; {node!r} is not (return inputs yourself)"
            )
    nodes = _ancestors(output)
    inputs = [n for n in nodes if isinstance(n, InputNode)]
    if len(inputs) != 1:
        raise GraphCompileError(
            "the graph must read exactly one InputNode (bind a method to it inside "
            f"'with InputNode() as inp:'), found {len(inputs)}"
        )
    calls = [n for n in nodes if isinstance(n, ClassMethodNode)]
    for node in calls:
        _check_follows_a_node(node)
    in_graph = {n._node_id for n in nodes}
    lost = [
        n for n in inputs[0]._bound if isinstance(n, ClassMethodNode) and n._node_id not in in_graph
    ]
    if lost:
        names = ", ".join(repr(n) for n in lost)
        raise GraphCompileError(
            f"the results of {names} would be lost: no output depends on them; add them to "
            "the MultiOutputNode or remove them"
        )
    for node in nodes:
        if node._hint is not None and not isinstance(node, ClassMethodNode):
            raise GraphCompileError(
                f"{node!r} has a transport hint; only method calls take one (inputs and "
                "outputs always travel between the driver and actors over the host channel)"
            )

    actors: dict[str, ActorSpec] = {}
    handles: dict[str, Any] = {}  # an actor's name is its identity in the graph
    device_keys: dict[str, Any] = {}
    task_ids: dict[int, int] = {}
    tasks: list[TaskSpec] = []
    for node in calls:
        _check_signature(node)
        name = node.actor.name
        if handles.setdefault(name, node.actor) is not node.actor:
            raise GraphCompileError(
                f"two actors are named {name!r}: the graph would take them for one; spawn "
                "them with names of their own (spawn(..., name=...))"
            )
        actors[name] = ActorSpec(name, node.actor.device)
        device_keys[name] = _device_key(node.actor)
        where = repr(node)
        task_id = len(tasks)
        task_ids[node._node_id] = task_id
        tensor = returns_tensor(node.actor.actor_class, node.method)
        if node._hint is not None and tensor is False:
            raise GraphCompileError(
                f"{where} has transport hint {node._hint.transport!r} but "
                f"{node.actor.actor_class.__name__}.{node.method} is annotated to return no "
                "tensor; drop the hint"
            )
        args = tuple(_arg_ref(v, task_ids, where) for v in node.args)
        kwargs = tuple((k, _arg_ref(v, task_ids, where)) for k, v in node.kwargs.items())
        tasks.append(TaskSpec(task_id, name, node.method, args, kwargs, tensor))

    hints = {task_ids[n._node_id]: n._hint or TransportHint() for n in calls}
    allowed = set(available_transports) if available_transports is not None else None
    edges: list[EdgeSpec] = []
    # Driver inputs: one edge per actor that reads inputs, carrying the keys it needs.
    for actor in actors:
        keys: list[Any] = []
        for task in tasks:
            if task.actor == actor:
                keys.extend(k for k in task.input_keys() if k not in keys)
        if keys:
            edges.append(
                EdgeSpec(len(edges), DRIVER, actor, None, host_transport, input_keys=tuple(keys))
            )
    # Actor-to-actor edges: one per (producing task, consuming actor).
    for task in tasks:
        for src_id in task.arg_tasks():
            src = tasks[src_id]
            if src.actor == task.actor:
                continue
            if any(e.src_task == src_id and e.dst_actor == task.actor for e in edges):
                continue
            hint = hints[src_id]
            where = f"{src.actor}.{src.label} -> {task.actor}"
            transport = resolve_transport(
                hint.transport,
                actors[src.actor].device,
                actors[task.actor].device,
                where=where,
                same_device=device_keys[src.actor] == device_keys[task.actor],
                host_transport=host_transport,
            )
            if allowed is not None and transport not in allowed:
                raise GraphCompileError(
                    f"{where}: transport {transport!r} is not available with this executor "
                    f"(available: {sorted(allowed)})"
                )
            edges.append(
                EdgeSpec(
                    len(edges),
                    src.actor,
                    task.actor,
                    src_id,
                    transport,
                    static_shape=hint.static_shape,
                    direct_return=hint.direct_return,
                )
            )
    outputs = tuple(task_ids[n._node_id] for n in out_nodes)
    for task_id in dict.fromkeys(outputs):
        task = tasks[task_id]
        edges.append(EdgeSpec(len(edges), task.actor, DRIVER, task_id, host_transport))
    return GraphSpec(tuple(actors.values()), tuple(tasks), tuple(edges), outputs, multi)
