"""The link watch (tensorferry.graph._link_watch) against a control block's flags, and how a
schedule runner ends once the watch aborted its links under it."""

from __future__ import annotations

import threading
import time

import pytest

from tensorferry.graph._link_watch import LinkWatch


class _Flags:
    """What the watch reads of a graph's control block."""

    def __init__(self) -> None:
        self.dead: int | None = None
        self.stopped = False
        self.driver_gone = False

    def dead_index(self) -> int | None:
        return self.dead


def _watch(flags: _Flags, drain_s: float) -> tuple[LinkWatch, list[float], threading.Event]:
    calls: list[float] = []
    aborted = threading.Event()

    def abort() -> None:
        calls.append(time.monotonic())
        aborted.set()

    return LinkWatch(flags, abort, drain_s=drain_s, what="test actor"), calls, aborted


def test_a_death_aborts_the_links_at_once():
    flags = _Flags()
    watch, calls, aborted = _watch(flags, drain_s=30.0)
    time.sleep(0.2)
    assert not calls and not watch.fired
    flags.dead = 1
    assert aborted.wait(5.0)
    watch.finish()  # after the abort: returns, and nothing more is called
    assert len(calls) == 1 and watch.fired


@pytest.mark.parametrize("flag", ["stopped", "driver_gone"])
def test_an_end_aborts_the_links_only_after_the_drain_time(flag):
    flags = _Flags()
    watch, calls, aborted = _watch(flags, drain_s=0.6)
    setattr(flags, flag, True)
    ended = time.monotonic()
    assert aborted.wait(5.0)
    assert calls[0] - ended >= 0.6
    watch.finish()
    assert len(calls) == 1 and watch.fired


def test_a_loop_that_closes_its_links_itself_is_left_alone():
    flags = _Flags()
    watch, calls, _ = _watch(flags, drain_s=0.6)
    flags.stopped = True
    time.sleep(0.2)
    watch.finish()  # the actor's thread closes them within the drain time
    flags.dead = 1
    time.sleep(0.3)
    assert not calls and not watch.fired


def test_an_abort_that_raises_is_logged_and_the_watch_ends(caplog):
    flags = _Flags()

    def abort() -> None:
        raise RuntimeError("abort failed on purpose")

    watch = LinkWatch(flags, abort, drain_s=1.0, what="test actor")
    flags.dead = 0
    deadline = time.monotonic() + 5.0
    while not watch.fired and time.monotonic() < deadline:
        time.sleep(0.01)
    watch.finish()
    assert watch.fired
    assert "the link watch's abort failed" in caplog.text


@pytest.mark.parametrize("kind", ["shared memory", "ray"])
def test_the_watch_reads_both_executors_control_blocks(kind):
    """The local executor's shared-memory ``Control`` and the Ray executor's ``NetControl``
    answer everything the watch reads (a missing one would end its thread at its first look)."""
    import uuid

    from tensorferry.graph._channel import Control, unlink_prefix
    from tensorferry.graph._channel_net import NetControl

    prefix = f"tftest{uuid.uuid4().hex[:8]}"
    controls = []
    for _ in range(2):
        if kind == "ray":
            controls.append(NetControl())
        else:
            controls.append(Control(f"{prefix}c{len(controls)}", create=True))
    try:
        stopping, dying = controls
        stop_watch, stop_calls, stop_aborted = _watch(stopping, drain_s=0.3)
        death_watch, death_calls, death_aborted = _watch(dying, drain_s=30.0)
        time.sleep(0.2)
        assert not stop_calls and not death_calls
        stopping.stop()
        dying.mark_dead(1)
        assert stop_aborted.wait(5.0) and death_aborted.wait(5.0)
        stop_watch.finish()
        death_watch.finish()
    finally:
        for control in controls:
            control.close()
        unlink_prefix(prefix)


class _AbortedLinks:
    """What ``ScheduleRunner.run`` reads of its GPU part: whether the watch aborted the links,
    and how it was closed."""

    def __init__(self, fired: bool) -> None:
        self.links_aborted_by_watch = fired
        self.closed_with: list[bool] = []

    def close(self, *, peer_died: bool) -> None:
        self.closed_with.append(peer_died)


def _runner_failing_after(fired: bool, dead: int | None):
    """A runner whose first method fails as one does after its links were aborted under it
    (NCCL's error on the next transfer); only the parts ``run`` touches."""
    from types import SimpleNamespace

    from tensorferry.graph._runner import ScheduleRunner

    runner = ScheduleRunner.__new__(ScheduleRunner)
    flags = _Flags()
    flags.dead = dead
    runner.control = flags
    runner.plan = SimpleNamespace(overlap=False)
    runner.gpu = _AbortedLinks(fired)
    runner._comm = None

    def run_once(execution: int) -> None:
        raise RuntimeError("NCCL error: invalid usage (the communicator was aborted)")

    runner._run_once = run_once
    return runner


@pytest.mark.parametrize(("dead", "ended"), [(1, "peer died"), (None, "stopped")])
def test_a_failure_after_the_watch_aborted_the_links_ends_the_loop_as_the_graph_ended(dead, ended):
    runner = _runner_failing_after(fired=True, dead=dead)
    assert runner.run() == ended
    assert runner.gpu.closed_with == [dead is not None]


def test_a_failure_the_watch_did_not_cause_is_raised():
    runner = _runner_failing_after(fired=False, dead=1)
    with pytest.raises(RuntimeError, match="communicator was aborted"):
        runner.run()
    assert runner.gpu.closed_with == [False]
