"""The p2p layer's stream per direction of a pair (GPU tier, one GPU): each direction has a
stream of its own, given back at shutdown, and a unit spanning several directions is ordered
with the work of each (tensorferry.p2p._direction_streams)."""

from __future__ import annotations

import pytest
import torch

from tensorferry.p2p._direction_streams import DirectionStreams
from tensorferry.runtime import stream_pool
from tensorferry.runtime._events import record_on_stream

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda", 0)


def _busy_then_fill(stream, tensor: torch.Tensor, value: float) -> None:
    """Queues tens of milliseconds of matrix products on ``stream``, then fills ``tensor``."""
    with torch.cuda.stream(stream):
        a = torch.randn(4096, 4096, device=DEVICE)
        for _ in range(60):
            a = a @ a
            a = a / a.norm()
        tensor.fill_(value)


def test_each_direction_has_a_stream_of_its_own_until_shutdown():
    leased = stream_pool().stats()["leased"]
    streams = DirectionStreams(DEVICE)
    directions = [(kind, peer) for kind in ("send", "recv") for peer in (1, 2, 5)]
    got = {direction: streams.get(*direction) for direction in directions}
    assert len({stream.cuda_stream for stream in got.values()}) == len(directions)
    assert all(streams.get(*direction) is stream for direction, stream in got.items())
    assert stream_pool().stats()["leased"] == leased + len(directions)
    streams.close()
    assert stream_pool().stats()["leased"] == leased


def test_a_unit_over_several_directions_follows_their_work_and_they_follow_it():
    streams = DirectionStreams(DEVICE)
    first, other = streams.get("send", 1), streams.get("recv", 2)
    try:
        # Unordered, the first stream runs ahead of the other's queued work: the check below
        # can see a missing order.
        unordered = torch.zeros(1 << 20, device=DEVICE)
        torch.cuda.synchronize()
        _busy_then_fill(other, unordered, 3.0)
        with torch.cuda.stream(first):
            seen_unordered = unordered.clone()
        torch.cuda.synchronize()
        assert not seen_unordered.eq(3.0).all(), "the other stream's work was not slow enough"

        x = torch.zeros(1 << 20, device=DEVICE)
        torch.cuda.synchronize()
        _busy_then_fill(other, x, 3.0)
        streams.order_span(first, [other])
        with torch.cuda.stream(first):
            seen_by_unit = x.clone()
        _busy_then_fill(first, x, 5.0)
        streams.follow_span(record_on_stream(first), [other])
        with torch.cuda.stream(other):
            seen_after_unit = x.clone()
        torch.cuda.synchronize()
        assert seen_by_unit.eq(3.0).all()
        assert seen_after_unit.eq(5.0).all()
    finally:
        torch.cuda.synchronize()
        streams.close()
