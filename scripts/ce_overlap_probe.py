"""Which copies slow a matmul loop down: 20 bf16 8192³ matmuls on cuda:1, alone and while 4 GiB
move in 1 GiB copies issued on a side stream — a local copy on cuda:1 (what a staged receive
adds), a copy cuda:0 → cuda:1 issued on cuda:0 (push) or on cuda:1 (pull), and the same
local copy by an SM kernel (``add``-based) for comparison. One process, both GPUs; times with
CUDA events, the median of 3. Usage: ``python scripts/ce_overlap_probe.py``
"""

import statistics

import torch


def main() -> None:
    a = torch.randn(8192, 8192, device="cuda:1", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda:1", dtype=torch.bfloat16)
    gib = 1 << 30
    src0 = torch.ones(gib, dtype=torch.uint8, device="cuda:0")
    src1 = torch.ones(gib, dtype=torch.uint8, device="cuda:1")
    dst1 = torch.empty(gib, dtype=torch.uint8, device="cuda:1")
    side0 = torch.cuda.Stream(device="cuda:0")
    side1 = torch.cuda.Stream(device="cuda:1")
    main1 = torch.cuda.current_stream("cuda:1")

    def copies(kind: str) -> None:
        if kind == "none":
            return
        # torch orders a cross-device copy with the current streams of both devices (and makes
        # the destination's wait for it): make both current streams side streams. The copy
        # itself runs on the source device's stream for a push and the destination's for a pull.
        first, second = (side1, side0) if kind == "push" else (side0, side1)
        with torch.cuda.stream(first), torch.cuda.stream(second):
            for _ in range(4):
                if kind == "local":
                    dst1.copy_(src1)
                elif kind == "local-kernel":
                    torch.add(src1, 0, out=dst1)
                else:
                    dst1.copy_(src0, non_blocking=True)

    results = {}
    for kind in ("none", "local", "local-kernel", "push", "pull", "none"):
        samples = []
        for _ in range(3):
            torch.cuda.synchronize("cuda:0")
            torch.cuda.synchronize("cuda:1")
            with torch.cuda.device(1):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record(main1)
                side0.wait_stream(torch.cuda.current_stream("cuda:0"))
                side1.wait_event(start)
                copies(kind)
                for _ in range(20):
                    a @ b
                end.record(main1)
            torch.cuda.synchronize("cuda:0")
            torch.cuda.synchronize("cuda:1")
            samples.append(start.elapsed_time(end))
        results.setdefault(kind, []).append(statistics.median(samples))
    base = statistics.mean(results["none"])
    for kind, values in results.items():
        ms = statistics.mean(values)
        print(f"{kind:>13}: {ms:7.2f} ms  ({ms / base - 1:+.1%} vs alone)")


if __name__ == "__main__":
    main()
