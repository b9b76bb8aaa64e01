"""``tensorferry bench batch``: many small tensors, one batch vs separate calls, vs torch.

Rank 0 sends ``--count`` tensors of ``--bytes`` each to rank 1 and rank 1 sends them back
(a ping-pong: one iteration = both directions; the table reports half an iteration, i.e. one
way). Variants:

- ``tf send(list)``: one ``tf.send`` of the whole list (one message: between GPUs of one host
  its tensors, back to back in one buffer, go as one copy; over gloo they travel packed);
- ``tf batch``: one ``tf.batch()`` with one ``b.send`` per tensor (``count`` messages of one
  call, moved together);
- ``tf separate``: ``count`` separate ``tf.send``/``tf.recv`` calls;
- ``torch batch_isend_irecv``: ``torch.distributed.batch_isend_irecv`` of ``count`` ops;
- ``torch separate``: ``count`` separate ``torch.distributed.isend``/``irecv`` calls, then a
  wait on each.

Completion: every send and receive is waited for, tf's with ``wait_stream()`` on GPU (the
current stream waits, as torch's NCCL ``work.wait()`` makes it wait) and ``wait()`` on the CPU,
then a stream sync. Also measured: the host time
of one ``tf.send`` call (rank 0) and one ``tf.recv`` call (rank 1), median, for one 1 KiB tensor
and for the list, and one-way bandwidth of large messages, tf vs torch: one message alone, and
eight back to back.
Fairness: torch.distributed runs on its own default process group (same backend), created
before tf's pair communicators; both warm up before timing.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from tensorferry.cli._args import (
    add_bench_output_arguments,
    add_device_argument,
    non_negative_int,
    positive_int,
)

__all__ = ["add_arguments", "run"]

# The lone float32 tensor whose tf.send / tf.recv host time is measured, in bytes.
_ONE_BYTES = 1024


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_device_argument(parser, cuda="NCCL between GPUs 0 and 1", cpu="gloo")
    parser.add_argument("--count", type=positive_int, default=64, help="tensors per iteration")
    parser.add_argument("--bytes", type=positive_int, default=4096, help="bytes per tensor")
    parser.add_argument(
        "--iters",
        type=positive_int,
        default=None,
        help="timed iterations (default: 200 on GPU, 20 on CPU)",
    )
    parser.add_argument(
        "--large-mib",
        type=non_negative_int,
        default=None,
        help="size of the bandwidth messages in MiB (default: 1024 on GPU, 16 on CPU; 0 skips)",
    )
    add_bench_output_arguments(parser, "batch")


def run(args: argparse.Namespace) -> int:
    from tensorferry.bench._devices import on_two_gpus
    from tensorferry.bench._report import report
    from tensorferry.p2p._launch import run_world

    use_cuda = on_two_gpus(args.device)
    if args.count < 1 or args.bytes < 4 or args.bytes % 4:
        raise SystemExit("--count must be >= 1 and --bytes a positive multiple of 4")
    config = {
        "count": args.count,
        "bytes": args.bytes,
        "iters": args.iters or (200 if use_cuda else 20),
        "large_mib": args.large_mib if args.large_mib is not None else (1024 if use_cuda else 16),
    }
    results = run_world(_worker, config, backend="nccl" if use_cuda else "gloo", timeout=120)
    device = "cuda (nccl)" if use_cuda else "cpu (gloo)"
    rows = []
    names = list(results[0]["one_way_us"])
    base = max(r["one_way_us"]["torch separate"] for r in results)
    for name in names:
        us = max(r["one_way_us"][name] for r in results)
        rows.append(
            {
                "variant": name,
                "device": device,
                "tensors": config["count"],
                "bytes_each": config["bytes"],
                "one_way_us": round(us, 1),
                "speedup_vs_torch_separate": round(base / us, 2),
            }
        )
    print(
        f"transport='auto' picks {results[0]['auto_list']!r} for the list of {args.count} and "
        f"{results[0]['auto_small']!r} for one {args.bytes}-byte tensor"
    )
    # Host time of the calls alone: rank 0 times its sends, rank 1 its receives.
    for label, count, key in (("", 1, "one"), ("(list)", config["count"], "list")):
        for call, rank in (("send", 0), ("recv", 1)):
            rows.append(
                {
                    "variant": f"tf.{call}{label} host time (median)",
                    "device": device,
                    "tensors": count,
                    "bytes_each": config["bytes"] if count > 1 else _ONE_BYTES,
                    "one_way_us": round(results[rank]["host_us"][key], 1),
                }
            )
    for name in results[0].get("bandwidth_gbps", {}):
        gbps = min(r["bandwidth_gbps"][name] for r in results)  # the slower rank's view
        rows.append(
            {
                "variant": f"{name} bandwidth",
                "device": device,
                "tensors": 1,
                "bytes_each": config["large_mib"] << 20,
                "one_way_gb_per_s": round(gbps, 2),
            }
        )
    from tensorferry.cli.doctor import native_report

    notes = [
        " ".join(__doc__.split()),
        f"compiled helpers (tensorferry/_native): {native_report()}",
    ]
    report(args.out, "batch", rows, title=__doc__.splitlines()[0], notes=notes)
    return 0


# ---------------------------------------------------------------------- in each rank
def _worker(rank: int, world: int, config: dict) -> dict:
    import tensorferry.p2p as tf
    from tensorferry.p2p._launch import torch_group

    with torch_group("bench/batch/torch", timeout_s=120):
        return _measure(rank, 1 - rank, tf._context.current().device, config)


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _measure(rank: int, peer: int, device: Any, config: dict) -> dict:
    import torch
    import torch.distributed as dist

    import tensorferry.p2p as tf

    count, numel = config["count"], config["bytes"] // 4
    out = [torch.full((numel,), float(rank * 1000 + i), device=device) for i in range(count)]
    into = [torch.empty(numel, device=device) for _ in range(count)]
    cuda = device.type == "cuda"

    def tf_done(handle: Any) -> None:
        if cuda:
            handle.wait_stream()
        else:
            handle.wait()

    def tf_list() -> None:
        if rank == 0:
            sent = tf.send(out, peer)
            tf_done(tf.recv(into, peer))
        else:
            tf_done(tf.recv(into, peer))
            sent = tf.send(out, peer)
        tf_done(sent)

    def tf_batch() -> None:
        def one_way(sending: bool) -> None:
            with tf.batch() as b:
                for t_out, t_in in zip(out, into, strict=True):
                    b.send(t_out, peer) if sending else b.recv(t_in, peer)
            tf_done(b)

        one_way(rank == 0)
        one_way(rank != 0)

    def tf_separate() -> None:
        def one_way(sending: bool) -> None:
            if sending:
                handles = [tf.send(t, peer) for t in out]
            else:
                handles = [tf.recv(t, peer) for t in into]
            for h in handles:
                tf_done(h)

        one_way(rank == 0)
        one_way(rank != 0)

    def torch_batch() -> None:
        def one_way(sending: bool) -> None:
            ops = [
                dist.P2POp(dist.isend if sending else dist.irecv, t, peer)
                for t in (out if sending else into)
            ]
            for work in dist.batch_isend_irecv(ops):
                work.wait()

        one_way(rank == 0)
        one_way(rank != 0)

    def torch_separate() -> None:
        def one_way(sending: bool) -> None:
            works = [
                dist.isend(t, peer) if sending else dist.irecv(t, peer)
                for t in (out if sending else into)
            ]
            for work in works:
                work.wait()

        one_way(rank == 0)
        one_way(rank != 0)

    variants = {
        "tf send(list)": tf_list,
        "tf batch": tf_batch,
        "tf separate": tf_separate,
        "torch batch_isend_irecv": torch_batch,
        "torch separate": torch_separate,
    }
    one_way_us = {}
    for name, fn in variants.items():
        # Each variant starts from a fresh pair: nothing an earlier one made is reused.
        tf._api._reset_pair(peer)
        for _ in range(3):  # warm-up: the pair's resources, its layouts
            fn()
        _sync(device)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(config["iters"]):
            fn()
        _sync(device)
        one_way_us[name] = (time.perf_counter() - t0) / config["iters"] / 2 * 1e6
        expect = float(peer * 1000)
        assert into[0].flatten()[0].item() == expect, f"{name}: wrong data"
        assert into[-1].flatten()[0].item() == expect + count - 1, f"{name}: wrong data"
        dist.barrier()
    tf._api._reset_pair(peer)
    ctx = tf._context.current()
    result = {
        "one_way_us": one_way_us,
        "host_us": {
            "one": _call_host_time(rank, peer, torch.ones(_ONE_BYTES // 4, device=device)),
            "list": _call_host_time(rank, peer, out if rank == 0 else into),
        },
        "auto_small": ctx.choose("auto", peer, out[:1]),
        "auto_list": ctx.choose("auto", peer, out),
    }
    if config["large_mib"]:
        tf._api._reset_pair(peer)
        result["bandwidth_gbps"] = _bandwidth(rank, peer, device, config["large_mib"] << 20)
    return result


def _call_host_time(rank: int, peer: int, tensors: Any) -> float:
    """Median host time of one ``tf.send`` (rank 0) or ``tf.recv`` (rank 1) call of ``tensors``,
    after 10 warm-up calls: the call only, not the transfer, each waited for before the next."""
    import torch.distributed as dist

    import tensorferry.p2p as tf

    tf._api._reset_pair(peer)  # a fresh pair: nothing an earlier layout made is reused
    samples = []
    for _ in range(200):
        t0 = time.perf_counter()
        handle = tf.send(tensors, peer) if rank == 0 else tf.recv(tensors, peer)
        samples.append(time.perf_counter() - t0)
        handle.wait()
    dist.barrier()
    return statistics.median(samples[10:]) * 1e6


def _bandwidth(rank: int, peer: int, device: Any, nbytes: int) -> dict:
    """One-way GB/s of large messages, rank 0 → 1, tf vs torch.distributed, timed on the host
    from a barrier to a device sync, best of 5 after a warm-up, this rank's view. Two ways each:
    one message alone (latency counts in full) and ``_STREAM`` messages back to back (what a
    stream of large transfers sees; torch issues its ``isend``/``irecv`` calls all at once, tf
    its ``send``/``recv`` calls)."""
    import torch
    import torch.distributed as dist

    import tensorferry.p2p as tf

    buf = torch.ones(nbytes // 4, device=device)
    auto = tf._context.current().choose("auto", peer, [buf])
    tf_names = ("tf nccl" if device.type == "cuda" else "tf gloo", f"tf auto ({auto})")

    def tf_messages(name: str, count: int) -> None:
        transport = "auto" if "auto" in name else name.split()[1]
        call = tf.send if rank == 0 else tf.recv
        handles = [call(buf, peer, transport=transport) for _ in range(count)]
        for handle in handles:
            if device.type == "cuda":
                handle.wait_stream()
            else:
                handle.wait()

    def torch_messages(count: int) -> None:
        if count == 1:
            (dist.send if rank == 0 else dist.recv)(buf, peer)
            return
        works = [(dist.isend if rank == 0 else dist.irecv)(buf, peer) for _ in range(count)]
        for work in works:
            work.wait()

    out = {}
    for count in (1, _STREAM):
        for name in (*tf_names, "torch"):
            best = float("inf")
            for rep in range(6):
                dist.barrier()
                _sync(device)
                t0 = time.perf_counter()
                if name == "torch":
                    torch_messages(count)
                else:
                    tf_messages(name, count)
                _sync(device)
                if rep:  # the first is a warm-up
                    best = min(best, time.perf_counter() - t0)
            label = name if count == 1 else f"{name} ({count} back to back)"
            out[label] = count * nbytes / best / 1e9
    return out


# Messages in a row for the streaming bandwidth.
_STREAM = 8
