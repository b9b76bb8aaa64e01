"""Shared-memory channels in one process, and schedule pictures from fake graphs."""

from __future__ import annotations

import socket
import uuid

import pytest
import torch
from graph_fakes import FakeActor

from tensorferry.errors import TransferTimeoutError
from tensorferry.graph import InputNode, MultiOutputNode, build_schedules
from tensorferry.graph._channel import (
    Channel,
    Control,
    GraphStopped,
    PeerDied,
    RemoteError,
    unlink_prefix,
)
from tensorferry.graph._channel_net import NetControl, NetReader, NetWriter
from tensorferry.graph._lower import lower
from tensorferry.graph._visualize import schedule_dot, write_schedule, write_timeline


def test_values_round_trip_in_order(ring):
    _, writer, reader = ring
    values = [
        torch.randn(3, 5),
        torch.randint(0, 100, (7,), dtype=torch.int64),
        torch.randn(4, 6).t(),  # not contiguous
        torch.tensor(2.5, dtype=torch.bfloat16),
        torch.zeros(0, 3),
        {"a": [torch.randn(2), "text", 3], "b": (torch.ones(2, dtype=torch.bool),)},
        torch.randn(100_000),  # larger than a slot: the ring relocates
        torch.randn(5),
    ]
    for value in values:
        writer.write(value, timeout=1)
        got = reader.read(timeout=1)
        if isinstance(value, torch.Tensor):
            assert got.dtype == value.dtype and torch.equal(got, value)
        else:
            assert torch.equal(got["a"][0], value["a"][0]) and got["a"][1:] == ["text", 3]
            assert torch.equal(got["b"][0], value["b"][0])


@pytest.fixture
def tcp_edge():
    """One TCP edge in this process (the Ray executor's channel): (writer, reader)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        a = socket.create_connection(server.getsockname())
        b, _ = server.accept()
    control = NetControl()
    writer = NetWriter(a, control, peer=None, where="test edge")
    reader = NetReader(b, control, capacity=4, peer=None, where="test edge")
    yield writer, reader
    writer.close()
    reader.close()


@pytest.mark.parametrize("channel", ["shm", "tcp"])
def test_tensors_that_require_grad_arrive_detached(ring, tcp_edge, channel):
    # As over the GPU edges: autograd does not cross processes, so what arrives is data.
    writer, reader = (ring[1], ring[2]) if channel == "shm" else tcp_edge
    weight = torch.randn(6, requires_grad=True)
    out = weight * 3  # computed from it: not a leaf
    param = torch.nn.Parameter(torch.randn(6))  # arrives as a plain tensor, as over GPU edges
    for value in (
        weight,
        out,
        param,
        {"w": weight, "out": [out, "label"]},
        torch.randn(100_000) * weight[0],
    ):
        writer.write(value, timeout=1)
        got = reader.read(timeout=1)
        pairs = (
            [(got, value)]
            if isinstance(value, torch.Tensor)
            else [(got["w"], weight), (got["out"][0], out)]
        )
        for g, want in pairs:
            assert type(g) is torch.Tensor and not g.requires_grad
            assert torch.equal(g, want.detach())
    assert weight.requires_grad and out.grad_fn is not None  # the sender's own are untouched


class _Tagged(torch.Tensor):
    """A tensor subclass: pickled whole, so it arrives as itself."""


@pytest.mark.parametrize("channel", ["shm", "tcp"])
def test_tensors_without_readable_bytes_or_of_a_subclass_are_pickled_whole(ring, tcp_edge, channel):
    # A meta tensor has no bytes (its data pointer is 0: copied as bytes, the process died).
    writer, reader = (ring[1], ring[2]) if channel == "shm" else tcp_edge
    meta = torch.empty(3, 5, device="meta")
    tagged = torch.arange(4.0).as_subclass(_Tagged)
    for value in (meta, [meta, torch.ones(2)], tagged, {"t": tagged}):
        writer.write(value, timeout=1)
        got = reader.read(timeout=1)
        if isinstance(value, torch.Tensor):
            got, value = [got], [value]
        got = list(got.values()) if isinstance(got, dict) else got
        value = list(value.values()) if isinstance(value, dict) else value
        for g, want in zip(got, value, strict=True):
            assert type(g) is type(want) and g.device == want.device and g.shape == want.shape
            if not want.is_meta:
                assert torch.equal(g.as_subclass(torch.Tensor), want.as_subclass(torch.Tensor))


@pytest.mark.parametrize("channel", ["shm", "tcp"])
def test_conjugate_and_negative_views_arrive_as_their_values(ring, tcp_edge, channel):
    # Their memory holds x; the flag that conjugates or negates it is not in the bytes.
    writer, reader = (ring[1], ring[2]) if channel == "shm" else tcp_edge
    x = torch.randn(4, dtype=torch.complex64)
    # x[:1].imag: one element, contiguous, but with a stride of 2 (over TCP it raised).
    views = [x.conj(), x[:1].conj().imag, x[:1].imag, {"in": [x.conj(), x[1:].conj()]}]
    for view in views:
        writer.write(view, timeout=1)
        got = reader.read(timeout=1)
        if isinstance(view, torch.Tensor):
            got, view = {"in": [got]}, {"in": [view]}
        for g, want in zip(got["in"], view["in"], strict=True):
            assert not g.is_conj() and not g.is_neg()
            assert torch.equal(g, want.resolve_conj().resolve_neg())


def test_full_ring_times_out_and_errors_travel(ring):
    _, writer, reader = ring
    writer.write(torch.ones(1), timeout=1)
    writer.write(RemoteError("A.f#0", "ValueError: x", "Traceback ..."), timeout=1)
    with pytest.raises(TransferTimeoutError):
        writer.write(torch.ones(1), timeout=0.05)  # two slots, both full
    assert torch.equal(reader.read(timeout=1), torch.ones(1))
    error = reader.read(timeout=1)
    assert isinstance(error, RemoteError) and error.where == "A.f#0"
    with pytest.raises(TransferTimeoutError):
        reader.read(timeout=0.05)


def test_control_ends_waits(ring):
    control, _, reader = ring
    control.mark_dead(2)
    with pytest.raises(PeerDied) as info:
        reader.read(timeout=5)
    assert info.value.index == 2
    control.stop()
    assert control.stopped


def test_stop_ends_a_wait():
    prefix = f"tftest{uuid.uuid4().hex[:8]}"
    control = Control(f"{prefix}c", create=True)
    Channel.create(f"{prefix}e", slots=1, slot_size=1024)
    reader = Channel(f"{prefix}e", control)
    control.stop()
    with pytest.raises(GraphStopped):
        reader.read(timeout=5)
    reader.close()
    control.close()
    assert unlink_prefix(prefix) == 2


def test_schedule_picture_and_dot(tmp_path):
    s, r = FakeActor("S", "cuda:0"), FakeActor("R", "cuda:1")
    with InputNode() as inp:
        dag = MultiOutputNode(
            [r.consume.bind(s.produce.bind(inp).with_transport("nccl")) for _ in range(3)]
        )
    graph = lower(dag)
    schedules = build_schedules(graph, overlap=True)
    dot = schedule_dot(graph, schedules)
    assert dot.count("subgraph cluster_") == 4  # driver, S, R, legend
    assert dot.count('color="#d62728", fontcolor="#d62728", penwidth=2') == 2  # moved READs
    assert 'label="nccl"' in dot
    dot_path, png_path = write_schedule(graph, schedules, tmp_path / "s.png")
    assert dot_path.read_text() == dot
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# The first bytes of each picture format: what the file really is, whatever its name says.
_MAGIC = {".png": b"\x89PNG", ".svg": b"<", ".pdf": b"%PDF", ".jpg": b"\xff\xd8\xff"}


@pytest.mark.parametrize(
    ("asked", "dot_name", "picture_name"),
    [
        ("s.svg", "s.dot", "s.svg"),
        ("s.pdf", "s.dot", "s.pdf"),
        ("s.JPG", "s.dot", "s.JPG"),
        ("s.dot", "s.dot", "s.png"),
        ("s", "s.dot", "s.png"),
        # A dot in a name is not a format: nothing of the name is dropped.
        ("run.1", "run.1.dot", "run.1.png"),
    ],
)
def test_schedule_pictures_are_written_where_and_as_asked(tmp_path, asked, dot_name, picture_name):
    s, r = FakeActor("S", "cuda:0"), FakeActor("R", "cuda:1")
    with InputNode() as inp:
        dag = r.consume.bind(s.produce.bind(inp).with_transport("nccl"))
    graph = lower(dag)
    schedules = build_schedules(graph, overlap=True)
    dot_path, picture = write_schedule(graph, schedules, tmp_path / asked)
    assert (dot_path, picture) == (tmp_path / dot_name, tmp_path / picture_name)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted({dot_name, picture_name})
    assert dot_path.read_text().startswith("digraph")
    magic = _MAGIC[picture.suffix.lower()]
    assert picture.read_bytes().lstrip()[: len(magic)] == magic


def test_timeline_picture(tmp_path):
    records = [
        ("R", 0, 0, "READ", "READ x", "recv", 0.000, 0.004),
        ("R", 0, 1, "COMPUTE", "COMPUTE y", "main", 0.001, 0.006),
        ("S", 0, 0, "COMPUTE", "COMPUTE x", "main", 0.000, 0.001),
        ("S", 0, 1, "WRITE", "WRITE x", "send", 0.001, 0.002),
    ]
    png = write_timeline(records, tmp_path / "t.png")
    assert png.read_bytes()[:4] == b"\x89PNG"
    svg = write_timeline(records, tmp_path / "t.svg")
    assert svg == tmp_path / "t.svg" and svg.read_bytes().lstrip()[:1] == b"<"
    # No format in the name (or a dot that is part of it): a PNG with its suffix added.
    named = write_timeline(records, tmp_path / "run.2")
    assert named == tmp_path / "run.2.png" and named.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="profile=True"):
        write_timeline([], tmp_path / "none.png")
    assert write_timeline(records, tmp_path / "last.png", last=1).exists()
    for last in (0, -1, True, 1.5):  # min() of nothing raised from inside, for 0 and -1
        with pytest.raises(ValueError, match="last must be a positive number"):
            write_timeline(records, tmp_path / "bad.png", last=last)
    assert not (tmp_path / "bad.png").exists()


def test_a_folder_given_as_a_picture_path_is_refused(tmp_path):
    """It wrote ``<folder>.dot`` and ``<folder>.png`` beside the folder."""
    s, r = FakeActor("S", "cuda:0"), FakeActor("R", "cuda:1")
    with InputNode() as inp:
        dag = r.consume.bind(s.produce.bind(inp).with_transport("nccl"))
    graph = lower(dag)
    folder = tmp_path / "pictures"
    folder.mkdir()
    with pytest.raises(ValueError, match="is a folder: give a file name"):
        write_schedule(graph, build_schedules(graph, overlap=True), folder)
    records = [("S", 0, 0, "COMPUTE", "COMPUTE x", "main", 0.0, 0.001)]
    with pytest.raises(ValueError, match="is a folder: give a file name"):
        write_timeline(records, folder)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pictures"]
    assert list(folder.iterdir()) == []
