"""Timeouts as callers give them, checked in one place: a finite number of seconds.

Infinity is refused rather than taken to mean "forever": Python's own locks cannot wait that
long (``OverflowError`` deep inside a wait, after the work started), and a wait that can never
end is the hang this library promises not to have. A large number waits as long as anyone needs:
it is taken as at most :data:`LONGEST_S` (about 31 years), which every wait below can hold (gloo
refused a wait of 1e15 s mid-transfer, and ``datetime.timedelta`` refuses more than about 8e13).
"""

from __future__ import annotations

import math
import numbers
from typing import Any

__all__ = ["checked_seconds", "LONGEST_S"]

LONGEST_S = 1e9


def checked_seconds(value: Any, what: str, *, zero_ok: bool = False) -> float:
    """``value`` as seconds: a real number (not a bool), finite, and positive (or zero, with
    ``zero_ok``: a wait that only looks).

    Raises:
        TypeError: not a number.
        ValueError: NaN, infinite, negative, or zero where that is not allowed.
    """
    kind = type(value)
    if (kind is float or kind is int) and (0 < value < math.inf or (zero_ok and value == 0)):
        return min(float(value), LONGEST_S)  # the common case, on per-call paths
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a number of seconds, got {type(value).__name__} {value!r}")
    seconds = float(value)
    if not math.isfinite(seconds):
        raise ValueError(
            f"{what} must be a finite number of seconds, got {value!r} (pass a large number to "
            "wait long)"
        )
    if seconds < 0 or (seconds == 0 and not zero_ok):
        bound = ">= 0" if zero_ok else "> 0"
        raise ValueError(f"{what} must be {bound} seconds, got {value!r}")
    return min(seconds, LONGEST_S)
