"""The table and files of ``tensorferry bench peers``: ``peers.csv``, ``peers.md``,
``peers.json`` and ``peers.png`` (the PNG when matplotlib is installed)."""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tensorferry.bench._peers_plan import CONTENDERS, FLOORS

__all__ = [
    "COLUMNS",
    "csv_rows",
    "format_ratio",
    "format_time",
    "markdown",
    "ratio",
    "table_rows",
    "write_files",
]

# Printed and Markdown table: one column per contender, then tensorferry's time over theirs.
_LABELS = {"torch": "torch", "nixl": "NIXL", "tensorferry": "tensorferry"}
COLUMNS = ("row", "torch µs", "NIXL µs", "tensorferry µs", "tf/torch", "tf/NIXL")


def ratio(time: float | None, reference: float | None) -> float | None:
    """``time / reference``, or ``None`` when either is missing (or the reference is 0)."""
    if time is None or not reference:
        return None
    return time / reference


def format_ratio(value: float | None) -> str:
    """``0.8123`` as ``"0.81×"``; nothing for ``None``."""
    return "" if value is None else f"{value:.2f}×"


def format_time(us: float, gb_per_s: float | None = None) -> str:
    """Microseconds to the tenth below 1000 µs, whole above; with GB/s in brackets if given."""
    text = f"{us:.1f}" if us < 1000 else f"{us:.0f}"
    return f"{text} ({gb_per_s:.1f} GB/s)" if gb_per_s is not None else text


def _median(entry: dict[str, Any] | None) -> float | None:
    return None if entry is None else entry.get("median_us")


def _floor(entries: dict[str, Any]) -> dict[str, Any] | None:
    """A floor row's one measurement (``"compute only"``, ``"nothing moved"``), or ``None``
    for a row the contenders ran."""
    return next((entries[name] for name in FLOORS if name in entries), None)


def table_rows(rows: Sequence[dict[str, Any]]) -> tuple[list[dict[str, str]], list[str]]:
    """The table's lines, and footnotes for the cells that are ``n/a`` (one per reason).

    A floor row (its one measurement is ``"compute only"`` or ``"nothing moved"``) shows that
    time in every contender's column, next to the rows above it, and no ratios: it is not a
    contender.
    """
    reasons: list[str] = []
    lines = []
    for row in rows:
        entries = row["contenders"]
        line = {"row": row["title"]}
        floor = _floor(entries)
        for name in CONTENDERS:
            entry = floor if floor is not None else entries.get(name)
            column = f"{_LABELS[name]} µs"
            if entry is None:
                line[column] = ""
            elif "skipped" in entry:
                reason = f"{_LABELS[name]}: {entry['skipped']}"
                if reason not in reasons:
                    reasons.append(reason)
                line[column] = f"n/a [{reasons.index(reason) + 1}]"
            else:
                gb_per_s = entry.get("gb_per_s") if row.get("bandwidth") else None
                line[column] = format_time(entry["median_us"], gb_per_s)
        tf_us = None if floor is not None else _median(entries.get("tensorferry"))
        line["tf/torch"] = format_ratio(ratio(tf_us, _median(entries.get("torch"))))
        line["tf/NIXL"] = format_ratio(ratio(tf_us, _median(entries.get("nixl"))))
        lines.append(line)
    return lines, [f"[{i}] {reason}" for i, reason in enumerate(reasons, 1)]


def csv_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per row and contender: numbers where it ran, the reason where it did not."""
    out = []
    for row in rows:
        for name, entry in row["contenders"].items():
            out.append(
                {
                    "row": row["key"],
                    "title": row["title"].strip(),
                    "contender": name,
                    "bytes": row["bytes"],
                    "iterations": row["iterations"],
                    "median_us": entry.get("median_us", ""),
                    "min_us": entry.get("min_us", ""),
                    "max_us": entry.get("max_us", ""),
                    "gb_per_s": entry.get("gb_per_s", "") if row["bytes"] else "",
                    "skipped": entry.get("skipped", ""),
                }
            )
    return out


def write_files(
    out_dir: str | Path,
    rows: Sequence[dict[str, Any]],
    *,
    title: str,
    environment: dict[str, str],
    lines: Sequence[dict[str, str]],
    notes: Sequence[str],
) -> list[Path]:
    """Writes ``peers.{csv,md,json}`` (and ``peers.png`` with matplotlib); returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "peers.csv", out / "peers.md", out / "peers.json"]
    flat = csv_rows(rows)
    with paths[0].open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(flat[0]) if flat else ["row"])
        writer.writeheader()
        writer.writerows(flat)
    paths[1].write_text(markdown(title, environment, lines, notes))
    document = {"title": title, "environment": environment, "rows": list(rows), "notes": notes}
    paths[2].write_text(json.dumps(document, indent=2) + "\n")
    png = _plot(out / "peers.png", rows, title)
    return [*paths, png] if png is not None else paths


def markdown(
    title: str,
    environment: dict[str, str],
    lines: Sequence[dict[str, str]],
    notes: Sequence[str],
) -> str:
    """``peers.md``: provenance (hardware, versions, date, command), the table, the notes."""
    text = [f"# {title}", ""]
    text += [f"- {k}: `{v}`" if k == "command" else f"- {k}: {v}" for k, v in environment.items()]
    text += ["", "| " + " | ".join(COLUMNS) + " |", "|---" + "|--:" * (len(COLUMNS) - 1) + "|"]
    for line in lines:
        cells = [line.get(c, "").strip().replace("|", "\\|") for c in COLUMNS]
        text.append("| " + " | ".join(cells) + " |")
    text += ["", "Notes and fairness caveats:", "", *(f"- {note}" for note in notes)]
    return "\n".join(text) + "\n"


def _plot(path: Path, rows: Sequence[dict[str, Any]], title: str) -> Path | None:
    """Median time of each row and contender as grouped bars (log scale); ``None`` without
    matplotlib (a line says so)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("peers.png skipped: matplotlib is not installed")
        return None
    fig, ax = plt.subplots(figsize=(10, 0.6 * len(rows) + 1.5))
    height = 0.8 / len(CONTENDERS)
    for name in [*CONTENDERS, *FLOORS]:
        # A floor row has one bar, in the first contender's place.
        slot = CONTENDERS.index(name) if name in CONTENDERS else 0
        ys, widths = [], []
        for n, row in enumerate(rows):
            us = _median(row["contenders"].get(name))
            if us is not None:
                ys.append(n + slot * height)
                widths.append(us)
        if ys:
            ax.barh(ys, widths, height=height, label=_LABELS.get(name, name))
    ax.set_yticks([n + height for n in range(len(rows))])
    ax.set_yticklabels([row["title"].strip()[:60] for row in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("median µs per iteration (lower is faster)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
