"""Tables, CSV and Markdown for the p2p benchmarks (hardware, versions, date, command)."""

from __future__ import annotations

import contextlib
import csv
import datetime
import os
import platform
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["print_table", "write", "hardware"]


def hardware() -> str:
    """``"2xNVIDIA-H200"``-style tag of this machine (``"cpu"`` without CUDA)."""
    import torch

    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0).replace(" ", "-")
        return f"{torch.cuda.device_count()}x{name}"
    return "cpu"


def _versions() -> str:
    import torch

    parts = [f"torch {torch.__version__}", f"python {platform.python_version()}"]
    if torch.cuda.is_available():
        parts.append(f"CUDA {torch.version.cuda}")
        with contextlib.suppress(Exception):  # NCCL-less builds
            parts.append("NCCL " + ".".join(map(str, torch.cuda.nccl.version())))
    return ", ".join(parts)


def print_table(rows: Sequence[dict[str, Any]]) -> None:
    if not rows:
        return
    columns = list(rows[0])
    for row in rows[1:]:
        columns += [c for c in row if c not in columns]
    cells = [[str(row.get(c, "")) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    for r in cells:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)))


def write(
    out_dir: str, theme: str, rows: Sequence[dict[str, Any]], *, notes: str = ""
) -> list[str]:
    """Writes ``<theme>_<hardware>_<date>.csv`` and ``.md`` into ``out_dir``; returns paths."""
    os.makedirs(out_dir, exist_ok=True)
    date = datetime.date.today().isoformat()
    stem = os.path.join(out_dir, f"{theme}_{hardware()}_{date}")
    columns = list(rows[0]) if rows else []
    for row in rows[1:]:
        columns += [c for c in row if c not in columns]
    with open(stem + ".csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    command = " ".join(["tensorferry", *sys.argv[1:]]) if sys.argv else "tensorferry"
    lines = [
        f"# {theme} — {hardware()} — {date}",
        "",
        f"- command: `{command}`",
        f"- versions: {_versions()}",
        f"- host: {platform.node()} ({platform.processor() or platform.machine()})",
        "",
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * len(columns),
    ]
    lines += ["| " + " | ".join(str(row.get(c, "")) for c in columns) + " |" for row in rows]
    if notes:
        lines += ["", "## What is measured", "", notes.strip()]
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    return [stem + ".csv", stem + ".md"]
