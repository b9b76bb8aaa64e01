"""Benchmark reports: a printed table, plus CSV and Markdown files with the run's provenance."""

from __future__ import annotations

import csv
import datetime as _dt
import os
import platform
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["environment", "format_table", "write_report"]


def environment() -> dict[str, str]:
    """Hardware and software the numbers were measured on."""
    import torch

    info = {
        "date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "command": "tensorferry " + shlex.join(sys.argv[1:]) if sys.argv else "",
    }
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        info["devices"] = f"{len(names)} × {names[0]}" if len(set(names)) == 1 else ", ".join(names)
        info["cuda"] = str(torch.version.cuda)
        try:
            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # NCCL missing from this build
            info["nccl"] = "n/a"
    else:
        info["devices"] = f"CPU only ({os.cpu_count()} cores, {platform.machine()})"
    for env in ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS"):
        if env in os.environ:
            info[env] = os.environ[env]
    return info


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """A fixed-width text table of ``rows`` (floats to 3 significant digits)."""
    cells = [[_cell(row.get(c, "")) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(lines)


def write_report(
    out_dir: str | os.PathLike[str],
    name: str,
    rows: Sequence[dict[str, Any]],
    columns: Sequence[str],
    *,
    title: str,
    notes: Sequence[str] = (),
) -> tuple[Path, Path]:
    """Writes ``<name>.csv`` and ``<name>.md`` (provenance, table, notes) under ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    csv_path, md_path = out / f"{name}.csv", out / f"{name}.md"
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    env = environment()
    lines = [f"# {title}", ""]
    lines += [f"- {k}: `{v}`" if k == "command" else f"- {k}: {v}" for k, v in env.items()]
    lines += ["", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(r.get(c, "")) for c in columns) + " |" for r in rows]
    if notes:
        lines += ["", "Notes:", *(f"- {n}" for n in notes)]
    md_path.write_text("\n".join(lines) + "\n")
    return csv_path, md_path


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)
