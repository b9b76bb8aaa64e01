"""Byte counts as people read them."""

from __future__ import annotations

__all__ = ["human_size"]


def human_size(nbytes: int) -> str:
    """``4096`` as ``"4 KiB"``, ``3 << 20`` as ``"3 MiB"``, three digits at most after the
    first (``"202.7 MiB"`` reads as ``"203 MiB"``)."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            value = nbytes / size
            return f"{value:.0f} {unit}" if value >= 100 else f"{value:.3g} {unit}"
    return f"{nbytes} B"
