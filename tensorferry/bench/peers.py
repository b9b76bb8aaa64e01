"""``tensorferry bench peers``: the same operations with torch.distributed, NIXL and
tensorferry, timed the same way in one run.

Two ranks on one machine (GPUs 0 and 1, or two CPU processes); rank 0 sends to rank 1:

1. KV-cache hand-off: 64 tensors of 2 MiB bf16 as one message (tensorferry: one ``tf.send``
   of the list; torch: one ``batch_isend_irecv`` of 64 ops; NIXL: one transfer of 64
   descriptors);
2. one 1 GiB tensor one way (also in GB/s);
3. one 4 KiB tensor one way;
4. a 4 KiB blocking round trip: rank 1 sends back what it received, each call waited for
   before the next;
5. 64 separate sends of 4 KiB, then a wait for all;
6. a batch of 64 messages of 4 KiB (``tf.batch()``; torch: ``batch_isend_irecv`` of 64 ops;
   NIXL has no such batch and skips the row); and, below the 4 KiB rows, the same timing with
   nothing moved (their floor: what the timing itself costs);
7. a two-stage pipeline: 8 microbatches of [4096, 8192] bf16, three 8192² matmuls each on
   stage 0, whose activations go to stage 1, which posts the receive of the next microbatch
   before it computes on this one; and, below it, the same compute with no transfer (floor).

Timing, the same for every contender: untimed, rank 0 writes the iteration's contents
(derived from its rank and the iteration) and rank 1 fills its buffers with 0xA5 bytes; both
meet at a barrier on a separate gloo group. Timed: from rank 0's start to the later of the two
ranks' done times, each taken once its part was waited for and, on GPUs, the device
synchronised. Untimed again: every received byte is checked, and a wrong one stops the run.
Reported: the median over the timed iterations, after warm-up ones. A contender that raises
shows ``n/a`` and the reason for that row; NIXL runs only when ``import nixl`` works, on GPUs.
On the CPU the rows keep their counts with smaller sizes, and the output says so.
"""

from __future__ import annotations

import argparse
import os

from tensorferry.bench._peers_plan import Plan
from tensorferry.cli._args import add_bench_output_arguments, add_device_argument, positive_float

__all__ = ["add_arguments", "run"]

_TITLE = "tensorferry bench peers: torch.distributed, NIXL and tensorferry, timed alike"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tensorferry.bench._peers_plan import ROW_KEYS, timed_iterations

    add_device_argument(
        parser,
        cuda="GPUs 0 and 1, torch over NCCL",
        cpu="two CPU processes, torch over gloo, smaller sizes",
    )
    parser.add_argument(
        "--rows",
        default="all",
        help=f"rows to run, comma-separated, from {','.join(ROW_KEYS)} (the pipeline brings its "
        "compute-only floor; any 4 KiB row brings the timing alone, their floor)",
    )
    (gpu_large, gpu_small), (cpu_large, cpu_small) = map(timed_iterations, ("gpu", "cpu"))
    parser.add_argument(
        "--iters",
        type=positive_float,
        default=1.0,
        help=f"multiplier of the timed iterations ({gpu_large} for large rows and {gpu_small} "
        f"for 4 KiB rows on GPUs, {cpu_large} and {cpu_small} on the CPU)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="a few iterations of small sizes (for tests)"
    )
    parser.add_argument(
        "--timeout",
        type=positive_float,
        default=120.0,
        help="seconds one wait may take before its contender's row is given up",
    )
    add_bench_output_arguments(parser, "peers")


def run(args: argparse.Namespace) -> int:
    from tensorferry.bench._devices import on_two_gpus
    from tensorferry.bench._peers_nixl import unavailable_reason
    from tensorferry.bench._peers_plan import make_plan, parse_rows
    from tensorferry.bench._peers_rank import rank_main
    from tensorferry.p2p._launch import run_world, under_torchrun

    try:
        rows = parse_rows(args.rows)
    except ValueError as exc:
        raise SystemExit(f"--rows {args.rows!r}: {exc}") from None
    use_cuda = on_two_gpus(args.device, check=not under_torchrun())
    plan = make_plan(
        "cuda" if use_cuda else "cpu",
        quick=args.quick,
        rows=rows,
        iters_scale=args.iters,
        timeout_s=args.timeout,
    )
    nixl_reason = unavailable_reason(plan.device)
    results = run_world(
        rank_main,
        plan,
        nixl_reason,
        backend="nccl" if use_cuda else "gloo",
        timeout=plan.timeout_s,
        join_timeout=1800.0,
    )
    if under_torchrun() and os.environ.get("RANK") != "0":
        return 0  # rank 0 reports; both ranks hold the same results
    result = results[0]
    if result["wrong_bytes"] is not None:
        wrong = result["wrong_bytes"]
        raise SystemExit(
            f"tensorferry bench peers: wrong bytes received in row {wrong['row'].strip()!r}, "
            f"contender {wrong['contender']}: {wrong['detail']}; no results are written"
        )
    _report(args, plan, result["rows"], nixl_reason)
    return 0


def _report(
    args: argparse.Namespace, plan: Plan, rows: list[dict], nixl_reason: str | None
) -> None:
    from tensorferry.bench._peers_nixl import nixl_version
    from tensorferry.bench._peers_report import COLUMNS, table_rows, write_files
    from tensorferry.bench._report import environment, format_table, record

    lines, footnotes = table_rows(rows)
    table = format_table(lines, COLUMNS, left=("row",))
    notes = [*footnotes, *_caveats(plan)]
    env = environment()
    env["nixl"] = nixl_version() or "not installed"
    env["sizes"] = _scale_text(plan)
    print(_TITLE)
    print(f"sizes: {env['sizes']}")
    print(table)
    for note in notes:
        print(f"note: {note}")
    paths = write_files(args.out, rows, title=_TITLE, environment=env, lines=lines, notes=notes)
    print("wrote " + ", ".join(str(p) for p in paths))
    record("peers", rows, title=_TITLE, notes=notes, files=paths)


def _scale_text(plan: Plan) -> str:
    if plan.scale == "gpu":
        return "as named in the rows (GPU sizes)"
    why = (
        "scaled down for the CPU, so that the whole run takes under a minute on two cores"
        if plan.scale == "cpu"
        else "scaled down for a quick check (--quick): the times say little"
    )
    return f"{why}; the rows name the sizes used"


def _caveats(plan: Plan) -> list[str]:
    """What the numbers mean and where the contenders differ."""
    torch_backend = "NCCL" if plan.device == "cuda" else "gloo"
    notes = [
        "times are medians of the timed iterations (warm-up first: "
        f"{plan.warmup_large} + {plan.iters_large} for large rows, {plan.warmup_small} + "
        f"{plan.iters_small} for 4 KiB rows), in µs per iteration; tf/torch and tf/NIXL are "
        "tensorferry's time over theirs: below 1.00× tensorferry is faster",
        "an iteration's time runs from rank 0's start (after a barrier on a separate gloo "
        "group) to the later of both ranks' done times; a rank is done when its part was "
        "waited for and, on GPUs, torch.cuda.synchronize() returned; both ranks read one "
        "host's monotonic clock",
        "every contender moves the same buffers; every received byte is checked after each "
        "iteration (untimed) against contents derived from rank and iteration, receive "
        "buffers filled with 0xA5 bytes before each",
        f"torch.distributed runs on its default process group ({torch_backend}); waits are "
        "work.wait() (NCCL: the current stream waits), then the device sync",
        "tensorferry runs through its public calls (tf.send, tf.recv, tf.batch), transport "
        "'auto' (between GPUs of one host: the receiver posts where its buffers are, the "
        "sender's copy engine writes into them); the pipeline's stage 1 waits with "
        "wait_stream(), as torch's NCCL wait()",
        "NIXL is one-sided: buffers registered and transfers initialized once, before timing; "
        "each iteration posts its WRITEs; the sender is done when the state is DONE, the "
        "receiver when the notification arrived; in the pipeline stage 0 waits on the host for "
        "each microbatch's matmuls before it posts the write (NIXL posts from the host)",
        "the pipeline's weight is the identity, so activations stay checkable byte for byte; "
        "a matmul costs the same whatever the values (a GPU's power draw may differ slightly)",
    ]
    if any(row.small for row in plan.rows):
        notes.append(
            "the row 'the timing alone, nothing moved' is the same timing with nothing moved "
            "and nothing computed: each rank's part is empty, so it shows what the timing "
            "costs (the barrier's exit skew between the ranks, the device sync, the clock "
            "reads); a floor under the 4 KiB rows, not a contender"
        )
    if plan.device == "cpu":
        notes.append(
            "CPU run: each rank computes on one thread (torch.set_num_threads(1)); NIXL runs "
            "only between GPUs in this bench"
        )
    return notes
