"""Waits on the critical path, on the CPU: the spin-then-sleep wait, and how a GPU actor's
results for host channels are held until their event fired (fake events stand in for CUDA)."""

from __future__ import annotations

import threading
import time
import uuid
from types import SimpleNamespace

import pytest
import torch

from tensorferry.errors import TransferTimeoutError
from tensorferry.graph._channel import Channel, Control, GraphStopped, unlink_prefix, wait_until
from tensorferry.graph._gpu import GpuOps
from tensorferry.graph._gpu_host import HostWriter, HostWrites, PinnedResults


class FakeEvent:
    """Stands in for a ``torch.cuda.Event``: fires when the test says so."""

    def __init__(self, fired: bool = False) -> None:
        self.fired = fired
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self.fired


@pytest.fixture
def rings():
    """A control block and two channels of one slot each: (control, [(writer, reader)] * 2)."""
    prefix = f"tftest{uuid.uuid4().hex[:8]}"
    control = Control(f"{prefix}c", create=True)
    ends = []
    for name in ("a", "b"):
        Channel.create(f"{prefix}{name}", slots=1, slot_size=4096)
        ends.append((Channel(f"{prefix}{name}", control), Channel(f"{prefix}{name}", control)))
    yield control, ends
    for writer, reader in ends:
        writer.close()
        reader.close()
    control.close()
    unlink_prefix(prefix)


def _later(seconds: float, fn) -> threading.Thread:
    thread = threading.Thread(target=lambda: (time.sleep(seconds), fn()), daemon=True)
    thread.start()
    return thread


# ---------------------------------------------------------------------- wait_until
def test_wait_until_returns_past_the_spin_and_calls_idle(rings):
    control, _ = rings
    flag = threading.Event()
    idle_calls = []
    _later(0.02, flag.set)  # well past the spin: found by the sleeping phase
    start = time.perf_counter()
    seen = wait_until(
        flag.is_set, control=control, timeout=5.0, what="test", idle=lambda: idle_calls.append(1)
    )
    assert 0.015 < seen - start < 1.0
    assert idle_calls


def test_wait_until_times_out_and_ends_on_stop(rings):
    control, _ = rings
    with pytest.raises(TransferTimeoutError, match="the thing waited more than"):
        wait_until(lambda: False, control=control, timeout=0.01, what="the thing")
    with pytest.raises(TransferTimeoutError):
        wait_until(lambda: False, control=control, timeout=0.0, what="zero", spin_s=0.0)
    _later(0.02, control.stop)
    start = time.perf_counter()
    with pytest.raises(GraphStopped):
        wait_until(lambda: False, control=control, timeout=60.0, what="stop", max_pause_s=1e-4)
    assert time.perf_counter() - start < 1.0


def test_wait_until_keeps_sleeps_short_for_50_ms_then_backs_off(rings, monkeypatch):
    from tensorferry.graph import _channel

    control, _ = rings
    clock = {"now": 100.0}
    sleeps = []

    def sleep(seconds: float) -> None:  # a virtual clock: each sleep advances it exactly
        sleeps.append(seconds)
        clock["now"] += seconds

    fake_time = SimpleNamespace(perf_counter=lambda: clock["now"], sleep=sleep)
    monkeypatch.setattr(_channel, "time", fake_time)
    polls = iter(range(100_000))
    wait_until(lambda: next(polls) == 3000, control=control, timeout=60.0, what="t", spin_s=0.0)
    elapsed = 0.0
    for pause in sleeps:
        if elapsed <= _channel._SHORT_SLEEPS_S:
            assert pause == _channel._SLEEP_MIN_S, elapsed
        elapsed += pause
    assert sleeps[-1] == _channel._SLEEP_MAX_S  # backed off afterwards
    assert max(sleeps) == _channel._SLEEP_MAX_S


def test_channel_read_waits_past_the_spin(rings):
    _, [(writer, reader), _] = rings
    _later(0.02, lambda: writer.write(torch.arange(3), timeout=1.0))
    assert torch.equal(reader.read(timeout=5.0), torch.arange(3))


# ---------------------------------------------------------------------- results held by the actor
def test_host_writes_go_out_at_once_when_the_event_fired(rings):
    _, [(writer, reader), _] = rings
    host = HostWrites()
    host.submit(writer, torch.ones(2), FakeEvent(fired=True))
    assert host.pending == 0 and torch.equal(reader.read(timeout=1.0), torch.ones(2))
    host.submit(writer, "no event", None)
    assert host.pending == 0 and reader.read(timeout=1.0) == "no event"


def test_host_writes_wait_for_their_event_and_keep_order(rings):
    _, [(writer, reader), _] = rings
    host = HostWrites()
    first, second = FakeEvent(), FakeEvent(fired=True)
    host.submit(writer, "first", first)
    host.submit(writer, "second", second)  # fired, but behind "first"
    host.pump()
    assert host.pending == 2 and not reader.readable()
    first.fired = True
    host.pump()
    assert host.pending == 1 and reader.read(timeout=1.0) == "first"  # one slot: "second" waits
    host.pump()
    assert host.pending == 0 and reader.read(timeout=1.0) == "second"


def test_a_full_channel_holds_back_only_its_own_results(rings):
    _, [(writer_a, reader_a), (writer_b, reader_b)] = rings
    host = HostWrites()
    host.submit(writer_a, "a0", None)  # fills a's only slot
    host.submit(writer_a, "a1", None)
    host.submit(writer_b, "b0", None)
    assert host.pending == 1 and reader_b.read(timeout=1.0) == "b0"
    assert reader_a.read(timeout=1.0) == "a0"
    host.pump()
    assert host.pending == 0 and reader_a.read(timeout=1.0) == "a1"
    host.submit(writer_a, "dropped", FakeEvent())
    host.close()
    assert host.pending == 0


def test_written_is_called_only_once_the_channel_holds_its_copy(rings):
    _, [(writer, reader), _] = rings
    host = HostWrites()
    written = []
    value = torch.arange(4.0)
    host.submit(writer, value, FakeEvent(fired=True), written.append)
    assert written == [value]  # written at once
    event = FakeEvent()
    later = torch.arange(4.0) + 10
    host.submit(writer, later, event, written.append)
    host.pump()
    assert written == [value]  # its event has not fired (and the one slot is full)
    event.fired = True
    host.pump()
    assert written == [value]  # fired, but no room yet: not written, not given back
    assert torch.equal(reader.read(timeout=1.0), torch.arange(4.0))
    later.fill_(-1)  # what the channel holds must not change with the tensor given back...
    host.pump()
    assert written == [value, later]
    later.fill_(-2)  # ...nor after it was written
    assert torch.equal(reader.read(timeout=1.0), torch.full((4,), -1.0))


def test_pinned_results_are_reused_per_shape_and_dtype(monkeypatch):
    made = []

    def fake_empty(shape, *, dtype, pin_memory):  # torch's pinned memory needs a GPU
        assert pin_memory
        made.append(torch.zeros(shape, dtype=dtype))
        return made[-1]

    monkeypatch.setattr(torch, "empty", fake_empty)
    pinned = PinnedResults()
    first = pinned.take((2, 3), torch.float32)
    pinned.give_back(first)
    assert pinned.take((2, 3), torch.float32) is first
    other = pinned.take((2, 3), torch.float16)  # another dtype: a new one
    assert other is not first and len(made) == 2
    assert pinned.take((2, 3), torch.float32) is not first  # first is taken: a new one again
    assert len(made) == 3


def test_pinned_results_forget_old_shapes_past_the_limit(monkeypatch):
    from tensorferry.graph import _gpu_host

    pinned = PinnedResults()
    tensors = [torch.zeros(n + 1) for n in range(_gpu_host._PINNED_LAYOUTS + 1)]
    for t in tensors:
        pinned.give_back(t)
    monkeypatch.setattr(torch, "empty", lambda shape, **kw: "fresh")
    assert pinned.take((1,), torch.float32) == "fresh"  # the oldest shapes were dropped
    assert pinned.take(tuple(tensors[-1].shape), torch.float32) is tensors[-1]
    for _ in range(_gpu_host._PINNED_PER_LAYOUT + 2):
        pinned.give_back(torch.zeros(3, 3))
    assert len(pinned._free[((3, 3), torch.float32)]) == _gpu_host._PINNED_PER_LAYOUT


def _ops(control: Control, host) -> GpuOps:
    """The waiting part of a GpuOps, without a GPU."""
    ops = object.__new__(GpuOps)
    ops._host = host
    ops._control = control
    ops.runner = SimpleNamespace(plan=SimpleNamespace(actor="A"))
    return ops


def test_an_actor_writes_held_results_while_it_waits(rings):
    control, [(writer, reader), (_, other_reader)] = rings
    host = HostWrites()
    ops = _ops(control, host)
    event = FakeEvent()
    host.submit(writer, "result", event)
    _later(0.02, lambda: setattr(event, "fired", True))
    # Waiting for an input that does not come: returns once nothing is held any more.
    ops._pump_until(other_reader.readable, "read")
    assert host.pending == 0 and reader.read(timeout=1.0) == "result"
    # Waiting on the host for a receive writes held results too.
    held, received = FakeEvent(), FakeEvent()
    host.submit(writer, "held", held)
    _later(0.01, lambda: setattr(held, "fired", True))
    _later(0.03, lambda: setattr(received, "fired", True))
    ops._wait_event(received, "receive")
    assert host.pending == 0 and reader.read(timeout=1.0) == "held"


def test_stop_ends_an_actor_wait_on_the_gpu(rings):
    control, _ = rings
    ops = _ops(control, HostWrites())
    _later(0.02, control.stop)
    with pytest.raises(GraphStopped):
        ops._wait_event(FakeEvent(), "receive")


def test_writer_thread_writes_after_the_event_and_ends_on_stop(rings, monkeypatch):
    control, [(writer, reader), _] = rings
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    thread_writer = HostWriter(torch.device("cpu"), control)
    assert thread_writer.pending == 0
    event = FakeEvent()
    thread_writer.submit(writer, "late", event)
    time.sleep(0.01)
    assert not reader.readable()
    event.fired = True
    assert reader.read(timeout=5.0) == "late"
    thread_writer.submit(writer, "never", FakeEvent())
    control.stop()
    start = time.perf_counter()
    thread_writer.close()
    assert time.perf_counter() - start < 1.5 and not thread_writer._thread.is_alive()
