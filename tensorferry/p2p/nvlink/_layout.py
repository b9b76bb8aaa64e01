"""Host mirror of the NVLink kernels' buffer and signal layout, and the launch plan.

Pure Python (no CUDA, no Triton): the host launcher and the CPU tests share it. The layout is
described in ``sendrecv.py``; offsets here must stay equal to the kernel's arithmetic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tensorferry._seconds import checked_seconds

__all__ = [
    "META_WORDS",
    "POISON",
    "ERROR_FIELDS",
    "ERR_TIMEOUT",
    "ERR_PEER_ABORT",
    "SignalLayout",
    "ChannelConfig",
    "LaunchPlan",
    "plan_launch",
    "dtype_code",
]

META_WORDS = 8
POISON = 1 << 62

ERR_NBYTES = 1
ERR_DTYPE = 2
ERR_NUM_CTAS = 3
ERR_CHUNK = 4
ERR_TIMEOUT = 8
ERR_PEER_ABORT = 9
# Kernel error code -> the MismatchError field it means.
ERROR_FIELDS = {
    ERR_NBYTES: "nbytes",
    ERR_DTYPE: "dtype",
    ERR_NUM_CTAS: "num_ctas",
    ERR_CHUNK: "chunk",
}

# Codes both sides compare: the dtype's identity, not only its size (bf16 vs fp16 differ).
_DTYPE_CODES = {
    dtype: code
    for code, dtype in enumerate(
        (
            torch.uint8,
            torch.int8,
            torch.int16,
            torch.int32,
            torch.int64,
            torch.float16,
            torch.bfloat16,
            torch.float32,
            torch.float64,
            torch.bool,
            torch.complex64,
            torch.complex128,
            torch.uint16,
            torch.uint32,
            torch.uint64,
            torch.float8_e4m3fn,
            torch.float8_e5m2,
        ),
        start=1,
    )
}


def dtype_code(dtype: torch.dtype) -> int:
    """A small integer naming ``dtype``, the same on every rank (0 for dtypes not listed)."""
    return _DTYPE_CODES.get(dtype, 0)


@dataclass(frozen=True, slots=True)
class SignalLayout:
    """Word offsets of the ``int64`` signal area (``world_size`` ranks, ``max_blocks`` lanes).

    ``ready(src, b)`` / ``post(dst)`` etc. are what the kernel computes inline.
    """

    world_size: int
    max_blocks: int

    @property
    def lanes(self) -> int:
        return self.world_size * self.max_blocks

    def ready(self, src: int, lane: int) -> int:
        return src * self.max_blocks + lane

    def free(self, dst: int, lane: int) -> int:
        return self.lanes + dst * self.max_blocks + lane

    def send_step(self, dst: int, lane: int) -> int:
        return 2 * self.lanes + dst * self.max_blocks + lane

    def recv_step(self, src: int, lane: int) -> int:
        return 3 * self.lanes + src * self.max_blocks + lane

    def send_msg(self, dst: int, lane: int) -> int:
        return 4 * self.lanes + dst * self.max_blocks + lane

    def post(self, dst: int) -> int:
        return 5 * self.lanes + dst * META_WORDS

    def recv_msg(self, src: int) -> int:
        return 5 * self.lanes + META_WORDS * self.world_size + src

    @property
    def status(self) -> int:
        """``status`` holds our own error code, ``status + 1`` the one a peer reported."""
        return 5 * self.lanes + (META_WORDS + 1) * self.world_size

    @property
    def num_words(self) -> int:
        return self.status + 8


@dataclass(kw_only=True, slots=True, frozen=True)
class ChannelConfig:
    """How an :class:`~tensorferry.p2p.nvlink.NvlinkChannel` sizes its buffers and launches.

    Every field must be equal on all ranks of the group (the launch plan depends on them).
    """

    max_ctas: int = 32
    """CTA budget of one launch (the SM budget). Both directions at once split it evenly."""
    max_blocks: int = 32
    """Lanes per peer the buffers are sized for; ``max_ctas`` per direction may not exceed it."""
    num_slots: int = 2
    """Staging slots per lane: how many chunks a sender may run ahead of its receiver."""
    slot_bytes: int = 1024 * 1024
    """Bytes per staging slot, the largest chunk (multiple of 16 KiB). Every chunk ends in a
    system-scope fence that waits for its stores to land on the peer, so larger chunks idle the
    link less: 1 MiB against 256 KiB took both ways at 1 GiB from 0.76x to 0.95x NCCL, one way
    from 0.88x to 0.93x, on 2 x H200; 128 MiB of staging per rank for a pair."""
    min_bytes_per_cta: int = 16 * 1024
    """Smallest share of a message worth another CTA."""
    block_words: int = 8192
    """``int32`` words one CTA copies per loop iteration (power of two)."""
    num_warps: int = 16
    """Warps per CTA."""
    timeout_s: float = 60.0
    """Device-side bound on every wait; past it the kernel gives up and records a timeout."""

    def __post_init__(self) -> None:
        for name in ("max_ctas", "max_blocks", "num_slots", "slot_bytes", "min_bytes_per_cta"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.max_ctas > 2 * self.max_blocks:
            raise ValueError(
                f"max_ctas={self.max_ctas} exceeds two directions of max_blocks={self.max_blocks}"
            )
        if self.slot_bytes % (16 * 1024):
            raise ValueError(f"slot_bytes must be a multiple of 16 KiB, got {self.slot_bytes}")
        if self.slot_bytes > 64 * 1024 * 1024:
            raise ValueError(f"slot_bytes must be at most 64 MiB, got {self.slot_bytes}")
        bw = self.block_words
        if not isinstance(bw, int) or bw < 256 or bw > 16384 or bw & (bw - 1):
            raise ValueError(f"block_words must be a power of two in [256, 16384], got {bw}")
        if self.num_warps not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"num_warps must be a power of two up to 32, got {self.num_warps}")
        checked_seconds(self.timeout_s, "timeout_s")  # inf overflowed the kernels' deadline

    def staging_bytes(self, world_size: int) -> int:
        """Bytes of one rank's staging allocation."""
        return world_size * self.max_blocks * self.num_slots * self.slot_bytes

    def ctas_per_direction(self, *, bidirectional: bool, max_ctas: int | None = None) -> int:
        """The CTA budget of one direction of a launch (``max_ctas`` overrides the config's).

        Raises:
            ValueError: the budget is below one CTA per direction or above ``max_blocks``.
        """
        budget = self.max_ctas if max_ctas is None else max_ctas
        if not isinstance(budget, int) or isinstance(budget, bool):
            raise TypeError(f"max_ctas must be an int, got {type(budget).__name__}")
        per_direction = budget // 2 if bidirectional else budget
        if per_direction < 1:
            raise ValueError(
                f"max_ctas={budget} leaves no CTA per direction"
                + (" (a send and a receive need at least 2)" if bidirectional else "")
            )
        if per_direction > self.max_blocks:
            raise ValueError(
                f"max_ctas={budget} gives {per_direction} CTAs per direction, more than "
                f"max_blocks={self.max_blocks} the buffers are sized for"
            )
        return per_direction


@dataclass(frozen=True, slots=True)
class LaunchPlan:
    """How one direction of one message is cut: ``num_ctas`` lanes, ``chunk`` bytes a step."""

    nbytes: int
    num_ctas: int
    chunk: int

    @property
    def body(self) -> int:
        """Bytes copied as 16-byte vectors (``nbytes`` rounded down to 16)."""
        return self.nbytes & ~15

    @property
    def num_chunks(self) -> int:
        return math.ceil(self.nbytes / self.chunk)

    def chunks_of_lane(self, lane: int) -> int:
        """Chunks lane ``lane`` moves: ``lane, lane + num_ctas, …`` below ``num_chunks``."""
        return math.ceil((self.num_chunks - lane) / self.num_ctas)


def plan_launch(nbytes: int, ctas: int, config: ChannelConfig) -> LaunchPlan:
    """Adaptive stride: as many CTAs as the message can keep busy (at most ``ctas``), and the
    chunk grown to spread the message over them, up to a slot.

    Both sides compute this from the same ``nbytes`` and budget, so they agree on the cut;
    every lane gets at least one chunk.

    Example: 1 MiB with 16 CTAs → 16 lanes of one 64 KiB chunk; 1 GiB with 16 CTAs and 1 MiB
    slots → 16 lanes of 64 chunks of 1 MiB (stride 16 MiB).
    """
    if nbytes <= 0:
        raise ValueError(f"nbytes must be positive, got {nbytes}")
    num_ctas = max(1, min(ctas, math.ceil(nbytes / config.min_bytes_per_cta)))
    per_cta = math.ceil(nbytes / num_ctas)
    chunk = min(config.slot_bytes, -(-per_cta // 1024) * 1024)
    num_ctas = min(num_ctas, math.ceil(nbytes / chunk))
    return LaunchPlan(nbytes=nbytes, num_ctas=num_ctas, chunk=chunk)
