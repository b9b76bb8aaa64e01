"""Every byte ``tensorferry bench peers`` moves, written from (rank, iteration) and checked.

A row's tensors are views of one flat buffer (its arena), so one iteration's contents are
written, poisoned and checked with a few whole-arena operations, whatever the tensor count.

Contents: byte ``j`` of tensor ``i``, sent by rank ``r`` in iteration ``n``, is
``pattern[j] + 1 + 97·r + 31·n + 7·i`` (mod 256), where ``pattern`` is a fixed run of random
bytes. The random run catches bytes that land at the wrong offset, the terms in ``n`` and ``i``
catch a stale message or a swapped tensor. The pipeline's tensors go through matmuls, so they
hold numbers instead: ``1 + (that byte mod 120)`` as bf16 (small non-zero integers, which a
matmul by the identity keeps exactly). Receive buffers are filled with ``0xA5`` bytes first,
so a transfer that writes nothing is caught too.
"""

from __future__ import annotations

from typing import Any

__all__ = ["POISON_BYTE", "Payload", "WrongBytesError", "first_difference", "poison"]

POISON_BYTE = 0xA5

# Length of the random run; not a power of two, so a shift by one reads different bytes.
_PATTERN_BYTES = (1 << 20) + 13
_PATTERN_SEED = 20_240_917
# The pipeline's numbers: 1..120, exact in bf16 and through a matmul by the identity.
_VALUE_RANGE = 120


class WrongBytesError(AssertionError):
    """A received tensor differs from what its sender wrote: the benchmark's results are void."""


def _pattern(nbytes: int) -> Any:
    import torch

    generator = torch.Generator().manual_seed(_PATTERN_SEED)
    run = torch.randint(
        0, 256, (min(nbytes, _PATTERN_BYTES),), dtype=torch.uint8, generator=generator
    )
    return run.repeat(-(-nbytes // run.numel()))[:nbytes]


def _base(rank: int, iteration: int) -> int:
    return (1 + 97 * rank + 31 * iteration) % 256


class Payload:
    """The contents of one row's arena: ``count`` tensors of ``numel`` elements of ``dtype``.

    Args:
        count: tensors in the arena.
        numel: elements per tensor.
        dtype: the tensors' ``torch.dtype``.
        device: where the arena lives.
        values: write numbers (the pipeline's bf16 activations) instead of raw bytes.
    """

    def __init__(self, count: int, numel: int, dtype: Any, device: Any, *, values: bool) -> None:
        import torch

        self.count, self.numel, self.dtype, self.values = count, numel, dtype, values
        self.tensor_bytes = numel * dtype.itemsize
        # Values: one pattern byte per element; bytes: one per byte of the arena.
        per_tensor = numel if values else self.tensor_bytes
        self._pattern = _pattern(per_tensor).repeat(count).to(device)
        offsets = torch.arange(count, dtype=torch.int64).mul_(7).remainder_(256).to(torch.uint8)
        self._offsets = offsets.repeat_interleave(per_tensor).to(device) if count > 1 else None
        self._scratch = torch.empty(count * numel, dtype=dtype, device=device)

    def write(self, arena: Any, rank: int, iteration: int) -> None:
        """Fills ``arena`` (flat, ``count × numel`` of ``dtype``) with what ``rank`` sends in
        ``iteration``."""
        import torch

        if self.values:
            codes = torch.add(self._pattern, _base(rank, iteration))
            if self._offsets is not None:
                codes += self._offsets
            codes.remainder_(_VALUE_RANGE).add_(1)
            arena.copy_(codes)
        else:
            raw = arena.view(torch.uint8)
            torch.add(self._pattern, _base(rank, iteration), out=raw)
            if self._offsets is not None:
                raw += self._offsets

    def problem(self, arena: Any, rank: int, iteration: int) -> str | None:
        """``None`` when ``arena`` holds exactly what ``rank`` sent in ``iteration``, else what
        is wrong (see :func:`first_difference`)."""
        import torch

        self.write(self._scratch, rank, iteration)
        got, want = arena.view(torch.uint8), self._scratch.view(torch.uint8)
        if torch.equal(got, want):
            return None
        return first_difference(got, want, self.tensor_bytes)


def poison(arena: Any) -> None:
    """Fills a receive arena with ``0xA5`` bytes, before each iteration."""
    import torch

    arena.view(torch.uint8).fill_(POISON_BYTE)


def first_difference(got: Any, want: Any, tensor_bytes: int) -> str | None:
    """Where two flat byte tensors of one arena differ: ``None`` if nowhere, else a sentence
    naming the first wrong tensor and byte and how many bytes are wrong in all."""
    wrong = (got != want).nonzero()
    if wrong.numel() == 0:
        return None
    first = int(wrong[0, 0])
    tensor, byte = divmod(first, tensor_bytes)
    return (
        f"{wrong.shape[0]} of {got.numel()} bytes wrong; the first is byte {byte} of tensor "
        f"{tensor}: 0x{int(got[first]):02x}, expected 0x{int(want[first]):02x}"
    )
