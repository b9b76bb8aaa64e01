"""A one-line text progress bar for the demo's long parts."""

from __future__ import annotations

import sys
from typing import TextIO

__all__ = ["ProgressBar"]


class ProgressBar:
    """A one-line text progress bar (``[#####.....] 5/10 label``), redrawn in place on a
    terminal. Elsewhere (a log file, a pipe) it writes one plain line per new label and one at
    the end, since redrawing would leave every frame on a single line there."""

    def __init__(self, total: int, *, width: int = 30, stream: TextIO | None = None) -> None:
        if total < 1:
            raise ValueError(f"total must be >= 1, got {total}")
        self.total = total
        self.width = width
        self.done = 0
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self.redraws = bool(isatty()) if callable(isatty) else False
        self._label: str | None = None

    def advance(self, label: str = "") -> None:
        self.done = min(self.total, self.done + 1)
        filled = round(self.width * self.done / self.total)
        line = f"[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} {label}"
        if self.redraws:
            self.stream.write(f"\r{line:<{self.width + 40}}")
            if self.done == self.total:
                self.stream.write("\n")
        elif label != self._label or self.done == self.total:
            self.stream.write(line.rstrip() + "\n")
        self._label = label
        self.stream.flush()
