"""A measured size table: which of the kernel-level channels (``nvlink``, ``ce``, ``nccl``) was
fastest for a message size.

The table is plain data (JSON): per direction mode, size thresholds and the transport that was
fastest up to each. ``tensorferry bench sendrecv --tune`` measures and writes one, and that
bench's ``auto`` column follows it (``--table``); defaults for H100/H200 ship in
:data:`DEFAULT_TABLES`. ``tf.send(transport="auto")`` does not read it: it picks ``ce`` or
``nccl`` by host. Pure Python, testable without a GPU.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["AutoTable", "DEFAULT_TABLES", "TRANSPORTS", "default_table"]

TRANSPORTS = ("nvlink", "ce", "nccl")
MODES = ("one_way", "both")

# 2 x H200, one way, graph-replayed (2026-11-21, benchmarks/sendrecv.md's history):
# up to 64 KiB NCCL (9.7-10.6 µs) beat the staged NVLink kernel (11.1-13.1 µs). Larger sizes
# and both-ways were not measured yet: above 64 KiB the rule follows the design expectation
# (NVLink kernels), to be replaced by a `--tune` table. H100 is not measured: same rules.
_H200 = {
    "device": "NVIDIA H200",
    "rules": {
        "one_way": [[64 << 10, "nccl"], [None, "nvlink"]],
        "both": [[64 << 10, "nccl"], [None, "nvlink"]],
    },
    "concurrent_compute_min_bytes": 1 << 20,
    "min_ctas_for_nvlink": 1,
}
DEFAULT_TABLES = {"H200": _H200, "H100": {**_H200, "device": "NVIDIA H100"}}


@dataclass(frozen=True, slots=True)
class AutoTable:
    """Size rules per mode; the first rule whose bound is at least the message size wins.

    Attributes:
        rules: ``{"one_way": [(max_bytes or None, transport), …], "both": […]}``, ascending,
            the last bound ``None`` (no limit).
        concurrent_compute_min_bytes: from this size up, messages that overlap compute go over
            the copy engine (which uses no SMs).
        min_ctas_for_nvlink: a smaller CTA budget (e.g. 0) means the copy engine.
        device: the device name the table was measured on.
    """

    rules: Mapping[str, Sequence[tuple[int | None, str]]]
    concurrent_compute_min_bytes: int = 1 << 20
    min_ctas_for_nvlink: int = 1
    device: str = ""
    source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        for mode in MODES:
            if mode not in self.rules:
                raise ValueError(f"auto table: no rules for mode {mode!r}")
            rules = list(self.rules[mode])
            if not rules:
                raise ValueError(f"auto table: empty rules for {mode!r}")
            last = -1
            for i, (bound, transport) in enumerate(rules):
                if transport not in TRANSPORTS:
                    raise ValueError(f"auto table: unknown transport {transport!r} in {mode!r}")
                if bound is None:
                    if i != len(rules) - 1:
                        raise ValueError(f"auto table: unbounded rule before the end in {mode!r}")
                    continue
                if not isinstance(bound, int) or bound <= last:
                    raise ValueError(f"auto table: bounds must ascend in {mode!r}, got {bound!r}")
                last = bound
            if rules[-1][0] is not None:
                raise ValueError(f"auto table: the last rule of {mode!r} must be unbounded")

    def choose(
        self,
        nbytes: int,
        *,
        bidirectional: bool,
        max_ctas: int | None = None,
        concurrent_compute: bool = False,
    ) -> str:
        """The transport for one message.

        Args:
            nbytes: message size (per direction).
            bidirectional: both directions move at once.
            max_ctas: the SM budget (CTAs) the caller allows; ``None`` for no limit.
            concurrent_compute: compute kernels run at the same time on this device.
        """
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        if max_ctas is not None and max_ctas < self.min_ctas_for_nvlink:
            return "ce"
        if concurrent_compute and nbytes >= self.concurrent_compute_min_bytes:
            return "ce"
        for bound, transport in self.rules["both" if bidirectional else "one_way"]:
            if bound is None or nbytes <= bound:
                return transport
        raise AssertionError("unreachable: the last rule is unbounded")

    # ------------------------------------------------------------------ persistence
    def to_json(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "rules": {m: [list(r) for r in self.rules[m]] for m in MODES},
            "concurrent_compute_min_bytes": self.concurrent_compute_min_bytes,
            "min_ctas_for_nvlink": self.min_ctas_for_nvlink,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any], *, source: str = "") -> AutoTable:
        if not isinstance(data, Mapping) or "rules" not in data:
            raise ValueError("auto table JSON needs a 'rules' object")
        rules = {m: [(b, t) for b, t in data["rules"].get(m, [])] for m in MODES}
        return cls(
            rules=rules,
            concurrent_compute_min_bytes=int(data.get("concurrent_compute_min_bytes", 1 << 20)),
            min_ctas_for_nvlink=int(data.get("min_ctas_for_nvlink", 1)),
            device=str(data.get("device", "")),
            source=source,
        )

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=2)
            f.write("\n")

    @classmethod
    def load(cls, path: str) -> AutoTable:
        with open(path) as f:
            return cls.from_json(json.load(f), source=path)

    @classmethod
    def from_measurements(
        cls, times: Mapping[tuple[str, int], Mapping[str, float]], *, device: str = ""
    ) -> AutoTable:
        """Builds rules from ``{(mode, nbytes): {transport: seconds}}``: each measured size goes
        to its fastest transport; neighbouring sizes with the same winner merge."""
        rules: dict[str, list[tuple[int | None, str]]] = {}
        for mode in MODES:
            sizes = sorted(n for (m, n) in times if m == mode)
            if not sizes:
                raise ValueError(f"no measurements for mode {mode!r}")
            winners = []
            for n in sizes:
                candidates = {t: s for t, s in times[(mode, n)].items() if t in TRANSPORTS}
                if not candidates:
                    raise ValueError(f"no known transport measured at {mode} {n} B")
                winners.append((n, min(candidates, key=candidates.__getitem__)))
            merged: list[tuple[int | None, str]] = []
            for i, (n, best) in enumerate(winners):
                if i + 1 < len(winners) and winners[i + 1][1] == best:
                    continue
                merged.append((n, best))
            merged[-1] = (None, merged[-1][1])
            rules[mode] = merged
        return cls(rules=rules, device=device)


def default_table(device_name: str | None = None, *, path: str | None = None) -> AutoTable:
    """The table at ``path`` (a JSON file from ``tensorferry bench sendrecv --tune``) if given,
    else the shipped default matching ``device_name`` (H100/H200), else the H200 one."""
    if path:
        return AutoTable.load(path)
    if device_name is None:
        try:
            import torch

            if torch.cuda.is_available():
                device_name = torch.cuda.get_device_name()
        except Exception:
            device_name = None
    key = "H100" if device_name and "H100" in device_name else "H200"
    return AutoTable.from_json(DEFAULT_TABLES[key], source=f"default:{key}")
