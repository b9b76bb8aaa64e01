"""Static GPU edges: the sender announces each execution's send so the receiver posts its
receive early, then writes the outcome; a failed value goes as stand-ins of the agreed layout.

Runs on the CPU: the link is a fake that matches sends to receives in order and copies the
bytes, CUDA events and stream switches are faked; the channel is a real shared-memory ring.
The GPU tier runs the same protocol over NCCL (tests/graph/test_gpu.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tensorferry.graph._channel import RemoteError
from tensorferry.graph._gpu import _ANNOUNCED, GpuOps, _Arrived
from tensorferry.graph._gpu_host import HostWrites
from tensorferry.graph._plan import EdgeSpec, Operation, OpKind


class FakeEvent:
    def record(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True


class FakeLink:
    """NCCL's contract: the n-th send on a direction meets the n-th receive, whatever the order
    in which the two sides issued them."""

    def __init__(self) -> None:
        self.sends: list[torch.Tensor] = []
        self.recvs: list[torch.Tensor] = []

    def send(self, tensor: torch.Tensor, peer: int):
        self.sends.append(tensor.clone())
        return SimpleNamespace(wait=lambda: None)

    def recv(self, tensor: torch.Tensor, peer: int):
        self.recvs.append(tensor)
        return SimpleNamespace(wait=lambda: None)

    def deliver(self) -> None:
        assert len(self.sends) == len(self.recvs), "sends and receives out of step"
        for sent, buffer in zip(self.sends, self.recvs, strict=True):
            buffer.copy_(sent)


@pytest.fixture
def channel_pair(ring, monkeypatch):
    """The shared ring (two slots: one execution's announcement and outcome), with CUDA faked."""
    monkeypatch.setattr(GpuOps, "_use", lambda self, stream: None)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    return ring


EDGE = EdgeSpec(0, "a", "b", 0, "nccl", static_shape=True, direct_return=True)
WRITE = Operation("a", OpKind.WRITE, edge_id=0)
READ = Operation("b", OpKind.READ, edge_id=0)


def _task(task_id: int) -> SimpleNamespace:
    return SimpleNamespace(label=f"method#{task_id}")


def _ops(control, link, *, writers=None, readers=None, overlap=True) -> GpuOps:
    """A GpuOps of one side of ``EDGE``, without a GPU."""
    ops = object.__new__(GpuOps)
    graph = SimpleNamespace(edge=lambda edge_id: EDGE, task=_task)
    plan = SimpleNamespace(schedule=[WRITE], graph=graph, max_inflight=1, actor="x")
    ops.runner = SimpleNamespace(writers=writers or {}, readers=readers or {}, plan=plan)
    ops._control = control
    ops._host = HostWrites()
    ops.overlap = overlap
    ops.device = torch.device("cpu")
    ops.compute_stream = ops.recv_stream = ops.send_stream = None
    ops.links = {"nccl": link}
    ops._ranks = {"a": 0, "b": 1}
    ops._profiling = False
    ops._static = {}
    ops._done = {}
    ops._announcing = ops._announcing_edges()
    ops._announced = {}
    ops._stand_ins = {}
    return ops


def _sent(sender: GpuOps, execution: int, value) -> None:
    # The fake link stands in for the streams and NCCL.
    sender._send = lambda ex, op, edge, tensors, done: [
        sender.links["nccl"].send(t, 1) for t in tensors
    ]
    sender.write(execution, WRITE, EDGE, value)


@pytest.mark.parametrize("overlap", [True, False])
def test_announced_receives_carry_values_and_errors_in_step(channel_pair, overlap):
    control, writer, reader = channel_pair
    link = FakeLink()
    sender = _ops(control, link, writers={0: writer})
    receiver = _ops(control, link, readers={0: reader}, overlap=overlap)
    assert sender.announces and [e.edge_id for e in sender._announcing] == [0]

    def receive(execution: int):
        got = receiver.read(execution, READ, EDGE)
        return receiver.settle(got) if overlap else got

    # First execution: nothing to announce yet (the layout is not known); the full metadata.
    sender.announce(0)
    assert not reader.readable()
    first = torch.randn(16)
    _sent(sender, 0, first)
    got = receive(0)
    link.deliver()
    value = got.value if overlap else got
    assert torch.equal(value, first)

    for execution, outcome in enumerate(["ok", "raised", "resized", "ok", "raised"], start=1):
        sender.announce(execution)
        assert reader.readable()  # announced before the sender computes anything
        posted = receiver.read(execution, READ, EDGE) if overlap else None
        if overlap:  # the receive is posted on the announcement alone
            assert isinstance(posted, _Arrived) and len(link.recvs) == execution + 1
        data = torch.randn(16)
        if outcome == "raised":
            _sent(sender, execution, RemoteError("a.make", "ValueError: boom", ""))
        elif outcome == "resized":
            _sent(sender, execution, torch.randn(8))
        else:
            _sent(sender, execution, data)
        got = receiver.settle(posted) if overlap else receive(execution)
        link.deliver()  # as many sends as receives: the pair stays matched
        if outcome == "ok":
            value = got.value if overlap else got
            assert torch.equal(value, data)
        else:
            assert isinstance(got, RemoteError)
            assert ("boom" if outcome == "raised" else "static_shape") in got.message
            assert torch.equal(link.sends[-1], torch.zeros(16))  # the stand-in
    assert not reader.readable()  # every announcement's outcome was read


def test_settle_reads_an_outcome_once_for_every_task_that_takes_the_value(channel_pair):
    control, writer, reader = channel_pair
    link = FakeLink()
    sender = _ops(control, link, writers={0: writer})
    receiver = _ops(control, link, readers={0: reader})
    _sent(sender, 0, torch.ones(4))
    receiver.settle(receiver.read(0, READ, EDGE))
    sender.announce(1)
    arrived = receiver.read(1, READ, EDGE)
    _sent(sender, 1, RemoteError("a.make", "ValueError: late", ""))
    first, second = receiver.settle(arrived), receiver.settle(arrived)
    assert isinstance(first, RemoteError) and first is second
    sender.announce(2)
    assert reader.read(timeout=1.0) == _ANNOUNCED  # the outcome was not read twice


def test_only_static_nccl_edges_with_room_for_two_messages_announce(channel_pair):
    control, writer, _ = channel_pair
    link = FakeLink()
    assert _ops(control, link, writers={0: writer}).announces
    for edge in (
        EdgeSpec(0, "a", "b", 0, "nccl", static_shape=False),
        EdgeSpec(0, "a", "b", 0, "ce", static_shape=True),
    ):
        ops = object.__new__(GpuOps)
        plan = SimpleNamespace(
            schedule=[WRITE],
            graph=SimpleNamespace(edge=lambda _id, e=edge: e, task=_task),
            max_inflight=1,
        )
        ops.runner = SimpleNamespace(writers={0: writer}, plan=plan)
        assert ops._announcing_edges() == []
    ops = object.__new__(GpuOps)
    plan = SimpleNamespace(schedule=[WRITE], graph=SimpleNamespace(edge=lambda _id: EDGE),
                           max_inflight=2)  # fmt: skip
    ops.runner = SimpleNamespace(writers={0: writer}, plan=plan)
    assert ops._announcing_edges() == []  # two slots, two executions in flight: no room
