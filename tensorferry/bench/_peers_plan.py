"""What ``tensorferry bench peers`` times: its rows, their sizes on each scale, their iterations.

Three scales share the same rows: ``gpu`` (the sizes the rows are named for), ``cpu`` (sizes
scaled down so that a whole run over gloo takes under a minute on two cores) and ``quick`` (a
few iterations of small sizes, for tests). Everything here is plain data, sent to every rank.
"""

from __future__ import annotations

import dataclasses
import math

__all__ = [
    "COMPUTE_ONLY",
    "CONTENDERS",
    "FLOORS",
    "NOTHING_MOVED",
    "ROW_KEYS",
    "Plan",
    "Row",
    "make_plan",
    "parse_rows",
    "size_text",
]

# Column order of the table; the keys name the contenders everywhere (results, files).
CONTENDERS = ("torch", "nixl", "tensorferry")

# The floor rows' one measurement each, named where the contenders' names go (results, files):
# what rows cost without the contenders' transfers, so the table shows how much is left for them.
COMPUTE_ONLY = "compute only"  # the pipeline's compute, no transfer
NOTHING_MOVED = "nothing moved"  # the timing alone, under every 4 KiB row
FLOORS = (COMPUTE_ONLY, NOTHING_MOVED)

# Selectable rows, in table order. The floors come with the rows they are under: "floor" (the
# pipeline's compute without transfers) with "pipeline", "idle" (the timing alone) with any
# 4 KiB row.
ROW_KEYS = ("kv", "large", "small", "roundtrip", "separate", "batch", "pipeline")

_KiB, _MiB, _GiB = 1 << 10, 1 << 20, 1 << 30


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of the table: the operation every contender performs, rank 0 to rank 1.

    Attributes:
        key: short name (``--rows``, file columns).
        number: place in the table (a floor shares the number of the row above it).
        count: tensors per iteration (messages, or microbatches of the pipeline; 0: none).
        shape: shape of each tensor.
        dtype: ``"bfloat16"`` or ``"uint8"`` (a name: plans travel to spawned ranks).
        small: a 4 KiB row, timed over more iterations (its times are tens of microseconds).
        bandwidth: the table also shows GB/s.
        weight_side: the pipeline's square weight side (0: no compute).
        matmuls: matmuls per microbatch on each stage.
        floor: set on a floor row, which the contenders do not run: the name of its one
            measurement (:data:`COMPUTE_ONLY` or :data:`NOTHING_MOVED`), shown in every
            contender's column.
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
    floor: str | None = None

    @property
    def compute_only(self) -> bool:
        """The pipeline's floor: the same compute, no transfer."""
        return self.floor == COMPUTE_ONLY

    @property
    def tensor_bytes(self) -> int:
        return math.prod(self.shape) * (2 if self.dtype == "bfloat16" else 1)

    @property
    def total_bytes(self) -> int:
        """Bytes one iteration moves from rank 0 to rank 1 (0 for a floor)."""
        return 0 if self.floor else self.count * self.tensor_bytes

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
            "idle": "  the timing alone, nothing moved (floor of the 4 KiB rows)",
        }
        # A floor is indented under the row it belongs to, without a number of its own.
        return titles[self.key] if self.floor else f"{self.number}. {titles[self.key]}"


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
        # No tensors: each rank's timed part is empty, timed like the 4 KiB rows it is under.
        Row("idle", 6, 0, (0,), "uint8", small=True, floor=NOTHING_MOVED),
        Row("pipeline", 7, **pipeline),
        Row("floor", 7, floor=COMPUTE_ONLY, **pipeline),
    ]


def _floors_of(rows: list[Row]) -> set[str]:
    """Keys of the floor rows that ``rows`` bring: the pipeline's compute alone with the
    pipeline, the timing alone with any 4 KiB row."""
    floors = set()
    if any(row.key == "pipeline" for row in rows):
        floors.add("floor")
    if any(row.small for row in rows):
        floors.add("idle")
    return floors


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
    """The plan for ``device`` (``"cuda"``/``"cpu"``): its scale's sizes, the selected rows with
    the floors they bring, in table order, and timed iterations scaled by ``iters_scale`` (at
    least 1)."""
    scale = "quick" if quick else "gpu" if device == "cuda" else "cpu"
    every_row = _rows(scale)
    chosen = [row for row in every_row if row.key in rows]
    selected = {row.key for row in chosen} | _floors_of(chosen)
    warmup_large, iters_large, warmup_small, iters_small = _SCALES[scale]["iterations"]
    return Plan(
        device=device,
        scale=scale,
        rows=tuple(row for row in every_row if row.key in selected),
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
