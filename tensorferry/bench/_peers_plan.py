"""What ``tensorferry bench peers`` times: its rows, their sizes on each scale, their iterations.

Three scales share the same rows: ``gpu`` (the sizes the rows are named for), ``cpu`` (sizes
scaled down so that a whole run over gloo takes under a minute on two cores) and ``quick`` (a
few iterations of small sizes, for tests). Everything here is plain data, sent to every rank.
"""

from __future__ import annotations

import dataclasses
import math

__all__ = [
    "CONTENDERS",
    "ROW_KEYS",
    "Plan",
    "Row",
    "make_plan",
    "parse_rows",
    "size_text",
]

# Column order of the table; the keys name the contenders everywhere (results, files).
CONTENDERS = ("torch", "nixl", "tensorferry")

# Selectable rows, in table order; "floor" comes with "pipeline" (its compute without transfers).
ROW_KEYS = ("kv", "large", "small", "roundtrip", "separate", "batch", "pipeline")

_KiB, _MiB, _GiB = 1 << 10, 1 << 20, 1 << 30


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of the table: the operation every contender performs, rank 0 to rank 1.

    Attributes:
        key: short name (``--rows``, file columns).
        number: place in the table (the floor shares the pipeline's number).
        count: tensors per iteration (messages, or microbatches of the pipeline).
        shape: shape of each tensor.
        dtype: ``"bfloat16"`` or ``"uint8"`` (a name: plans travel to spawned ranks).
        small: a 4 KiB row, timed over more iterations (its times are tens of microseconds).
        bandwidth: the table also shows GB/s.
        weight_side: the pipeline's square weight side (0: no compute).
        matmuls: matmuls per microbatch on each stage.
        compute_only: the pipeline's floor: the same compute, no transfer.
    """

    key: str
    number: int
    count: int
    shape: tuple[int, ...]
    dtype: str
    small: bool = False
    bandwidth: bool = False
    weight_side: int = 0
    matmuls: int = 0
    compute_only: bool = False

    @property
    def tensor_bytes(self) -> int:
        return math.prod(self.shape) * (2 if self.dtype == "bfloat16" else 1)

    @property
    def total_bytes(self) -> int:
        """Bytes one iteration moves from rank 0 to rank 1 (0 for the floor)."""
        return 0 if self.compute_only else self.count * self.tensor_bytes

    @property
    def title(self) -> str:
        size = size_text(self.tensor_bytes)
        shape = "×".join(map(str, self.shape))
        titles = {
            "kv": f"KV-cache hand-off: {self.count} × {size} bf16 as one message",
            "large": f"one {size} tensor one way",
            "small": f"one {size} tensor one way",
            "roundtrip": f"{size} blocking round trip",
            "separate": f"{self.count} separate sends of {size}",
            "batch": f"a batch of {self.count} messages of {size}",
            "pipeline": f"2-stage pipeline: {self.count} microbatches [{shape}] bf16, "
            f"{self.matmuls} matmuls of {self.weight_side}² each",
            "floor": "  the same pipeline, compute only (floor)",
        }
        return f"{self.number}. {titles[self.key]}" if self.key != "floor" else titles["floor"]


@dataclasses.dataclass(frozen=True)
class Plan:
    """A whole run: device, scale, rows and how each is timed."""

    device: str  # "cuda" or "cpu"
    scale: str  # "gpu", "cpu" or "quick"
    rows: tuple[Row, ...]
    warmup_large: int
    iters_large: int
    warmup_small: int
    iters_small: int
    timeout_s: float  # bound of one transfer's wait

    def iterations(self, row: Row) -> tuple[int, int]:
        """``(warm-up, timed)`` iterations of ``row``."""
        if row.small:
            return self.warmup_small, self.iters_small
        return self.warmup_large, self.iters_large


# Per scale: sizes of the rows whose sizes scale, then (warm-up, timed) large and small.
_SCALES = {
    "gpu": {
        "kv_bytes": 2 * _MiB,
        "large_bytes": _GiB,
        "pipeline_shape": (4096, 8192),
        "weight_side": 8192,
        "iterations": (5, 20, 20, 200),
    },
    "cpu": {
        "kv_bytes": 32 * _KiB,
        "large_bytes": 16 * _MiB,
        "pipeline_shape": (32, 128),
        "weight_side": 128,
        # Small rows: 300 timed iterations, as medians of 30 moved by 2x between runs on a
        # host's CPUs; the whole run still takes about half a minute on two cores.
        "iterations": (2, 10, 20, 300),
    },
    "quick": {
        "kv_bytes": 4 * _KiB,
        "large_bytes": _MiB,
        "pipeline_shape": (16, 64),
        "weight_side": 64,
        "iterations": (1, 3, 1, 5),
    },
}

_SMALL_BYTES = 4 * _KiB
_MESSAGES = 64
_MICROBATCHES = 8
_MATMULS = 3


def _rows(scale: str) -> list[Row]:
    sizes = _SCALES[scale]
    pipeline = {
        "count": _MICROBATCHES,
        "shape": sizes["pipeline_shape"],
        "dtype": "bfloat16",
        "weight_side": sizes["weight_side"],
        "matmuls": _MATMULS,
    }
    return [
        Row("kv", 1, _MESSAGES, (sizes["kv_bytes"] // 2,), "bfloat16"),
        Row("large", 2, 1, (sizes["large_bytes"],), "uint8", bandwidth=True),
        Row("small", 3, 1, (_SMALL_BYTES,), "uint8", small=True),
        Row("roundtrip", 4, 1, (_SMALL_BYTES,), "uint8", small=True),
        Row("separate", 5, _MESSAGES, (_SMALL_BYTES,), "uint8", small=True),
        Row("batch", 6, _MESSAGES, (_SMALL_BYTES,), "uint8", small=True),
        Row("pipeline", 7, **pipeline),
        Row("floor", 7, compute_only=True, **pipeline),
    ]


def parse_rows(text: str | None) -> list[str]:
    """``--rows``: comma-separated keys of :data:`ROW_KEYS` (``None`` or ``"all"``: every row).

    Raises:
        ValueError: an unknown key, or none at all.
    """
    if text is None or text.strip() == "all":
        return list(ROW_KEYS)
    keys = [k.strip() for k in text.split(",") if k.strip()]
    unknown = [k for k in keys if k not in ROW_KEYS]
    if unknown or not keys:
        raise ValueError(
            f"unknown rows {unknown or 'none given'}; choose from {','.join(ROW_KEYS)}"
        )
    return [k for k in ROW_KEYS if k in keys]


def make_plan(
    device: str, *, quick: bool, rows: list[str], iters_scale: float, timeout_s: float
) -> Plan:
    """The plan for ``device`` (``"cuda"``/``"cpu"``): its scale's sizes, the selected rows (the
    floor with the pipeline) and timed iterations scaled by ``iters_scale`` (at least 1)."""
    scale = "quick" if quick else "gpu" if device == "cuda" else "cpu"
    selected = set(rows) | ({"floor"} if "pipeline" in rows else set())
    warmup_large, iters_large, warmup_small, iters_small = _SCALES[scale]["iterations"]
    return Plan(
        device=device,
        scale=scale,
        rows=tuple(r for r in _rows(scale) if r.key in selected),
        warmup_large=warmup_large,
        iters_large=max(1, round(iters_large * iters_scale)),
        warmup_small=warmup_small,
        iters_small=max(1, round(iters_small * iters_scale)),
        timeout_s=timeout_s,
    )


def timed_iterations(scale: str) -> tuple[int, int]:
    """Timed iterations of a large row and of a 4 KiB row at ``scale`` (``"gpu"``, ``"cpu"``),
    before ``--iters`` scales them."""
    _, large, _, small = _SCALES[scale]["iterations"]
    return large, small


def size_text(nbytes: int) -> str:
    """``4096`` as ``"4 KiB"``, ``1 << 30`` as ``"1 GiB"``; other counts in bytes."""
    for unit, size in (("GiB", _GiB), ("MiB", _MiB), ("KiB", _KiB)):
        if nbytes >= size and nbytes % size == 0:
            return f"{nbytes // size} {unit}"
    return f"{nbytes} B"
