"""The graph demo's names where earlier code imports them from: the demo itself lives in
:mod:`tensorferry.demo.graph` and its actors in :mod:`tensorferry.demo.graph_actors`."""

from __future__ import annotations

from tensorferry.demo.graph import run_graph_demo
from tensorferry.demo.graph_actors import DemoReceiver, DemoSender, expected_result
from tensorferry.demo.graph_actors import check as _check
from tensorferry.demo.graph_actors import demo_data as _data
from tensorferry.demo.graph_actors import demo_weight as _weight

__all__ = ["DemoSender", "DemoReceiver", "run_graph_demo", "expected_result"]
__all__ += ["_check", "_data", "_weight"]  # imported by name by the overlap benchmark
