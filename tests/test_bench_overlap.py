"""``tensorferry bench overlap``: how executions are kept in flight and timed (CPU, fakes)."""

import argparse

import pytest

from tensorferry.bench import overlap
from tensorferry.bench._report import time_ratio_text


class _FakeGraph:
    """Counts executions in flight; results come back in submission order."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.in_flight = 0
        self.most_in_flight = 0
        self.read: list[int] = []

    def execute(self, step: int) -> "_FakeRef":
        self.steps.append(step)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        return _FakeRef(self, step)


class _FakeRef:
    def __init__(self, graph: _FakeGraph, step: int) -> None:
        self.graph, self.step = graph, step

    def get(self, timeout: float) -> int:
        self.graph.in_flight -= 1
        self.graph.read.append(self.step)
        return self.step


@pytest.mark.parametrize("inflight", [1, 2, 3])
def test_time_graph_keeps_the_asked_executions_in_flight(inflight):
    graph = _FakeGraph()
    samples = overlap._time_graph(graph, iters=7, warmup=2, inflight=inflight)
    assert len(samples) == 7
    assert all(s >= 0 for s in samples)
    assert graph.most_in_flight == inflight
    assert graph.in_flight == 0
    assert graph.steps == list(range(2 + 7 + 1))
    assert graph.read == graph.steps  # every result read, oldest first


def test_intervals_are_differences_of_successive_times():
    assert overlap._intervals([1.0, 1.5, 3.0]) == [0.5, 1.5]
    assert overlap._intervals([2.0]) == []


@pytest.mark.parametrize("bad", ["0", "x", "", "1,-2"])
def test_bad_inflight_is_a_usage_error(bad):
    parser = argparse.ArgumentParser()
    overlap.add_arguments(parser)
    args = parser.parse_args(["--inflight", bad])
    with pytest.raises(SystemExit, match="--inflight"):
        overlap.run(args)


@pytest.mark.parametrize(
    "time, reference, text",
    [
        (1.23, 1.0, "1.23× the time of overlap off (slower)"),
        (0.81, 1.0, "0.81× the time of overlap off (faster)"),
        (1.001, 1.0, "1.00× the time of overlap off (same)"),
        (22.0, 100.0, "0.22× the time of overlap off (faster)"),
    ],
)
def test_verdicts_are_ratios_of_times_never_negative_percentages(time, reference, text):
    assert time_ratio_text(time, reference, "overlap off") == text
