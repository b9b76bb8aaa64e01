"""Argument types shared by the commands.

A bad value is argparse's usage error naming the flag (``argument --iters: must be a positive
integer, got '-5'``), before anything runs, rather than a traceback from deep inside a run.
"""

from __future__ import annotations

import argparse

__all__ = ["non_negative_int", "positive_float", "positive_int"]


def _number(text: str, kind: type, what: str, *, allow_zero: bool) -> int | float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
    if value < 0 or (value == 0 and not allow_zero) or value != value:  # NaN too
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    return int(_number(text, int, "a positive integer", allow_zero=False))


def non_negative_int(text: str) -> int:
    return int(_number(text, int, "an integer >= 0", allow_zero=True))


def positive_float(text: str) -> float:
    return float(_number(text, float, "a positive number", allow_zero=False))
