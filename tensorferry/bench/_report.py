"""Benchmark reports, shared by every ``tensorferry bench``: a printed table, plus CSV and
Markdown files that carry the run's provenance (hardware, versions, date, command).

Files are named ``<theme>_<hardware>_<date>.{csv,md}`` so results from different machines and
days can sit side by side in one ``--out`` folder; a run's table then goes onto its living page
under ``benchmarks/``.

Every report is also kept in this process (:func:`record`, :func:`collected`), so that
``tensorferry bench <name> --json`` can print all of a run's results as one JSON document.
"""

from __future__ import annotations

import contextlib
import csv
import datetime as _dt
import os
import platform
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "collected",
    "environment",
    "environment_lines",
    "format_table",
    "hardware_tag",
    "record",
    "report",
    "time_ratio_text",
]

# The reports made in this process, oldest first (see record()).
_RECORDED: list[dict[str, Any]] = []


def environment() -> dict[str, str]:
    """Hardware and software the numbers were measured on, and the command that ran."""
    import torch

    import tensorferry

    info = {
        "date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "tensorferry": tensorferry.__version__,
        "command": "tensorferry " + shlex.join(sys.argv[1:]),
    }
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        info["devices"] = f"{len(names)} × {names[0]}" if len(set(names)) == 1 else ", ".join(names)
        info["cuda"] = str(torch.version.cuda)
        with contextlib.suppress(Exception):  # NCCL-less builds
            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    else:
        info["devices"] = f"CPU only ({os.cpu_count()} cores, {platform.machine()})"
    for env in ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS"):
        if env in os.environ:
            info[env] = os.environ[env]
    return info


def environment_lines() -> list[str]:
    """:func:`environment` as Markdown list items (the command in code quotes)."""
    return [f"- {k}: `{v}`" if k == "command" else f"- {k}: {v}" for k, v in environment().items()]


def hardware_tag() -> str:
    """``"2xNVIDIA-H200"``-style tag of this machine (``"cpu"`` without CUDA)."""
    import torch

    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0).replace(" ", "-")
        return f"{torch.cuda.device_count()}x{name}"
    return "cpu"


def format_table(
    rows: Sequence[dict[str, Any]],
    columns: Sequence[str] | None = None,
    *,
    left: Sequence[str] = (),
) -> str:
    """A fixed-width text table of ``rows`` (columns: every key, in first-seen order), numbers
    aligned right; the columns named in ``left`` (text, such as row names) aligned left."""
    columns = list(columns) if columns is not None else _columns(rows)
    cells = [[_cell(row.get(c, "")) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]

    def line(values: Sequence[str]) -> str:
        parts = zip(columns, values, widths, strict=True)
        return "  ".join(v.ljust(w) if c in left else v.rjust(w) for c, v, w in parts).rstrip()

    lines = [line(columns), line(["-" * w for w in widths])]
    lines += [line(r) for r in cells]
    return "\n".join(lines)


def report(
    out_dir: str | os.PathLike[str] | None,
    theme: str,
    rows: Sequence[dict[str, Any]],
    *,
    title: str,
    notes: Sequence[str] = (),
    columns: Sequence[str] | None = None,
) -> tuple[Path, Path] | None:
    """Prints the table and notes; with ``out_dir``, also writes the CSV and Markdown files.

    Returns:
        The ``(csv, md)`` paths, or ``None`` without ``out_dir``.
    """
    columns = list(columns) if columns is not None else _columns(rows)
    print(title)
    print(format_table(rows, columns))
    for note in notes:
        print(f"note: {note}")
    if out_dir is None:
        record(theme, rows, title=title, notes=notes)
        return None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{theme}_{hardware_tag()}_{_dt.date.today().isoformat()}"
    csv_path, md_path = out / f"{stem}.csv", out / f"{stem}.md"
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    lines = [f"# {title}", "", *environment_lines()]
    lines += ["", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(r.get(c, "")) for c in columns) + " |" for r in rows]
    if notes:
        lines += ["", "Notes and fairness caveats:", "", *(f"- {n}" for n in notes)]
    md_path.write_text("\n".join(lines) + "\n")
    print(f"wrote {csv_path} and {md_path}")
    record(theme, rows, title=title, notes=notes, files=[csv_path, md_path])
    return csv_path, md_path


def record(
    theme: str,
    rows: Sequence[dict[str, Any]],
    *,
    title: str,
    notes: Sequence[str] = (),
    files: Sequence[str | os.PathLike[str]] = (),
) -> None:
    """Keeps one report of this process for :func:`collected` (``report`` calls it; a benchmark
    that writes its own files calls it once per report)."""
    _RECORDED.append(
        {
            "theme": theme,
            "title": title,
            "rows": [dict(row) for row in rows],
            "notes": list(notes),
            "files": [str(path) for path in files],
        }
    )


def collected() -> list[dict[str, Any]]:
    """The reports recorded in this process so far, oldest first; the list is emptied."""
    reports = list(_RECORDED)
    _RECORDED.clear()
    return reports


def time_ratio_text(time: float, reference_time: float, reference: str) -> str:
    """One time against another, as a ratio of times: ``"1.23× the time of overlap off
    (slower)"``, ``"0.81× the time of torch (faster)"``, ``"1.00× the time of torch (same)"``.

    A ratio reads the same way above and below 1, where a percentage "faster" does not
    ("-78% faster").
    """
    ratio = time / reference_time
    verdict = "faster" if ratio < 0.995 else "slower" if ratio > 1.005 else "same"
    return f"{ratio:.2f}× the time of {reference} ({verdict})"


def _columns(rows: Sequence[dict[str, Any]]) -> list[str]:
    columns: list[str] = []
    for row in rows:
        columns += [c for c in row if c not in columns]
    return columns


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)
