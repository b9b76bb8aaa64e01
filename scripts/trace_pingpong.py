"""Timeline of a 64 x 4 KiB ping-pong (one packed message each way): where the time goes.

Wraps the p2p layer's stages (call, accept, header out/in, issue, wait) with timestamps in both
ranks (one clock: same host) and prints three iterations merged. NCCL on a 2-GPU machine, gloo
otherwise.  Usage: ``python scripts/trace_pingpong.py``
"""

import time

import torch

EVENTS = []


def mark(what):
    EVENTS.append((what, time.perf_counter()))


def patch():
    from tensorferry.p2p import _api, _engine, _transfer

    def wrap(cls, name, label):
        orig = getattr(cls, name)

        def f(self, *a, **k):
            mark(label + ">")
            try:
                return orig(self, *a, **k)
            finally:
                mark(label + "<")

        setattr(cls, name, f)

    wrap(_engine.Engine, "_accept", "accept")
    wrap(_engine.Engine, "_send_header", "hdr_out")
    wrap(_engine.Engine, "_issue", "issue")
    orig_frame = _engine.Engine._on_frame

    def on_frame(self, link, frame):
        if frame.get("k") == "h":
            mark("hdr_in")
        return orig_frame(self, link, frame)

    _engine.Engine._on_frame = on_frame
    wrap(_transfer.Transfer, "wait_stream", "wait_stream")
    orig_settled = _transfer.Transfer._settled

    def settled(self):
        r = orig_settled(self)
        if r:
            mark("settled")
        return r

    _transfer.Transfer._settled = settled
    wrap_fn(_api, "send", "send")
    wrap_fn(_api, "recv", "recv")


def wrap_fn(mod, name, label):
    import tensorferry.p2p as tfp

    orig = getattr(mod, name)

    def f(*a, **k):
        mark(label + ">")
        try:
            return orig(*a, **k)
        finally:
            mark(label + "<")

    setattr(tfp, name, f)


def worker(rank, world, cfg):
    patch()
    import tensorferry.p2p as tf

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

    return {"events": list(EVENTS), "median_iter_us": statistics.median(times) * 1e6}


if __name__ == "__main__":
    from tensorferry.p2p._launch import run_world

    backend = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    res = run_world(worker, {}, backend=backend, timeout=120)
    for r, out in enumerate(res):
        print(f"rank {r}: median iteration {out['median_iter_us']:.0f} us (= 2 one-way trips)")
    merged = sorted(
        [(t, r, w) for r, out in enumerate(res) for (w, t) in out["events"]], key=lambda x: x[0]
    )
    # Show iterations 100..103 of rank 0's clock.
    starts = [t for (t, r, w) in merged if r == 0 and w == "iter"]
    t0 = starts[100]
    for t, r, w in merged:
        if starts[100] <= t < starts[103]:
            print(f"{(t - t0) * 1e6:9.1f} us  rank {r}  {w}")
