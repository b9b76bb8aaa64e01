"""Stream pool and Client lifetimes, with a fake stream factory (no GPU needed)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import tensorferry as tf
from tensorferry.runtime import CompletionPool, StreamKey, StreamPool
from tensorferry.runtime import client as client_module

from .fakes import FakeStreamFactory


@pytest.fixture
def two_fake_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lets Client accept cuda:0 and cuda:1 on a machine without CUDA (streams come from fakes)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    # Parsed device lists are cached per process; a fake device count must not leak out.
    monkeypatch.setattr(client_module, "_PARSED", {})


@pytest.fixture
def factory() -> FakeStreamFactory:
    return FakeStreamFactory()


@pytest.fixture
def completions():
    pool = CompletionPool(threads=2)
    yield pool
    pool.shutdown(wait=False)


@pytest.fixture
def pool(factory: FakeStreamFactory, completions: CompletionPool) -> StreamPool:
    return StreamPool(factory, completions=completions, reset_timeout_s=0.2)


def _handles(client: tf.Client) -> set[int]:
    return {s.handle for d in client.devices for ss in client.streams(d).values() for s in ss}


def test_client_streams_are_reused_across_lifetimes(two_fake_gpus, pool, factory):
    first = tf.Client([0, 1], pool=pool)
    handles = _handles(first)
    assert len(handles) == 2 * 14, "14 distinct streams per device"
    first.close()
    assert pool.stats()["pooled"] == 28
    second = tf.Client([0, 1], pool=pool)
    assert _handles(second) == handles
    stats = pool.stats()
    assert (stats["misses"], stats["hits"], stats["leased"], stats["pooled"]) == (28, 28, 28, 0)
    second.close()
    assert factory.destroyed == [], "pooled streams are kept, not destroyed"


def test_client_roles_and_devices(two_fake_gpus, pool):
    with tf.Client([0, 1], config=tf.ClientConfig(streams_per_device=9), pool=pool) as client:
        roles = client.streams(1)
        assert set(roles) == {*tf.runtime.STREAM_ROLES, "device_to_device"}
        assert len(roles["device_to_device"]) == 9 - len(tf.runtime.STREAM_ROLES)
        assert all(s.key.device == 1 for ss in roles.values() for s in ss)
        assert client.stream("cuda:0", "send") == (
            "fake-stream",
            client.raw_stream(0, "send").handle,
        )
        with pytest.raises(ValueError, match="role"):
            client.stream(0, "warp")
        with pytest.raises(ValueError, match="index"):
            client.stream(0, "compute", 1)
        with pytest.raises(ValueError, match="not one of"):
            client.stream("cpu")


def test_no_reuse_across_keys(two_fake_gpus, pool, factory):
    normal = tf.Client([0], pool=pool)
    normal_handles = _handles(normal)
    normal.close()
    high = tf.Client([0], config=tf.ClientConfig(priority="high"), pool=pool)
    assert _handles(high).isdisjoint(normal_handles)
    assert {factory.created[h].priority for h in _handles(high)} == {"high"}
    high.close()
    blocking = tf.Client([0], config=tf.ClientConfig(non_blocking=False), pool=pool)
    assert _handles(blocking).isdisjoint(normal_handles)
    blocking.close()
    other_device = tf.Client([1], pool=pool)
    assert _handles(other_device).isdisjoint(normal_handles)
    other_device.close()
    for stream in pool.pooled_streams():  # every pooled stream was made for its own key
        assert factory.created[stream.handle] == stream.key


def test_stream_that_stays_busy_is_destroyed_and_recreated(pool, factory):
    key = StreamKey(device=0)
    stream = pool.acquire(key)
    factory.busy.add(stream.handle)
    start = time.monotonic()
    pool.release(stream)
    assert time.monotonic() - start < 2.0, "reset wait is bounded"
    stats = pool.stats()
    assert factory.destroyed == [stream.handle]
    assert (stats["reset_failures"], stats["recreated"], stats["pooled"]) == (1, 1, 1)
    fresh = pool.acquire(key)
    assert fresh.handle != stream.handle
    assert fresh.handle in factory.alive


def test_stream_never_handed_out_skips_the_idle_query(pool, factory):
    stream = pool.acquire(StreamKey(device=0))
    factory.broken.add(stream._handle)  # a query would fail; an unused stream is never queried
    pool.release(stream)
    assert pool.stats()["reset_failures"] == 0
    again = pool.acquire(StreamKey(device=0))
    assert again is stream
    _ = again.torch  # handed out now: the next release must query it
    pool.release(again)
    assert pool.stats()["reset_failures"] == 1


def test_stream_whose_query_fails_is_destroyed_and_recreated(pool, factory):
    stream = pool.acquire(StreamKey(device=0))
    factory.broken.add(stream.handle)
    pool.release(stream)
    assert stream.handle in factory.destroyed
    assert pool.stats()["recreated"] == 1
    assert pool.acquire(StreamKey(device=0)).handle not in factory.broken


def test_double_release_is_rejected(pool):
    stream = pool.acquire(StreamKey(device=0))
    pool.release(stream)
    with pytest.raises(ValueError, match="not leased"):
        pool.release(stream)


def test_pool_is_bounded(factory, completions):
    pool = StreamPool(factory, completions=completions, max_pooled_per_key=2)
    streams = [pool.acquire(StreamKey(device=0)) for _ in range(5)]
    for stream in streams:
        pool.release(stream)
    assert pool.stats()["pooled"] == 2
    assert len(factory.destroyed) == 3


def test_many_threads_never_share_a_stream(two_fake_gpus, pool, factory):
    owners: dict[int, int] = {}
    lock = threading.Lock()
    errors: list[str] = []

    def lifecycles(worker: int) -> None:
        config = tf.ClientConfig(streams_per_device=7)
        for _ in range(200):
            client = tf.Client([0, 1], config=config, pool=pool)
            handles = _handles(client)
            with lock:
                for h in handles:
                    if h in owners:
                        errors.append(f"stream {h} held by {owners[h]} and {worker}")
                    owners[h] = worker
            with lock:
                for h in handles:
                    del owners[h]
            client.close()

    threads = [threading.Thread(target=lifecycles, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "lifecycle threads hung"
    assert errors == []
    stats = pool.stats()
    assert stats["leased"] == 0
    assert stats["hits"] + stats["misses"] == 16 * 200 * 14
    assert stats["live"] == len(factory.alive) <= 16 * 14, "no leak: at most one set per thread"


def test_release_waits_for_a_callback_in_flight(pool, completions):
    stream = pool.acquire(StreamKey(device=0))
    callback_running = threading.Event()
    let_callback_finish = threading.Event()
    finished_at: list[float] = []

    def slow_callback(_future) -> None:
        callback_running.set()
        let_callback_finish.wait(5)
        finished_at.append(time.monotonic())

    completions.watch(lambda: True, owner=stream.uid).add_done_callback(slow_callback)
    assert callback_running.wait(5)
    threading.Timer(0.05, let_callback_finish.set).start()
    pool.release(stream)
    released_at = time.monotonic()
    assert finished_at and finished_at[0] <= released_at, "pooled only after the callback returned"
    assert pool.stats()["recreated"] == 0
    assert pool.acquire(StreamKey(device=0)).handle == stream.handle


def test_release_with_a_stuck_callback_gives_next_owner_a_fresh_stream(pool, completions, factory):
    stream = pool.acquire(StreamKey(device=0))
    stuck = threading.Event()
    started = threading.Event()

    def stuck_callback(_future) -> None:
        started.set()
        stuck.wait(10)

    completions.watch(lambda: True, owner=stream.uid).add_done_callback(stuck_callback)
    never_ready = completions.watch(lambda: False, owner=stream.uid)
    assert started.wait(5)
    pool.release(stream)  # reset timeout is 0.2 s
    stuck.set()
    assert never_ready.cancelled(), "work that never started is cancelled"
    assert stream.handle in factory.destroyed
    next_stream = pool.acquire(StreamKey(device=0))
    assert next_stream.handle != stream.handle
    assert pool.stats()["recreated"] == 1


def test_unpooled_clients_create_and_destroy(two_fake_gpus, pool, factory):
    config = tf.ClientConfig(pool_streams=False, streams_per_device=6)
    client = tf.Client([0], config=config, pool=pool)
    handles = _handles(client)
    client.close()
    assert set(factory.destroyed) == handles
    assert pool.stats()["pooled"] == 0


def test_cpu_client_has_no_streams_but_same_api():
    with tf.Client("cpu") as client:
        assert client.stream("cpu") is None
        assert client.stream("cpu", "device_to_device", 7) is None  # the last of 14 - 6
        assert client.streams("cpu") == {}
        # What is wrong on a GPU is wrong here too (it used to pass on the CPU and fail later).
        with pytest.raises(ValueError, match="role must be one of"):
            client.stream("cpu", "comptue")
        with pytest.raises(ValueError, match="compute has 1 stream"):
            client.stream("cpu", "compute", 1)
        with pytest.raises(ValueError, match="device_to_device has 8 stream"):
            client.stream("cpu", "device_to_device", 8)
    assert client.closed


def test_closed_client_raises_and_double_close_is_harmless(two_fake_gpus, pool):
    client = tf.Client([0], pool=pool)
    client.close()
    client.close()
    with pytest.raises(tf.ClientClosedError):
        client.stream(0)
    with pytest.raises(tf.ClientClosedError), client:
        pass


@pytest.mark.parametrize(
    ("devices", "match"),
    [
        (["tpu:0"], "unknown device|unsupported device"),
        ([5], "out of range"),
        ([-1], r"devices: -1 is not a CUDA index"),
        (["cuda:2"], "out of range"),
        ([0, "cuda:0"], "listed twice"),
        ([], "empty"),
    ],
)
def test_bad_devices(two_fake_gpus, pool, devices, match):
    with pytest.raises(ValueError, match=match):
        tf.Client(devices, pool=pool)


def test_bad_device_type(two_fake_gpus, pool):
    with pytest.raises(TypeError, match="not a device"):
        tf.Client([1.5], pool=pool)


def test_cached_device_lists_still_reject_bools(two_fake_gpus, pool):
    tf.Client([0, 1], pool=pool).close()  # [0, 1] is now parsed and cached; True == 1
    with pytest.raises(TypeError, match="not a device"):
        tf.Client([0, True], pool=pool)
    with pytest.raises(TypeError, match="not a device"):
        tf.Client(False, pool=pool)


def test_a_released_set_goes_whole_to_the_next_lease_of_its_size(pool, factory):
    key = StreamKey(device=0)
    first = pool.acquire_many(key, 14)
    pool.release_many(first)
    again = pool.acquire_many(key, 14)
    assert {s.uid for s in again} == {s.uid for s in first}
    pool.release_many(again)
    # A smaller lease splits the set; the rest stays pooled and is still handed out.
    three = pool.acquire_many(key, 3)
    assert pool.stats()["pooled"] == 11
    rest = pool.acquire_many(key, 12)
    assert len({s.uid for s in three + rest}) == 15
    assert pool.stats()["misses"] == 14 + 1
    assert not {s.uid for s in three} & {s.uid for s in rest}
    high = pool.acquire_many(StreamKey(device=0, priority="high"), 2)
    pool.release_many(three + high + rest)  # streams of two keys in one release
    assert (pool.stats()["pooled"], pool.stats()["leased"]) == (17, 0)
    for stream in pool.pooled_streams():
        assert factory.created[stream.handle] == stream.key
    assert {s.uid for s in pool.acquire_many(StreamKey(device=0, priority="high"), 2)} == {
        s.uid for s in high
    }


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"streams_per_device": -1}, "streams_per_device"),
        ({"streams_per_device": 3}, "streams_per_device"),
        ({"priority": "urgent"}, "priority"),
    ],
)
def test_bad_config(kwargs, field):
    with pytest.raises(ValueError, match=field):
        tf.ClientConfig(**kwargs)


def test_config_rejects_non_integer_counts():
    with pytest.raises(TypeError, match="streams_per_device"):
        tf.ClientConfig(streams_per_device=14.0)


def test_half_built_client_gives_back_what_it_took(two_fake_gpus, factory, completions):
    class FailingFactory(FakeStreamFactory):
        def create(self, key):
            if len(self.created) == 20:
                raise RuntimeError("out of streams")
            return super().create(key)

    failing = FailingFactory()
    pool = StreamPool(failing, completions=completions)
    with pytest.raises(RuntimeError, match="out of streams"):
        tf.Client([0, 1], pool=pool)
    stats = pool.stats()
    assert (stats["leased"], stats["pooled"]) == (0, 20)
