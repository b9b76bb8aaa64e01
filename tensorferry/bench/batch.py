"""`tensorferry bench batch` (being written)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=None, help="directory for CSV + Markdown results")


def run(args: argparse.Namespace) -> int:
    raise SystemExit("tensorferry bench batch is not available yet")
