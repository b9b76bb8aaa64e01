"""The p2p demo's names where earlier code imports them from: the demo itself lives in
:mod:`tensorferry.demo.p2p`."""

from __future__ import annotations

from tensorferry.demo._progress import ProgressBar
from tensorferry.demo.p2p import run_p2p_demo

__all__ = ["run_p2p_demo", "ProgressBar"]
