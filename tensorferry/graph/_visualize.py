"""Pictures: the compiled schedule (DOT + picture) and the measured timeline (picture).

matplotlib draws the pictures (the ``plot`` extra); it is imported only here, when a picture is
asked for. When graphviz's ``dot`` is on the PATH it renders the schedule picture from the DOT
text instead. Pictures are PNG unless the path asks for another format (:data:`PICTURE_FORMATS`).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

from tensorferry.graph._plan import DRIVER, GraphSpec, OpKind, Schedules

__all__ = [
    "PICTURE_FORMATS",
    "picture_path",
    "schedule_dot",
    "write_schedule",
    "write_timeline",
    "TRANSPORT_COLORS",
]

PICTURE_FORMATS = (".png", ".svg", ".pdf", ".jpg", ".jpeg")
"""Suffixes that choose the picture's format; both graphviz and matplotlib write each."""

TRANSPORT_COLORS = {
    "shm": "#4c72b0",
    "tcp": "#17becf",
    "nccl": "#2ca02c",
    "nvlink": "#9467bd",
    "ce": "#ff7f0e",
}
KIND_COLORS = {OpKind.READ: "#dbe9f6", OpKind.COMPUTE: "#e8e8e8", OpKind.WRITE: "#fde4c8"}
MOVED_COLOR = "#d62728"
_LANE_ORDER = {"main": 0, "host": 0, "compute": 1, "recv": 2, "send": 3}


def _figure(width: float, height: float) -> Any:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError(
            "drawing pictures needs matplotlib: pip install 'tensorferry[plot]'"
        ) from None
    figure = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(figure)
    return figure


def _actors(graph: GraphSpec, schedules: Schedules) -> list[str]:
    names = [DRIVER] if schedules.get(DRIVER) else []
    return names + [spec.name for spec in graph.actors]


# ---------------------------------------------------------------------- schedule


def schedule_dot(graph: GraphSpec, schedules: Schedules) -> str:
    """The schedule as graphviz DOT text (one cluster per actor, operations in order)."""
    lines = [
        "digraph schedule {",
        "  rankdir=TB; newrank=true; node [shape=box, style=filled, fontname=Helvetica];",
    ]
    where: dict[tuple[str, OpKind, int], str] = {}
    for a, actor in enumerate(_actors(graph, schedules)):
        device = "host" if actor == DRIVER else graph.device_of(actor)
        lines.append(f'  subgraph cluster_{a} {{ label="{actor} ({device})"; style=rounded;')
        previous = None
        for i, op in enumerate(schedules[actor]):
            node = f"a{a}_{i}"
            if op.edge_id is not None:
                where[(actor, op.kind, op.edge_id)] = node
            color = MOVED_COLOR if op.moved else "black"
            label = graph.describe(op) + ("\\n(moved)" if op.moved else "")
            lines.append(
                f'    {node} [label="{i}: {label}", fillcolor="{KIND_COLORS[op.kind]}", '
                f'color="{color}", fontcolor="{color}", penwidth={2 if op.moved else 1}];'
            )
            if previous is not None:
                lines.append(f"    {previous} -> {node} [color=gray60, arrowsize=0.5];")
            previous = node
        lines.append("  }")
    for edge in graph.edges:
        src = where.get((edge.src_actor, OpKind.WRITE, edge.edge_id))
        dst = where.get((edge.dst_actor, OpKind.READ, edge.edge_id))
        if src and dst:
            color = TRANSPORT_COLORS[edge.transport]
            lines.append(
                f'  {src} -> {dst} [color="{color}", fontcolor="{color}", label="{edge.transport}",'
                " constraint=false, penwidth=2];"
            )
    lines.append('  subgraph cluster_legend { label="legend"; style=dashed;')
    lines.append(f'    l_moved [label="moved by overlap", color="{MOVED_COLOR}", fillcolor=white];')
    for name, color in TRANSPORT_COLORS.items():
        lines.append(f'    l_{name} [label="{name} edge", color="{color}", fillcolor=white];')
    lines.append("  }")
    lines.append("}")
    return "\n".join(lines) + "\n"


def picture_path(path: str | Path) -> Path:
    """Where a picture asked for as ``path`` goes: ``path`` itself when its suffix names a
    format (:data:`PICTURE_FORMATS`), else ``path`` with ``.png`` added. Added, not swapped:
    ``run.1`` is a name, and replacing its "suffix" would write ``run.png`` instead, over
    another run's picture."""
    out = _file_path(path)
    if out.suffix.lower() in PICTURE_FORMATS:
        return out
    return out.with_name(out.name + ".png")


def _file_path(path: str | Path) -> Path:
    """``path`` as a file to write; an existing folder is refused (a base name beside it, its
    own name plus ``.png``, is not where anyone looks)."""
    out = Path(path)
    if out.is_dir():
        raise ValueError(f"{out} is a folder: give a file name, such as {out / 'schedule.png'}")
    return out


def write_schedule(graph: GraphSpec, schedules: Schedules, path: str | Path) -> tuple[Path, Path]:
    """Writes the schedule as DOT text and as a picture; returns (dot path, picture path).

    ``path`` ending in a picture format (``s.svg``) gives that picture and ``s.dot`` beside
    it; ending in ``.dot``, that file and a PNG beside it; anything else is a base name:
    ``<path>.dot`` and ``<path>.png``.
    """
    out = _file_path(path)
    if out.suffix.lower() == ".dot":
        dot_path, picture = out, out.with_suffix(".png")
    else:
        picture = picture_path(out)
        dot_path = picture.with_suffix(".dot")
    picture.parent.mkdir(parents=True, exist_ok=True)
    dot_text = schedule_dot(graph, schedules)
    dot_path.write_text(dot_text)
    dot = shutil.which("dot")
    if dot is not None:
        image_format = picture.suffix.lower().lstrip(".").replace("jpeg", "jpg")
        done = subprocess.run(
            [dot, f"-T{image_format}", "-o", str(picture)],
            input=dot_text.encode(),
            timeout=60,
            check=False,
        )
        if done.returncode == 0:
            return dot_path, picture
    _draw_schedule(graph, schedules, picture)
    return dot_path, picture


def _draw_schedule(graph: GraphSpec, schedules: Schedules, picture: Path) -> None:
    from matplotlib.lines import Line2D
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Patch

    actors = _actors(graph, schedules)
    rows = max(len(schedules[a]) for a in actors)
    col_w, box_w, box_h = 3.4, 3.0, 0.62
    figure = _figure(max(6.0, col_w * len(actors) + 0.6), 1.6 + 0.78 * rows + 1.2)
    axes = figure.add_axes((0.01, 0.13, 0.98, 0.85))
    axes.set_xlim(-0.2, col_w * len(actors))
    axes.set_ylim(-rows - 0.3, 1.3)
    axes.axis("off")
    centre: dict[tuple[str, OpKind, int], tuple[float, float]] = {}
    for a, actor in enumerate(actors):
        x0 = a * col_w
        ops = schedules[actor]
        device = "host" if actor == DRIVER else graph.device_of(actor)
        axes.add_patch(
            FancyBboxPatch(
                (x0 + 0.05, -len(ops) - 0.1), col_w - 0.3, len(ops) + 1.05,
                boxstyle="round,pad=0.05", facecolor="#f7f7fb", edgecolor="#888888",
            )
        )  # fmt: skip
        axes.text(x0 + col_w / 2 - 0.1, 0.6, f"{actor}\n({device})", ha="center", va="center",
                  fontsize=9, fontweight="bold")  # fmt: skip
        for i, op in enumerate(ops):
            y = -i - 0.5
            colour = MOVED_COLOR if op.moved else "#333333"
            axes.add_patch(
                FancyBboxPatch(
                    (x0 + 0.1, y - box_h / 2), box_w, box_h, boxstyle="round,pad=0.02",
                    facecolor=KIND_COLORS[op.kind], edgecolor=colour,
                    linewidth=2.2 if op.moved else 0.8,
                )
            )  # fmt: skip
            label = f"{i}: {graph.describe(op)}"
            axes.text(x0 + 0.1 + box_w / 2, y, label, ha="center", va="center", fontsize=6.3,
                      color=colour, fontweight="bold" if op.moved else "normal")  # fmt: skip
            if i:
                middle = x0 + 0.1 + box_w / 2
                arrow = {"arrowstyle": "-|>", "color": "#aaaaaa", "lw": 0.6}
                axes.annotate("", (middle, y + box_h / 2), (middle, y + 1 - box_h / 2),
                              arrowprops=arrow)  # fmt: skip
            if op.edge_id is not None:
                centre[(actor, op.kind, op.edge_id)] = (x0 + 0.1, y)
    for edge in graph.edges:
        src = centre.get((edge.src_actor, OpKind.WRITE, edge.edge_id))
        dst = centre.get((edge.dst_actor, OpKind.READ, edge.edge_id))
        if src is None or dst is None:
            continue
        right = dst[0] > src[0]
        start = (src[0] + (box_w if right else 0), src[1])
        end = (dst[0] + (0 if right else box_w), dst[1])
        axes.add_patch(
            FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=11, lw=1.6,
                            color=TRANSPORT_COLORS[edge.transport],
                            connectionstyle="arc3,rad=0.12")
        )  # fmt: skip
    handles = [Patch(facecolor=KIND_COLORS[k], edgecolor="#333333", label=k.value) for k in OpKind]
    handles.append(Patch(facecolor="white", edgecolor=MOVED_COLOR, lw=2.2,
                         label="moved by the overlap pass"))  # fmt: skip
    used = sorted({e.transport for e in graph.edges})
    handles += [Line2D([], [], color=TRANSPORT_COLORS[t], lw=2, label=f"{t} edge") for t in used]
    figure.legend(handles=handles, loc="lower center", ncol=min(len(handles), 4), fontsize=8,
                  frameon=False)  # fmt: skip
    figure.savefig(picture)


# ---------------------------------------------------------------------- timeline


def _busy_union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def _intersections(a: list[tuple[float, float]], b: list[tuple[float, float]]):
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def write_timeline(records: list, path: str | Path, *, last: int | None = None) -> Path:
    """Draws profile records as a Gantt chart, one row per actor and stream (or thread).

    Communication that ran while the same actor computed is shaded yellow: that is the overlap.

    Args:
        records: ``ProfileRecord`` tuples (actor, execution, op index, kind, label, lane,
            start, end).
        path: the picture to write: PNG, or the format its suffix names
            (:data:`PICTURE_FORMATS`); any other name gets ``.png`` added.
        last: keep only each actor's last ``last`` executions.

    Returns:
        The picture's path.

    Raises:
        ValueError: no records (was the graph compiled with ``profile=True`` and executed?).
    """
    from matplotlib.patches import Patch

    if last is not None and (type(last) is not int or last < 1):
        raise ValueError(f"last must be a positive number of executions, got {last!r}")
    out = picture_path(path)  # before the drawing: a folder given as the path is refused
    if not records:
        raise ValueError("no profile records: compile with profile=True and execute first")
    if last is not None:
        newest: dict[str, int] = {}
        for r in records:
            newest[r[0]] = max(newest.get(r[0], -1), r[1])
        records = [r for r in records if r[1] > newest[r[0]] - last]
    origin = min(r[6] for r in records)
    actors = list(dict.fromkeys(r[0] for r in sorted(records, key=lambda r: r[6])))
    lanes = sorted({(r[0], r[5]) for r in records},
                   key=lambda k: (actors.index(k[0]), _LANE_ORDER.get(k[1], 9), k[1]))  # fmt: skip
    row = {lane: i for i, lane in enumerate(lanes)}
    height = 2.2 + 0.5 * len(lanes) + 0.2 * len(actors)
    figure = _figure(12.0, height)
    axes = figure.add_axes((0.16, 0.9 / height, 0.82, 1 - (1.4 + 0.2 * len(actors)) / height))
    kind_colors = {"READ": "#4c72b0", "COMPUTE": "#8c8c8c", "WRITE": "#dd8452"}
    summary = []
    for actor in actors:
        # A GPU actor's "host" lane is its thread issuing the device work drawn on the other
        # lanes: overlap is judged on the device lanes only.
        mine = [r for r in records if r[0] == actor and r[5] != "host"]
        compute = _busy_union([(r[6], r[7]) for r in mine if r[3] == "COMPUTE"])
        comm = _busy_union([(r[6], r[7]) for r in mine if r[3] != "COMPUTE"])
        hidden = _intersections(compute, comm)
        rows = [row[k] for k in lanes if k[0] == actor]
        for start, end in hidden:
            axes.axvspan((start - origin) * 1e3, (end - origin) * 1e3,
                         ymin=0, ymax=1, color="#fff3b0", zorder=0)  # fmt: skip
        comm_time = sum(e - s for s, e in comm)
        if comm_time > 0 and rows:
            share = sum(e - s for s, e in hidden) / comm_time
            summary.append(f"{actor}: {share:.0%} of communication overlapped compute")
    for r in records:
        actor, execution, _, kind, _label, lane, start, end = r
        y = row[(actor, lane)]
        axes.barh(y, max((end - start) * 1e3, 1e-4), left=(start - origin) * 1e3, height=0.6,
                  color=kind_colors[kind], edgecolor="black", linewidth=0.3,
                  alpha=0.95 if execution % 2 == 0 else 0.7, zorder=2)  # fmt: skip
    axes.set_yticks(range(len(lanes)), [f"{a} / {lane}" for a, lane in lanes], fontsize=8)
    axes.invert_yaxis()
    axes.set_xlabel("time (ms)")
    axes.grid(axis="x", alpha=0.3)
    axes.set_title("measured timeline (alternate executions shaded lighter; waits not drawn)\n"
                   + "\n".join(summary), fontsize=9)  # fmt: skip
    handles = [Patch(color=c, label=k) for k, c in kind_colors.items()]
    handles.append(Patch(color="#fff3b0", label="communication overlapping compute"))
    figure.legend(handles=handles, loc="lower center", ncol=4, fontsize=8, frameon=False)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out)
    return out
