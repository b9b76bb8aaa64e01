"""Compiled actor graphs whose communication overlaps their compute.

Build a static graph of actor method calls, compile it into one schedule per actor (READ /
COMPUTE / WRITE operations, checked for deadlock), and run it many times with little overhead::

    import tensorferry as tf
    from tensorferry.graph import InputNode, MultiOutputNode

    Sender, Receiver = tf.actor(SenderCls), tf.actor(ReceiverCls)
    s, r = Sender.spawn(device=0), Receiver.spawn(device=1)
    with InputNode() as inp:
        y = r.consume.bind(s.produce.bind(inp).with_transport("auto"))
    dag = MultiOutputNode([y]).compile(overlap_communication=True)
    print(dag.execute(3).get(timeout=10))
    dag.teardown()

Actors spawned with ``.spawn(..., executor="ray", num_gpus=1, resources={...})`` are Ray actors
placed on any node of a Ray cluster; their graphs run on the Ray executor (docs/multihost.md).
Ray is imported only then, never by ``import tensorferry``.
"""

from tensorferry.graph._actor import ActorClass, ActorHandle, ActorMethod, actor
from tensorferry.graph._actor_ray import RayActorHandle
from tensorferry.graph._compiled import (
    CompiledGraph,
    CompiledGraphFuture,
    CompiledGraphRef,
    CompileOptions,
)
from tensorferry.graph._dag import (
    ClassMethodNode,
    DAGNode,
    InputAttributeNode,
    InputNode,
    MultiOutputNode,
    TransportHint,
)
from tensorferry.graph._deadlock import WaitStep, check_deadlock, find_deadlock
from tensorferry.graph._plan import (
    DRIVER,
    ActorSpec,
    ArgRef,
    EdgeSpec,
    GraphSpec,
    Operation,
    OpKind,
    TaskSpec,
)
from tensorferry.graph._schedule import build_schedules, default_schedules, overlap_schedules

__all__ = [
    # building graphs
    "actor",
    "ActorClass",
    "ActorHandle",
    "ActorMethod",
    "RayActorHandle",
    "InputNode",
    "InputAttributeNode",
    "ClassMethodNode",
    "MultiOutputNode",
    "DAGNode",
    "TransportHint",
    # compiled graphs
    "CompiledGraph",
    "CompiledGraphRef",
    "CompiledGraphFuture",
    "CompileOptions",
    # the compiler's plain data and pure functions
    "DRIVER",
    "ActorSpec",
    "ArgRef",
    "TaskSpec",
    "EdgeSpec",
    "GraphSpec",
    "OpKind",
    "Operation",
    "build_schedules",
    "default_schedules",
    "overlap_schedules",
    "check_deadlock",
    "find_deadlock",
    "WaitStep",
]
