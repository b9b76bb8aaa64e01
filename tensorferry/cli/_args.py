"""Argument types shared by the commands.

A bad value is argparse's usage error naming the flag (``argument --iters: must be a positive
integer, got '-5'``), before anything runs, rather than a traceback from deep inside a run.
"""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["folder_problem", "non_negative_int", "positive_float", "positive_int"]


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


def folder_problem(path: str) -> str | None:
    """Why the folder ``path`` cannot be made, or ``None`` when it can. It is made to find out,
    and what this made is removed again: the command makes it when it writes there, and a run
    that fails first leaves nothing behind."""
    folder = Path(path)
    missing = []
    for level in (folder, *folder.parents):
        if level.exists():
            break
        missing.append(level)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"cannot make that folder ({exc.strerror or exc})"
    for level in missing:  # the deepest first; each was empty, made just now
        level.rmdir()
    return None
