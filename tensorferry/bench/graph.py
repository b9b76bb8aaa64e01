"""``tensorferry bench graph``: compiled-graph per-execute overhead of compiled graphs."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="bench-results", help="folder for CSV + Markdown")


def run(args: argparse.Namespace) -> int:
    raise NotImplementedError("bench graph is being written")
