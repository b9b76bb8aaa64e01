"""Compile-time checks: each bad graph fails with a GraphCompileError that says what to fix."""

from __future__ import annotations

import pytest
from graph_fakes import FakeActor

from tensorferry.errors import GraphCompileError
from tensorferry.graph import DRIVER, InputNode, MultiOutputNode
from tensorferry.graph._lower import lower, resolve_transport


def test_auto_picks_nccl_between_gpus_and_shm_elsewhere():
    assert resolve_transport("auto", "cuda:0", "cuda:1", where="e") == "nccl"
    assert resolve_transport("auto", "cuda:0", "cuda:0", where="e") == "shm"
    assert resolve_transport("auto", "cpu", "cuda:1", where="e") == "shm"
    assert resolve_transport("shm", "cuda:0", "cuda:1", where="e") == "shm"


def test_nccl_between_two_actors_on_one_device_is_rejected():
    a, b = FakeActor("A", "cuda:0"), FakeActor("B", "cuda:0")
    with InputNode() as inp:
        dag = b.consume.bind(a.produce.bind(inp).with_transport("nccl"))
    with pytest.raises(GraphCompileError, match=r"same device.*'auto'"):
        lower(dag)
    with InputNode() as inp:
        dag = b.consume.bind(a.produce.bind(inp).with_transport("auto"))
    graph = lower(dag)
    assert [e.transport for e in graph.edges if e.src_actor == "A" and e.dst_actor == "B"] == [
        "shm"
    ]


@pytest.mark.parametrize("transport", ["nccl", "nvlink", "ce"])
def test_gpu_transports_need_gpus_at_both_ends(transport):
    a, b = FakeActor("A", "cpu"), FakeActor("B", "cuda:0")
    with InputNode() as inp:
        dag = b.consume.bind(a.produce.bind(inp).with_transport(transport))
    with pytest.raises(GraphCompileError, match="needs CUDA devices"):
        lower(dag)


def test_transport_the_executor_lacks_is_rejected():
    a, b = FakeActor("A", "cuda:0"), FakeActor("B", "cuda:1")
    with InputNode() as inp:
        dag = b.consume.bind(a.produce.bind(inp).with_transport("nvlink"))
    with pytest.raises(GraphCompileError, match="not available"):
        lower(dag, available_transports={"shm", "nccl"})
    assert lower(dag).edges[1].transport == "nvlink"


def test_lost_leaf_is_rejected_with_its_name():
    a = FakeActor("A")
    with InputNode() as inp:
        kept = a.produce.bind(inp)
        a.consume.bind(kept)  # nobody reads this one
        dag = MultiOutputNode([kept])
    with pytest.raises(GraphCompileError, match=r"A\.consume.*would be lost"):
        lower(dag)


def test_missing_and_unknown_arguments_are_rejected():
    a = FakeActor("A")
    with InputNode() as inp:
        dag = a.combine.bind(inp)
    with pytest.raises(GraphCompileError, match=r"combine.*missing"):
        lower(dag)
    with InputNode() as inp:
        dag = a.consume.bind(inp, y=3)
    with pytest.raises(GraphCompileError, match="unexpected keyword"):
        lower(dag)


class _Kinds:
    @staticmethod
    def scale(x, factor):
        return x * factor

    @classmethod
    def shift(cls, x, by):
        return x + by


def test_static_and_class_methods_are_checked_without_dropping_an_argument():
    a = FakeActor("A", cls=_Kinds)
    for method in ("scale", "shift"):
        with InputNode() as inp:
            lower(getattr(a, method).bind(inp, 2.0))  # both arguments: fits
        with InputNode() as inp:
            dag = getattr(a, method).bind(inp)
        with pytest.raises(GraphCompileError, match=rf"A\.{method}: .*missing a required"):
            lower(dag)


def test_graph_without_input_is_rejected():
    a = FakeActor("A")
    dag = a.consume.bind(5)
    with pytest.raises(GraphCompileError, match="exactly one InputNode"):
        lower(dag)


def test_two_actors_of_one_name_are_rejected():
    # The name is an actor's identity in the graph: two were taken for one (both calls ran on
    # the first, and the second was left running after teardown).
    first, second = FakeActor("worker"), FakeActor("worker")
    with InputNode() as inp:
        dag = MultiOutputNode([first.consume.bind(inp), second.consume.bind(inp)])
    with pytest.raises(GraphCompileError, match="two actors are named 'worker'"):
        lower(dag)
    with InputNode() as inp:
        lower(MultiOutputNode([first.consume.bind(inp), first.produce.bind(inp)]))  # one actor


def test_a_call_that_takes_no_node_is_rejected():
    # Nothing made it wait for execute(): it ran ahead, as often as its output had room (six
    # runs for three executions).
    a, b = FakeActor("A"), FakeActor("B")
    with InputNode() as inp:
        dag = MultiOutputNode([a.consume.bind(0), b.consume.bind(inp)])
    with pytest.raises(GraphCompileError, match=r"A\.consume.*takes no node.*execute\(\)"):
        lower(dag)
    with InputNode() as inp:
        dag = MultiOutputNode([a.consume.bind(x=0), b.consume.bind(inp)])
    with pytest.raises(GraphCompileError, match="takes no node"):
        lower(dag)
    with InputNode() as inp:
        lower(MultiOutputNode([a.combine.bind(0, b=inp.key), b.consume.bind(inp)]))


def test_transport_hint_on_a_method_returning_none_is_rejected():
    a, b = FakeActor("A", "cuda:0"), FakeActor("B", "cuda:1")
    with InputNode() as inp:
        dag = b.consume.bind(a.log.bind(inp).with_transport("nccl"))
    with pytest.raises(GraphCompileError, match="return no tensor"):
        lower(dag)
    with InputNode() as inp:  # unannotated: allowed, checked at run time
        dag = b.consume.bind(a.anything.bind(inp).with_transport("nccl"))
    assert lower(dag).tasks[0].returns_tensor is None


def test_transport_hint_on_input_is_rejected():
    a = FakeActor("A")
    with InputNode() as inp:
        dag = a.consume.bind(inp[0].with_transport("shm"))
    with pytest.raises(GraphCompileError, match="only method calls take one"):
        lower(dag)


def test_unknown_transport_is_a_value_error():
    a = FakeActor("A")
    with InputNode() as inp, pytest.raises(ValueError, match="transport must be one of"):
        a.consume.bind(inp).with_transport("carrier-pigeon")


@pytest.mark.parametrize("flag", ["static_shape", "direct_return"])
@pytest.mark.parametrize("value", ["no", 1, None])
def test_transport_promises_must_be_bools(flag, value):
    """``static_shape="no"`` was taken as a promise (any non-empty string is true)."""
    a = FakeActor("A")
    with InputNode() as inp:
        node = a.consume.bind(inp)
    with pytest.raises(TypeError, match=f"{flag} must be a bool, got {value!r}"):
        node.with_transport("auto", **{flag: value})
    assert node.with_transport("auto", **{flag: True}) is node


def test_outputs_must_be_method_calls():
    a = FakeActor("A")
    with InputNode() as inp:
        node = a.consume.bind(inp)
        dag = MultiOutputNode([node, inp])
    with pytest.raises(GraphCompileError, match="outputs must be actor method calls"):
        lower(dag)


def test_nodes_inside_containers_and_outputs_that_are_not_nodes_are_named():
    # Nothing resolves a node inside a list: it would have travelled as the node object, and
    # compile blamed the graph for reading no InputNode. A non-node output failed in lowering.
    a = FakeActor("A")
    with InputNode() as inp:
        node = a.consume.bind(inp)
        with pytest.raises(TypeError, match=r"A\.combine\.bind\(\): argument 0 holds .* list"):
            a.combine.bind([inp, 1], 2)
        with pytest.raises(TypeError, match=r"keyword argument 'b' holds a graph node .* dict"):
            a.combine.bind(node, b={"deep": (node,)})
        with pytest.raises(TypeError, match="MultiOutputNode output 1 is a int"):
            MultiOutputNode([node, 3])
        looped: list = [1]
        looped.append(looped)  # a container holding itself is looked through once
        a.combine.bind(node, looped)


def test_edges_inputs_and_outputs():
    a, b = FakeActor("A", "cuda:0"), FakeActor("B", "cuda:1")
    with InputNode() as inp:
        x = a.produce.bind(inp[0])
        y = b.combine.bind(x, inp.scale)
        dag = MultiOutputNode([y, x, y])
    graph = lower(dag)
    inputs = {e.dst_actor: e.input_keys for e in graph.edges if e.src_actor == DRIVER}
    assert inputs == {"A": (0,), "B": ("scale",)}
    assert graph.outputs == (1, 0, 1)
    outputs = [e for e in graph.edges if e.dst_actor == DRIVER]
    assert sorted(e.src_task for e in outputs) == [0, 1]  # one edge per distinct output
    (cross,) = [e for e in graph.edges if e.src_actor == "A" and e.dst_actor == "B"]
    assert cross.transport == "nccl"  # auto between two GPUs


def test_compile_options_of_the_wrong_type_or_range_are_named():
    from tensorferry.graph._compiled import CompileOptions

    bad = [
        ("overlap_communication", "yes", TypeError, "must be a bool"),
        ("profile", 1, TypeError, "must be a bool"),
        ("max_inflight", 2.0, TypeError, "must be an int"),
        ("buffer_size_bytes", 1.5e6, TypeError, "must be an int"),
        ("submit_timeout", "10", TypeError, "must be a number of seconds"),
        ("get_timeout", True, TypeError, "must be a number of seconds"),
        ("teardown_timeout", 0, ValueError, "must be > 0 seconds"),
        # A wait that can never end is refused (threading's locks overflowed on it at get()).
        ("get_timeout", float("inf"), ValueError, "must be a finite number of seconds"),
        ("submit_timeout", float("nan"), ValueError, "must be a finite number of seconds"),
    ]
    for name, value, error, text in bad:
        with pytest.raises(error, match=f"{name} {text}"):
            CompileOptions(**{name: value})
    options = CompileOptions(overlap_communication=True, submit_timeout=1, get_timeout=0.5)
    assert options.submit_timeout == 1 and options.overlap_communication


def test_actor_handles_name_private_and_missing_methods():
    from tensorferry.graph._methods import check_method_name

    class Kind:
        value = 3

        def shown(self) -> None: ...

        def _hidden(self) -> None: ...

    check_method_name(Kind, "shown")
    with pytest.raises(AttributeError, match=r"Kind\._hidden is private"):
        check_method_name(Kind, "_hidden")  # it said only "_hidden"
    with pytest.raises(AttributeError, match=r"^__deepcopy__$"):  # probes are told no at once
        check_method_name(Kind, "__deepcopy__")
    with pytest.raises(AttributeError, match="Kind has no method 'value'"):
        check_method_name(Kind, "value")
