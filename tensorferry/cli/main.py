"""Entry point of the ``tensorferry`` console script.

Each command lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``;
modules are imported only when their command runs, so ``tensorferry doctor`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from tensorferry import envs

# command name -> (module, one-line help)
COMMANDS = {
    "doctor": ("tensorferry.cli.doctor", "versions, devices, links and usable transports"),
    "demo": ("tensorferry.cli.demo", "the main job: an overlapped actor graph, checked"),
}
BENCHMARKS = {
    "lifecycle": ("tensorferry.bench.lifecycle", "Client create+close cost, pooled vs unpooled"),
    "toy": ("tensorferry.bench.toy", "toy programs: cached vs uncached communicators"),
    "batch": ("tensorferry.bench.batch", "64 small tensors: one batch vs separate calls"),
    "sendrecv": ("tensorferry.bench.sendrecv", "send/recv bandwidth and latency vs NCCL"),
    "overlap": ("tensorferry.bench.overlap", "graph overlap off/on vs hand-written streams"),
    "graph": ("tensorferry.bench.graph", "per-execute overhead of compiled graphs"),
}


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tensorferry", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        sub = commands.add_parser(name, help=help_text, description=help_text)
        sub.set_defaults(_module=module)
        _add_module_arguments(module, sub)
    bench = commands.add_parser("bench", help="benchmarks", description="benchmarks")
    benches = bench.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    for name, (module, help_text) in BENCHMARKS.items():
        sub = benches.add_parser(name, help=help_text, description=help_text)
        sub.set_defaults(_module=module)
        _add_module_arguments(module, sub)
    return parser


def _add_module_arguments(module: str, parser: argparse.ArgumentParser) -> None:
    # Only this command's module is imported when it runs; arguments need it now, so parse lazily
    # by importing here — the modules keep their heavy imports inside ``run``.
    importlib.import_module(module).add_arguments(parser)


def main(argv: list[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    level = logging.INFO if args.verbose else getattr(logging, envs.log_level(), logging.WARNING)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    module = importlib.import_module(args._module)
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
