"""Which NVLink kernel configuration moves large messages fastest, next to NCCL in one run.

Two ranks (``torchrun --nproc-per-node 2``). For each ``ChannelConfig`` below: the time of one
message of each size one way and both ways (per message; both ranks send and receive at once),
staged, and one way zero-copy too (the receive tensor in symmetric memory), CUDA-graph replayed
and timed with events (median, max over ranks), next to NCCL's ``isend``/``irecv`` of the same
sizes. Every configuration's result is checked byte for byte first.

Usage: ``torchrun --standalone --nproc-per-node 2 scripts/nvlink_config_probe.py``
"""

import os
import statistics

import torch
import torch.distributed as dist

from tensorferry.p2p.nvlink import NvlinkChannel, empty
from tensorferry.p2p.nvlink._layout import ChannelConfig

SIZES = (8 << 20, 16 << 20, 64 << 20, 256 << 20, 1 << 30)
CONFIGS = {
    "256K slots (default)": ChannelConfig(),
    "512K slots": ChannelConfig(slot_bytes=512 << 10),
    "1M slots": ChannelConfig(slot_bytes=1 << 20),
    "2M slots": ChannelConfig(slot_bytes=2 << 20),
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

    def data(seed_rank: int) -> torch.Tensor:  # rank r's bytes, reproducible on any GPU
        gen = torch.Generator(device=device).manual_seed(11 + seed_rank)
        return torch.randint(0, 255, (big,), dtype=torch.uint8, device=device, generator=gen)

    src, expected = data(rank), data(peer)
    dst = torch.empty(big, dtype=torch.uint8, device=device)
    zc = empty(big, dtype=torch.uint8, device=device)
    rows = []
    for size in SIZES:
        for both in (False, True):

            def nccl_op(size=size, both=both):
                ops = []
                if both or rank == 0:
                    ops.append(dist.P2POp(dist.isend, src[:size], peer))
                if both or rank == 1:
                    ops.append(dist.P2POp(dist.irecv, dst[:size], peer))
                for work in dist.batch_isend_irecv(ops):
                    work.wait()

            rows.append(("nccl", size, "both" if both else "one way", timed(nccl_op)))
    for name, config in CONFIGS.items():
        channel = NvlinkChannel(config=config)
        for size in SIZES:
            for mode, out in (("one way", dst), ("both", dst), ("one way zero-copy", zc)):
                both = mode == "both"
                out[:size].fill_(0xA5)  # poison
                torch.cuda.synchronize()

                def op(size=size, out=out, both=both, channel=channel):
                    sending, receiving = both or rank == 0, both or rank == 1
                    channel.sendrecv(
                        src[:size] if sending else None,
                        peer if sending else None,
                        out[:size] if receiving else None,
                        peer if receiving else None,
                    )

                op()
                torch.cuda.synchronize()
                if both or rank == 1:
                    assert torch.equal(out[:size], expected[:size]), f"{name} {mode} {size}"
                rows.append((name, size, mode, timed(op)))
        channel.close()
        dist.barrier()
    if rank == 0:
        nccl = {(size, mode): t for n, size, mode, t in rows if n == "nccl"}
        print("| config | size | mode | us | GB/s per direction | vs NCCL |")
        print("|---|---|---|---|---|---|")
        for name, size, mode, t in rows:
            base = nccl[(size, "both" if mode == "both" else "one way")]
            print(
                f"| {name} | {size >> 20} MiB | {mode} | {t * 1e6:.0f} | {size / t / 1e9:.0f} "
                f"| {base / t:.3f} |"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
