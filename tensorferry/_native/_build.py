"""Builds the compiled helpers: run as a script, in a process of its own (no torch imported).

``python _build.py OUTPUT COMMAND_JSON``: under an exclusive lock on ``OUTPUT.lock``, unless
``OUTPUT`` exists already or an earlier build failed (``OUTPUT.failed``), runs the compiler
command (whose ``-o`` names a temporary file) and renames its output to ``OUTPUT``; on failure
writes the command and the compiler's output to ``OUTPUT.failed``. A process of its own, in a
session of its own, so that a program that exits first (a short script) does not leave the
build half done: the next process of the host finds it built.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

# Seconds the compiler may take (about 12 s on a 2-core machine).
BUILD_TIMEOUT_S = 300.0


def build_needed(output: Path) -> bool:
    """Whether :func:`build` would compile ``output``: it is not built yet, and no earlier
    build failed (a failed one is not retried until its ``.failed`` file is deleted)."""
    return not output.exists() and not output.with_suffix(".failed").exists()


def build(output: Path, command: list[str]) -> None:
    output.parent.mkdir(parents=True, exist_ok=True)
    failed = output.with_suffix(".failed")
    temporary = Path(command[command.index("-o") + 1])
    with open(output.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it: wait for it
        if not build_needed(output):
            return
        try:
            done = subprocess.run(
                command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False
            )
            problem = done.stderr if done.returncode != 0 else None
        except (OSError, subprocess.TimeoutExpired) as error:
            problem = f"the compiler did not run: {error}"
        if problem is None:
            os.replace(temporary, output)
            return
        with contextlib.suppress(FileNotFoundError):
            temporary.unlink()
        with contextlib.suppress(OSError):
            failed.write_text(" ".join(command) + "\n\n" + problem)


if __name__ == "__main__":
    build(Path(sys.argv[1]), json.loads(sys.argv[2]))
