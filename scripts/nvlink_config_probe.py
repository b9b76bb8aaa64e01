"""Which NVLink kernel configuration moves large messages fastest, next to NCCL in one run.

Two ranks (``torchrun --nproc-per-node 2``). For each ``ChannelConfig`` below: one-way time of
256 MiB and 1 GiB, staged and zero-copy (the receive tensor in symmetric memory), CUDA-graph
replayed and timed with events (median, max over ranks), and NCCL's ``isend``/``irecv`` of the
same sizes. Every configuration's result is checked byte for byte first.

Usage: ``torchrun --standalone --nproc-per-node 2 scripts/nvlink_config_probe.py``
"""

import os
import statistics

import torch
import torch.distributed as dist

from tensorferry.p2p.nvlink import NvlinkChannel, empty
from tensorferry.p2p.nvlink._layout import ChannelConfig

SIZES = (256 << 20, 1 << 30)
CONFIGS = {
    "default (32 CTAs, 256K slots x2, 16 warps)": ChannelConfig(),
    "1M slots x2": ChannelConfig(slot_bytes=1 << 20),
    "4M slots x2": ChannelConfig(slot_bytes=4 << 20),
    "48 CTAs, 1M slots": ChannelConfig(max_ctas=48, max_blocks=48, slot_bytes=1 << 20),
    "64 CTAs, 1M slots": ChannelConfig(max_ctas=64, max_blocks=64, slot_bytes=1 << 20),
    "32 CTAs, 1M slots, 8 warps": ChannelConfig(slot_bytes=1 << 20, num_warps=8),
    "32 CTAs, 1M slots, 16K words": ChannelConfig(slot_bytes=1 << 20, block_words=16384),
}


def timed(op, reps: int = 1, iters: int = 20) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            op()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(reps):
            op()
    torch.cuda.synchronize()
    dist.barrier()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e-3 / reps)
    median = torch.tensor([statistics.median(times)], device="cuda", dtype=torch.float64)
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return float(median.item())


def main() -> None:
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", device_id=device)
    peer = 1 - rank
    big = max(SIZES)
    gen = torch.Generator(device=device).manual_seed(11)
    src = torch.randint(0, 255, (big,), dtype=torch.uint8, device=device, generator=gen)
    dst = torch.empty(big, dtype=torch.uint8, device=device)
    zc = empty(big, dtype=torch.uint8, device=device)
    rows = []
    for size in SIZES:

        def nccl_op(size=size):
            if rank == 0:
                dist.send(src[:size], peer)
            else:
                dist.recv(dst[:size], peer)

        rows.append(("nccl", size, "-", timed(nccl_op)))
    for name, config in CONFIGS.items():
        channel = NvlinkChannel(config=config)
        for size in SIZES:
            for mode, out in (("staged", dst), ("zero-copy", zc)):
                out[:size].fill_(0xA5)  # poison
                torch.cuda.synchronize()

                def op(size=size, out=out, channel=channel):
                    if rank == 0:
                        channel.sendrecv(src[:size], peer, None, None)
                    else:
                        channel.sendrecv(None, None, out[:size], peer)

                op()
                torch.cuda.synchronize()
                if rank == 1:  # both ranks made `src` from one seed: rank 0's bytes
                    assert torch.equal(out[:size], src[:size]), f"{name} {mode} {size}: differ"
                rows.append((name, size, mode, timed(op)))
        channel.close()
        dist.barrier()
    if rank == 0:
        nccl = {size: t for n, size, _, t in rows if n == "nccl"}
        print("| config | size | mode | us | GB/s | vs NCCL |")
        print("|---|---|---|---|---|---|")
        for name, size, mode, t in rows:
            print(
                f"| {name} | {size >> 20} MiB | {mode} | {t * 1e6:.0f} | {size / t / 1e9:.0f} "
                f"| {nccl[size] / t:.3f} |"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
