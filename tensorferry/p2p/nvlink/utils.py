"""Device helpers shared by the NVLink copy kernels: clocks, fences, acquire loads, bounded waits.

Every helper here is ``@triton.jit`` code. The signalling words they operate on are ``int64``
counters that only ever grow (``atomic_max``), so a stale read is always "not yet" and a
poison value (:data:`POISON` in the kernel file) sticks once written.
"""

import triton
import triton.language as tl


@triton.jit
def globaltimer():
    """Nanoseconds of the GPU's global timer (monotonic within a device)."""
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
    )


@triton.jit
def fence_system():
    """``fence.acq_rel.sys``: this thread's earlier stores (local or over NVLink) are ordered
    before its later stores as seen from any GPU of the system."""
    tl.inline_asm_elementwise(
        "fence.acq_rel.sys; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def load_acquire(ptr):
    """``ld.acquire.sys`` of one ``int64`` word: later loads see what the writer published."""
    return tl.inline_asm_elementwise(
        "ld.acquire.sys.global.b64 $0, [$1];",
        "=l,l",
        [ptr],
        dtype=tl.int64,
        is_pure=False,
        pack=1,
    )


@triton.jit
def signal(ptr, value):
    """Publishes ``value`` to a signal word (local or a peer's) with release semantics.

    The caller fences and barriers first so every thread's data stores precede the signal.
    ``atomic_max`` keeps the word monotonic: a poison value written by the peer is never undone.
    """
    tl.atomic_max(ptr, value, sem="release", scope="sys")


@triton.jit
def wait_at_least(ptr, target, deadline_ns):
    """Spins until the signal word at ``ptr`` reaches ``target`` or the global timer passes
    ``deadline_ns``. Returns the last value read (the caller checks it against ``target``)."""
    value = load_acquire(ptr)
    while (value < target) & (globaltimer() < deadline_ns):
        value = load_acquire(ptr)
    return value
