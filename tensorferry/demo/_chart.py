"""The p2p demo's table as a picture: one-way time and bandwidth against message size."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tensorferry.demo._sizes import human_size

__all__ = ["write_p2p_chart"]

_SERIES = (("tensorferry", "#2ca02c", "o"), ("torch", "#4c72b0", "s"))


def write_p2p_chart(rows: list[dict[str, Any]], path: str | Path, title: str) -> Path:
    """Draws the rows of ``run_p2p_demo`` into a PNG at ``path``; returns the path.

    Raises:
        ImportError: matplotlib is not installed.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11.0, 4.2), dpi=110)
    FigureCanvasAgg(figure)
    time_axes, rate_axes = figure.subplots(1, 2)
    sizes = [row["bytes"] for row in rows]
    for library, color, marker in _SERIES:
        label = "torch.distributed" if library == "torch" else library
        time_axes.plot(sizes, [row[f"{library}_us"] for row in rows], marker=marker,
                       color=color, label=label)  # fmt: skip
        rate_axes.plot(sizes, [row[f"{library}_gb_per_s"] for row in rows], marker=marker,
                       color=color, label=label)  # fmt: skip
    for axes, what in ((time_axes, "one-way time (µs)"), (rate_axes, "one-way GB/s")):
        axes.set_xscale("log", base=2)
        axes.set_yscale("log")
        axes.set_xticks(sizes, [human_size(size) for size in sizes], fontsize=8)
        axes.set_xlabel("message size")
        axes.set_ylabel(what)
        axes.grid(alpha=0.3, which="both")
        axes.legend(fontsize=8)
    figure.suptitle(f"tensorferry beside torch.distributed: {title}", fontsize=10)
    figure.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out)
    return out
