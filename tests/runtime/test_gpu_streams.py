"""Stream pool properties with real CUDA streams (GPU tier)."""

from __future__ import annotations

import threading

import pytest
import torch

import tensorferry as tf
from tensorferry.runtime import CompletionPool, StreamKey, StreamPool
from tensorferry.runtime._cuda_streams import CudaStreamFactory

pytestmark = pytest.mark.gpu


def _keep_busy(stream) -> None:
    """Queues tens of milliseconds of matrix products on ``stream``: a release must wait."""
    with torch.cuda.stream(stream):
        a = torch.randn(4096, 4096, device=stream.device)
        for _ in range(100):
            a = a @ a
            a = a / a.norm()


@pytest.fixture
def pool():
    completions = CompletionPool(threads=2)
    pool = StreamPool(CudaStreamFactory(), completions=completions, reset_timeout_s=5.0)
    yield pool
    pool.clear()
    completions.shutdown(wait=False)


def _all_streams(client):
    return [s for d in client.devices for ss in client.streams(d).values() for s in ss]


def test_real_streams_are_exclusive_and_reused(pool):
    devices = list(range(torch.cuda.device_count()))
    a = tf.Client(devices, pool=pool)
    b = tf.Client(devices, pool=pool)
    handles_a = {s.handle for s in _all_streams(a)}
    handles_b = {s.handle for s in _all_streams(b)}
    assert len(handles_a) == 14 * len(devices)
    assert handles_a.isdisjoint(handles_b), "two live clients never share a stream"
    a.close()
    c = tf.Client(devices, pool=pool)
    assert {s.handle for s in _all_streams(c)} == handles_a
    b.close()
    c.close()


def test_priority_gives_a_different_stream(pool):
    normal = tf.Client([0], pool=pool)
    normal_handles = {s.handle for s in _all_streams(normal)}
    normal.close()
    high = tf.Client([0], config=tf.ClientConfig(priority="high"), pool=pool)
    streams = _all_streams(high)
    assert {s.handle for s in streams}.isdisjoint(normal_handles)
    normal_priority = tf.Client([0], pool=pool)
    assert streams[0].torch.priority < normal_priority.stream(0).priority, "lower is higher"
    normal_priority.close()
    high.close()


def test_work_finishes_before_the_next_client_gets_the_stream(pool):
    first = tf.Client([0], pool=pool)
    stream = first.raw_stream(0, "compute")
    _keep_busy(stream.torch)
    done = torch.cuda.Event()
    done.record(stream.torch)
    assert not CudaStreamFactory().is_idle(stream._handle), "the work should still be running"
    first.close()
    assert done.query(), "the stream was pooled before its work finished"
    second = tf.Client([0], pool=pool)
    assert stream.uid in {s.uid for s in _all_streams(second)}, "the stream was reused"
    second.close()


def test_stream_busy_past_the_reset_timeout_is_replaced():
    completions = CompletionPool(threads=1)
    pool = StreamPool(CudaStreamFactory(), completions=completions, reset_timeout_s=0.001)
    stream = pool.acquire(StreamKey(device=0))
    _keep_busy(stream.torch)
    pool.release(stream)
    stats = pool.stats()
    assert (stats["reset_failures"], stats["recreated"]) == (1, 1)
    # The driver may hand the destroyed stream's address to the fresh one: compare leases.
    assert pool.acquire(StreamKey(device=0)).uid != stream.uid
    torch.cuda.synchronize()
    pool.clear()
    completions.shutdown(wait=False)


def test_callback_on_event_finishes_before_handover(pool):
    client = tf.Client([0], pool=pool)
    stream = client.raw_stream(0, "device_to_host")
    completions = pool._completions
    finished = threading.Event()
    with torch.cuda.stream(stream.torch):
        _keep_busy(stream.torch)
        event = torch.cuda.Event()
        event.record()
    future = completions.after_event(event, owner=stream.uid, then=lambda: "device work done")
    future.add_done_callback(lambda _f: finished.set())
    client.close()
    assert finished.is_set(), "the callback ran before the stream was pooled"
    assert future.result(timeout=1) == "device work done"


def test_default_process_pool_with_real_devices():
    tf.runtime.clear()
    before = tf.runtime.stats()["streams"]
    with tf.Client([0]):
        pass
    with tf.Client([0]):
        pass
    after = tf.runtime.stats()["streams"]
    assert after["hits"] - before["hits"] >= 14
    assert after["pooled"] >= 14


@pytest.mark.parametrize("device", [0, max(torch.cuda.device_count() - 1, 0)])
def test_caller_events_follow_the_current_stream_and_are_reused(device):
    from tensorferry.runtime import _events

    checked = _events._runtime()  # its one-time check takes device time: not in the loop
    _events._free.pop(device, None)  # from an empty pool: the first event is made, then reused
    with torch.cuda.device(device):
        stream = torch.cuda.Stream()
        seen = set()
        for _ in range(3):
            with torch.cuda.stream(stream):
                torch.cuda._sleep(20_000_000)  # the event must wait for this
                # From a thread whose current device is another (device 0): the given device's
                # current stream is the one recorded on.
                with torch.cuda.device(0):
                    event = _events.record_on_current_stream(device)
            assert event.device == torch.device("cuda", device)
            assert not event.query(), "recorded behind a running kernel: still pending"
            stream.synchronize()
            assert event.query()
            seen.add(id(event))
            _events.recycle(event)
            # No CUDA error left behind for the next launch to raise (a record through the
            # runtime from the wrong device once left cudaErrorInvalidResourceHandle there).
            with torch.cuda.device(0):
                assert torch.ones(4, device=device).sum().item() == 4.0
        assert len(seen) == 1, "a recycled event is recorded again, not remade"
        assert _events._runtime() is checked, "the GIL-holding calls are still in use"


@pytest.mark.parametrize("device", [0, max(torch.cuda.device_count() - 1, 0)])
def test_the_current_stream_reads_idle_only_once_its_work_is_over(device):
    from tensorferry.runtime import _events

    checked = _events._runtime()
    with torch.cuda.device(device):
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            stream.synchronize()
            assert _events.current_stream_idle(device), "nothing queued: idle"
            torch.cuda._sleep(20_000_000)
            with torch.cuda.device(0):  # from a thread on another device: the given one's
                busy = _events.current_stream_idle(device)
            assert not busy, "a kernel still running on it"
            stream.synchronize()
            assert _events.current_stream_idle(device)
    assert _events._runtime() is checked, "the GIL-holding calls are still in use"


def test_stream_waits_and_queries_through_the_event_calls():
    from tensorferry.runtime import _events

    _events._runtime()
    stream, waiter = torch.cuda.Stream(), torch.cuda.Stream()
    for _ in range(3):  # pooled events come back and are recorded again
        with torch.cuda.stream(stream):
            torch.cuda._sleep(20_000_000)
        done = _events.record_on_stream(stream)
        _events.stream_wait(waiter, done)
        after = _events.record_on_stream(waiter)
        assert not _events.is_done(done), "recorded behind a running kernel: still pending"
        assert not _events.is_done(after), "the waiting stream must wait for it"
        waiter.synchronize()
        assert _events.is_done(done) and _events.is_done(after)
        assert done.query() and after.query()
        _events.recycle(done)
        _events.recycle(after)


def test_the_event_calls_check_tells_working_calls_from_a_record_that_does_nothing():
    from tensorferry.runtime import _events

    calls = _events._load_calls()
    assert calls is not None, "the CUDA runtime's event calls load on a GPU machine"
    assert _events._misbehaviour(calls, _events._CHECK_SPINS[0]) is None
    broken = calls._replace(record=lambda event, stream: 0)  # says it recorded, records nothing
    problem = _events._misbehaviour(broken, _events._CHECK_SPINS[0])
    assert problem is not None and problem.startswith(_events._FINISHED_TOO_SOON)
    assert _events._checked(broken) is None, "the longer second look finds the same"
