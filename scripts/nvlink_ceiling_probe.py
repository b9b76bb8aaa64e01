"""How fast can plain stores into a peer's memory go? The ceiling under the NVLink kernels.

Two ranks (``torchrun --nproc-per-node 2``), each with one symmetric receive buffer. Every
variant copies a local buffer into the peer's buffer with no signalling at all — no slots, no
fences, no counters — so it bounds what any protocol built on it can reach:

- ``st``: a Triton kernel, grid-stride over tiles, ``tl.load`` then ``tl.store`` of 16-byte
  vectors; ``UNROLL`` vectors per thread are loaded before the first store (bytes in flight).
- ``tma``: a Gluon kernel, local tile → shared memory → peer by TMA bulk copies
  (``cp.async.bulk.tensor``), ``STAGES`` tiles in flight per CTA, no registers involved.
- ``ce``: the copy engine (``peer.copy_(src)``), NCCL's ``isend``/``irecv``, and the
  ``NvlinkChannel`` zero-copy path as it ships, all in the same run.

One way: rank 0 writes into rank 1. Both ways: each rank writes into the other at once.
Times: CUDA events around one launch, after a barrier, median of ``ITERS``, max over ranks.
Every variant's bytes are checked on the receiver once, before timing.

Usage: ``torchrun --standalone --nproc-per-node 2 scripts/nvlink_ceiling_probe.py``
"""

import faulthandler
import os
import statistics

import torch
import torch.distributed as dist
import triton
import triton.language as tl
from torch.distributed import _symmetric_memory as symm_mem

SIZES = tuple(int(s) << 20 for s in os.environ.get("CEILING_SIZES_MIB", "64,256,1024").split(","))
ITERS = int(os.environ.get("CEILING_ITERS", "15"))
ROW_WORDS = 64  # a TMA row: 64 int32 words = 256 bytes


@triton.jit
def _store_copy(src, dst, n_tiles, TILE: tl.constexpr):
    """Grid-stride copy of ``n_tiles`` tiles of ``TILE`` int32 words, no masks."""
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    for t in range(pid, n_tiles, step):
        offs = t.to(tl.int64) * TILE + tl.arange(0, TILE)
        x = tl.load(src + offs, cache_modifier=".cg")
        tl.store(dst + offs, x)


def st_copy(src, dst, ctas, warps, unroll):
    tile = warps * 32 * 4 * unroll
    n = src.numel()
    assert n % tile == 0
    _store_copy[(ctas,)](src, dst, n // tile, TILE=tile, num_warps=warps)


def _gluon_copy():
    """The TMA kernel, built only where Gluon's Hopper TMA exists."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    @gluon.jit
    def _tma_copy(src_desc, dst_desc, n_tiles, STAGES: gl.constexpr):
        pid = gl.program_id(0)
        step = gl.num_programs(0)
        rows: gl.constexpr = src_desc.block_shape[0]
        cols: gl.constexpr = src_desc.block_shape[1]
        nbytes: gl.constexpr = src_desc.block_type.nbytes
        smem = gl.allocate_shared_memory(src_desc.dtype, [STAGES, rows, cols], src_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(bars.index(i), count=1)
        mine = (n_tiles - pid + step - 1) // step
        for i in gl.static_range(STAGES):
            go = i < mine
            mbarrier.expect(bars.index(i), nbytes, pred=go)
            tma.async_copy_global_to_shared(
                src_desc, [(pid + i * step) * rows, 0], bars.index(i), smem.index(i), pred=go
            )
        for k in range(mine):
            s = k % STAGES
            mbarrier.wait(bars.index(s), (k // STAGES) & 1)
            tma.async_copy_shared_to_global(dst_desc, [(pid + k * step) * rows, 0], smem.index(s))
            # Refill the stage the previous store read from, once that store has read it.
            refill = k - 1 + STAGES
            if (k >= 1) & (refill < mine):
                tma.store_wait(pendings=1)
                r = (k - 1) % STAGES
                mbarrier.expect(bars.index(r), nbytes)
                tma.async_copy_global_to_shared(
                    src_desc, [(pid + refill * step) * rows, 0], bars.index(r), smem.index(r)
                )
        tma.store_wait(pendings=0)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(i))

    def tma_copy(src, dst, ctas, rows, stages):
        words = src.view(torch.int32).view(-1, ROW_WORDS)
        peer = dst.view(torch.int32).view(-1, ROW_WORDS)
        layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
        block = [rows, ROW_WORDS]
        src_desc = TensorDescriptor(words, list(words.shape), list(words.stride()), block, layout)
        dst_desc = TensorDescriptor(peer, list(peer.shape), list(peer.stride()), block, layout)
        n_tiles = triton.cdiv(words.shape[0], rows)
        _tma_copy[(ctas,)](src_desc, dst_desc, n_tiles, STAGES=stages, num_warps=1)

    return tma_copy


def timed(op) -> float:
    for _ in range(2):
        op()
    torch.cuda.synchronize()
    times = []
    for _ in range(ITERS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        torch.cuda.synchronize()
        start.record()
        op()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    median = torch.tensor([statistics.median(times)], device="cuda", dtype=torch.float64)
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return float(median.item())


def main() -> None:
    faulthandler.dump_traceback_later(float(os.environ.get("CEILING_LIMIT_S", "200")), exit=True)
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", device_id=device)
    peer = 1 - rank
    big = max(SIZES)
    gen = torch.Generator(device=device).manual_seed(7 + rank)
    src = torch.randint(0, 255, (big,), dtype=torch.uint8, device=device, generator=gen)
    gen = torch.Generator(device=device).manual_seed(7 + peer)
    expected = torch.randint(0, 255, (big,), dtype=torch.uint8, device=device, generator=gen)
    recv = symm_mem.empty(big, dtype=torch.uint8, device=device)
    handle = symm_mem.rendezvous(recv, dist.group.WORLD.group_name)
    peer_recv = handle.get_buffer(peer, (big,), torch.uint8)
    plain = torch.empty(big, dtype=torch.uint8, device=device)
    sides = [torch.cuda.Stream() for _ in range(4)]

    def split_copy(n, dst, parts, kernel_share=0.0):
        """The copy engine on ``parts`` streams, each a contiguous share; with
        ``kernel_share``, that fraction goes by the store kernel (132 CTAs) at the same time."""
        here = torch.cuda.current_stream()
        by_kernel = int(n * kernel_share) // (1 << 20) << 20
        cuts = [by_kernel + (n - by_kernel) * i // parts // 256 * 256 for i in range(parts)]
        cuts.append(n)
        for stream, lo, hi in zip(sides[:parts], cuts[:-1], cuts[1:], strict=True):
            stream.wait_stream(here)
            with torch.cuda.stream(stream):
                dst[lo:hi].copy_(src[lo:hi], non_blocking=True)
        if by_kernel:
            st_copy(
                src[:by_kernel].view(torch.int32), dst[:by_kernel].view(torch.int32), 132, 16, 1
            )
        for stream in sides[:parts]:
            here.wait_stream(stream)

    variants = {
        "ce": lambda n, dst: split_copy(n, dst, 1),
        "ce x2": lambda n, dst: split_copy(n, dst, 2),
        "ce x4": lambda n, dst: split_copy(n, dst, 4),
        "ce + st 30%": lambda n, dst: split_copy(n, dst, 1, 0.3),
        "ce x2 + st 30%": lambda n, dst: split_copy(n, dst, 2, 0.3),
        "ce + st 50%": lambda n, dst: split_copy(n, dst, 1, 0.5),
    }
    for ctas, warps, unroll in ((32, 16, 1), (32, 16, 4), (64, 16, 2), (132, 8, 4), (132, 16, 1)):
        variants[f"st {ctas}x{warps}w u{unroll}"] = lambda n, dst, c=ctas, w=warps, u=unroll: (
            st_copy(src[:n].view(torch.int32), dst[:n].view(torch.int32), c, w, u)
        )
    try:
        tma_copy = _gluon_copy()
    except ImportError as exc:
        print(f"[{rank}] no Gluon TMA here: {exc}", flush=True)
    else:
        tma_configs = ((16, 128, 6), (32, 128, 4), (32, 64, 8), (64, 64, 4), (132, 32, 4))
        for ctas, tile_rows, stages in tma_configs:
            variants[f"tma {ctas} ctas {tile_rows * 256 >> 10}K x{stages}"] = (
                lambda n, dst, c=ctas, r=tile_rows, st=stages: tma_copy(src[:n], dst[:n], c, r, st)
            )

    only = [p for p in os.environ.get("CEILING_ONLY", "").split(",") if p]
    if only:  # names starting with one of these
        variants = {k: v for k, v in variants.items() if any(k.startswith(p) for p in only)}
    # Build every kernel on every rank first, into a local buffer, so that a variant that does
    # not compile here is dropped by both ranks alike (one rank alone failing would leave the
    # other waiting in a barrier).
    for name in list(variants):
        ok = 1
        try:
            variants[name](1 << 20, plain)
            torch.cuda.synchronize()
        except Exception as exc:
            ok = 0
            if rank == 0:
                print(f"{name}: not built: {type(exc).__name__}: {str(exc)[-400:]}", flush=True)
        flag = torch.tensor([ok], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if not flag.item():
            del variants[name]

    from tensorferry.p2p.nvlink import NvlinkChannel, empty

    channel = NvlinkChannel()
    zc = empty(big, dtype=torch.uint8, device=device)
    rows = []

    def measure(name, n, both, op, out=recv):
        sending = both or rank == 0
        if name != "nccl":
            out[:n].fill_(0xA5)  # poison what the peer will overwrite
            torch.cuda.synchronize()
            dist.barrier()
            op(sending, n)
            torch.cuda.synchronize()
            dist.barrier()
            right = torch.equal(out[:n], expected[:n]) if both or rank == 1 else True
            flag = torch.tensor([int(right)], device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            if not flag.item():
                if rank == 0:
                    print(f"{name} {n >> 20} MiB both={both}: WRONG BYTES", flush=True)
                return
        rows.append((name, n, both, timed(lambda: op(sending, n))))

    for n in SIZES:
        for both in (False, True):

            def nccl(sending, n, both=both):
                ops = []
                if sending:
                    ops.append(dist.P2POp(dist.isend, src[:n], peer))
                if both or rank == 1:
                    ops.append(dist.P2POp(dist.irecv, plain[:n], peer))
                for work in dist.batch_isend_irecv(ops):
                    work.wait()

            measure("nccl", n, both, nccl)

            def shipped(sending, n, both=both):
                receiving = both or rank == 1
                channel.sendrecv(
                    src[:n] if sending else None,
                    peer if sending else None,
                    zc[:n] if receiving else None,
                    peer if receiving else None,
                )

            measure("nvlink-zc (shipped)", n, both, shipped, out=zc)
            for name, copy in variants.items():

                def run(sending, n, copy=copy):
                    if sending:
                        copy(n, peer_recv)

                measure(name, n, both, run)
            if rank == 0:
                print(f"done {n >> 20} MiB {'both' if both else 'one way'}", flush=True)

    if rank == 0:
        nccl_time = {(n, both): t for name, n, both, t in rows if name == "nccl"}
        print("| variant | size | mode | us | GB/s per direction | vs NCCL |")
        print("|---|---|---|---|---|---|")
        for name, n, both, t in rows:
            mode = "both" if both else "one way"
            ratio = nccl_time[(n, both)] / t
            gbs = n / t / 1e9
            print(f"| {name} | {n >> 20} MiB | {mode} | {t * 1e6:.0f} | {gbs:.0f} | {ratio:.3f} |")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
