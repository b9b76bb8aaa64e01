"""How many launches a CUDA stream takes behind work that does not finish before one blocks.

A transfer's kernel waits on the device for its peer; the launches behind it queue up, and
once the queue is full the next launch waits on the host, in the launching call, until
the device makes room. The p2p layer must never launch that far ahead of the device. Cases
(each behind a kernel spinning about ``SPIN_S`` seconds on stream A):

- ``kernels``: one tiny kernel per step on stream A;
- ``issue-like``: per step what a lone message's issue enqueues on the transfer stream: a wait
  for an event recorded on another stream, a tiny kernel, an event recorded after it;
- ``other stream``: stream A filled to just below the first case's count, then tiny kernels
  on stream B: whether B has a queue of its own.

Prints the step whose launch took over 50 ms (blocked) and the time it waited.
Usage: ``python scripts/launch_queue_probe.py`` (one GPU).
"""

import time

import torch

SPIN_S = 3.0
LIMIT = 40000


def spin(stream, seconds):
    with torch.cuda.stream(stream):
        torch.cuda._sleep(int(seconds * 1.5e9))  # cycles, about 1.5 GHz


def steps_until_blocked(step, limit=LIMIT):
    for i in range(limit):
        t0 = time.perf_counter()
        step()
        waited = time.perf_counter() - t0
        if waited > 0.05:
            return i, waited
    return None, 0.0


def main():
    a, b, c = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream()
    events = [torch.cuda.Event() for _ in range(2)]

    def tiny(stream):
        with torch.cuda.stream(stream):
            torch.cuda._sleep(1)

    spin(a, SPIN_S)
    n, waited = steps_until_blocked(lambda: tiny(a))
    print(f"kernels: launch {n} blocked for {waited:.2f} s")
    torch.cuda.synchronize()

    def issue_like():
        events[0].record(c)
        a.wait_event(events[0])
        tiny(a)
        events[1].record(a)

    spin(a, SPIN_S)
    m, waited = steps_until_blocked(issue_like)
    print(f"issue-like: step {m} blocked for {waited:.2f} s")
    torch.cuda.synchronize()

    if n:
        spin(a, SPIN_S)
        for _ in range(n - 16):
            tiny(a)
        k, waited = steps_until_blocked(lambda: tiny(b), limit=2 * n)
        print(f"other stream, A holding {n - 16}: launch {k} on B blocked for {waited:.2f} s")
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
