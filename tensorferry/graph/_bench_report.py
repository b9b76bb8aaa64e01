"""Writing benchmark results: a printed table, CSV and Markdown with the run's context."""

from __future__ import annotations

import csv
import datetime
import platform
import sys
from pathlib import Path
from typing import Any

__all__ = ["context", "write_report"]


def context() -> dict[str, str]:
    """Hardware, versions, date and command of this run."""
    import torch

    import tensorferry

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpus = "none"
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        gpus = f"{len(names)} x {names[0]}" if names else "none"
    import os

    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(["tensorferry", *sys.argv[1:]]),
        "cpu": f"{cpu} ({os.cpu_count()} cores)",
        "gpus": gpus,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "-",
        "tensorferry": tensorferry.__version__,
    }


def write_report(
    name: str,
    rows: list[dict[str, Any]],
    out: str | Path,
    *,
    title: str,
    notes: list[str],
) -> tuple[Path, Path]:
    """Prints ``rows`` as a table and writes ``<out>/<name>.csv`` and ``<out>/<name>.md``."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    columns = list(rows[0]) if rows else []
    widths = {c: max(len(c), *(len(_fmt(r[c])) for r in rows)) for c in columns}
    print(title)
    print("  ".join(c.ljust(widths[c]) for c in columns))
    for row in rows:
        print("  ".join(_fmt(row[c]).ljust(widths[c]) for c in columns))
    for note in notes:
        print(f"note: {note}")
    csv_path = folder / f"{name}.csv"
    with csv_path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    info = context()
    lines = [f"# {title}", ""]
    lines += [f"- {key}: `{value}`" for key, value in info.items()]
    lines += ["", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_fmt(r[c]) for c in columns) + " |" for r in rows]
    if notes:
        lines += ["", "Notes and fairness caveats:", ""] + [f"- {n}" for n in notes]
    md_path = folder / f"{name}.md"
    md_path.write_text("\n".join(lines) + "\n")
    print(f"wrote {csv_path} and {md_path}")
    return csv_path, md_path


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"
    return str(value)
