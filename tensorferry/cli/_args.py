"""Argument types shared by the commands.

A bad value is argparse's usage error naming the flag (``argument --iters: must be a positive
integer, got '-5'``), before anything runs, rather than a traceback from deep inside a run.
"""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = [
    "BENCH_RESULTS",
    "DefaultsHelpFormatter",
    "add_bench_output_arguments",
    "add_device_argument",
    "folder_problem",
    "non_negative_int",
    "positive_float",
    "positive_int",
]

# Every benchmark writes its files to BENCH_RESULTS/<benchmark>/ unless --out says otherwise.
BENCH_RESULTS = "bench-results"


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with each option's default after its text, as ``(default: 20)``.

    Left out where it would say nothing: options whose default is ``None`` or ``False`` (their
    text says what happens without them) and texts that already state their default.
    """

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            not action.option_strings
            or "default" in text
            or action.default is None
            or action.default is False
            or action.default is argparse.SUPPRESS
        ):
            return text
        return f"{text} (default: %(default)s)"


def add_device_argument(parser: argparse.ArgumentParser, *, cuda: str, cpu: str) -> None:
    """``--device {auto,cpu,cuda}`` of a benchmark between two ranks: ``cuda`` and ``cpu`` say
    what runs on each; ``auto`` is ``cuda`` where this machine has two GPUs (see
    :func:`tensorferry.bench._devices.on_two_gpus`)."""
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help=f"cuda: {cuda} (needs two CUDA GPUs); cpu: {cpu}; auto: cuda when this machine "
        "has two GPUs",
    )


def add_bench_output_arguments(
    parser: argparse.ArgumentParser, name: str, *, needs: str | None = None
) -> None:
    """Gives a benchmark's parser what every benchmark shares.

    That is ``--out`` (default ``bench-results/<name>/``), ``--json`` and a ``--help`` that
    lists each option's default; ``needs`` (such as ``"two CUDA GPUs on this machine"``) is
    added to the description, so ``--help`` states what the benchmark requires.

    Args:
        parser: the benchmark's own subparser.
        name: the benchmark's name, as in ``tensorferry bench <name>``.
        needs: what the machine must have, or ``None`` when any machine runs it.
    """
    parser.formatter_class = DefaultsHelpFormatter
    if needs:
        summary = (parser.description or "").rstrip(".")
        parser.description = f"{summary}. Needs {needs}." if summary else f"Needs {needs}."
    parser.add_argument(
        "--out",
        default=f"{BENCH_RESULTS}/{name}/",
        help="folder for the result files (CSV, Markdown and more)",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the results as JSON on stdout (the table and progress go to stderr)",
    )


def _number(text: str, kind: type, what: str, *, allow_zero: bool) -> int | float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
    if value < 0 or (value == 0 and not allow_zero) or value != value:  # NaN too
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    return int(_number(text, int, "a positive integer", allow_zero=False))


def non_negative_int(text: str) -> int:
    return int(_number(text, int, "an integer >= 0", allow_zero=True))


def positive_float(text: str) -> float:
    return float(_number(text, float, "a positive number", allow_zero=False))


def folder_problem(path: str) -> str | None:
    """Why the folder ``path`` cannot be made, or ``None`` when it can. It is made to find out,
    and what this made is removed again: the command makes it when it writes there, and a run
    that fails first leaves nothing behind."""
    folder = Path(path)
    missing = []
    for level in (folder, *folder.parents):
        if level.exists():
            break
        missing.append(level)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"cannot make that folder ({exc.strerror or exc})"
    for level in missing:  # the deepest first; each was empty, made just now
        level.rmdir()
    return None
