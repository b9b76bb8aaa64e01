"""Timeline of a 64 x 4 KiB ping-pong (one packed message each way): where the time goes.

Wraps the p2p layer's stages (call, accept, header out/in, issue, wait) with timestamps in both
ranks (one clock: same host) and prints three iterations merged. NCCL on a 2-GPU machine, gloo
otherwise.  Usage: ``python scripts/trace_pingpong.py [--no-speculate] [--no-short]
[--dump-after S]``

``--no-short`` runs the ranks with ``TENSORFERRY_P2P_SHORT_PATH=0``: every message through a
full step of the p2p engine, without the short way for agreed static messages (an A/B of it).
``--no-speculate`` runs the ranks with ``TENSORFERRY_NCCL_SPECULATE=0``: without the NCCL
transport's speculative issue (agreed static messages issued before the peer's header; by
default in a world of two ranks, as here).
``--dump-after S`` prints every thread's Python stack every S seconds in each rank (to find
where a hang sits). ``--no-linger`` makes the completion pool's poller sleep until told after
each item, as it did before it lingered (an A/B of that). ``--watch-delay-ms D`` makes the
completion pool first poll each transfer D ms after its issue (default: the spin window), so
that transfers nobody waits for are completed later, off the measured iterations.
"""

import os
import time

import torch

EVENTS = []


def mark(what):
    EVENTS.append((what, time.perf_counter()))


def timed(fn, label):
    """``fn`` marking its entry (``label>``) and exit (``label<``); methods too (``self`` is
    just the first argument)."""

    def wrapper(*args, **kwargs):
        mark(label + ">")
        try:
            return fn(*args, **kwargs)
        finally:
            mark(label + "<")

    return wrapper


def patch():
    import tensorferry.p2p as tfp
    from tensorferry.p2p import _api, _context, _engine, _nccl, _staging, _transfer

    stages = [
        (_engine.Engine, "_accept", "accept"),
        (_engine.Engine, "_send_header", "hdr_out"),
        (_engine.Engine, "_issue", "issue"),
        (_engine.Engine, "_issue_short", "short_way"),  # true when it issued the message
        (_engine.Engine, "_read_link", "read_link"),
        (_engine.Engine, "_flush_links", "flush"),
        (_transfer.Transfer, "wait_stream", "wait_stream"),
        (_transfer.Transfer, "_wait_issued", "wait_issued"),
        (_context.P2PContext, "issue", "ctx.issue"),
        (_nccl.NcclTransport, "start", "nccl.start"),
        *((_nccl, name, name) for name in ("pack", "unpack", "wire_plan")),
        *((_staging.Staging, name, f"staging.{name}") for name in ("pack", "unpack")),
        *((_api, name, name) for name in ("_message", "_submit", "_caller_event")),
    ]
    for owner, name, label in stages:
        setattr(owner, name, timed(getattr(owner, name), label))
    for name in ("send", "recv"):  # the public names callers use
        setattr(tfp, name, timed(getattr(_api, name), name))
    orig_short = _engine.Engine._issue_short

    def issue_short(self, unit):
        took = orig_short(self, unit)
        if not took:  # a zero-length span per message the short way left to the full step
            mark("short_way_declined>")
            mark("short_way_declined<")
        return took

    _engine.Engine._issue_short = issue_short
    orig_frame = _engine.Engine._on_frame

    def on_frame(self, link, frame):
        if frame.get("k") == "h":
            mark("hdr_in")
        return orig_frame(self, link, frame)

    _engine.Engine._on_frame = on_frame


def worker(rank, world, cfg):
    patch()
    import tensorferry.p2p as tf

    if cfg.get("no_linger"):
        from tensorferry.runtime import _completion

        _completion._LINGER_S = 0.0
    if cfg.get("watch_delay_ms") is not None:  # when the completion pool first polls a transfer
        from tensorferry.p2p import _engine_issue

        _engine_issue.spin_window_s = lambda: cfg["watch_delay_ms"] / 1e3
    if cfg.get("dump_after"):
        import faulthandler
        import sys

        faulthandler.dump_traceback_later(cfg["dump_after"], repeat=True, file=sys.stderr)

    dev = tf._context.current().device
    peer = 1 - rank
    out = [torch.full((1024,), float(rank), device=dev) for _ in range(64)]
    into = [torch.empty(1024, device=dev) for _ in range(64)]

    def it():
        if rank == 0:
            tf.send(out, peer, static=True)
            tf.recv(into, peer, static=True).wait_stream()
        else:
            tf.recv(into, peer, static=True).wait_stream()
            tf.send(out, peer, static=True)

    for _ in range(50):
        it()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    EVENTS.clear()
    times = []
    for _ in range(200):
        t = time.perf_counter()
        mark("iter")
        it()
        times.append(time.perf_counter() - t)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    import statistics

    events = list(EVENTS)
    # Phase 2: one small tensor per call, as the host-time benchmark does, on a fresh pair
    # (the static channel agreed on the 64-tensor message).
    _reset_when_idle(tf, peer)
    EVENTS.clear()
    x = torch.ones(256, device=dev)
    for _ in range(300):
        if rank == 0:
            tf.send(x, peer, static=True).wait()
        else:
            tf.recv(x, peer, static=True).wait()
    return {
        "events": events,
        "median_iter_us": statistics.median(times) * 1e6,
        "iter_spread": _spread(times),
        "packed": _spans(events),
        "single": _spans(EVENTS[len(EVENTS) // 3 :]),
    }


def _reset_when_idle(tf, peer):
    """Both ranks: once nothing is in flight with ``peer``, move the pair to a new epoch."""
    for _ in range(500):
        try:
            tf._api._reset_pair(peer)
            return
        except ValueError:  # the last transfer is still finishing
            time.sleep(0.01)
    raise RuntimeError("the pair never went idle")


def _spread(times):
    """Mean, 90th and 99th percentile and maximum of the iterations, µs: the slow ones."""
    import statistics

    ordered = sorted(t * 1e6 for t in times)
    p90, p99 = (ordered[min(len(ordered) - 1, int(q * len(ordered)))] for q in (0.9, 0.99))
    mean = statistics.mean(ordered)
    return f"mean {mean:.0f}, p90 {p90:.0f}, p99 {p99:.0f}, max {ordered[-1]:.0f}"


def _spans(events):
    """Median duration of each wrapped stage (label> ... label<) on this rank."""
    import statistics

    open_at, spans = {}, {}
    for what, t in events:
        label, edge = what[:-1], what[-1]
        if edge == ">":
            open_at[label] = t
        elif edge == "<" and label in open_at:
            spans.setdefault(label, []).append((t - open_at.pop(label)) * 1e6)
    return {k: (statistics.median(v), len(v)) for k, v in spans.items()}


if __name__ == "__main__":
    import argparse

    from tensorferry.p2p._launch import run_world

    parser = argparse.ArgumentParser()
    parser.add_argument("--no-speculate", action="store_true")
    parser.add_argument("--no-short", action="store_true")
    parser.add_argument("--dump-after", type=float, default=0.0)
    parser.add_argument("--no-linger", action="store_true")
    parser.add_argument("--watch-delay-ms", type=float, default=None)
    args = parser.parse_args()
    backend = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    if args.no_speculate:  # read when tf.init makes the transport, in the ranks this starts
        os.environ["TENSORFERRY_NCCL_SPECULATE"] = "0"
    if args.no_short:  # read by the engine at tf.init
        os.environ["TENSORFERRY_P2P_SHORT_PATH"] = "0"
    cfg = {
        "dump_after": args.dump_after,
        "no_linger": args.no_linger,
        "watch_delay_ms": args.watch_delay_ms,
    }
    res = run_world(worker, cfg, backend=backend, timeout=120)
    for r, out in enumerate(res):
        print(f"rank {r}: median iteration {out['median_iter_us']:.0f} us (= 2 one-way trips)")
        print(f"rank {r}: iterations: {out['iter_spread']}")
        for phase, title in (
            ("packed", "64 x 4 KiB per call"),
            ("single", "one small tensor per call"),
        ):
            print(f"rank {r}: {title}, median us per stage:")
            for label, (us, n) in sorted(out[phase].items(), key=lambda kv: -kv[1][0]):
                print(f"    {label:14s} {us:8.1f}  ({n} calls)")
    merged = sorted(
        [(t, r, w) for r, out in enumerate(res) for (w, t) in out["events"]], key=lambda x: x[0]
    )
    # Show iterations 100..103 of rank 0's clock.
    starts = [t for (t, r, w) in merged if r == 0 and w == "iter"]
    t0 = starts[100]
    for t, r, w in merged:
        if starts[100] <= t < starts[102]:
            print(f"{(t - t0) * 1e6:9.1f} us  rank {r}  {w}")
