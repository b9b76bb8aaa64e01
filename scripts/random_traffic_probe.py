"""Random traffic between ranks (three by default) over gloo, with messages sent by mistake:
do both sides of every message end alike?

Runs the CPU tier's ``random_traffic`` case (``tests/p2p/_cases.py``) for each seed, with a
share of the non-static messages sent one row longer than their receiver expects. Such a
message must fail on both sides, and every other message must either arrive byte for byte or
fail on both sides, promptly. Prints, per seed, the messages whose two sides ended
differently or by a timeout (each side's outcome: ``ok``, an error's class name).

Usage: ``python scripts/random_traffic_probe.py [--transport gloo|gloo-spec|gloo-stream|auto]
[--count N]
[--seeds A:B] [--changed P] [--broken P] [--early P] [--wait S] [--world N] [--trace DIR]``
(``--broken``: as ``--changed`` for static messages, default 0; ``--early``: the share of messages
waited for at once, in calls of their own, default 0; ``--programs``: runs the ``random_programs``
case instead, each rank calling in an order of its own and waiting between calls (``--changed`` then
applies to every message; ``--broken`` and ``--early`` do not apply); ``--wait``: seconds each wait
of the case takes at most, and each transfer's timeout, default 3; ``--world``: ranks, default 3;
``--trace``: each rank keeps its p2p engine's last events (``TENSORFERRY_P2P_TRACE``, 20000 unless
set) and writes them to ``DIR/seed<S>-rank<R>.txt`` when a message of seed ``S`` timed out;
``--programs``: ``DIR/program<S>-rank<R>.txt``, also when one arrived with wrong bytes).
``--backend auto --transport auto`` puts the ranks on their GPUs and the messages on NCCL (with
``TF_TEST_ONE_GPU_RANKS=1``, all on one GPU: see ``tests/p2p/_pool.py``); keep ``--batches`` 0
there, since the case's model of a batch is gloo's (each message goes as soon as it can).
``--prepare`` (with ``--programs``): each seed makes every pair with ``tf.prepare`` first.
``--room N``: each rank's engine counts gloo's messages as if they queued device work, with
room for N on a transfer stream (see ``Issuing._room_for``): what the room holds back then
meets every fault, batch and order of calls the programs make. Use it with ``--transport
gloo-stream`` (gloo run in NCCL's stream order, ``tests/p2p/_stream_gloo.py``): over plain
gloo, whose messages do not wait behind each other, holding one back can stall a program
that NCCL's stream order would stall anyway.
``--seed-timeout S`` (default 600): a seed with no answer from every rank within S seconds is
reported as stalled, and the next seed runs on a fresh world.

Reading it: a message of a batch or ``sendrecv`` may end ``ok`` on one side and failed on the
other when that call failed whole while the peer's own call for it succeeded (see
``docs/transfers.md``); such a failure reads ``"... (with N more)"``. Both sides timing out
together, seeds run one after another in one world, used to come from a race in a pair's
making (one rank entering gloo's rendezvous alone, ``docs/transfers.md``); on the CPU machine
also from its store connections, every 25th of which takes 5 s (``--wait 8`` rules that out).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests" / "p2p"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--transport", default="gloo", choices=("gloo", "gloo-spec", "gloo-stream", "auto")
    )
    parser.add_argument("--backend", default="gloo", choices=("gloo", "auto"))
    parser.add_argument("--count", type=int, default=6)
    parser.add_argument("--seeds", default="100:115")
    parser.add_argument("--changed", type=float, default=0.2)
    parser.add_argument("--wait", type=float, default=3.0)
    parser.add_argument("--world", type=int, default=3)
    parser.add_argument("--broken", type=float, default=0.0)
    parser.add_argument("--early", type=float, default=0.0)
    parser.add_argument("--programs", action="store_true")
    parser.add_argument("--batches", type=float, default=0.0)
    parser.add_argument("--prepare", action="store_true")
    parser.add_argument("--seed-timeout", type=float, default=600.0)
    parser.add_argument("--trace", metavar="DIR")
    parser.add_argument("--room", type=int, default=0)
    args = parser.parse_args()
    os.environ["TF_TEST_CASE_WAIT_S"] = str(args.wait)  # read by the workers' cases
    if args.trace:  # the workers keep their last events and write them out after a timeout
        os.environ.setdefault("TENSORFERRY_P2P_TRACE", "20000")
        os.environ["TF_TEST_TRACE_DIR"] = args.trace
    sys.path.insert(0, str(TESTS))
    from _pool import WorkerPool

    first, last = (int(n) for n in args.seeds.split(":"))

    def new_pool() -> WorkerPool:
        made = WorkerPool(args.world, transfer_timeout=10.0, backend=args.backend)
        made.run("register_speculating_gloo")
        made.run("register_stream_ordered_gloo")
        if args.room:
            made.run("count_host_work_as_queued", args.room)
        return made

    pool = new_pool()
    try:
        for seed in range(first, last):
            if args.programs:
                case = ("random_programs", seed, args.count, args.transport, args.wait)
                case += (args.changed, args.batches, args.prepare)
            else:
                case = ("random_traffic", seed, args.count, args.transport, args.changed)
                case += (args.wait, args.broken, args.early)
            try:
                sides = pool.run(*case, timeout=args.seed_timeout)
            except TimeoutError:  # a rank stuck for good (in a CUDA call, say): the pool is gone
                print(
                    f"seed {seed}: stalled (no answer within {args.seed_timeout:g} s)", flush=True
                )
                pool = new_pool()
                continue
            fates: dict[int, list[str]] = {}
            for outcomes in sides:
                for tag, outcome in outcomes.items():
                    fates.setdefault(tag, []).append(outcome)
            odd = {
                tag: fate
                for tag, fate in sorted(fates.items())
                if (fate[0] == "ok") != (fate[1] == "ok")
                or any("Timeout" in outcome or outcome == "wrong bytes" for outcome in fate)
            }
            print(f"seed {seed}: {odd or 'every message ended alike'}", flush=True)
    finally:
        pool.close()


if __name__ == "__main__":
    main()
