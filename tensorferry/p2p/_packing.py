"""Packing small tensors of one message into one byte buffer (shared by the transports).

Which tensors are packed depends only on the agreed shapes and dtypes, so sender and receiver
derive the same wire layout: first the packed buffer (if any), then each large tensor alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["as_bytes", "pack", "unpack", "wire_plan"]


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` view of a contiguous tensor (every dtype travels as bytes).

    A tensor of one element is contiguous whatever its stride (``x[:1].imag`` of a complex
    ``x`` has 2), and ``view`` refuses a byte view of a stride other than 1: that one element is
    re-viewed with stride 1 first, the same memory."""
    flat = t.reshape(-1)
    if flat.numel() == 1 and flat.stride(0) != 1:
        flat = flat.as_strided((1,), (1,))
    return flat.view(torch.uint8)


def wire_plan(tensors: Sequence[torch.Tensor], *, pack_below: int) -> tuple[list[int], list[int]]:
    """``(packed, alone)``: indices of the tensors packed together, and of those sent alone.

    Tensors under ``pack_below`` bytes are packed when there are at least two of them; empty
    tensors are skipped (both sides agree they carry nothing).
    """
    packed, alone = [], []
    for i, t in enumerate(tensors):
        nbytes = t.numel() * t.element_size()
        if nbytes == 0:
            continue
        (packed if nbytes < pack_below else alone).append(i)
    if len(packed) == 1:  # one small tensor: a copy would gain nothing
        alone, packed = sorted(alone + packed), []
    return packed, alone


def pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One ``uint8`` buffer holding ``tensors`` back to back (one copy kernel on CUDA)."""
    if _one_dtype(tensors):
        # One C++ call instead of two tensor ops per tensor in Python: for a message of many
        # small tensors the per-tensor host cost dominates. Same bytes as the general path.
        return torch._C._nn.flatten_dense_tensors(list(tensors)).view(torch.uint8)
    return torch.cat([as_bytes(t) for t in tensors])


@torch.inference_mode()  # targets may be inference tensors (a rollout worker's buffers)
def unpack(packed: torch.Tensor, targets: Sequence[torch.Tensor]) -> None:
    """Copies ``packed`` back into ``targets`` (one multi-tensor copy on CUDA).

    In inference mode, on whichever thread runs it: writing into a tensor made in inference
    mode is refused outside it, and inference mode is a per-thread setting (a transport may
    unpack on a thread of its own).
    """
    targets = list(targets)
    if _one_dtype(targets):
        flat = packed.view(targets[0].dtype)
        torch._foreach_copy_(targets, torch._C._nn.unflatten_dense_tensors(flat, targets))
        return
    sizes = [t.numel() * t.element_size() for t in targets]
    torch._foreach_copy_([as_bytes(t) for t in targets], list(packed.split(sizes)))


def _one_dtype(tensors: Sequence[torch.Tensor]) -> bool:
    dtype = tensors[0].dtype
    return all(t.dtype == dtype for t in tensors)
