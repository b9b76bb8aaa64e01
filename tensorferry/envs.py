"""Every environment variable tensorferry reads, in one place, all prefixed ``TENSORFERRY_``.

Values are read when asked for (not at import) so tests and launchers can set them late.
"""

from __future__ import annotations

import math
import os

__all__ = [
    "transfer_timeout_s",
    "stream_reset_timeout_s",
    "completion_threads",
    "visualize_schedule",
    "log_level",
    "spin_us",
    "native_mode",
]


def _float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None
    if not 0 < value < math.inf:  # NaN fails both
        raise ValueError(f"{name}={raw!r} must be a finite positive number")
    return value


def _int(name: str, default: int, *, zero_ok: bool = False) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
    if value < 0 or (value == 0 and not zero_ok):
        raise ValueError(f"{name}={raw!r} must be {'>= 0' if zero_ok else 'positive'}")
    return value


def transfer_timeout_s() -> float:
    """Default timeout of every transfer wait (``TENSORFERRY_TRANSFER_TIMEOUT_S``, 300 s)."""
    return _float("TENSORFERRY_TRANSFER_TIMEOUT_S", 300.0)


def stream_reset_timeout_s() -> float:
    """How long a released stream may take to go idle (``TENSORFERRY_STREAM_RESET_TIMEOUT_S``)."""
    return _float("TENSORFERRY_STREAM_RESET_TIMEOUT_S", 5.0)


def completion_threads() -> int:
    """Threads that run completion callbacks (``TENSORFERRY_COMPLETION_THREADS``, 4)."""
    return _int("TENSORFERRY_COMPLETION_THREADS", 4)


def visualize_schedule() -> bool:
    """Write schedule pictures at compile time (``TENSORFERRY_VISUALIZE_SCHEDULE=1``)."""
    return os.environ.get("TENSORFERRY_VISUALIZE_SCHEDULE", "") not in ("", "0", "false", "no")


_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def log_level() -> str | None:
    """Log level of the ``tensorferry`` logger (``TENSORFERRY_LOG_LEVEL``), ``None`` when unset."""
    raw = os.environ.get("TENSORFERRY_LOG_LEVEL", "")
    if not raw:
        return None
    if raw.upper() not in _LOG_LEVELS:
        raise ValueError(f"TENSORFERRY_LOG_LEVEL={raw!r} must be one of {', '.join(_LOG_LEVELS)}")
    return raw.upper()


def apply_log_level() -> None:
    """Sets the ``tensorferry`` logger's level from ``TENSORFERRY_LOG_LEVEL`` where it is set
    (``tf.init``, spawning an actor, the command line); unset, the logger keeps the level the
    program's own logging configuration gives it."""
    import logging

    level = log_level()
    if level is not None:
        logging.getLogger("tensorferry").setLevel(level)


def spin_us() -> float:
    """How long a waiting thread busy-polls before it sleeps (``TENSORFERRY_SPIN_US``).

    Waking a sleeping thread costs tens to hundreds of microseconds (more on virtual machines),
    often more than the transfer it waits for; polling holds a core meanwhile. Default: 1000 µs
    on hosts with at least 8 CPUs, 0 (never poll) on smaller ones, where a polling thread would
    take the core the work needs. ``0`` turns polling off.
    """
    raw = os.environ.get("TENSORFERRY_SPIN_US")
    if raw is None or raw == "":
        return 1000.0 if (os.cpu_count() or 1) >= 8 else 0.0
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"TENSORFERRY_SPIN_US={raw!r} is not a number") from None
    if value < 0:
        raise ValueError(f"TENSORFERRY_SPIN_US={raw!r} must be >= 0")
    return value


def native_mode() -> str:
    """Whether the compiled helpers are used (``TENSORFERRY_NATIVE``): ``auto`` (the default:
    built on first use in the background, Python meanwhile), ``wait`` (built before ``tf.init``
    returns) or ``0`` (never). See ``tensorferry/_native``."""
    raw = os.environ.get("TENSORFERRY_NATIVE", "").strip().lower() or "auto"
    if raw in ("0", "false", "no", "off"):
        return "0"
    if raw not in ("auto", "wait", "1"):
        raise ValueError(f"TENSORFERRY_NATIVE={raw!r} must be auto, wait or 0")
    return "auto" if raw == "1" else raw
