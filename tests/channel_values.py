"""Values for the graph channel tests (local and Ray): tensors of every dtype the channels
carry raw, and a value that pickles but cannot be rebuilt."""

from __future__ import annotations

import torch


def _refuse_to_load() -> None:
    raise ValueError("this value cannot be rebuilt on purpose")


class LoadsBadly:
    """Pickles, but cannot be unpickled: what a reader cannot rebuild."""

    def __reduce__(self):
        return (_refuse_to_load, ())


def every_raw_dtype() -> list[torch.Tensor]:
    """A tensor of random bytes for every dtype this torch has that channels carry raw."""
    from tensorferry.graph._channel import _DTYPES

    out = []
    for dtype in (d for d in _DTYPES if d is not None):
        size = dtype.itemsize
        raw = torch.randint(0, 256, (7 * size,), dtype=torch.uint8)
        if dtype is torch.bool:
            raw = raw % 2  # only 0 and 1 are bools
        out.append(raw.view(dtype).reshape(7))
    return out


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )
