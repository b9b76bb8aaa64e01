"""The GIL-holding CUDA event calls' fallbacks, with the runtime's calls replaced (CPU tier).

The real calls run in the GPU tier (``test_gpu_streams.py``); here a fake runtime fails on
purpose, which real hardware does only when something is wrong: what a failure leaves behind
(the runtime's last error, which torch would raise from the thread's next kernel) and which
way each call then takes.
"""

from __future__ import annotations

import pytest

from tensorferry.runtime import _events

_INVALID_RESOURCE_HANDLE = 400


class _FakeEvent:
    def __init__(self, index: int) -> None:
        self.cuda_event = 0xE0 + index
        self.device = type("Device", (), {"index": index})()
        self.torch_records: list = []

    def record(self, stream) -> None:  # torch's own call
        self.torch_records.append(stream)


class _FakeStream:
    device_index = 0
    cuda_stream = 0x5

    def __init__(self) -> None:
        self.torch_waits: list = []

    def wait_event(self, event) -> None:  # torch's own call
        self.torch_waits.append(event)


class _FakeRuntime:
    """The runtime's calls, failing with ``code`` (0: they succeed)."""

    def __init__(self, code: int) -> None:
        self.code = code
        self.calls: list[str] = []

    def record(self, event, stream) -> int:
        self.calls.append("record")
        return self.code

    def wait(self, stream, event, flags) -> int:
        self.calls.append("wait")
        return self.code

    def query(self, event) -> int:
        self.calls.append("query")
        return self.code

    def clear(self) -> int:
        self.calls.append("clear")
        return self.code


@pytest.fixture
def runtime(monkeypatch):
    """Installs a fake runtime (failing with code 0 until a test sets another), one pooled
    event of device 0, and a calling thread on device 0 (``on_device`` changes that)."""
    fake = _FakeRuntime(0)
    state = {"device": 0}
    monkeypatch.setattr(_events, "_calls", fake)
    monkeypatch.setattr(_events, "_calls_checked", True)
    monkeypatch.setattr(_events, "_free", {})
    monkeypatch.setattr(_events, "_why_torch", None)
    monkeypatch.setattr(_events, "_on_current_device", lambda index: index == state["device"])
    _events.recycle(_FakeEvent(0))
    fake.on_device = lambda index: state.__setitem__("device", index)
    return fake


def test_a_record_that_fails_clears_the_error_and_leaves_the_runtime_calls(runtime):
    runtime.code = _INVALID_RESOURCE_HANDLE
    pooled = _events._free[0][0]
    assert _events._record_pooled(0, 0x5) is None  # the caller then records through torch
    assert runtime.calls == ["record", "clear"]
    assert _events._runtime() is None, "later calls take torch's way"
    assert _events._why_torch == "cudaEventRecord failed", "and tensorferry doctor says why"
    assert list(_events._free[0]) == [pooled], "the event is back in the pool"


def test_a_thread_on_another_device_records_and_waits_through_torch(runtime):
    runtime.on_device(1)
    event = _events.record_on_stream(_FakeStream())
    assert event.torch_records, "recorded by torch's call, which switches devices"
    stream = _FakeStream()
    _events.stream_wait(stream, event)
    assert stream.torch_waits == [event], "waited for by torch's call"
    assert runtime.calls == [], "the runtime's calls were not made from the wrong device"
    assert _events._runtime() is runtime, "and stay in use for threads on the device"


@pytest.fixture
def current_stream(monkeypatch):
    """The current stream of each device as a raw handle (``0x70 + index``) and as torch's
    object (a fake that notes its waits), each asked for by device index."""
    import torch

    asked: list[tuple[str, int]] = []
    streams: dict[int, _FakeStream] = {}

    def raw(index: int) -> int:
        asked.append(("raw", index))
        return 0x70 + index

    def stream_object(index: int) -> _FakeStream:
        asked.append(("object", index))
        return streams.setdefault(index, _FakeStream())

    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", raw, raising=False)
    monkeypatch.setattr(torch.cuda, "current_stream", stream_object)
    return asked, streams


def test_the_current_stream_waits_through_the_runtime_by_its_raw_handle(runtime, current_stream):
    asked, _streams = current_stream
    waits = []
    runtime.wait = lambda stream, event, flags: waits.append((stream, event, flags)) or 0
    event = _FakeEvent(0)
    _events.current_stream_wait(0, event)
    assert waits == [(0x70, event.cuda_event, 0)]
    assert asked == [("raw", 0)], "no torch Stream object made"


def test_the_current_stream_of_another_device_waits_through_torch(runtime, current_stream):
    asked, streams = current_stream
    runtime.on_device(1)
    event = _FakeEvent(0)
    _events.current_stream_wait(0, event)
    assert streams[0].torch_waits == [event] and asked == [("object", 0)]
    assert runtime.calls == [], "the runtime's calls were not made from the wrong device"


def test_a_failed_wait_of_the_current_stream_gives_up_the_calls_and_waits_through_torch(
    runtime, current_stream
):
    _asked, streams = current_stream
    runtime.code = _INVALID_RESOURCE_HANDLE
    event = _FakeEvent(0)
    _events.current_stream_wait(0, event)
    assert runtime.calls == ["wait", "clear"]
    assert streams[0].torch_waits == [event], "the wait is still made, by torch"
    assert _events._runtime() is None
    assert _events._why_torch == "cudaStreamWaitEvent failed"


def test_on_the_device_records_go_through_the_runtime(runtime):
    event = _events.record_on_stream(_FakeStream())
    assert not event.torch_records
    assert runtime.calls == ["record"]


def test_a_query_that_fails_clears_the_error_before_torch_reports_it(runtime):
    runtime.code = _INVALID_RESOURCE_HANDLE

    class Queried(_FakeEvent):
        def query(self) -> bool:  # torch's call: raises the CUDA error itself on a GPU
            return False

    assert _events.is_done(Queried(0)) is False
    assert runtime.calls == ["query", "clear"]


def _verdicts(monkeypatch, *verdicts):
    """Makes the check's runs answer ``verdicts`` in turn; returns the spins they were asked."""
    asked: list[int] = []
    answers = iter(verdicts)

    def misbehaviour(calls, cycles):
        asked.append(cycles)
        return next(answers)

    monkeypatch.setattr(_events, "_misbehaviour", misbehaviour)
    return asked


def test_the_check_looks_again_longer_when_its_kernel_finished_before_it_looked(monkeypatch):
    too_soon = f"{_events._FINISHED_TOO_SOON} was already done (20000000 cycles)"
    asked = _verdicts(monkeypatch, too_soon, None)
    calls = _FakeRuntime(0)
    assert _events._checked(calls) is calls
    assert asked == list(_events._CHECK_SPINS) and asked[1] > asked[0]


def test_the_check_gives_up_the_calls_when_the_longer_look_finds_the_same(monkeypatch, caplog):
    too_soon = f"{_events._FINISHED_TOO_SOON} was already done"
    asked = _verdicts(monkeypatch, too_soon, too_soon)
    with caplog.at_level("WARNING", logger=_events.log.name):
        assert _events._checked(_FakeRuntime(0)) is None
    assert len(asked) == 2
    assert "was already done" in caplog.text and "using torch" in caplog.text


def test_the_check_gives_up_at_once_on_a_failed_call(monkeypatch, caplog):
    asked = _verdicts(monkeypatch, "record, wait and record returned [400, 0, 0]")
    with caplog.at_level("WARNING", logger=_events.log.name):
        assert _events._checked(_FakeRuntime(0)) is None
    assert len(asked) == 1, "a failed call is not timing: no second look"
    assert "[400, 0, 0]" in caplog.text


def test_a_compiled_caller_gets_the_addresses_of_the_calls_in_use(monkeypatch):
    import ctypes
    import ctypes.util

    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    # record, wait, query, query_stream, clear
    calls = _events._Runtime(libc.labs, libc.abs, libc.llabs, libc.llabs, libc.getpid)
    monkeypatch.setattr(_events, "_calls", calls)
    monkeypatch.setattr(_events, "_calls_checked", True)
    monkeypatch.setattr(_events, "_entry_points", None)
    monkeypatch.setattr(_events, "_why_torch", None)
    address = lambda fn: ctypes.cast(fn, ctypes.c_void_p).value  # noqa: E731
    assert _events.entry_points() == (address(libc.abs), address(libc.labs))  # wait, record
    assert _events.entry_points() is _events.entry_points(), "found once"
    _events.give_up_calls("cudaEventRecord failed (1)")  # a compiled caller's call failed
    assert _events.entry_points() is None, "torch's calls from now on"
    assert _events._why_torch == "cudaEventRecord failed (1)"
