"""Devices: reading a device argument, and counting this process's CUDA devices. Every layer
accepts an int (a CUDA index), a string or a ``torch.device``, and only CPU and CUDA devices."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["cuda_device_count", "parse_device"]


def cuda_device_count() -> int:
    """CUDA devices this process sees: 0 without a usable CUDA (a CPU build, or no driver),
    where ``torch.cuda.device_count()`` alone may still count devices."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def parse_device(value: Any, *, what: str = "device") -> torch.device:
    """A ``torch.device`` of type ``cpu`` or ``cuda`` from ``value`` — the form only: whether a
    CUDA index exists is for the caller to check (it may be checked where the work will run).

    Args:
        value: ``3`` (``cuda:3``), ``"cuda:1"``, ``"cpu"`` or a ``torch.device``.
        what: how error messages name the argument.

    Raises:
        TypeError: not a device at all (``bool`` included).
        ValueError: a string torch does not know, or a device neither CPU nor CUDA.
    """
    if isinstance(value, bool):
        raise TypeError(f"{what}: {value!r} is not a device (an int, str or torch.device)")
    if isinstance(value, int):
        if value < 0:  # torch's own error would not name the argument
            raise ValueError(f"{what}: {value} is not a CUDA index (they start at 0)")
        return torch.device("cuda", value)
    if isinstance(value, str):
        try:
            device = torch.device(value)
        except RuntimeError:
            raise ValueError(f"{what}: unknown device {value!r}") from None
    elif isinstance(value, torch.device):
        device = value
    else:
        raise TypeError(f"{what}: {value!r} is not a device (an int, str or torch.device)")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{what}: unsupported device type {device.type!r} (cpu or cuda)")
    return device
