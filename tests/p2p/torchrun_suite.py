"""The p2p suite under torchrun, on any number of nodes: the cases of the CPU tier, run in
step on every rank (a barrier between cases), each checking every byte it receives.

Run by ``tests/test_multinode.py`` as two torchrun "nodes" on loopback::

    python -m torch.distributed.run --nnodes 2 --nproc-per-node 2 --node-rank R \\
        --master-addr 127.0.0.1 --master-port P tests/p2p/torchrun_suite.py

Exit code 0 on every rank means every case passed there. Needs a world of at least 2. With
``TF_TEST_TRANSPORT=nccl`` the GPU cases take NCCL where ``"auto"`` would take the copy engine:
with ``NCCL_NET=Socket NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1`` that is the route across hosts,
over NCCL's socket transport, on one host.
"""

from __future__ import annotations

import datetime
import os
import sys
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

import _cases
import _hangdump

import tensorferry.p2p as tf


def expectations(world: int) -> list[tuple[str, tuple, dict[int, object]]]:
    """(case, args, {rank: expected result}); ranks not listed may return anything."""
    first_two = {0: "ok", 1: "ok"}
    everyone = dict.fromkeys(range(world), "ok")
    cases = [
        ("send_recv_all_dtypes", (11,), first_two),
        ("strided_single_elements", (12,), {0: "sent", 1: "ok"}),
        ("ring_sendrecv", (4,), everyone),
        ("mixed_batch", (20,), dict.fromkeys(range(world), 4 * (world - 1))),
        ("many_small_batch", (64,), {0: "sent", 1: "ok"}),
        ("all_gather", (False,), everyone),
        ("all_gather", (True,), everyone),
        ("all_gather", (False, True), everyone),  # in place: inp is out's own row
        ("all_gather_matches_torch", (4097, "float32"), everyone),
        ("all_gather_matches_torch", (33, "int64"), everyone),
        # 16 MiB per rank: each ring step outgrows NCCL's buffers both ways at once.
        ("all_gather_matches_torch", (1 << 22, "float32"), everyone),
        ("disjoint_pairs_both_ways", (1 << 18, 3), {r: "ok" for r in range(world - world % 2)}),
        ("static_channel", (4,), first_two),
        ("static_broken", (), {0: "shape", 1: "shape"}),
        ("static_channel", (2,), first_two),
        # A static channel stays static: a different message is a mismatch and resets the pair.
        ("static_broken", (), {0: "shape", 1: "shape"}),
        ("ring_sendrecv", (1,), everyone),
    ]
    for kind in ("count", "dtype", "shape"):
        cases.append(("mismatch", (kind,), {0: kind, 1: kind}))
        cases.append(("send_recv_all_dtypes", (40,), first_two))
    cases.append(("wait_timeout_then_complete", (), {0: "ok", 1: "sent"}))
    cases.append(("reset_after_an_unwaited_send", (70,), first_two))
    # Bad calls fail before anything moves (each returns its list of errors), then a timeout:
    # and the pairs still work afterwards.
    cases.append(("bad_arguments", (), dict.fromkeys(range(world), _EVERY_BAD_CALL_REJECTED)))
    cases.append(("timeout_unmatched", (), {0: _TIMED_OUT_IN_TIME, 1: _LATE_SIDE_FAILED}))
    cases.append(("send_recv_all_dtypes", (60,), first_two))
    if world >= 3:
        # 64 MiB on GPUs: more than NCCL's buffers, so a send waits for its receiver there.
        numel = 1 << 24 if torch.cuda.is_available() else 1 << 16
        first_three = {0: "ok", 1: "ok", 2: "ok"}
        cases.append(("send_behind_a_send_its_peer_receives_later", (numel,), first_three))
        cases.append(("receive_behind_a_receive_its_peer_sends_later", (numel,), first_three))
    cases.append(("ring_sendrecv", (1,), everyone))
    return cases


class _Check:
    """An expected result given by a predicate (for results that are not one fixed value)."""

    def __init__(self, text: str, predicate) -> None:
        self.text, self.predicate = text, predicate

    def __eq__(self, other: object) -> bool:
        return bool(self.predicate(other))

    def __repr__(self) -> str:
        return self.text


# Two more bad calls where a rank has another GPU to misuse (see _cases.bad_arguments).
_BAD_CALLS = _cases.BAD_CALLS + (
    _cases.BAD_CALLS_WITH_ANOTHER_GPU
    if torch.cuda.is_available() and torch.cuda.device_count() > 1
    else 0
)
_EVERY_BAD_CALL_REJECTED = _Check(
    f"{_BAD_CALLS} rejected calls", lambda r: isinstance(r, list) and len(r) == _BAD_CALLS
)
_TIMED_OUT_IN_TIME = _Check("a timeout after 0.9-4 s", lambda r: 0.9 <= r < 4.0)
_LATE_SIDE_FAILED = _Check(
    "the late side failed at once", lambda r: r[0] == "TransferTimeoutError" and r[1] < 2.0
)


def main() -> int:
    if os.environ.get("TF_TEST_DUMP_AFTER"):  # a hang shows every thread's stack
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["TF_TEST_DUMP_AFTER"]))
        _hangdump.dump_later(float(os.environ["TF_TEST_DUMP_AFTER"]) + 1)
    if os.environ.get("TENSORFERRY_LOG_LEVEL"):
        import logging

        rank_tag = f"rank {os.environ.get('RANK', '?')}"
        logging.basicConfig(format=f"%(relativeCreated)8.0f {rank_tag} %(name)s: %(message)s")
        logging.getLogger("tensorferry").setLevel(os.environ["TENSORFERRY_LOG_LEVEL"].upper())
    forced = os.environ.get("TF_TEST_TRANSPORT")
    if forced:  # "auto" picks it between GPUs: a route across hosts, run on one host
        from tensorferry.p2p import _context

        _context.P2PContext.default_route = lambda self, peer: forced
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    tf.init(timeout=30)  # reuses the process group's store, rank and world size
    rank, world = tf.get_rank(), tf.get_world_size()
    failures = []
    cases = expectations(world)
    for name, args, expected in cases:
        dist.barrier()
        try:
            result = getattr(_cases, name)(rank, world, *args)
        except Exception:
            failures.append(f"{name}{args}: raised\n{traceback.format_exc()}")
            continue
        if rank in expected and expected[rank] != result:
            failures.append(f"{name}{args}: got {result!r}, expected {expected[rank]!r}")
    dist.barrier()
    host = os.environ.get("GROUP_RANK", "?")
    verdict = "ok" if not failures else "FAILED"
    print(f"rank {rank}/{world} node {host}: p2p suite {verdict} ({len(cases)} cases)", flush=True)
    for failure in failures:
        print(failure, file=sys.stderr, flush=True)
    tf.shutdown()
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
