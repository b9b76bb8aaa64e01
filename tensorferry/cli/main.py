"""Entry point of the ``tensorferry`` console script.

Each command lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``.
Only the module of the command being run is imported, so one command never pays for (or breaks
on) another's imports.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import os
import sys
from typing import Any

from tensorferry import envs
from tensorferry.cli._args import folder_problem

_DESCRIPTION = "tensorferry: fast tensor transfers between GPUs and compiled actor graphs"

# command name -> (module, one-line help)
COMMANDS = {
    "doctor": ("tensorferry.cli.doctor", "versions, devices, links and usable transports"),
    "demo": (
        "tensorferry.cli.demo",
        "the main job: round trips beside torch.distributed, then an overlapped actor graph",
    ),
}
# benchmark name -> (module, one-line help). Each writes to bench-results/<name>/ by default
# and takes --json (see tensorferry.cli._args.add_bench_output_arguments).
BENCHMARKS = {
    "lifecycle": ("tensorferry.bench.lifecycle", "Client create+close cost, pooled vs unpooled"),
    "toy": ("tensorferry.bench.toy", "toy programs: cached vs uncached communicators"),
    "batch": ("tensorferry.bench.batch", "64 small tensors: one batch vs separate calls"),
    "sendrecv": (
        "tensorferry.bench.sendrecv",
        "send/recv bandwidth and latency vs NCCL on two GPUs",
    ),
    "allgather": ("tensorferry.bench.allgather", "ring all-gather vs torch's, any world size"),
    "overlap": ("tensorferry.bench.overlap", "graph overlap off/on vs hand-written streams"),
    "graph": ("tensorferry.bench.graph", "per-execute overhead of compiled graphs"),
    "peers": (
        "tensorferry.bench.peers",
        "the same operations with torch.distributed, NIXL and tensorferry, timed alike",
    ),
}


def _selected(argv: list[str]) -> tuple[str | None, str | None]:
    """The command (and benchmark) named in ``argv``, found without importing any module."""
    words = [a for a in argv if not a.startswith("-")]
    if not words:
        return None, None
    if words[0] == "bench":
        return "bench", words[1] if len(words) > 1 and words[1] in BENCHMARKS else None
    return (words[0], None) if words[0] in COMMANDS else (None, None)


def _build_parser(argv: list[str]) -> argparse.ArgumentParser:
    command, benchmark = _selected(argv)
    parser = argparse.ArgumentParser(prog="tensorferry", description=_DESCRIPTION)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        sub = commands.add_parser(name, help=help_text, description=help_text)
        sub.set_defaults(_module=module, _parser=sub)
        if name == command:
            importlib.import_module(module).add_arguments(sub)
    bench = commands.add_parser("bench", help="benchmarks", description="benchmarks")
    benches = bench.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    for name, (module, help_text) in BENCHMARKS.items():
        sub = benches.add_parser(name, help=help_text, description=help_text)
        sub.set_defaults(_module=module, _parser=sub)
        if name == benchmark:
            importlib.import_module(module).add_arguments(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = _build_parser(argv)
    args = parser.parse_args(argv)
    out = getattr(args, "out", None)
    problem = folder_problem(out) if out else None  # every command that writes takes --out
    if problem is not None:  # the usage of the command that takes it
        args._parser.error(f"--out {out}: {problem}")
    try:
        configured = envs.log_level()
    except ValueError as exc:
        parser.error(str(exc))
    level = logging.INFO if args.verbose else getattr(logging, configured or "WARNING")
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "bench":
        # Every timed call takes one path: the compiled validation is built before the first.
        os.environ.setdefault("TENSORFERRY_NATIVE", "wait")
    module = importlib.import_module(args._module)
    if args.command == "bench" and getattr(args, "json", False):
        return _run_printing_json(module, args)
    return int(module.run(args) or 0)


def _run_printing_json(module: Any, args: argparse.Namespace) -> int:
    """Runs a benchmark for ``--json``: its results as one JSON document on stdout.

    What the benchmark prints for people (tables, progress) goes to stderr instead, so stdout
    holds the document alone. A run that made no report here prints nothing: a benchmark that
    starts itself again under torchrun prints its document from the rank that reports.
    """
    from tensorferry.bench import _report

    _report.collected()  # reports of earlier runs in this process are not this run's
    with contextlib.redirect_stdout(sys.stderr):
        code = int(module.run(args) or 0)
    reports = _report.collected()
    if reports:
        document = {
            "benchmark": args.benchmark,
            "environment": _report.environment(),
            "reports": reports,
        }
        print(json.dumps(document, indent=2, default=str))
    return code


if __name__ == "__main__":
    sys.exit(main())
