"""Two-rank GPU checks of the NVLink and copy-engine channels (run under torchrun).

Usage: ``python -m torch.distributed.run --standalone --nproc-per-node 2 tests/nvlink/_worker.py
[nvlink] [ce] [mismatch]``. Prints ``VERDICT: PASS`` on rank 0 when every check passed on every
rank; exits non-zero otherwise.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

SIZES = [1, 17, 4096 + 3, 1 << 20, (64 << 20) + 5]
DTYPES = [
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
]


class Checks:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.failures: list[str] = []
        self.passed = 0

    def run(self, name: str, fn, *args) -> None:
        t0 = time.perf_counter()
        try:
            fn(*args)
            self.passed += 1
            print(f"[rank {self.rank}] ok   {name} ({time.perf_counter() - t0:.2f} s)", flush=True)
        except Exception as exc:
            self.failures.append(f"{name}: {exc!r}")
            print(f"[rank {self.rank}] FAIL {name}: {exc!r}", flush=True)
            traceback.print_exc()


def payload(seed: int, nbytes: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Random bytes seeded by ``seed`` (every rank can rebuild any rank's payload)."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device, generator=gen)
    return raw.view(dtype).reshape(-1)[: nbytes // itemsize]


def poisoned(like: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(like)
    out.view(torch.uint8).fill_(0xA5)
    return out


def expect_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    g, w = got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)
    if g.shape != w.shape:
        raise AssertionError(f"{what}: {g.numel()} bytes, want {w.numel()}")
    bad = (g != w).nonzero()
    if bad.numel():
        first = int(bad[0])
        raise AssertionError(
            f"{what}: {bad.numel()} of {g.numel()} bytes differ, first at {first} "
            f"(got {int(g[first])}, want {int(w[first])})"
        )


def seed_of(case: int, src: int) -> int:
    return 1_000_003 * case + 7919 * src + 17


def main() -> int:
    parts = set(sys.argv[1:]) or {"nvlink", "ce", "mismatch"}
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    peer_next, peer_prev = (rank + 1) % world, (rank - 1) % world
    checks = Checks(rank)

    from tensorferry.p2p import nvlink
    from tensorferry.p2p.nvlink import ChannelConfig, NvlinkChannel

    case = [0]

    def next_case() -> int:
        case[0] += 1
        return case[0]

    def one_way(ch, nbytes: int, dtype: torch.dtype, src: int, zero_copy_buf=None, **kw) -> None:
        c = next_case()
        itemsize = torch.empty(0, dtype=dtype).element_size()
        n = max(1, nbytes // itemsize) * itemsize
        if rank == src:
            ch.send(payload(seed_of(c, src), n, dtype, device), 1 - src, **kw)
            ch.check()
        else:
            want = payload(seed_of(c, src), n, dtype, device)
            out = poisoned(want) if zero_copy_buf is None else zero_copy_buf
            if zero_copy_buf is not None:
                out.view(torch.uint8).fill_(0xA5)
            ch.recv(out, src, **kw)
            ch.check()
            expect_equal(out, want, f"{n} B {dtype} from {src}")

    def both_ways(ch, nbytes: int, dtype: torch.dtype, **kw) -> None:
        c = next_case()
        x = payload(seed_of(c, rank), nbytes, dtype, device)
        want = payload(seed_of(c, peer_prev), nbytes, dtype, device)
        out = poisoned(want)
        ch.sendrecv(x, peer_next, out, peer_prev, **kw)
        ch.check()
        expect_equal(out, want, f"sendrecv {nbytes} B {dtype}")

    if "nvlink" in parts:
        ch = NvlinkChannel(config=ChannelConfig(timeout_s=20.0))
        for nbytes in SIZES:
            for src in (0, 1):
                checks.run(
                    f"nvlink one-way {nbytes} B uint8 from {src}",
                    one_way,
                    ch,
                    nbytes,
                    torch.uint8,
                    src,
                )
        for dtype in DTYPES:
            checks.run(f"nvlink one-way 4099 B {dtype}", one_way, ch, 4096 + 3, dtype, 0)
            checks.run(f"nvlink one-way 1 MiB+8 {dtype}", one_way, ch, (1 << 20) + 8, dtype, 1)
        for nbytes in SIZES:
            checks.run(f"nvlink both ways {nbytes} B", both_ways, ch, nbytes, torch.uint8)
        for dtype in (torch.bfloat16, torch.float32, torch.int64):
            checks.run(f"nvlink both ways 3 MiB {dtype}", both_ways, ch, 3 << 20, dtype)

        # Back-to-back launches with different CTA budgets, no sync between them.
        def budgets() -> None:
            c0 = next_case()
            outs, wants = [], []
            for i, ctas in enumerate((2, 8, 3, 16, 1 * 2, 32, 5 * 2)):
                x = payload(seed_of(c0 + i, rank), 5 << 20, torch.uint8, device)
                want = payload(seed_of(c0 + i, peer_prev), 5 << 20, torch.uint8, device)
                out = poisoned(want)
                ch.sendrecv(x, peer_next, out, peer_prev, max_ctas=ctas)
                outs.append(out)
                wants.append(want)
            case[0] += 10
            ch.check()
            for i, (o, w) in enumerate(zip(outs, wants, strict=True)):
                expect_equal(o, w, f"launch {i}")

        checks.run("nvlink back-to-back CTA budgets", budgets)

        def one_way_budgets() -> None:
            for ctas in (1, 4, 7, 32):
                one_way(ch, (8 << 20) + 3, torch.uint8, 0, max_ctas=ctas)

        checks.run("nvlink one-way CTA budgets 1/4/7/32", one_way_budgets)

        def graph_replays(nbytes: int, replays: int = 100) -> None:
            x = torch.empty(nbytes, dtype=torch.uint8, device=device)
            out = torch.empty(nbytes, dtype=torch.uint8, device=device)
            side = torch.cuda.Stream()
            ch.sendrecv(x, peer_next, out, peer_prev)  # warm up (compile) outside capture
            ch.check()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=side):
                ch.sendrecv(x, peer_next, out, peer_prev)
            c0 = next_case()
            for i in range(replays):
                x.copy_(payload(seed_of(c0 + i, rank), nbytes, torch.uint8, device))
                want = payload(seed_of(c0 + i, peer_prev), nbytes, torch.uint8, device)
                out.fill_(0xA5)
                torch.cuda.synchronize()
                dist.barrier()
                graph.replay()
                torch.cuda.synchronize()
                expect_equal(out, want, f"replay {i}")
            case[0] += replays
            ch.check()

        checks.run("nvlink 100 graph replays 64 KiB+3", graph_replays, (64 << 10) + 3)
        checks.run("nvlink 20 graph replays 16 MiB", graph_replays, 16 << 20, 20)

        # Zero-copy: receive into a symmetric tensor from empty().
        zbuf = nvlink.empty((32 << 20) + 16, dtype=torch.uint8, device=device)
        for nbytes in (16, 4096 + 3, (32 << 20) + 16):
            for src in (0, 1):
                checks.run(
                    f"nvlink zero-copy {nbytes} B from {src}",
                    one_way,
                    ch,
                    nbytes,
                    torch.uint8,
                    src,
                    zbuf[:nbytes],
                )

        def zero_copy_offset() -> None:
            one_way(ch, 1 << 20, torch.uint8, 0, zbuf[4096 : 4096 + (1 << 20)])
            one_way(ch, 1000, torch.uint8, 1, zbuf[3 : 3 + 1000])  # unaligned: staged

        checks.run("nvlink zero-copy views", zero_copy_offset)
        ch.close()

    if "mismatch" in parts:
        from tensorferry.errors import MismatchError

        def mismatch(send_n: int, recv_n: int, send_dtype, recv_dtype, field: str) -> None:
            mch = NvlinkChannel(config=ChannelConfig(timeout_s=5.0))
            if rank == 0:
                mch.send(torch.zeros(send_n, dtype=send_dtype, device=device), 1)
            else:
                mch.recv(torch.zeros(recv_n, dtype=recv_dtype, device=device), 0)
            try:
                mch.check()
            except MismatchError as exc:
                if exc.field != field:
                    raise AssertionError(f"field {exc.field!r}, want {field!r}") from exc
            else:
                raise AssertionError("no MismatchError")
            mch.close()

        checks.run(
            "nvlink mismatch nbytes", mismatch, 1024, 2048, torch.uint8, torch.uint8, "nbytes"
        )
        checks.run(
            "nvlink mismatch nbytes (many CTAs)",
            mismatch,
            8 << 20,
            1 << 20,
            torch.uint8,
            torch.uint8,
            "nbytes",
        )
        checks.run("nvlink mismatch dtype", mismatch, 256, 256, torch.float32, torch.int32, "dtype")

    if "ce" in parts:
        from tensorferry.p2p.copy_engine import CopyEngineChannel

        ce = CopyEngineChannel(timeout_s=20.0)

        def ce_one_way(nbytes: int, dtype: torch.dtype, src: int) -> None:
            c = next_case()
            itemsize = torch.empty(0, dtype=dtype).element_size()
            n = max(1, nbytes // itemsize) * itemsize
            if rank == src:
                handle = ce.send(payload(seed_of(c, src), n, dtype, device), 1 - src)
                handle.wait()
            else:
                want = payload(seed_of(c, src), n, dtype, device)
                out = poisoned(want)
                handle = ce.recv(out, src)
                handle.wait()
                torch.cuda.current_stream().synchronize()
                expect_equal(out, want, f"ce {n} B {dtype} from {src}")

        def ce_both(nbytes: int) -> None:
            c = next_case()
            x = payload(seed_of(c, rank), nbytes, torch.uint8, device)
            want = payload(seed_of(c, peer_prev), nbytes, torch.uint8, device)
            out = poisoned(want)
            ce.sendrecv(x, peer_next, out, peer_prev).wait()
            expect_equal(out, want, f"ce sendrecv {nbytes} B")

        for nbytes in [*SIZES, (200 << 20) + 7]:
            for src in (0, 1):
                checks.run(
                    f"ce one-way {nbytes} B from {src}", ce_one_way, nbytes, torch.uint8, src
                )
        for dtype in (torch.bfloat16, torch.float32, torch.int64):
            checks.run(f"ce one-way 1 MiB+8 {dtype}", ce_one_way, (1 << 20) + 8, dtype, 0)
        for nbytes in (17, 1 << 20, (150 << 20) + 5):
            checks.run(f"ce both ways {nbytes} B", ce_both, nbytes)

        def ce_graph(nbytes: int, replays: int) -> None:
            x = torch.empty(nbytes, dtype=torch.uint8, device=device)
            out = torch.empty(nbytes, dtype=torch.uint8, device=device)
            ce.sendrecv(x, peer_next, out, peer_prev).wait()
            side = torch.cuda.Stream()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=side):
                ce.sendrecv(x, peer_next, out, peer_prev)
            c0 = next_case()
            for i in range(replays):
                x.copy_(payload(seed_of(c0 + i, rank), nbytes, torch.uint8, device))
                want = payload(seed_of(c0 + i, peer_prev), nbytes, torch.uint8, device)
                out.fill_(0xA5)
                torch.cuda.synchronize()
                dist.barrier()
                graph.replay()
                torch.cuda.synchronize()
                expect_equal(out, want, f"ce replay {i}")
            case[0] += replays

        checks.run("ce 100 graph replays 64 KiB+3", ce_graph, (64 << 10) + 3, 100)
        checks.run("ce 10 graph replays 100 MiB", ce_graph, 100 << 20, 10)

        if "mismatch" in parts:
            from tensorferry.errors import MismatchError

            def ce_mismatch() -> None:
                mce = CopyEngineChannel(timeout_s=3.0)
                try:
                    if rank == 0:
                        mce.send(torch.zeros(1000, dtype=torch.uint8, device=device), 1).wait()
                    else:
                        mce.recv(torch.zeros(2000, dtype=torch.uint8, device=device), 0).wait()
                except MismatchError as exc:
                    if exc.field != "nbytes":
                        raise AssertionError(f"field {exc.field!r}") from exc
                else:
                    raise AssertionError("no MismatchError")

            checks.run("ce mismatch nbytes", ce_mismatch)

            def ce_timeout_drains() -> None:
                # Rank 0 sends and rank 1 never receives: rank 0 times out, and its streams
                # (and the caller's, which waits on them) must not stay blocked.
                from tensorferry.errors import TransferTimeoutError

                tce = CopyEngineChannel(timeout_s=1.0)
                if rank == 0:
                    handle = tce.send(torch.ones(1 << 20, dtype=torch.uint8, device=device), 1)
                    try:
                        handle.wait()
                    except TransferTimeoutError:
                        pass
                    else:
                        raise AssertionError("no TransferTimeoutError")
                    if not handle.ready():
                        raise AssertionError("the timed-out send still waits on the device")
                    torch.cuda.current_stream(device).synchronize()
                    tce.abort()
                dist.barrier()
                if rank == 1:
                    tce.close(force=True)

            checks.run("ce timeout drains its streams", ce_timeout_drains)
        ce.close(force=True)

    failures = torch.tensor([len(checks.failures)], device=device)
    dist.all_reduce(failures)
    total = int(failures.item())
    if rank == 0:
        print(
            f"VERDICT: {'PASS' if total == 0 else 'FAIL'} ({total} failure(s) over ranks, "
            f"{checks.passed} passed on rank 0)",
            flush=True,
        )
    for failure in checks.failures:
        print(f"[rank {rank}] failure: {failure}", flush=True)
    dist.destroy_process_group()
    return 0 if total == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
