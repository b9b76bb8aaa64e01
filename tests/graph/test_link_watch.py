"""The link watch (tensorferry.graph._link_watch) against a control block's flags."""

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
