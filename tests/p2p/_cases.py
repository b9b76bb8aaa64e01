"""Test cases run inside the worker processes (one call per rank; see ``_pool.py``).

Each case takes ``(rank, world, *args)``, checks what it received byte for byte against a
payload both sides derive from (src, dst, tag), and returns something small for the test to
assert on. Outputs are poisoned before receiving so a transfer that writes nothing fails.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
import warnings
from typing import Any

import torch

import tensorferry.p2p as tf
from tensorferry.errors import (
    MismatchError,
    PeerLostError,
    TensorFerryError,
    TransferTimeoutError,
)

# Seconds: every wait in these cases is bounded (TF_TEST_CASE_WAIT_S: shorter, to explore).
T = float(os.environ.get("TF_TEST_CASE_WAIT_S", "20"))


def D() -> torch.device:
    """This rank's device: cuda:N over NCCL on the GPU tier, the CPU over gloo here."""
    from tensorferry.p2p import _context

    return _context.current().device


def payload(src: int, dst: int, tag: int, shape: tuple[int, ...], dtype: torch.dtype):
    """Random data both sides can derive: seeded by (src, dst, tag), rank-encoded."""
    gen = torch.Generator().manual_seed(src * 1_000_003 + dst * 1_009 + tag)
    if dtype.is_floating_point:
        t = (torch.randn(shape, generator=gen) + src * 100).to(dtype)
    elif dtype == torch.bool:
        t = torch.randint(0, 2, shape, generator=gen).bool()
    else:
        t = torch.randint(0, 120, shape, generator=gen).to(dtype) + src
    return t.to(D())


def poisoned(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device=D())
    if t.numel():
        t.view(-1).view(torch.uint8).fill_(0xA5)
    return t


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


SHAPES = [
    ((), torch.float32),
    ((7,), torch.int64),
    ((3, 5), torch.bfloat16),
    ((33,), torch.bool),
    ((0, 4), torch.float32),
    ((128, 1024), torch.float32),  # 512 KiB: sent alone (not packed)
    ((2, 3, 4), torch.uint8),
]


# ---------------------------------------------------------------------- basic API
def send_recv_all_dtypes(rank: int, world: int, tag: int) -> str:
    """Rank 0 sends a many-dtype message to rank 1 (tensors) and rank 1 → 0 (specs)."""
    if rank == 0:
        out = [payload(0, 1, tag + i, s, d) for i, (s, d) in enumerate(SHAPES)]
        h = tf.send(out, 1)
        specs = [tf.TensorSpec(s, d) for s, d in SHAPES]
        got = tf.recv(specs, 1).result(T)
        h.wait(T)
        assert h.done() and h.exception() is None and h.result() is None
        expect = [payload(1, 0, tag + i, s, d) for i, (s, d) in enumerate(SHAPES)]
    elif rank == 1:
        got_buffers = [poisoned(s, d) for s, d in SHAPES]
        h = tf.recv(got_buffers, 0)
        back = [payload(1, 0, tag + i, s, d) for i, (s, d) in enumerate(SHAPES)]
        tf.send(back, 0).wait(T)
        got = h.result(T)
        assert all(g is b for g, b in zip(got, got_buffers, strict=True)), "recv into buffers"
        expect = [payload(0, 1, tag + i, s, d) for i, (s, d) in enumerate(SHAPES)]
    else:
        return "idle"
    assert isinstance(got, list) and len(got) == len(expect)
    for i, (g, e) in enumerate(zip(got, expect, strict=True)):
        assert same_bytes(g, e), f"tensor {i} ({e.dtype}, {tuple(e.shape)}) differs"
    return "ok"


def nccl_without_the_library(rank: int, world: int, tag: int) -> list[str] | str:
    """Ranks 0 and 1 exchange many-dtype messages over ``nccl`` where the NCCL library cannot
    be loaded: the pair's communicators are then ``ProcessGroupNCCL`` ones. Returns the kinds
    of communicator the pair used."""
    if rank > 1:
        return "idle"
    from tensorferry.p2p import _nccl
    from tensorferry.runtime import communicator_cache

    peer, plain = 1 - rank, _nccl.nccl_library
    _nccl.nccl_library = lambda: None
    try:
        tf._api._reset_pair(peer, timeout=T)  # the next message makes new communicators
        for step in range(3):
            mark = tag + 100 * step
            out = [payload(rank, peer, mark + i, s, d) for i, (s, d) in enumerate(SHAPES)]
            got = [poisoned(s, d) for s, d in SHAPES]
            tf.sendrecv(out, peer, got, peer, transport="nccl").wait(T)
            for i, (s, d) in enumerate(SHAPES):
                assert same_bytes(got[i], payload(peer, rank, mark + i, s, d)), (step, i)
        cache = communicator_cache()
        kinds = sorted({type(cache.get(k)).__name__ for k in cache.keys() if k[0] == "nccl"})  # noqa: SIM118
    finally:
        _nccl.nccl_library = plain
        tf._api._reset_pair(peer, timeout=T)  # later cases call the library again
    return kinds


def strided_single_elements(rank: int, world: int, tag: int) -> str:
    """One-element tensors are contiguous whatever their stride (``x[:1].imag`` of a complex
    ``x`` has 2, ``x[::3][:1]`` 3), and a byte view of them used to be refused mid-transfer.
    Rank 0 sends them alone and in a list; rank 1 receives one into such a view and checks that
    only that element of its base changed."""
    if rank > 1:
        return "idle"
    base = payload(0, 1, tag, (6,), torch.complex64).to(D())
    plain = payload(0, 1, tag + 1, (9,), torch.float32).to(D())
    sent = [base[:1].imag, plain[::3][:1]]
    assert all(t.is_contiguous() and t.stride(0) != 1 for t in sent)
    if rank == 0:
        for t in sent:
            tf.send(t, 1).wait(T)
        tf.send(sent, 1).wait(T)
        return "sent"
    for t in sent:
        backing = poisoned((8,), torch.float32)
        into = backing[::2][1:2]  # one element, stride 2, at offset 2
        tf.recv(into, 0).wait(T)
        want = poisoned((8,), torch.float32)
        want[2] = t[0]
        assert same_bytes(backing, want), "only the viewed element may change"
    got = tf.recv([poisoned((1,), torch.float32) for _ in sent], 0).result(T)
    for g, t in zip(got, sent, strict=True):
        want = torch.empty(1, device=D())
        want.copy_(t)  # its value with a stride of 1 (clone keeps the stride)
        assert same_bytes(g, want), "a list of them"
    return "ok"


def parameters_travel(rank: int, world: int, tag: int) -> str:
    """Weight sync: rank 0 sends parameters and an activation (tensors that require grad),
    rank 1 receives into its own parameters (small ones packed, a large one alone) and gets the
    bytes, its parameters staying leaves that require grad, with no gradient made."""
    if rank > 1:
        return "idle"
    # One dtype, as a model's weights: the packed ones are unpacked straight into them.
    shapes = [((5,), torch.float32), ((3, 4), torch.float32), ((70_000,), torch.float32)]
    tf._api._reset_pair(1 - rank, timeout=T)  # a fresh channel: its static agreement is ours
    if rank == 0:
        weights = [torch.nn.Parameter(payload(0, 1, tag + i, *sd)) for i, sd in enumerate(shapes)]
        leaf = torch.nn.Parameter(payload(0, 1, tag + 9, (6,), torch.float32))
        activation = leaf * 2  # not a leaf: it has a grad_fn
        for static in (False, True, True):  # the agreed static channel takes the short way
            tf.send([*weights, activation], 1, static=static).wait(T)
        assert all(w.grad is None for w in weights) and leaf.grad is None
    else:
        expect = [payload(0, 1, tag + i, s, d) for i, (s, d) in enumerate(shapes)]
        expect.append(payload(0, 1, tag + 9, (6,), torch.float32) * 2)
        for static in (False, True, True):
            layouts = [*shapes, ((6,), torch.float32)]
            into = [torch.nn.Parameter(poisoned(s, d)) for s, d in layouts]
            got = tf.recv(into, 0, static=static).result(T)
            for i, (param, received, want) in enumerate(zip(into, got, expect, strict=True)):
                assert same_bytes(param.detach(), want), f"parameter {i} differs"
                assert received.data_ptr() == param.data_ptr(), "result() shares the memory"
                assert param.is_leaf and param.requires_grad and param.grad is None
    tf._api._reset_pair(1 - rank, timeout=T)  # later cases start without this agreement
    return "sent" if rank == 0 else "ok"


def inference_tensors_travel(rank: int, world: int, tag: int) -> str:
    """A rollout worker: its buffers were made in inference mode, and it receives into them
    from inside and from outside that mode (packed small ones and a large one alone); rank 0
    sends inference tensors too."""
    if rank > 1:
        return "idle"
    shapes = [((5,), torch.float32), ((3, 4), torch.float32), ((70_000,), torch.float32)]
    if rank == 0:
        with torch.inference_mode():
            data = [payload(0, 1, tag + i, s, d) for i, (s, d) in enumerate(shapes)]
        for _ in range(2):
            tf.send(data, 1).wait(T)
        return "sent"
    expect = [payload(0, 1, tag + i, s, d) for i, (s, d) in enumerate(shapes)]
    for inside in (True, False):
        with torch.inference_mode():
            into = [poisoned(s, d) for s, d in shapes]
        with torch.inference_mode(inside):
            tf.recv(into, 0).wait(T)
        for i, (got, want) in enumerate(zip(into, expect, strict=True)):
            assert got.is_inference() and same_bytes(got, want), (inside, i)
    return "ok"


def single_tensor_and_callbacks(rank: int, world: int) -> dict:
    """A bare tensor in, a bare tensor out; callbacks run off the caller's thread."""
    if rank == 1:
        time.sleep(0.3)  # rank 0 registers its callback before anything can arrive
        tf.send(payload(1, 0, 7, (64,), torch.float32), 0).wait(T)
        return {}
    if rank != 0:
        return {}
    seen = {}
    done = threading.Event()

    def callback(transfer: tf.Transfer) -> None:
        seen["thread"] = threading.current_thread().name
        seen["done"] = transfer.done()
        done.set()

    h_recv = tf.recv(tf.TensorSpec((64,), torch.float32), 1)
    h_recv.add_done_callback(callback)
    got = h_recv.result(T)
    assert done.wait(T)
    assert isinstance(got, torch.Tensor)
    assert same_bytes(got, payload(1, 0, 7, (64,), torch.float32))
    late = []
    h_recv.add_done_callback(lambda t: late.append(threading.current_thread().name))
    return {
        "callback_thread": seen["thread"],
        "caller_thread": threading.current_thread().name,
        "callback_saw_done": seen["done"],
        "late_callback_ran": late == [threading.current_thread().name],
        "repr": repr(h_recv),
    }


def ring_sendrecv(rank: int, world: int, rounds: int) -> str:
    """sendrecv with send_peer = rank+1 ≠ recv_peer = rank-1, several rounds back to back."""
    right, left = (rank + 1) % world, (rank - 1) % world
    handles = []
    for r in range(rounds):
        out = payload(rank, right, 100 + r, (1000 + r,), torch.float32)
        into = poisoned((1000 + r,), torch.float32)
        handles.append((tf.sendrecv(out, right, into, left), into, r))
    for h, into, r in handles:
        got = h.result(T)
        assert got is into
        assert same_bytes(into, payload(left, rank, 100 + r, (1000 + r,), torch.float32)), r
    return "ok"


def mixed_batch(rank: int, world: int, tag: int) -> int:
    """One batch: to every peer several sends, from every peer several receives."""
    recvs = []
    with tf.batch() as b:
        for peer in range(world):
            if peer == rank:
                continue
            sizes = [(16,), (3, 300), (70_000,)]  # the last is 273 KiB: sent alone
            b.send(
                [payload(rank, peer, tag + i, s, torch.float32) for i, s in enumerate(sizes)], peer
            )
            b.send(payload(rank, peer, tag + 50, (5,), torch.int32), peer)
            got = b.recv([tf.TensorSpec(s, torch.float32) for s in sizes], peer)
            into = poisoned((5,), torch.int32)
            got2 = b.recv(into, peer)
            assert got2 is into
            recvs.append((peer, sizes, got, into))
    b.wait(T)
    assert len(b.result()) == 2 * (world - 1)
    checked = 0
    for peer, sizes, got, into in recvs:
        for i, s in enumerate(sizes):
            assert same_bytes(got[i], payload(peer, rank, tag + i, s, torch.float32))
            checked += 1
        assert same_bytes(into, payload(peer, rank, tag + 50, (5,), torch.int32))
        checked += 1
    return checked


def many_small_batch(rank: int, world: int, count: int) -> str:
    """``count`` tensors of 4 KiB in one batch (the packed path) and as separate calls."""
    if rank > 1:
        return "idle"
    peer = 1 - rank
    if rank == 0:
        with tf.batch() as b:
            for i in range(count):
                b.send(payload(0, 1, 1000 + i, (1024,), torch.float32), 1)
        b.wait(T)
        hs = [tf.send(payload(0, 1, 3000 + i, (1024,), torch.float32), 1) for i in range(count)]
        for h in hs:
            h.wait(T)
        return "sent"
    into = [poisoned((1024,), torch.float32) for _ in range(count)]
    with tf.batch() as b:
        for t in into:
            b.recv(t, peer)
    b.wait(T)
    into2 = [poisoned((1024,), torch.float32) for _ in range(count)]
    hs = [tf.recv(t, peer) for t in into2]
    for h in hs:
        h.wait(T)
    for i in range(count):
        assert same_bytes(into[i], payload(0, 1, 1000 + i, (1024,), torch.float32)), i
        assert same_bytes(into2[i], payload(0, 1, 3000 + i, (1024,), torch.float32)), i
    return "ok"


def _layout(rank: int, peer: int, tag: int, unaligned: bool) -> list[torch.Tensor]:
    """Small tensors of two dtypes (packed) around one large one (sent alone); ``unaligned``
    puts a float32 at an odd byte offset of the packed part."""
    specs = [((256,), torch.float32)] * 40 + [((70_000,), torch.float32)]
    specs += [((5,), torch.bfloat16)] * 3
    if unaligned:
        specs = [((17,), torch.uint8), ((3,), torch.float32), *specs]
    return [payload(rank, peer, tag * 100 + i, s, d) for i, (s, d) in enumerate(specs)]


def repeated_layouts(rank: int, world: int, rounds: int) -> str:
    """Ranks 0 and 1 swap the same layouts round after round, fresh data each time: through
    ``sendrecv`` one round and separate calls the next (another CUDA stream), twice in one batch
    (one group), and with a layout whose packed tensors sit at unaligned offsets."""
    if rank > 1:
        return "idle"
    peer = 1 - rank
    for r in range(rounds):
        for unaligned in (False, True):
            tag = 2 * r + unaligned
            into = [poisoned(t.shape, t.dtype) for t in _layout(peer, rank, tag, unaligned)]
            mine = _layout(rank, peer, tag, unaligned)
            if r % 2 == 0:
                tf.sendrecv(mine, peer, into, peer).wait(T)
            else:
                received = tf.recv(into, peer)
                tf.send(mine, peer).wait(T)
                received.wait(T)
            want = _layout(peer, rank, tag, unaligned)
            assert all(same_bytes(a, b) for a, b in zip(into, want, strict=True)), (r, unaligned)
    # Two messages of one layout in one group: they must not share a packing buffer.
    into = [[poisoned(t.shape, t.dtype) for t in _layout(peer, rank, 0, False)] for _ in "ab"]
    with tf.batch() as b:
        for i, target in enumerate(into):
            b.send(_layout(rank, peer, 500 + i, False), peer)
            b.recv(target, peer)
    b.wait(T)
    for i, target in enumerate(into):
        want = _layout(peer, rank, 500 + i, False)
        assert all(same_bytes(a, b) for a, b in zip(target, want, strict=True)), i
    return "ok"


def views_of_one_buffer(rank: int, world: int, count: int) -> str:
    """Rank 0 sends rank 1 ``count`` messages, each a view of one buffer, into views of one
    buffer: where both sides' views follow one another the copies of a step may go as one.
    Rounds: a batch in order; a batch into the views in reverse order; separate sends whose
    receives were all posted first; views with a gap between them. Random payloads, every
    byte checked."""
    if rank > 1:
        return "idle"
    n = 1024
    arena = torch.empty(count * (n + 8), device=D())
    packed = list(arena[: count * n].view(count, n).unbind(0))
    gapped = [arena[i * (n + 8) : i * (n + 8) + n] for i in range(count)]
    rounds = {"batch": packed, "reversed": packed, "separate": packed, "gaps": gapped}
    for r, (how, views) in enumerate(rounds.items()):
        wanted = [payload(0, 1, 7000 + 100 * r + i, (n,), torch.float32) for i in range(count)]
        if rank == 0:
            for view, want in zip(views, wanted, strict=True):
                view.copy_(want)
            _move_views(views, sending=True, separate=how == "separate")
            continue
        arena.view(torch.uint8).fill_(0xA5)
        into = views[::-1] if how == "reversed" else views
        _move_views(into, sending=False, separate=how == "separate")
        pairs = enumerate(zip(into, wanted, strict=True))
        wrong = [i for i, (view, want) in pairs if not same_bytes(view, want)]
        assert not wrong, f"{how}: wrong bytes in messages {wrong}"
    return "sent" if rank == 0 else "ok"


def _move_views(views: list[torch.Tensor], *, sending: bool, separate: bool) -> None:
    """Rank 0 sends ``views`` to rank 1 (``sending``), rank 1 receives them: as one batch, or
    in separate calls, the sends only once the receiver said (one element) that it posted
    every receive."""
    peer = 1 if sending else 0
    if not separate:
        with tf.batch() as b:
            for view in views:
                b.send(view, peer) if sending else b.recv(view, peer)
        b.wait(T)
        return
    if sending:
        tf.recv(torch.empty(1, device=D()), peer).wait(T)
        handles = [tf.send(view, peer) for view in views]
    else:
        handles = [tf.recv(view, peer) for view in views]
        tf.send(torch.ones(1, device=D()), peer).wait(T)
    for handle in handles:
        handle.wait(T)


def all_gather(rank: int, world: int, stacked: bool, in_place: bool = False) -> str:
    """``in_place``: ``inp`` is this rank's own row of ``out``."""
    shape = (3, 5)
    inp = payload(rank, rank, 77, shape, torch.float32)
    out = poisoned((world, *shape) if stacked else (world * 15,), torch.float32)
    if in_place:
        own = out.view(world, *shape)[rank]
        own.copy_(inp)
        inp = own if stacked else out[rank * 15 : (rank + 1) * 15]
    result = tf.ring_all_gather(out, inp).result(T)
    assert result is out
    rows = out.view(world, *shape)
    for r in range(world):
        assert same_bytes(rows[r].contiguous(), payload(r, r, 77, shape, torch.float32)), r
    return "ok"


def all_gather_matches_torch(rank: int, world: int, numel: int, dtype_name: str) -> str:
    """``tf.ring_all_gather`` against ``torch.distributed.all_gather_into_tensor`` on the default
    process group, byte for byte (on CPU copies when that group is gloo). Needs
    ``torch.distributed`` initialised (the torchrun suite)."""
    import torch.distributed as dist

    dtype = getattr(torch, dtype_name)
    inp = payload(rank, rank, 88, (numel,), dtype)
    out = poisoned((world * numel,), dtype)
    tf.ring_all_gather(out, inp).wait(T)
    on_cpu = dist.get_backend() != "nccl"
    ref_inp = inp.cpu() if on_cpu else inp
    ref = torch.empty(world * numel, dtype=dtype, device=ref_inp.device)
    dist.all_gather_into_tensor(ref, ref_inp)
    assert same_bytes(out.cpu(), ref.cpu()), "ring all-gather differs from torch's"
    return "ok"


def disjoint_pairs_both_ways(rank: int, world: int, numel: int, rounds: int) -> str:
    """Ranks (0, 1), (2, 3), …: every pair swaps a message both ways at once (``sendrecv``), all
    pairs at the same time; a rank without a partner idles."""
    partner = rank ^ 1
    if partner >= world:
        return "idle"
    for step in range(rounds):
        out = payload(rank, partner, 91 + step, (numel,), torch.float32)
        got = poisoned((numel,), torch.float32)
        tf.sendrecv(out, partner, got, partner).wait(T)
        assert same_bytes(got, payload(partner, rank, 91 + step, (numel,), torch.float32)), step
    return "ok"


# ---------------------------------------------------------------------- static and mismatch
def static_channel(rank: int, world: int, steps: int, transport: str = "auto") -> str:
    if rank > 1:
        return "idle"
    for step in range(steps):
        data = payload(0, 1, 500 + step, (4, 4), torch.float32)
        if rank == 0:
            tf.send(data, 1, static=True, transport=transport).wait(T)
        else:
            got = tf.recv(tf.TensorSpec((4, 4)), 0, static=True, transport=transport).result(T)
            assert same_bytes(got, data), step
    return "ok"


_SETUP_LOCK = threading.Lock()  # one pair set-up at a time in this process


def packed_ping_pong(rank: int, world: int, rounds: int) -> str:
    """Ranks 0 and 1 swap a static message of 64 small tensors (packed), fresh data each round,
    as fast as the bench's ping-pong: sends not waited for, each receive's stream ordering only
    (``wait_stream``), so the library's own threads complete and issue some. Every round into
    buffers of its own, checked byte for byte at the end."""
    if rank > 1:
        return "idle"
    peer = 1 - rank
    shape, dtype = (1024,), torch.float32
    outs = [
        [payload(rank, peer, 64 * r + i, shape, dtype) for i in range(64)] for r in range(rounds)
    ]
    intos = [[poisoned(shape, dtype) for _ in range(64)] for _ in range(rounds)]
    handles = []
    for r in range(rounds):
        for sending in (rank == 0, rank != 0):
            if sending:
                handles.append(tf.send(outs[r], peer, static=True))
            else:
                handles.append(tf.recv(intos[r], peer, static=True))
                handles[-1].wait_stream()
    for h in handles:
        h.wait(T)
    for r, into in enumerate(intos):
        for i, t in enumerate(into):
            assert same_bytes(t, payload(peer, rank, 64 * r + i, shape, dtype)), (r, i)
    return "ok"


def reply_awaited_beside_an_unwaited_send(rank: int, world: int, rounds: int) -> list | str:
    """Rank 0 sends without waiting, then waits for rank 1's reply (a stage that hands its
    output on and waits for what comes back). The receiver's post of each send may come while
    rank 0 waits for the reply: that wait must issue the send, not leave it to the idle-pair
    watcher (milliseconds later). Returns the names of the threads that issued rank 0's
    sends; every byte is checked."""
    if rank > 1:
        return "idle"
    from tensorferry.p2p import _context

    peer = 1 - rank
    shape, dtype = (1024,), torch.float32
    ctx = _context.current()
    route = type(ctx.route(ctx.choose("auto", peer, (torch.empty(0, device=D()),))))
    issuers: list[str] = []
    write = route.write

    def recorded(self, pair, sends):
        issuers.append(threading.current_thread().name)
        return write(self, pair, sends)

    route.write = recorded
    try:
        for r in range(rounds):
            out, into = payload(rank, peer, r, shape, dtype), poisoned(shape, dtype)
            if rank == 0:
                sent = tf.send(out, peer)
                tf.recv(into, peer).wait(T)
                sent.wait(T)
            else:
                time.sleep(0.005)  # the post comes while rank 0 waits for the reply
                tf.recv(into, peer).wait(T)
                tf.send(out, peer).wait(T)
            assert same_bytes(into, payload(peer, rank, r, shape, dtype)), r
    finally:
        route.write = write
    return sorted(set(issuers))


def reset_after_an_unwaited_send(rank: int, world: int, tag: int) -> str:
    """Rank 0 sends without waiting, rank 1 receives, and both reset the pair (as a benchmark
    does between its variants). The reset ends the send, done (its bytes went), and the pair
    carries the next message. A send left open across a reset used to outlive the resources
    of its epoch: on the copy-engine route its next look read the shared page the reset had
    let go of, and raised."""
    if rank > 1:
        return "idle"
    peer = 1 - rank
    shape, dtype = (1024,), torch.float32
    into = poisoned(shape, dtype)
    if rank == 0:
        sent = tf.send(payload(rank, peer, tag, shape, dtype), peer)
    else:
        tf.recv(into, peer).wait(T)
        assert same_bytes(into, payload(peer, rank, tag, shape, dtype))
    tf._api._reset_pair(peer, timeout=T)
    if rank == 0:
        assert sent.done(), "the reset left the unwaited send open"
        assert sent.exception(0) is None, sent.exception(0)
    into = poisoned(shape, dtype)
    out = payload(rank, peer, tag + 1, shape, dtype)
    tf.sendrecv(out, peer, into, peer).wait(T)
    assert same_bytes(into, payload(peer, rank, tag + 1, shape, dtype))
    return "ok"


_busy_runs = itertools.count()  # (both ranks run the case alike: their counts agree)


def calls_return_while_the_device_is_busy(rank: int, world: int, count: int) -> dict | str:
    """Rank 1's current stream sleeps about two seconds (a kernel) while rank 0 sends ``count``
    4 KiB messages and rank 1 receives them, neither waiting on the host: each post waits for
    that stream, so nothing moves meanwhile. A pair's stream took about 1020 operations before
    the call queueing the next one blocked inside the driver, holding the GIL, until the kernel
    ended; a message now waits for room instead, and the calls return at once on both ranks.
    Returns the seconds the calls took and the kernel's; every byte is then checked."""
    if rank > 1:
        return "idle"
    peer, shape, dtype = 1 - rank, (1024,), torch.float32
    # Rows of one buffer each side: one allocation, whose handle and mapping the warm-up below
    # makes (making them waits for the device, which the calls timed here must not).
    mine = torch.stack([payload(rank, peer, i, shape, dtype) for i in range(count)]).unbind()
    arena = poisoned((count, *shape), dtype)
    into = arena.unbind()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10**8)
    end.record()
    end.synchronize()
    per_second = 10**8 / (start.elapsed_time(end) / 1e3)  # the sleeping kernel's cycles
    tf._api._reset_pair(peer, timeout=T)  # both start together, on a fresh pair
    warm = tf.recv(into[0], peer) if rank == 1 else tf.send(mine[0], peer)
    warm.wait(T)  # the pair's pages, its allocations' handles and mappings
    arena.view(torch.uint8).fill_(0xA5)
    torch.cuda.synchronize()
    ctx = tf._context.current()
    tf._api._meet(ctx, f"cases/busy/{next(_busy_runs)}", peer, T)  # both start together
    began = time.monotonic()
    if rank == 1:
        start.record()
        torch.cuda._sleep(int(2.0 * per_second))
        end.record()
        handles = [tf.recv(t, peer) for t in into]
    else:
        handles = [tf.send(t, peer) for t in mine]
    calls = time.monotonic() - began
    for handle in handles:
        handle.wait(T)
    torch.cuda.synchronize()
    for i, got in enumerate(into if rank == 1 else ()):
        assert same_bytes(got, payload(peer, rank, i, shape, dtype)), f"message {i}"
    kernel = start.elapsed_time(end) / 1e3 if rank == 1 else None
    return {"calls": calls, "kernel": kernel}


def contexts_on_other_devices(rank: int, world: int) -> list[int]:
    """The other CUDA devices on which this rank's process has a context. Each process moves
    tensors of its own device only; a context elsewhere (made when a thread of the library's
    issued with another device current, say) costs hundreds of MiB of that device's memory."""
    own = D().index
    others = [i for i in range(torch.cuda.device_count()) if i != own]
    return [i for i in others if torch._C._cuda_hasPrimaryContext(i)]


def fails_after_leaving_a_send_in_flight(rank: int, world: int) -> None:
    """Rank 0 leaves a send its peer never receives and raises (a case that failed midway)."""
    if rank == 0:
        tf.send(torch.ones(4, device=D()), 1, timeout=60)
        raise RuntimeError("failed on purpose")


def mismatch(rank: int, world: int, kind: str) -> str | None:
    """Sender and receiver disagree on ``kind`` (a field, and what differs in it); returns the
    field each side saw."""
    if rank > 1:
        return None
    send = [torch.zeros(4, device=D()), torch.ones(2, device=D())]
    recv = [torch.zeros(4, device=D()), torch.ones(2, device=D())]
    if kind == "count":
        recv = recv[:1]
    elif kind == "dtype":
        recv[1] = torch.ones(2, dtype=torch.float64, device=D())
    elif kind == "shape":
        recv[0] = torch.zeros(5, device=D())
    elif kind == "shape, a large receive":  # (gloo: a receive posted alone, then withdrawn)
        recv[0] = torch.zeros(1 << 18, device=D())
    elif kind == "shape, a large send":  # (gloo: more bytes than the receive posted)
        send[0] = torch.zeros(1 << 18, device=D())
    poison = [r.clone() for r in recv]
    try:
        if rank == 0:
            tf.send(send, 1).wait(T)
        else:
            tf.recv(recv, 0).wait(T)
    except MismatchError as exc:
        if rank == 1:
            assert all(torch.equal(r, p) for r, p in zip(recv, poison, strict=True)), "wrote"
        return exc.field
    raise AssertionError("no MismatchError")


def transports_differ(rank: int, world: int, senders: str) -> tuple | None:
    """Rank 0 sends over ``senders`` transport, rank 1 receives over the other one ("ce" or
    "nccl"), both with a 3 s timeout; returns each side's error, whether it came well before
    the timeout, whether it names the transport, and whether the pair then moves a message."""
    if rank > 1:
        return None
    theirs = {"ce": "nccl", "nccl": "ce"}
    buffer = torch.zeros(16, device=D())
    poison = buffer.clone()
    started = time.monotonic()
    try:
        if rank == 0:
            tf.send(torch.ones(16, device=D()), 1, transport=senders, timeout=3).wait(T)
        else:
            tf.recv(buffer, 0, transport=theirs[senders], timeout=3).wait(T)
        return ("no error",)
    except (MismatchError, TransferTimeoutError) as exc:
        error, seconds = exc, time.monotonic() - started
    assert torch.equal(buffer, poison), "bytes landed"
    return (
        type(error).__name__,
        seconds < 2,
        "transport" in str(error),
        send_recv_all_dtypes(rank, world, 90),
    )


# ---------------------------------------------------------------------- validation
# How many calls bad_arguments makes everywhere, and how many more where a rank has another
# GPU to misuse.
BAD_CALLS = 33
BAD_CALLS_WITH_ANOTHER_GPU = 2


def _sparse_csr() -> torch.Tensor:
    with warnings.catch_warnings():  # torch warns that its CSR support is in beta
        warnings.simplefilter("ignore", UserWarning)
        return torch.eye(4, device=D()).to_sparse_csr()


def bad_arguments(rank: int, world: int) -> list[str]:
    """Every bad call raises TypeError/ValueError before anything moves."""
    peer = (rank + 1) % world
    x = torch.zeros(4, device=D())
    calls = {
        "self": lambda: tf.send(x, rank),
        "out of range": lambda: tf.send(x, world),
        "negative": lambda: tf.recv(x, -1),
        "bool peer": lambda: tf.send(x, True),
        "str peer": lambda: tf.send(x, "1"),
        "non-contiguous": lambda: tf.send(torch.zeros(4, 4, device=D()).t(), peer),
        "empty list": lambda: tf.send([], peer),
        "not a tensor": lambda: tf.send([x, 3], peer),
        "numpy": lambda: tf.send(x.numpy(), peer),
        "spec shape": lambda: tf.recv(tf.TensorSpec("abc"), peer),
        "cpu on nccl": lambda: tf.send(torch.zeros(4), peer, transport="nccl"),
        "unknown transport": lambda: tf.send(x, peer, transport="pigeon"),
        "static not bool": lambda: tf.send(x, peer, static=1),
        "bad timeout": lambda: tf.send(x, peer, timeout=-1),
        "infinite timeout": lambda: tf.recv(x, peer, timeout=float("inf")),
        "nan timeout": lambda: tf.send(x, peer, timeout=float("nan")),
        "empty batch": lambda: tf.batch().__enter__().__exit__(None, None, None),
        "gather shape": lambda: tf.ring_all_gather(
            torch.zeros(3, device=D()), torch.zeros(2, device=D())
        ),
        "gather input inside out, misplaced": lambda: _gather_misplaced(world),
        "gather dtype": lambda: tf.ring_all_gather(
            torch.zeros(world * 2, dtype=torch.int32, device=D()), torch.zeros(2, device=D())
        ),
        "meta device": lambda: tf.send(torch.zeros(2, device="meta"), peer),
        # A message whose odd tensor comes late: the one-pass check hands it to the detailed one.
        "non-contiguous last": lambda: tf.send([x, x, torch.zeros(4, 4, device=D()).t()], peer),
        "receive into a non-contiguous buffer": lambda: tf.recv(
            [x, torch.zeros(4, 4, device=D()).t()], peer
        ),
        "devices mixed": lambda: tf.send([x, x, torch.zeros(2, device="meta")], peer),
        "sparse": lambda: tf.send([x, torch.eye(4, device=D()).to_sparse()], peer),
        "sparse csr": lambda: tf.send(_sparse_csr(), peer),
        # Receiving into memory the same call sends from, or receives into twice: garbled.
        "exchange in place": lambda: tf.sendrecv(x, peer, x, peer),
        "one buffer twice": lambda: tf.recv([x, x], peer),
        "receive views that overlap": lambda: tf.recv([x[:3], x[2:]], peer),
        "batch shift in place": lambda: _batch_shift_in_place(x, peer, (rank - 1) % world),
        # Views whose conjugation or negation is a flag: their bytes are not their values.
        "conjugate view": lambda: tf.send(
            torch.ones(4, dtype=torch.complex64, device=D()).conj(), peer
        ),
        "negative view last": lambda: tf.send([x, x, torch._neg_view(x)], peer),
        "receive into a conjugate view": lambda: tf.recv(
            [torch.zeros(1, dtype=torch.complex64, device=D()).conj(), x], peer
        ),
    }
    if D().type == "cuda" and torch.cuda.device_count() > 1:
        other = torch.device("cuda", (D().index + 1) % torch.cuda.device_count())
        calls["other rank's device"] = lambda: tf.send(torch.zeros(4, device=other), peer)
        calls["gpu on gloo"] = lambda: tf.send(x, peer, transport="gloo")
    outcomes = []
    for name, call in calls.items():
        try:
            call()
        except (TypeError, ValueError) as exc:
            outcomes.append(f"{name}: {type(exc).__name__}")
            continue
        raise AssertionError(f"{name}: no error")
    return outcomes


def _gather_misplaced(world: int) -> None:
    out = torch.zeros(world * 4, device=D())
    tf.ring_all_gather(out, out[1:5])  # overlaps rows 0 and 1: no rank's row


def _batch_shift_in_place(x: torch.Tensor, right: int, left: int) -> None:
    try:
        with tf.batch() as b:
            b.send(x, right)
            b.recv(x[1:], left)  # a view of what it sends
    except ValueError as exc:  # the error names both entries
        text = str(exc)
        assert text.startswith(f"batch entry 1 (recv from rank {left}) tensors[0] shares"), text
        assert f"with batch entry 0 (send to rank {right}) tensors[0]" in text, text
        raise


# ---------------------------------------------------------------------- faults
def timeout_unmatched(
    rank: int, world: int, transport: str = "auto", side: str = "send"
) -> float | tuple:
    """One rank calls, its peer does not: TransferTimeoutError within the timeout. ``side``:
    ``"send"`` (rank 0 sends to rank 1) or ``"recv"`` (rank 1 receives from rank 0). Returns
    the caller's seconds to the error.

    The peer makes its side of the message only after that (late): it fails at once, as its
    counterpart did, rather than wait for (or take) the caller's next message. It returns
    ``(error class name, seconds to the error)``; the other ranks return 0.0."""
    caller = 0 if side == "send" else 1
    if rank > 1:
        return 0.0
    x = torch.ones(8, device=D())
    if rank != caller:
        time.sleep(1.6)  # past the caller's timeout, and its fault notice on the way
        t0 = time.monotonic()
        if side == "send":
            h = tf.recv(tf.TensorSpec((8,)), 0, timeout=5.0, transport=transport)
        else:
            h = tf.send(x, 1, timeout=5.0, transport=transport)
        try:
            h.wait()
        except TensorFerryError as exc:
            return type(exc).__name__, time.monotonic() - t0
        return "completed", time.monotonic() - t0
    t0 = time.monotonic()
    if side == "send":
        h = tf.send(x, 1, timeout=1.0, transport=transport)
    else:
        h = tf.recv(tf.TensorSpec((8,)), 0, timeout=1.0, transport=transport)
    try:
        h.wait()
    except TransferTimeoutError:
        return time.monotonic() - t0
    raise AssertionError("no TransferTimeoutError")


def both_send_unmatched(rank: int, world: int) -> tuple | str:
    """Ranks 0 and 1 send to each other at one instant and neither receives: both sends time
    out, and both ranks start a fault at about once, so their notices may cross. Each rank's
    late receive of the other's send then fails at once, as that send did. Returns ``(the
    send's error, the late receive's error, its seconds)``."""
    if rank > 1:
        return "idle"
    peer = 1 - rank
    time.sleep(max(0.0, _common_instant() - time.time()))
    sent = tf.send(torch.ones(8, device=D()), peer, timeout=1.0)
    try:
        sent.wait()
        send_outcome = "completed"
    except TensorFerryError as exc:
        send_outcome = type(exc).__name__
    time.sleep(0.3)  # both notices arrive
    t0 = time.monotonic()
    try:
        tf.recv(tf.TensorSpec((8,)), peer, timeout=5.0).wait()
        late = "completed"
    except TensorFerryError as exc:
        late = type(exc).__name__
    return send_outcome, late, time.monotonic() - t0


def _common_instant() -> float:
    """A wall-clock instant every rank of a case derives alike: the next whole second at
    least half a second away (the ranks' clocks are one machine's)."""
    return float(int(time.time() + 1.5))


def send_after_unmatched_to_an_idle_peer(rank: int, world: int) -> str:
    """Rank 0's send times out while rank 1 is busy elsewhere, and rank 0 sends again at once:
    that message waits for rank 1 to answer the fault. Rank 1 then receives twice: the first
    receive fails at once (its send failed), the second gets the second send's bytes."""
    if rank > 1:
        return "idle"
    if rank == 0:
        try:
            tf.send(payload(0, 1, 1, (8,), torch.float32), 1, timeout=1.0).wait()
            return "first send completed"
        except TransferTimeoutError:
            pass
        tf.send(payload(0, 1, 2, (8,), torch.float32), 1, timeout=10.0).wait()
        return "ok"
    time.sleep(1.8)
    try:
        tf.recv(tf.TensorSpec((8,)), 0, timeout=5.0).wait()
        return "first receive completed"
    except TransferTimeoutError:
        pass
    got = tf.recv(tf.TensorSpec((8,)), 0, timeout=5.0).result(10.0)
    return "ok" if same_bytes(got, payload(0, 1, 2, (8,), torch.float32)) else "wrong bytes"


def _receive_from_rank_0(tags) -> list[str]:
    """Rank 1 receives rank 0's 8-float payload of each tag in turn: each one's outcome."""
    outcomes = []
    for tag in tags:
        try:
            got = tf.recv(tf.TensorSpec((8,)), 0, timeout=5.0).result(10.0)
            right = same_bytes(got, payload(0, 1, tag, (8,), torch.float32))
            outcomes.append("ok" if right else "wrong bytes")
        except TensorFerryError as exc:
            outcomes.append(type(exc).__name__)
    return outcomes


def sends_that_time_out_while_the_peer_is_idle(rank: int, world: int) -> list[str]:
    """Rank 0's first send times out while rank 1 is busy elsewhere; its second, sent at once
    with a short timeout, times out too while waiting for rank 1 to answer that fault; its
    third waits long enough. Rank 1 then receives three times: the first two fail at once
    (their sends failed), the third gets the third send's bytes. Returns each call's outcome."""
    if rank > 1:
        return []
    outcomes = []
    if rank == 0:
        for tag, timeout in ((1, 1.0), (2, 0.5), (3, 10.0)):
            try:
                tf.send(payload(0, 1, tag, (8,), torch.float32), 1, timeout=timeout).wait()
                outcomes.append("ok")
            except TensorFerryError as exc:
                outcomes.append(type(exc).__name__)
        return outcomes
    time.sleep(2.5)
    return outcomes + _receive_from_rank_0((1, 2, 3))


def failed_while_frozen_then_idle(rank: int, world: int) -> list:
    """Rank 0's send times out while rank 1 is busy elsewhere (a fault: rank 0 waits for rank
    1's answer), its second send times out while waiting for that answer, and then rank 0
    makes no more calls for a while (as at a barrier of another library). Rank 1 then receives
    twice: both receives must fail promptly. The second needs rank 0 to read rank 1's answer
    while idle and say that it failed one more send. Returns rank 1's ``(outcome, seconds)``
    per receive."""
    if rank > 1:
        return []
    if rank == 0:
        for tag, timeout in ((1, 1.0), (2, 0.3)):
            with contextlib.suppress(TransferTimeoutError):
                tf.send(payload(0, 1, tag, (8,), torch.float32), 1, timeout=timeout).wait()
        time.sleep(5.0)
        return []
    time.sleep(2.0)
    outcomes = []
    for _ in range(2):
        t0 = time.monotonic()
        try:
            tf.recv(tf.TensorSpec((8,)), 0, timeout=4.0).result(10.0)
            outcome = "ok"
        except TensorFerryError as exc:
            outcome = type(exc).__name__
        outcomes.append((outcome, round(time.monotonic() - t0, 2)))
    return outcomes


def _outcome_of(step: Any) -> str:
    """``"ok"``, or the class name of the library error ``step()`` raised."""
    try:
        step()
        return "ok"
    except TensorFerryError as exc:
        return type(exc).__name__


def ring_all_gathers_beside_other_calls(rank: int, world: int) -> list[str]:
    """Every rank makes the same calls: two all-gathers, then a ``sendrecv`` with its
    neighbours; rank 0 first works a while (then polls ``done()``) and waits for the second
    all-gather before the first. A step went out when its ring was next polled, so each rank
    numbered its steps at different points among its other calls: rows of one gather landed
    in the other and in the ``sendrecv``, with no error. Returns what was wrong, if anything."""
    n = 256
    first, second = torch.zeros(world, n, device=D()), torch.zeros(world, n, device=D())
    a = tf.ring_all_gather(first, torch.full((n,), rank + 1.0, device=D()))
    b = tf.ring_all_gather(second, torch.full((n,), -rank - 1.0, device=D()))
    if rank == 0:
        time.sleep(0.3)
        a.done()
    exchanged = tf.sendrecv(
        torch.full((n,), 100.0 + rank, device=D()),
        (rank + 1) % world,
        torch.zeros(n, device=D()),
        (rank - 1) % world,
    )
    for ring in (b, a) if rank == 0 else (a, b):
        ring.wait(T)
    got = exchanged.result(T)
    rows = torch.arange(1, world + 1, dtype=torch.float32, device=D())
    wrong = []
    if not torch.equal(first[:, 0], rows) or not torch.equal(second[:, 0], -rows):
        wrong.append(f"gathered {first[:, 0].tolist()} and {second[:, 0].tolist()}")
    if float(got[0]) != 100.0 + (rank - 1) % world:
        wrong.append(f"the sendrecv got {float(got[0])}")
    return wrong


def timeouts_past_any_need(rank: int, world: int) -> list[str]:
    """A call's timeout of 1e15 s (or 1e300) is taken as one long enough for anything: gloo
    refused it mid-transfer ("Python int too large to convert to C int") and the pair
    faulted. A ring all-gather's ``wait()`` lasts as long as its steps keep their timeouts:
    rank 2 moves the ring on late, each step well within 2 s, the whole beyond 3 s (it
    stopped at the first step's deadline with a TypeError). Returns each step's outcome."""
    peer = (rank + 1) % world
    outcomes = []
    sent = payload(rank, peer, 1, (8,), torch.float32)
    got = tf.sendrecv(sent, peer, tf.TensorSpec((8,)), (rank - 1) % world, timeout=1e15)
    expected = payload((rank - 1) % world, rank, 1, (8,), torch.float32)
    outcomes.append("ok" if same_bytes(got.result(timeout=1e300), expected) else "wrong bytes")
    out = torch.full((world, 2), -1.0)
    if rank == 2:
        time.sleep(1.2)
    ring = tf.ring_all_gather(out, torch.full((2,), float(rank)), timeout=2)
    if rank == 2:
        time.sleep(1.2)
    ring.wait()
    rows = [float(v) for v in out[:, 0]]
    outcomes.append("ok" if rows == [float(r) for r in range(world)] else f"rows {rows}")
    with tf.batch() as group:  # not submitted yet: asking how it failed is a mistake
        group.send(sent, peer)
        try:
            group.exception(1)
            outcomes.append("exception() answered inside the block")
        except RuntimeError:
            outcomes.append("ok")
        group.recv(tf.TensorSpec((8,)), (rank - 1) % world)
    group.wait(T)
    return outcomes


def receive_right_after_the_peer_timed_out(rank: int, world: int) -> list[str]:
    """Rank 0's receive times out while rank 1 makes no call; gloo closes the pair's connection
    then, before rank 0's fault notice leaves. Rank 1 receives 1 ms after that timeout, before
    its idle-pairs watcher (every 20 ms) may have read the notice: its post found the
    connection closed and failed with "connection closed by peer", a fault of its own, instead
    of rank 0's timeout. Returns each step's outcome (an error by its class)."""
    if rank > 1:
        return []
    timed_out_at = _common_instant() + 1.0
    if rank == 0:
        tf.send(payload(0, 1, 1, (8,), torch.float32), 1).wait(T)
        left = timed_out_at - time.time()
        outcomes = [_outcome_of(lambda: tf.recv(tf.TensorSpec((8,)), 1, timeout=left).wait())]
        time.sleep(1.0)
        for tag in (2, 3):
            sent = payload(0, 1, tag, (8,), torch.float32)
            outcomes.append(_outcome_of(lambda sent=sent: tf.send(sent, 1).wait(T)))
        return outcomes
    tf.recv(tf.TensorSpec((8,)), 0).wait(T)
    time.sleep(max(0.0, timed_out_at + 0.001 - time.time()))
    outcomes = []
    for tag in (2, 3):

        def receive(tag: int = tag) -> None:
            got = tf.recv(tf.TensorSpec((8,)), 0, timeout=5.0).result(T)
            assert same_bytes(got, payload(0, 1, tag, (8,), torch.float32)), tag

        outcomes.append(_outcome_of(receive))
    # The send rank 0's timed-out receive was for: failed in the fault, at once (and the pair's
    # calls are even again for the cases after this one).
    late = payload(1, 0, 1, (8,), torch.float32)
    outcomes.append(_outcome_of(lambda: tf.send(late, 0, timeout=5.0).wait(T)))
    return outcomes


def _swap_rows(rank: int) -> None:
    """A ``sendrecv`` of one row with the other rank of a pair (0 and 1), its bytes checked."""
    mine, theirs = payload(rank, 1 - rank, 3, (8,), torch.float32), torch.full((8,), -1.0)
    tf.sendrecv(mine, 1 - rank, theirs, 1 - rank).wait(T)
    assert same_bytes(theirs, payload(1 - rank, rank, 3, (8,), torch.float32))


def a_timeout_beside_a_longer_receive(rank: int, world: int) -> list[str]:
    """Rank 0 posts a receive with a long timeout, then one with 0.25 s, from a rank 1 that
    makes no call until both ended, and waits for the short one, or for the long one with a
    shorter ``wait(timeout)`` (a waiter thread waits in gloo) or with none (this thread waits
    in gloo). The short one's timeout fails both, each with ``TransferTimeoutError``, at once:
    gloo closes the pair when a wait times out, and the long one's wait failing on the closed
    pair ("pair closure") was taken for a transport error, the pair's fault with it, on both
    sides; and a ``wait(timeout)`` whose message a fault ended waited out its timeout. Rank 1's
    two sends then fail at once with rank 0's error; a ``sendrecv`` after them goes through.
    Returns each step's outcomes."""
    from tensorferry.p2p import _context

    if rank > 1:
        return []
    store = _context.current().store
    outcomes = []
    for step in range(6):
        ended = f"cases/{next(_STORE_KEYS)}/ended"
        if rank == 0:
            long = tf.recv(tf.TensorSpec((8,)), 1, timeout=30.0)
            short = tf.recv(tf.TensorSpec((8,)), 1, timeout=0.25)
            first, second = (short, long) if step % 3 == 0 else (long, short)
            wait_s = None if step % 3 == 2 else T
            outcomes += [_outcome_of(lambda t=t, s=wait_s: t.wait(s)) for t in (first, second)]
            store.set(ended, "1")
        else:
            store.wait([ended])
            for tag in (1, 2):
                sent = payload(1, 0, tag, (8,), torch.float32)
                outcomes.append(_outcome_of(lambda sent=sent: tf.send(sent, 0, timeout=5).wait(T)))
        outcomes.append(_outcome_of(lambda: _swap_rows(rank)))
    return outcomes


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def messages_of_ever_new_sizes(rank: int, world: int) -> int:
    """Rank 0 sends rank 1 600 messages of one tensor each, every one of a size not sent
    before (80 to 248 KB: variable-length batches), from and into views of one buffer, each
    received byte checked. Returns how many bytes this rank's resident memory grew by: the
    pair kept a head for reuse of every size it had seen (about 100 MB each side here)."""
    if rank > 1:
        return 0
    sizes = [20000 + 70 * i for i in range(600)]
    buffer = torch.empty(max(sizes))
    tf.sendrecv(torch.ones(1), 1 - rank, torch.empty(1), 1 - rank).wait(T)  # the pair is made
    before = _resident_bytes()
    for i, numel in enumerate(sizes):
        view = buffer[:numel]
        if rank == 0:
            view.fill_(float(i))
            tf.send(view, 1).wait(T)
        else:
            view.fill_(-1.0)
            tf.recv(view, 0).wait(T)
            assert bool((view == float(i)).all()), i
    return _resident_bytes() - before


def reset_right_after_a_fault(rank: int, world: int) -> list[str]:
    """Rank 0's send times out while rank 1 is idle, and both reset the pair at once (the
    uncached benchmark's step): rank 1 reads the fault's notice only inside its reset. Both
    resets must end, and the pair then work: rank 1's first receive fails at once (it was for
    the failed send), its second gets rank 0's next send. Returns each step's outcome."""
    from tensorferry.p2p import _api

    if rank > 1:
        return []
    outcomes = []
    if rank == 0:
        with contextlib.suppress(TransferTimeoutError):
            tf.send(payload(0, 1, 1, (8,), torch.float32), 1, timeout=0.5).wait()
            outcomes.append("first send completed")
    else:
        time.sleep(1.0)
    try:
        _api._reset_pair(1 - rank, timeout=5.0)
        outcomes.append("reset")
    except Exception as exc:  # reported: the pair may be stuck
        outcomes.append(f"reset failed: {type(exc).__name__}")
        return outcomes
    if rank == 0:
        tf.send(payload(0, 1, 2, (8,), torch.float32), 1, timeout=5.0).wait()
        return [*outcomes, "ok"]
    return outcomes + _receive_from_rank_0((1, 2))


def wait_timeout_then_complete(rank: int, world: int) -> str:
    """wait(timeout) on a transfer whose peer is late raises, and the transfer goes on."""
    if rank > 1:
        return "idle"
    if rank == 1:
        time.sleep(0.6)
        tf.send(payload(1, 0, 9, (8,), torch.float32), 0).wait(T)
        return "sent"
    h = tf.recv(tf.TensorSpec((8,)), 1)
    try:
        h.wait(timeout=0.1)
        raise AssertionError("wait(0.1) returned before the peer sent")
    except TransferTimeoutError:
        pass
    for endless in (float("inf"), float("nan")):  # refused at once; the transfer goes on
        try:
            h.wait(timeout=endless)
            raise AssertionError(f"wait({endless}) was taken")
        except ValueError as exc:
            assert "finite number of seconds" in str(exc), exc
    assert not h.done()
    got = h.result(T)
    assert same_bytes(got, payload(1, 0, 9, (8,), torch.float32))
    for endless in (float("inf"), float("nan"), -1.0):  # refused once it is done too
        try:
            h.wait(timeout=endless)
            raise AssertionError(f"wait({endless}) of a done transfer was taken")
        except ValueError:
            pass
    return "ok"


def cross_traffic(rank: int, world: int, numel: int, messages: int) -> str:
    """Rank 0 and 1 each send ``messages`` large messages as separate calls and only then post
    their receives (as an exchange written naively, or a pipeline's forward and backward):
    the two directions must not wait for each other."""
    if rank > 1:
        return "idle"
    peer = 1 - rank
    sent = [payload(rank, peer, 70 + i, (numel,), torch.float32) for i in range(messages)]
    handles = [tf.send(t, peer) for t in sent]
    into = [poisoned((numel,), torch.float32) for _ in range(messages)]
    arrived = [tf.recv(t, peer) for t in into]
    for handle in arrived + handles:
        handle.wait(T)
    for i, got in enumerate(into):
        assert same_bytes(got, payload(peer, rank, 70 + i, (numel,), torch.float32)), i
    return "ok"


def prepare_eagerly(rank: int, world: int) -> dict:
    from tensorferry.runtime import communicator_cache

    peers = [p for p in range(world) if p != rank]
    tf.prepare(peers)
    backend = "nccl" if D().type == "cuda" else "gloo"
    keys = {k for k in communicator_cache().keys() if k[0] == backend}  # noqa: SIM118
    before = communicator_cache().stats()["created"]
    for peer in peers:  # transfers after prepare make no communicator
        tf.sendrecv(torch.ones(2, device=D()) * rank, peer, torch.empty(2, device=D()), peer).wait(
            T
        )
    return {"keys": sorted(keys), "created_after": communicator_cache().stats()["created"] - before}


def init_twice(rank: int, world: int) -> str:
    tf.init(rank=rank, world_size=world)  # same settings: no-op
    try:
        tf.init(rank=rank, world_size=world + 1)
    except RuntimeError:
        return f"{tf.get_rank()}/{tf.get_world_size()}"
    raise AssertionError("second init with other settings did not raise")


def static_with(rank: int, world: int, other: int, transport: str) -> str:
    """Ranks 0 and ``other`` agree on a static channel ``other`` → 0 (three messages)."""
    if rank not in (0, other):
        return "idle"
    tf._api._reset_pair(other if rank == 0 else 0, timeout=T)  # earlier cases' agreements
    for step in range(3):
        data = payload(other, 0, 700 + step, (1 << 16,), torch.float32)
        if rank == other:
            tf.send(data, 0, static=True, transport=transport).wait(T)
        else:
            got = tf.recv(tf.TensorSpec((1 << 16,)), other, static=True, transport=transport)
            assert same_bytes(got.result(T), data), step
    return "ok"


def _outcomes(handles: list) -> dict[str, int]:
    """How many of ``handles`` ended how: ``"ok"`` or their exception's class name (each
    waited for up to ``T``)."""
    outcomes: dict[str, int] = {}
    for h in handles:
        exc = h.exception(T)
        name = "ok" if exc is None else type(exc).__name__
        outcomes[name] = outcomes.get(name, 0) + 1
    return outcomes


def send_ends_once_its_bytes_are_read(rank: int, world: int, transport: str) -> str:
    """Rank 0's send can only read its tensor after half a second of work on its stream; once
    its ``wait()`` returned, rank 0 overwrites the tensor on another stream at once, which the
    contract allows. Rank 1 must receive the bytes from before. (Over NCCL a send once ended
    when the receiver's answer came, before its kernel had read the tensor: a fast link hid
    it, and a freed tensor's memory taken by the next one sent the wrong bytes.)"""
    if rank > 1:
        return "idle"
    sent = payload(0, 1, 4242, (1 << 16,), torch.float32)
    if rank == 0:
        data = sent.clone()
        torch.cuda._sleep(int(1e9))  # (cycles: about half a second)
        tf.send(data, 1, transport=transport).wait(T)
        with torch.cuda.stream(torch.cuda.Stream(D())):
            data.fill_(-1.0)
        torch.cuda.synchronize(D())
        return "sent"
    got = tf.recv(poisoned((1 << 16,), torch.float32), 0, transport=transport).result(T)
    return "ok" if same_bytes(got, sent) else "wrong bytes"


def burst_received(rank: int, world: int, count: int, elements: int) -> str:
    """Rank 0 sends rank 1 ``count`` messages of ``elements`` float32 values at once on an
    agreed static channel, more than a transfer stream takes (``Issuing._room_for``: the
    rest wait in the engine and go as earlier ones end); rank 1 posts as many receives at
    once, then checks every byte of every one."""
    if rank > 1:
        return "idle"
    peer = 1 - rank
    tf._api._reset_pair(peer, timeout=T)  # earlier cases' agreements
    shape = (elements,)
    data = [payload(0, 1, 3000 + i, shape, torch.float32) for i in range(count)]
    if rank == 0:
        handles = [tf.send(t, 1, static=True) for t in data]
    else:
        into = [poisoned(shape, torch.float32) for _ in range(count)]
        handles = [tf.recv(t, 0, static=True) for t in into]
    for h in handles:
        h.wait(T)
    if rank == 1:
        for i, (got, want) in enumerate(zip(into, data, strict=True)):
            if not same_bytes(got, want):
                raise AssertionError(f"message {i} arrived with wrong bytes")
    return "ok"


def burst_to_doomed(rank: int, world: int, doomed: int, count: int, elements: int) -> dict:
    """Rank 0 agrees a static channel to ``doomed`` (three messages), then sends it ``count``
    more, of ``elements`` float32 values each, without waiting for any; ``doomed`` receives
    none of them and is killed by the test meanwhile. Rank 0 then waits for every one: each
    must fail with ``PeerLostError``, promptly. The kernels of sends nobody receives stay on
    the device, and a stream takes about a thousand before a launch waits for room, in the
    launching call: the engine must hold the rest back (``Issuing._room_for``), or that call
    waits with the engine's lock held and nothing sees the peer die."""
    if rank not in (0, doomed):
        return {}
    tf._api._reset_pair(doomed if rank == 0 else 0, timeout=T)  # earlier cases' agreements
    shape = (elements,)
    for step in range(3):
        data = payload(0, doomed, 600 + step, shape, torch.float32)
        if rank == 0:
            tf.send(data, doomed, static=True).wait(T)
        else:
            got = tf.recv(tf.TensorSpec(shape), 0, static=True)
            assert same_bytes(got.result(T), data), step
    if rank == doomed:
        return {}
    x = torch.ones(shape, device=D())
    t0 = time.monotonic()
    handles, raised, longest = [], None, 0.0
    for _ in range(count):
        start = time.monotonic()
        try:
            handles.append(tf.send(x, doomed, static=True))
        except PeerLostError as exc:  # a call after the loss was seen may fail at once
            raised = type(exc).__name__
            break
        finally:
            longest = max(longest, time.monotonic() - start)
    return {
        "seconds": time.monotonic() - t0,
        "issued": len(handles),
        "raised": raised,
        "longest_call_s": longest,
        "outcomes": _outcomes(handles),
    }


class _Queued:
    """What a unit's completion event is to the engine: its work counts as queued."""

    def query(self) -> bool:
        return True


def after_loss(rank: int, world: int, doomed: int) -> str:
    """Transfers with the dead peer fail fast; with the others they still work."""
    try:
        tf.send(torch.ones(2, device=D()), doomed).wait(T)
        raise AssertionError("send to a dead peer succeeded")
    except PeerLostError:
        pass
    return ring_among(rank, [r for r in range(world) if r != doomed])


def rounds_after_loss(rank: int, world: int, doomed: int, rounds: int) -> list[float]:
    """:func:`after_loss`, then ``rounds`` more rings among the survivors, half a second
    apart: the seconds each took. A survivor whose library stalls for a while after the loss
    (cleaning up the dead pair on a thread that transfers need) shows it here."""
    took = []
    for i in range(rounds + 1):
        started = time.monotonic()
        if i == 0:
            after_loss(rank, world, doomed)
        else:
            ring_among(rank, [r for r in range(world) if r != doomed])
        took.append(time.monotonic() - started)
        time.sleep(0.5)
    return took


def timed_shutdown(rank: int, world: int) -> float:
    """Seconds ``tf.shutdown()`` took (the worker's own shutdown at the end does nothing)."""
    started = time.monotonic()
    tf.shutdown()
    return time.monotonic() - started


def ring_among(rank: int, ranks: list[int]) -> str:
    i = ranks.index(rank)
    right, left = ranks[(i + 1) % len(ranks)], ranks[(i - 1) % len(ranks)]
    into = poisoned((300,), torch.float32)
    tf.sendrecv(payload(rank, right, 4242, (300,), torch.float32), right, into, left).wait(T)
    assert same_bytes(into, payload(left, rank, 4242, (300,), torch.float32))
    return "ok"


def leave_or_receive(rank: int, world: int) -> tuple:
    """Rank 0, which hosts the world's store, leaves at once; rank 1 receives from it."""
    if rank == 0:
        return ("left",)
    start = time.monotonic()
    try:
        tf.recv(torch.empty(4), 0, timeout=20).wait()
    except Exception as exc:
        return (type(exc).__name__, time.monotonic() - start, str(exc))
    return ("received", time.monotonic() - start)


def die(rank: int, world: int) -> None:
    os._exit(3)


# ---------------------------------------------------------------------- GPU tier only
def send_host_time(rank: int, world: int, calls: int) -> float:
    """Median host time (µs) of ``tf.send`` on rank 0, static channel, CUDA tensor."""
    import statistics

    if rank > 1:
        return 0.0
    x = torch.ones(1024, device=D())
    samples = []
    for _ in range(calls):
        if rank == 0:
            t0 = time.perf_counter()
            h = tf.send(x, 1, static=True)
            samples.append(time.perf_counter() - t0)
            h.wait(T)
        else:
            tf.recv(x, 0, static=True).wait(T)
    return statistics.median(samples[calls // 10 :]) * 1e6 if samples else 0.0


def send_is_asynchronous(rank: int, world: int) -> dict:
    """Rank 0 sends a tensor that a long chain of matmuls on its current stream still has to
    write: ``tf.send`` must return at once (not when the transfer, queued behind them, is done)."""
    if rank > 1:
        return {}
    x = torch.zeros(1 << 20, device=D())
    if rank == 1:
        tf.recv(torch.empty(1, device=D()), 0).wait(T)  # the pair's first message: its making
        tf.recv(x, 0).wait(T)
        assert torch.all(x == 3.0)
        return {}
    tf.send(torch.ones(1, device=D()), 1).wait(T)
    big = torch.randn(4096, 4096, device=D())
    for _ in range(30):  # tens of milliseconds of work ahead of the transfer
        big = big @ big / 4096**0.5
    x.add_(3.0)
    t0 = time.perf_counter()
    handle = tf.send(x, 1)
    call_s = time.perf_counter() - t0
    pending = not handle.done()
    handle.wait(T)
    return {"call_s": call_s, "total_s": time.perf_counter() - t0, "pending": pending}


def stream_ordering(rank: int, world: int, sender: int = 0, in_thread: bool = False) -> str:
    """The sender's tensor is written by a slow kernel on the caller's stream right before
    tf.send (the transfer must wait for it); the receiver consumes on another stream after
    wait_stream (no host wait) and through wait().

    ``in_thread``: each rank calls from a thread it starts, whose current device is device 0
    whatever the rank's device (CUDA's current device is per thread): the ordering is with the
    thread's current stream of the rank's device, and the receiver's ``wait_stream()`` with no
    stream given makes that stream wait too."""
    if rank > 1:
        return "idle"
    if in_thread:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(1) as thread:
            return thread.submit(_stream_ordering, rank, sender, True).result()
    return _stream_ordering(rank, sender, False)


def _stream_ordering(rank: int, sender: int, in_thread: bool) -> str:
    n = 1 << 22
    if rank == sender:
        x = torch.zeros(n, device=D())
        big = torch.randn(2048, 2048, device=D())
        for _ in range(20):  # keep the current stream busy
            big = big @ big / 2048**0.5
        x.add_(7.0)  # queued behind the matmuls on the caller's stream
        tf.send(x, 1 - rank).wait(T)
        return "sent"
    y = torch.empty(n, device=D())
    h = tf.recv(y, 1 - rank)
    if in_thread:  # the default: this thread's current stream of this rank's device
        h.wait_stream()
        total = y.sum()
    else:
        side = torch.cuda.Stream(device=D())
        with torch.cuda.stream(side):
            h.wait_stream()  # this stream now waits for the transfer on the device
            total = y.sum()
        side.synchronize()
    assert total.item() == 7.0 * n, total.item()
    h.wait(T)
    assert torch.all(y == 7.0)
    return "ok"


def stream_ordering_when_agreed(rank: int, world: int) -> str:
    """The same ordering on an agreed static channel, where each call issues its transfer
    itself (a lone tensor: the stream's wait for the caller's event in the issue's one compiled
    call, where the helper is loaded). Messages 0 and 2: the
    sender's tensor is written by a slow kernel right before ``tf.send``. Messages 1 and 3: on
    the receiver, a slow kernel then a read of the buffer right before ``tf.recv`` into it (the
    receive must not overwrite it before that read). The first message agrees the channel; the
    others travel on the agreement. Random payloads, every byte checked."""
    if rank > 1:
        return "idle"
    n = 1 << 20
    sender = rank == 0

    def busy() -> None:  # about a millisecond or more of work on the current stream
        big = torch.randn(1024, 1024, device=D())
        for _ in range(40):
            big = big @ big / 1024**0.5

    for i in range(4):
        good = payload(0, 1, 1300 + i, (n,), torch.float32)
        if sender:
            x = torch.zeros(n, device=D())
            if i % 2 == 0:
                busy()
            x.copy_(good)  # queued behind the matmuls on the caller's stream
            tf.send(x, 1, static=True).wait(T)
            continue
        y = poisoned((n,), torch.float32)
        old = y.clone()
        if i % 2 == 1:
            busy()
        seen = y * 1  # reads the buffer behind the matmuls, before the receive may write it
        got = tf.recv(y, 0, static=True).result(T)
        assert same_bytes(seen, old), f"message {i}: the receive overwrote the buffer too soon"
        assert same_bytes(got, good), f"message {i}: wrong bytes"
    return "sent" if sender else "ok"


def order_across_streams(
    rank: int, world: int, first: str, static: bool, rounds: int, transport: str = "auto"
) -> str:
    """Two receives from one peer on two transfer streams: a batch with a send goes on the send
    stream, a lone receive on the receive stream. The peer's messages must land in the order
    both sides issued them, whichever kernel the device could start first (an NCCL
    communicator runs its operations in issue order across streams: what the engine and
    ``graph/_nccl.py`` rest on).

    ``first="batch"``: rank 0 sends a message rank 1 takes only after a pause (the send
    stream waits behind it), then a batch [send, receive], then a lone receive, already queued
    on an idle stream when the peer's messages come. ``first="lone"``: rank 0's lone receive
    waits for a message rank 1 sends after a pause, then a batch [send, receive] on the other,
    idle stream. Random payloads, every byte checked, every round."""
    if rank > 1:
        return "idle"
    tf._api._reset_pair(1 - rank, timeout=T)  # earlier cases' agreements
    shape = (1 << 18,)  # one layout: a static channel keeps it
    how = {"static": static, "transport": transport}
    for r in range(rounds):
        tags = [4000 + 10 * r + i for i in range(4)]
        if rank == 0:
            handles, got = _order_across_streams_0(first, how, tags, shape)
        else:
            time.sleep(0.5)  # rank 0 has queued everything by now
            handles, got = _order_across_streams_1(first, how, tags, shape)
        for h in handles:
            h.wait(T)
        for what, (tensor, tag) in got.items():
            want = payload(1 - rank, rank, tag, tensor.shape, tensor.dtype)
            if not same_bytes(tensor, want):
                raise AssertionError(f"round {r}: {what} arrived with wrong bytes")
    return "ok"


def _order_across_streams_0(first: str, how: dict, tags: list, shape: tuple):
    """Rank 0's side of ``order_across_streams``: (handles, {name: (buffer, tag)})."""
    handles, got = [], {}
    if first == "batch":
        handles.append(tf.send(payload(0, 1, tags[0], shape, torch.float32), 1, **how))
    else:
        lone = poisoned(shape, torch.float32)
        handles.append(tf.recv(lone, 1, **how))
        got["the lone receive"] = (lone, tags[1])
    in_batch = poisoned(shape, torch.float32)
    with tf.batch(**how) as b:
        b.send(payload(0, 1, tags[2], shape, torch.float32), 1)
        b.recv(in_batch, 1)
    handles.append(b)
    got["the batch's receive"] = (in_batch, tags[3])
    if first == "batch":
        lone = poisoned(shape, torch.float32)
        handles.append(tf.recv(lone, 1, **how))
        got["the lone receive"] = (lone, tags[1])
    return handles, got


def _order_across_streams_1(first: str, how: dict, tags: list, shape: tuple):
    """Rank 1's side: the same messages, issued in rank 0's order."""
    handles, got = [], {}
    if first == "batch":
        first_one = poisoned(shape, torch.float32)
        handles.append(tf.recv(first_one, 0, **how))
        got["the first message"] = (first_one, tags[0])
    else:
        handles.append(tf.send(payload(1, 0, tags[1], shape, torch.float32), 0, **how))
    in_batch = poisoned(shape, torch.float32)
    with tf.batch(**how) as b:
        b.recv(in_batch, 0)
        b.send(payload(1, 0, tags[3], shape, torch.float32), 0)
    handles.append(b)
    got["the batch's receive"] = (in_batch, tags[2])
    if first == "batch":
        handles.append(tf.send(payload(1, 0, tags[1], shape, torch.float32), 0, **how))
    return handles, got


def _outcome(fn) -> str:
    """``fn()``'s result, or what it raised: ``mismatch:<field>`` or the error's type name."""
    try:
        return fn()
    except MismatchError as exc:
        return f"mismatch:{exc.field}"
    except Exception as exc:
        return type(exc).__name__


def _which(got: torch.Tensor, good: list[torch.Tensor]) -> str:
    """``good<i>`` for the payload ``got`` holds byte for byte, else ``?``."""
    return next((f"good{i}" for i, g in enumerate(good) if same_bytes(got, g)), "?")


def static_broken_with_receives_ahead(rank: int, world: int) -> dict:
    """Rank 1 posts three static receives ahead; rank 0 sends a good message, then one whose
    shape breaks the static promise, then two good ones. Rank 1 posts its fourth receive once
    the first three finished. Reports what each call saw."""
    if rank > 1:
        return {}
    good = [payload(0, 1, 900 + i, (4, 4), torch.float32) for i in range(4)]

    def which(got: torch.Tensor) -> str:
        return _which(got, good)

    def send(tensor: torch.Tensor) -> str:
        tf.send(tensor, 1, static=True, timeout=3.0).wait(T)
        return "ok"

    if rank == 0:
        sends = [good[0], torch.zeros(5, 4, device=D()), good[2], good[3]]
        return {"sends": [_outcome(lambda t=t: send(t)) for t in sends]}
    handles = [tf.recv(tf.TensorSpec((4, 4)), 0, static=True, timeout=3.0) for _ in range(3)]
    seen = [_outcome(lambda h=h: which(h.result(T))) for h in handles]
    last = tf.recv(tf.TensorSpec((4, 4)), 0, static=True, timeout=3.0)
    seen.append(_outcome(lambda: which(last.result(T))))
    return {"recvs": seen}


_RANDOM_DTYPES = [
    torch.float32,
    torch.int64,
    torch.bfloat16,
    torch.bool,
    torch.uint8,
    torch.float16,
]


def _random_layout(rng) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """1 to 4 tensors: scalars, empty ones, small ones and, now and then, one of 256 KiB."""
    layout = []
    for _ in range(rng.randint(1, 4)):
        kind = rng.random()
        if kind < 0.1:
            shape: tuple[int, ...] = ()
        elif kind < 0.2:
            shape = (0, rng.randint(1, 3))
        elif kind < 0.9:
            shape = tuple(rng.randint(1, 9) for _ in range(rng.randint(1, 3)))
        else:
            shape = (64, 1024)
        layout.append((shape, rng.choice(_RANDOM_DTYPES)))
    return layout


def _reset_my_pairs(rank: int, world: int) -> None:
    """A fresh epoch with every peer (no static agreement left by earlier cases), pair by pair
    in one order on every rank, so no two ranks wait for each other."""
    from tensorferry.p2p import _api

    for low in range(world):
        for high in range(low + 1, world):
            if rank in (low, high):
                _api._reset_pair(high if rank == low else low, timeout=T)


def _changed(layout: list) -> list:
    """``layout`` with its first tensor one row longer: what a sender sends by mistake."""
    (shape, dtype), rest = layout[0], layout[1:]
    longer = (shape[0] + 1, *shape[1:]) if shape else (1,)
    return [(longer, dtype), *rest]


def _random_program(script: Any, rank: int, messages: list, static: dict, batches: float) -> list:
    """``rank``'s calls (``("call", tags)``: one message, or a batch of several) in a random
    order that keeps each direction's order, with a wait (``("wait", tags)``) after some of
    them, for a call made before."""
    queues: dict[tuple[int, int], list[int]] = {}
    for src, dst, tag, _ in messages:
        if rank in (src, dst):
            queues.setdefault((src, dst), []).append(tag)
    program, called = [], []
    while any(queues.values()):
        direction = script.choice([d for d, q in queues.items() if q])
        tags = [queues[direction].pop(0)]
        if batches > 0 and script.random() < batches:  # (no draw without, as for mistakes)
            for _ in range(script.randint(1, 3)):
                alike = [d for d, q in queues.items() if q and static[d] == static[direction]]
                if alike:
                    tags.append(queues[script.choice(alike)].pop(0))
        program.append(("call", tuple(tags)))
        called.append(tuple(tags))
        if script.random() < 0.4:  # wait now for one call not waited for yet
            program.append(("wait", called.pop(script.randrange(len(called)))))
    return program


def _drop_waits_that_cannot_end(programs: list, messages: list) -> None:
    """Runs every rank's program step by step, as a correct layer would carry them (a message
    finishes once both its sides are called: each direction's messages are called in one order
    on both sides, so the ones before it were too; a call finishes once all its messages did);
    each wait that leaves every rank stuck is taken out (its call is then waited for at the
    program's end). Edits ``programs`` in place."""
    sides = {tag: 2 for _, _, tag, _ in messages}
    at = [0] * len(programs)
    while any(at[r] < len(p) for r, p in enumerate(programs)):
        moved = False
        for r, program in enumerate(programs):
            while at[r] < len(program):
                step, tags = program[at[r]]
                if step == "call":
                    for tag in tags:
                        sides[tag] -= 1
                elif any(sides[tag] > 0 for tag in tags):
                    break
                at[r] += 1
                moved = True
        if not moved:  # every unfinished rank waits: drop the first such wait found
            stuck = next(r for r, p in enumerate(programs) if at[r] < len(p))
            del programs[stuck][at[stuck]]


def batch_waits_for_every_peer(rank: int, world: int) -> str:
    """Rank 0 sends to 1 and to 2 in one batch; rank 1 receives, then sends to 2; rank 2
    receives from 1, then from 0. torch's ``batch_isend_irecv`` posts both sends at once and
    all three finish. So does a transport whose messages go peer by peer (gloo). Over one that
    issues a batch as one group (NCCL) the batch goes once every message in it can, and the
    send to 2 cannot before rank 2 calls: rank 2 waits for rank 1, which waits for the batch."""
    if rank > 2:
        return "idle"
    x = torch.full((4,), float(rank), device=D())
    wait_s = 3.0
    try:
        if rank == 0:
            with tf.batch(timeout=wait_s) as b:
                b.send(x, 1)
                b.send(x, 2)
            b.wait(wait_s)
        elif rank == 1:
            tf.recv(torch.empty(4, device=D()), 0, timeout=wait_s).wait(wait_s)
            tf.send(x, 2, timeout=wait_s).wait(wait_s)
        else:
            tf.recv(torch.empty(4, device=D()), 1, timeout=wait_s).wait(wait_s)
            tf.recv(torch.empty(4, device=D()), 0, timeout=wait_s).wait(wait_s)
    except TransferTimeoutError as exc:
        return f"timed out: {str(exc)[:60]}"
    return "ok"


def recv_from_absent(rank: int, world: int) -> str:
    """Rank 0 receives from rank 1, which never sends (nor makes any call): the receive times
    out while the pair's rendezvous still waits for rank 1."""
    if rank != 0:
        return "idle"
    try:
        tf.recv(torch.empty(4, device=D()), 1, timeout=1.0).wait(5.0)
    except TransferTimeoutError:
        return "timed out"
    return "received?"


def mismatch_read_with_the_fault(rank: int, world: int) -> list[str]:
    """Rank 0 sends two messages, the second one element longer than rank 1 expects, and
    stops (SIGSTOP) before it reads anything back. Rank 1 receives both in one batch: the
    second's header disagrees, the batch fails and the pair faults. Rank 1 then wakes rank 0,
    which reads rank 1's headers and the fault notice in one go. Both messages must end on
    rank 0 as on rank 1: the second one was moved to the pair's next epoch instead, where
    nothing met it, and waited for its timeout."""
    import signal

    from tensorferry.errors import TensorFerryError
    from tensorferry.p2p import _context

    if rank > 1:
        return ["idle"]
    # The world's store is served by rank 0's process: every use of it comes before the stop.
    store = _context.current().store
    key = "mismatch_read_with_the_fault"
    warm = payload(0, 1, 9000, (4,), torch.float32)
    outcomes: list[str] = []
    if rank == 0:
        tf.send(warm, 1, timeout=T).wait(T)  # the pair's transport exists before the fault
        store.set(f"{key}/pid", str(os.getpid()))
        store.wait([f"{key}/known"])
        first = tf.send(payload(0, 1, 9001, (4,), torch.float32), 1, timeout=T)
        second = tf.send(payload(0, 1, 9002, (5,), torch.float32), 1, timeout=T)
        os.kill(os.getpid(), signal.SIGSTOP)  # rank 1 sends SIGCONT
        handles = [first, second]
    else:
        tf.recv(torch.empty(4, device=D()), 0, timeout=T).wait(T)
        store.wait([f"{key}/pid"])
        sender = int(store.get(f"{key}/pid"))
        store.set(f"{key}/known", "1")
        time.sleep(0.5)  # rank 0 sent both and stopped by now
        with tf.batch(timeout=T) as b:
            b.recv(torch.empty(4, device=D()), 0)
            b.recv(torch.empty(4, device=D()), 0)
        handles = [b]
    try:
        for handle in handles:
            try:
                handle.wait(T)
                outcomes.append("ok")
            except TensorFerryError as exc:
                outcomes.append(type(exc).__name__)
    finally:
        if rank == 1:
            os.kill(sender, signal.SIGCONT)
    return outcomes


# Keys of the store that cases use to say when they are ready: new ones each time (a case may
# run more than once in a pool's life), the same on every rank (each counts its own calls).
_STORE_KEYS = itertools.count()


def exit_with_a_gloo_wait_stuck(rank: int, world: int, linger: float) -> str:
    """Rank 0 sends rank 1 two messages; rank 1 then posts a third receive that rank 0 never
    sends: its gloo receive waits for bytes that never come. Rank 1 leaves with that wait under
    way; rank 0 stays ``linger`` seconds before it leaves too."""
    if rank > 1:
        return "idle"
    if rank == 0:
        sent = payload(0, 1, 71, (4,), torch.float32)
        for _ in range(2):
            tf.send(sent, 1, timeout=T).wait(T)
        time.sleep(linger)
        return "lingered"
    for _ in range(2):
        tf.recv(poisoned((4,), torch.float32), 0, timeout=T).wait(T)
    stuck = tf.recv(poisoned((4,), torch.float32), 0, timeout=10 * T)
    time.sleep(0.5)  # posted at once: gloo's wait for it can begin
    stuck.done()  # handed to the pair's waiter thread
    return "left with a receive in flight" if not stuck.done() else "its receive finished?"


def empty_static_receive_waits_for_its_send(rank: int, world: int) -> dict | None:
    """Rank 1 receives a message of empty tensors on an agreed static channel from rank 0,
    which sends it only later. Over gloo such a channel skips headers; a receive must still
    not complete before its send does (else, should a fault abandon the send, the two sides
    would end differently). Returns rank 1's view: whether the receive had completed while
    rank 0 had not sent yet, and how it ended."""
    _reset_my_pairs(rank, world)
    if rank not in (0, 1):
        return None
    layout = [((0, 3), torch.float32), ((0,), torch.int64)]
    for _ in range(3):  # agree the channel 0 -> 1
        if rank == 0:
            tf.send([payload(0, 1, 0, s, d) for s, d in layout], 1, static=True).wait(T)
        else:
            tf.recv([poisoned(s, d) for s, d in layout], 0, static=True).wait(T)
    if rank == 0:
        time.sleep(1.0)  # rank 1 has posted its receive and looked at it meanwhile
        tf.send([payload(0, 1, 1, s, d) for s, d in layout], 1, static=True).wait(T)
        return None
    pending = tf.recv([poisoned(s, d) for s, d in layout], 0, static=True)
    time.sleep(0.5)
    early = pending.done()
    pending.wait(T)
    return {"done before the send": early, "then": "ok" if pending.exception() is None else "?"}


def sends_ahead_then_receives_one_by_one(
    rank: int, world: int, static: bool, transport: str = "auto"
) -> str:
    """Ranks 0 and 1 each send four messages ahead, then receive the other's four one at a
    time, each waited for before the next is posted (torch's ``isend``s, then ``recv``s). A
    send completes only once the peer posted its receive, and the peer posts its second only
    after its first completed: a receive's completion held up behind this rank's own unfinished
    sends would leave both ranks waiting for each other (it did over gloo on an agreed static
    channel, where sends go out at once)."""
    if rank > 1:
        return "idle"
    peer = 1 - rank
    tf._api._reset_pair(peer, timeout=T)  # a fresh channel: its static agreement is this case's
    shape = (33, 5)
    data = [payload(rank, peer, 900 + i, shape, torch.float32).to(D()) for i in range(4)]
    sends = [tf.send(t, peer, static=static, transport=transport) for t in data]
    for i in range(4):
        got = poisoned(shape, torch.float32)
        tf.recv(got, peer, static=static, transport=transport).wait(T)
        if not same_bytes(got, payload(peer, rank, 900 + i, shape, torch.float32)):
            raise AssertionError(f"message {i} from rank {peer} arrived with wrong bytes")
    for h in sends:
        h.wait(T)
    return "ok"


def calls_from_many_threads(
    rank: int, world: int, seed: int, per_thread: int, static: bool = False
) -> dict:
    """Every rank calls from several threads at once: for each peer, two threads send to it
    and one thread receives all that peer's messages, one at a time, while other threads do
    the same for the other peers. Messages of one direction share a shape (calls of one rank
    to one peer are matched in the order they were made, whichever thread made them) and carry
    their sender thread and number in their bytes: each must arrive once, whole."""
    import random
    from concurrent.futures import ThreadPoolExecutor

    _reset_my_pairs(rank, world)  # fresh static agreements: this seed's shapes
    rng = random.Random(seed)
    shapes = {(s, d): (rng.randint(1, 300), 3) for s in range(world) for d in range(world)}
    peers = [p for p in range(world) if p != rank]

    def message(src: int, dst: int, sender: int, i: int) -> torch.Tensor:
        t = payload(src, dst, sender * 10_000 + i, shapes[src, dst], torch.float32)
        t[0, :2] = torch.tensor([sender, i], dtype=torch.float32)  # who sent it, which one
        return t

    def send_all(dst: int, sender: int) -> None:
        pending = []
        for i in range(per_thread):
            data = message(rank, dst, sender, i).to(D())
            pending.append(tf.send(data, dst, static=static, timeout=T))
            if len(pending) > 4:
                pending.pop(0).wait(T)
        for h in pending:
            h.wait(T)

    def receive_all(src: int) -> list:
        seen = []
        for _ in range(2 * per_thread):
            spec = tf.TensorSpec(shapes[src, rank], torch.float32)
            got = tf.recv(spec, src, static=static, timeout=T).result(T).cpu()
            sender, i = (int(v) for v in got[0, :2].tolist())
            if sender not in (0, 1) or not same_bytes(got, message(src, rank, sender, i).cpu()):
                raise AssertionError(f"a message from rank {src} arrived with wrong bytes")
            seen.append((sender, i))
        return seen

    with ThreadPoolExecutor(3 * len(peers)) as threads:
        sends = [threads.submit(send_all, p, k) for p in peers for k in (0, 1)]
        receives = {p: threads.submit(receive_all, p) for p in peers}
        for job in sends:
            job.result()
        arrived = {p: job.result() for p, job in receives.items()}
    _reset_my_pairs(rank, world)  # leaves no static agreement to the cases after it
    expected = sorted((k, i) for k in (0, 1) for i in range(per_thread))
    return {p: sorted(seen) == expected for p, seen in arrived.items()}


def batch_meets_calls_made_one_after_another(
    rank: int, world: int, static: bool, transport: str
) -> str:
    """Rank 0 batches a send to rank 1 with a receive from it, then two sends to it. Rank 1
    makes its matching calls one at a time, each waited for before the next: it receives,
    sends back what it got, doubled, then receives twice. With torch's ``batch_isend_irecv``
    each operation goes at once and all of this finishes; so must it here (over gloo each
    message of a batch goes as soon as it can)."""
    if rank > 1:
        return "idle"
    tf._api._reset_pair(1 - rank, timeout=T)  # a fresh channel: its static agreement is ours
    first = payload(0, 1, 1200, (6, 5), torch.float32).to(D())
    more = [payload(0, 1, 1201 + i, (6, 5), torch.float32).to(D()) for i in range(2)]
    options = {"static": static, "transport": transport, "timeout": T}
    if rank == 0:
        back = poisoned((6, 5), torch.float32)
        with tf.batch(**options) as b:
            b.send(first, 1)
            b.recv(back, 1)
        b.wait(T)
        with tf.batch(**options) as b:
            for t in more:
                b.send(t, 1)
        b.wait(T)
        assert same_bytes(back.cpu(), (first * 2).cpu()), "the answer arrived with wrong bytes"
        return "ok"
    got = tf.recv(tf.TensorSpec((6, 5)), 0, **options).result(T)
    assert same_bytes(got.cpu(), first.cpu()), "the first message arrived with wrong bytes"
    tf.send(got * 2, 0, **options).wait(T)
    for t in more:
        assert same_bytes(tf.recv(tf.TensorSpec((6, 5)), 0, **options).result(T).cpu(), t.cpu())
    return "ok"


class _StaticRoutes:
    """Messages of ``numel`` floats among ranks 0-2 on ``routes`` ({name: (src, dst)}), each
    channel static and agreed by one message first, so that later messages are issued at once
    (over NCCL: before the peer's call). Made on every rank of 0-2 in step."""

    def __init__(self, rank: int, numel: int, transport: str, routes: dict) -> None:
        self.routes, self.numel = routes, numel
        self.options = {"static": True, "transport": transport, "timeout": T}
        self.data = {
            name: payload(src, dst, 1300 + i, (numel,), torch.float32).to(D())
            for i, (name, (src, dst)) in enumerate(routes.items())
        }
        _reset_my_pairs(rank, 3)  # fresh channels, agreed below
        for name, (src, dst) in routes.items():
            if rank == src:
                self.send(name).wait(T)
            elif rank == dst:
                self.check(name, self.post(name))

    def send(self, name: str) -> tf.Transfer:
        return tf.send(self.data[name], self.routes[name][1], **self.options)

    def post(self, name: str) -> tf.Transfer:
        return tf.recv(tf.TensorSpec((self.numel,)), self.routes[name][0], **self.options)

    def check(self, name: str, transfer: tf.Transfer) -> None:
        if not same_bytes(transfer.result(T).cpu(), self.data[name].cpu()):
            raise AssertionError(f"message {name} arrived with wrong bytes")


def send_behind_a_send_its_peer_receives_later(
    rank: int, world: int, numel: int, transport: str = "auto"
) -> str:
    """Rank 0 sends a large message A to rank 1, then B to rank 2 (issued at once). Rank 2
    receives B, then sends C to rank 1; rank 1 receives C before it receives A. Every message
    can finish, as with torch's ``isend``s (one stream per pair): unless B waits behind A, whose
    receiver waits for C, which waits for B. Sends to different peers must not queue behind
    one another."""
    if rank > 2:
        return "idle"
    calls = _StaticRoutes(rank, numel, transport, {"A": (0, 1), "B": (0, 2), "C": (2, 1)})
    if rank == 0:
        first, second = calls.send("A"), calls.send("B")
        first.wait(T)
        second.wait(T)
    elif rank == 1:
        calls.check("C", calls.post("C"))
        calls.check("A", calls.post("A"))
    else:
        calls.check("B", calls.post("B"))
        calls.send("C").wait(T)
    _reset_my_pairs(rank, 3)  # leaves no static agreement to the cases after it
    return "ok"


def receive_behind_a_receive_its_peer_sends_later(
    rank: int, world: int, numel: int, transport: str = "auto"
) -> str:
    """Rank 1 posts two receives (issued at once): A from rank 0, then B from rank 2. Rank 2
    sends B, then C to rank 0; rank 0 receives C before it sends A. Every message can finish,
    as with torch's ``irecv``s: unless B's receive waits behind A's, whose sender waits for C,
    which waits for B. Receives from different peers must not queue behind one another."""
    if rank > 2:
        return "idle"
    calls = _StaticRoutes(rank, numel, transport, {"A": (0, 1), "B": (2, 1), "C": (2, 0)})
    if rank == 1:
        first, second = calls.post("A"), calls.post("B")
        calls.check("B", second)
        calls.check("A", first)
    elif rank == 2:
        calls.send("B").wait(T)
        calls.send("C").wait(T)
    else:
        calls.check("C", calls.post("C"))
        calls.send("A").wait(T)
    _reset_my_pairs(rank, 3)  # leaves no static agreement to the cases after it
    return "ok"


def nothing_left_for_the_collector(rank: int, world: int, rounds: int) -> dict[str, int]:
    """Every kind of call, ``rounds`` times, with the garbage collector off: what tensorferry
    objects are then left in reference cycles (``{type: count}``; empty when every message
    was freed as it finished). Calls of every rank in one world: lone sends and receives
    (a list and a single tensor), a ring of ``sendrecv``, a batch with every peer,
    ``ring_all_gather``, a transfer with a done callback, and last a static channel (then
    reset: its agreed layout would refuse the other calls' next round)."""
    import gc

    right, left = (rank + 1) % world, (rank - 1) % world

    def pair_messages(tag: int, static: bool) -> None:
        shapes = [(4, 4)] * 3 if static else [(3, 8)] * 5
        for count, shape in ((len(shapes), shapes[0]), (1, (5,))):
            if rank == 0:
                out = [payload(0, 1, tag + i, shape, torch.float32) for i in range(count)]
                tf.send(out if count > 1 else out[0], 1, static=static).wait(T)
            else:
                into = [poisoned(shape, torch.float32) for _ in range(count)]
                tf.recv(into if count > 1 else into[0], 0, static=static).wait(T)
                for i, got in enumerate(into):
                    assert same_bytes(got, payload(0, 1, tag + i, shape, torch.float32))
            if static:
                break  # one layout per static channel

    def calls(tag: int) -> None:
        if rank < 2:
            pair_messages(tag, static=False)
        out = payload(rank, right, tag, (300,), torch.float32)
        into = poisoned((300,), torch.float32)
        tf.sendrecv(out, right, into, left).wait(T)
        assert same_bytes(into, payload(left, rank, tag, (300,), torch.float32))
        received = {}
        with tf.batch() as b:
            for peer in range(world):
                if peer != rank:
                    b.send(payload(rank, peer, tag + 1, (6,), torch.int64), peer)
                    received[peer] = b.recv(poisoned((6,), torch.int64), peer)
        b.wait(T)
        for peer, got in received.items():
            assert same_bytes(got, payload(peer, rank, tag + 1, (6,), torch.int64)), peer
        gathered = poisoned((world * 10,), torch.float32)
        tf.ring_all_gather(gathered, payload(rank, rank, tag, (10,), torch.float32)).wait(T)
        for r in range(world):
            want = payload(r, r, tag, (10,), torch.float32)
            assert same_bytes(gathered[r * 10 : (r + 1) * 10], want), r
        called = threading.Event()
        handle = tf.sendrecv(out, right, into, left)
        handle.add_done_callback(lambda _t: called.set())
        handle.wait(T)
        assert called.wait(T)
        if rank < 2:
            for step in range(3):
                pair_messages(tag + 5 + step, static=True)
            tf._api._reset_pair(1 - rank, timeout=T)

    calls(1000)  # warm: pairs made
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for r in range(rounds):
            calls(2000 + 10 * r)
        time.sleep(0.3)  # completions still on the pool's threads
        gc.collect()
        left_over: dict[str, int] = {}
        for obj in gc.garbage:
            kind = type(obj)
            if kind.__module__.startswith("tensorferry"):
                name = f"{kind.__module__}.{kind.__qualname__}"
                left_over[name] = left_over.get(name, 0) + 1
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    return left_over


# ---------------------------------------------------------------------- reliability
def _bytes_of(rank_from: int, rank_to: int, tag: int) -> torch.Tensor:
    return payload(rank_from, rank_to, tag, (256,), torch.float32)


def _which_message(got: torch.Tensor, src: int, dst: int, tags: list[int]) -> str:
    for tag in tags:
        if same_bytes(got, _bytes_of(src, dst, tag)):
            return f"message {tag}"
    return "other bytes"


def batch_with_a_gone_peer_then_more(rank: int, world: int, gone: int) -> list[str]:
    """Rank ``gone`` has shut down. Rank 0 batches a send to rank 1 (message 1) with a send to
    ``gone``, which fails; then sends messages 2 and 3 to rank 1. Rank 1 receives three times
    and says what each receive got: a receive that succeeds must hold the message it matched,
    never the next one."""
    if rank == gone:
        return ["gone"]
    if rank == 0:
        outcome = "batch ok"
        try:
            with tf.batch() as b:
                b.send(_bytes_of(0, 1, 1), 1)
                b.send(_bytes_of(0, gone, 1), gone)
            b.wait(T)
        except TensorFerryError as exc:
            outcome = f"batch failed: {type(exc).__name__}"
        for tag in (2, 3):
            tf.send(_bytes_of(0, 1, tag), 1).wait(T)
        return [outcome]
    seen = []
    for _ in range(3):
        into = poisoned((256,), torch.float32)
        try:
            tf.recv(into, 0, timeout=5.0).wait()
            seen.append(_which_message(into, 0, 1, [1, 2, 3]))
        except TensorFerryError as exc:
            seen.append(type(exc).__name__)
    return seen


def shut_down(rank: int, world: int) -> str:
    tf.shutdown()
    return "shut down"


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def faults_leave_nothing_behind(rank: int, world: int, faults: int) -> dict:
    """Rank 0 lets ``faults`` receives from rank 1 time out (each a fault of the pair: rank 1
    sends nothing meanwhile). Rank 1 then makes as many sends, which fail at once (the k-th
    send meets the k-th receive, and those failed), and both exchange one message. Returns
    how many file descriptors and threads rank 0 gained over the faults, and how rank 1's
    sends ended."""
    first = ring_among(rank, list(range(world)))  # the pair exists before counting
    assert first == "ok"
    time.sleep(0.5)
    fds, threads = _open_fds(), threading.active_count()
    late = []
    if rank == 0:
        for _ in range(faults):
            with contextlib.suppress(TransferTimeoutError):
                tf.recv(torch.empty(16), 1, timeout=0.05).wait(T)
    tf_barrier_after_faults(rank)
    if rank == 1:
        for _ in range(faults):
            started = time.monotonic()
            try:
                tf.send(torch.ones(16), 0, timeout=T).wait(T)
                late.append("ok")
            except TransferTimeoutError:
                late.append("failed at once" if time.monotonic() - started < 1.0 else "late")
    assert ring_among(rank, list(range(world))) == "ok"
    time.sleep(1.0)  # what the faults let go of has gone by now
    return {
        "fds": _open_fds() - fds,
        "threads": threading.active_count() - threads,
        "late": sorted(set(late)),
    }


def tf_barrier_after_faults(rank: int) -> None:
    """Rank 1 waits for rank 0 to finish its faults without a transfer of the pair: through a
    file both see (the store belongs to the layer)."""
    import tempfile

    path = os.path.join(tempfile.gettempdir(), f"tf-faults-done-{os.getppid()}")
    if rank == 0:
        with open(path, "w") as f:
            f.write("done")
        return
    deadline = time.monotonic() + 4 * T
    while not os.path.exists(path):
        assert time.monotonic() < deadline, "rank 0 never finished its faults"
        time.sleep(0.05)
    time.sleep(0.2)
    os.unlink(path)


def wait_with_busy_callbacks(rank: int, world: int, slow: int, slow_s: float) -> float | str:
    """Rank 1 receives ``slow`` messages whose done-callbacks each sleep ``slow_s`` (taking
    every completion thread), then one more with a callback of its own: the seconds its
    ``wait()`` took once the message had been sent."""
    if rank == 0:
        for tag in range(slow + 1):
            tf.send(_bytes_of(0, 1, tag), 1).wait(T)
        return "sent"
    handles = []
    for _ in range(slow):
        h = tf.recv(poisoned((256,), torch.float32), 0)
        h.add_done_callback(lambda _t: time.sleep(slow_s))
        handles.append(h)
    for h in handles:
        h.wait(T)
    time.sleep(0.2)  # every callback has started by now, each holding a completion thread
    into = poisoned((256,), torch.float32)
    last = tf.recv(into, 0)
    last.add_done_callback(lambda _t: None)
    started = time.monotonic()
    last.wait(T)
    took = time.monotonic() - started
    assert same_bytes(into, _bytes_of(0, 1, slow))
    return took


def store_host_dies_before_a_pair_is_made(rank: int, world: int) -> tuple:
    """Rank 0 hosts the world's store and dies at once; ranks 1 and 2 have never talked and
    then do: what each gets (error type, seconds, message)."""
    if rank == 0:
        os._exit(3)
    time.sleep(1.0)  # rank 0 is gone by now
    started = time.monotonic()
    try:
        if rank == 1:
            tf.send(_bytes_of(1, 2, 0), 2, timeout=6.0).wait()
        else:
            tf.recv(poisoned((256,), torch.float32), 1, timeout=6.0).wait()
    except Exception as exc:
        return (type(exc).__name__, time.monotonic() - started, str(exc))
    return ("ok", time.monotonic() - started, "")


def static_broken(rank: int, world: int, transport: str = "auto", breaker: int = 0) -> str | None:
    """After the static agreement, rank ``breaker`` (0 sends, 1 receives) changes the shape:
    both sides must raise."""
    if rank > 1:
        return None
    shape = (5, 4) if rank == breaker else (4, 4)
    try:
        if rank == 0:
            tf.send(torch.zeros(shape, device=D()), 1, static=True, transport=transport).wait(T)
        else:
            tf.recv(tf.TensorSpec(shape), 0, static=True, transport=transport).wait(T)
    except MismatchError as exc:
        if rank == breaker:
            assert "[5, 4]" in str(exc) and "[4, 4]" in str(exc), exc
        return exc.field
    raise AssertionError("no MismatchError")


def _traffic_batch(messages: list, static: bool, transport: str, wait: float) -> tuple:
    """One ``tf.batch`` of ``messages`` (``(tag, kind, peer, tensors or buffers, what
    arrives)`` each); returns it with what each message covers (as ``_traffic_outcomes``
    takes them)."""
    covers = []
    with tf.batch(static=static, transport=transport, timeout=wait) as b:
        for tag, kind, peer, tensors, sent in messages:
            if kind == "send":
                b.send(tensors, peer)
                covers.append((tag, None, None))
            else:
                covers.append((tag, b.recv(tensors, peer), sent))
    return b, covers


def _traffic_outcomes(handle: tf.Transfer, covers: list, wait: float) -> dict[int, str]:
    """Waits for one call of ``random_traffic``; the outcome of each message it carries."""
    from tensorferry.errors import TensorFerryError

    try:
        handle.wait(wait)
    except TensorFerryError as exc:
        failed = type(exc).__name__
        if len(covers) > 1:  # a call of several messages fails whole
            failed += f" (with {len(covers) - 1} more)"
        return {tag: failed for tag, _, _ in covers}
    outcomes = {}
    for tag, got, sent in covers:
        if got is None:
            outcomes[tag] = "ok"
            continue
        got = got.result(wait) if isinstance(got, tf.Transfer) else got
        got = got if isinstance(got, list) else [got]
        right = len(got) == len(sent) and all(map(same_bytes, got, sent))
        outcomes[tag] = "ok" if right else "wrong bytes"
    return outcomes


def random_traffic(
    rank: int,
    world: int,
    seed: int,
    count: int,
    transport: str = "auto",
    changed: float = 0.0,
    wait: float = T,
    broken: float = 0.0,
    early: float = 0.0,
) -> dict:
    """Every rank derives one script from ``seed``: ``count`` messages between random ordered
    pairs of ranks, cut into segments of 1 to 16 messages. A direction is static for the whole
    script (one layout, ``static=True`` on both sides) or not (a new layout each message).
    Each rank carries its side of a segment's messages in script order, grouped its own random
    way: lone sends and receives, batches mixing sends and receives with several peers, a
    ``sendrecv`` of a send and a receive; it receives into poisoned buffers or into specs,
    then waits for all of them at the segment's end, in a random order. (Over NCCL a batch
    goes once every message in it can: one spanning segments could wait for a peer that waits
    for this rank, see ``batch_waits_for_every_peer``.)

    ``wait``: each call's timeout and each wait's bound, in seconds. ``broken``: as
    ``changed``, for the static messages: each one so sent breaks its direction's promise.
    ``early``: the share of messages that both sides carry in a call of their own and wait for
    at once, before their next call (a program that needs a message before it goes on). Every
    rank's waits are then for messages earlier in the script than anything it has yet to
    call, so a correct layer never leaves them waiting for each other.

    With ``changed``, that share of the non-static messages leave with a tensor one row longer
    than their receiver expects: they fail on both sides, and so may others of the calls that
    carry them, on both sides alike.

    Returns ``{tag: outcome}`` for this rank's side of each of its messages: ``"ok"`` (a
    receive: every byte checked), ``"wrong bytes"``, or the error's class name, followed by
    ``" (with N more)"`` where the call that failed carried N more messages (a batch, a
    ``sendrecv``)."""
    import random

    script = random.Random(seed)
    pairs = [(a, b) for a in range(world) for b in range(world) if a != b]
    static = {pair: script.random() < 0.5 for pair in pairs}
    fixed = {pair: _random_layout(script) for pair in pairs}
    segments: list[list] = []
    waited_at_once: set[int] = set()
    for tag in range(count):
        if not segments or script.random() < 1 / 8:
            segments.append([])
        src, dst = script.choice(pairs)
        layout = fixed[(src, dst)] if static[(src, dst)] else _random_layout(script)
        if not static[(src, dst)]:
            mistake = script.random() < changed
        else:  # (no draw without ``broken``: the scripts of earlier seeds stay as they were)
            mistake = broken > 0 and script.random() < broken
        if early > 0 and script.random() < early:  # (no draw without it, as for ``broken``)
            waited_at_once.add(7000 + tag)
        segments[-1].append((src, dst, 7000 + tag, layout, mistake))
    own = random.Random(seed * 1009 + rank)  # this rank's grouping and waits
    try:
        _reset_my_pairs(rank, world)
    except TimeoutError:
        raise

    def side(message):
        """(kind, peer, tensors or buffers, what arrives, static, tag) of this rank's side."""
        src, dst, tag, layout, mistake = message
        if rank == src:
            shapes = _changed(layout) if mistake else layout
            sent = [payload(src, dst, tag * 8 + j, s, d) for j, (s, d) in enumerate(shapes)]
            return "send", dst, sent, None, static[(src, dst)], tag
        sent = [payload(src, dst, tag * 8 + j, s, d) for j, (s, d) in enumerate(layout)]
        if own.random() < 0.5:
            buffers = [poisoned(s, d) for s, d in layout]
        else:
            buffers = [tf.TensorSpec(s, d) for s, d in layout]
        return "recv", src, buffers, sent, static[(src, dst)], tag

    outcomes: dict[int, str] = {}
    for segment in segments:
        mine = [side(m) for m in segment if rank in m[:2]]
        calls: list = []  # (transfer, [(tag, what arrived or None, what was sent)])
        i = 0
        while i < len(mine):
            first, pick = mine[i], own.random()
            if first[5] in waited_at_once:
                pick = 1.0  # a call of its own, waited for below
            if pick < 0.3:  # a batch of the next few messages of the same static-ness
                group, size = [first], own.randint(2, 6)
                while len(group) < size and i + len(group) < len(mine):
                    following = mine[i + len(group)]
                    if following[4] != first[4] or following[5] in waited_at_once:
                        break
                    group.append(following)
                batch = [
                    (tag, kind, peer, tensors, sent) for kind, peer, tensors, sent, _, tag in group
                ]
                calls.append(_traffic_batch(batch, first[4], transport, wait))
                i += len(group)
                continue
            if pick < 0.45 and i + 1 < len(mine):  # a sendrecv, if these are a send and a recv
                second = mine[i + 1]
                alike = first[4] == second[4] and second[5] not in waited_at_once
                if {first[0], second[0]} == {"send", "recv"} and alike:
                    out, into = (first, second) if first[0] == "send" else (second, first)
                    handle = tf.sendrecv(
                        out[2], out[1], into[2], into[1], static=first[4], transport=transport,
                        timeout=wait,
                    )  # fmt: skip
                    calls.append((handle, [(out[5], None, None), (into[5], handle, into[3])]))
                    i += 2
                    continue
            kind, peer, tensors, sent, is_static, tag = first
            call = tf.send if kind == "send" else tf.recv
            handle = call(tensors, peer, static=is_static, transport=transport, timeout=wait)
            covers = [(tag, handle if kind == "recv" else None, sent)]
            if tag in waited_at_once:
                outcomes.update(_traffic_outcomes(handle, covers, wait))
            else:
                calls.append((handle, covers))
            i += 1
        own.shuffle(calls)
        for handle, covers in calls:
            outcomes.update(_traffic_outcomes(handle, covers, wait))
    return outcomes


def random_programs(
    rank: int,
    world: int,
    seed: int,
    count: int,
    transport: str = "auto",
    wait: float = T,
    changed: float = 0.0,
    batches: float = 0.0,
    prepare: bool = False,
) -> dict:
    """Every rank derives from ``seed`` the programs of all ranks: ``count`` messages between
    random ordered pairs, each rank calling its side of them in an order of its own (any order
    that keeps each direction's messages in their order, as two ranks' programs may), with
    waits between its calls: for a call it made, at once or later. A direction is static (one
    layout, ``static=True`` on both sides) or not (a new layout each message).

    Waits are placed as a program's author may place them, not only where a single global
    order would: a rank may send ahead, then wait for a receive before its next call. Where
    the ranks' programs together could never finish (each waiting for a call the other makes
    only after its own wait), the wait is moved to the program's end: the script is checked by
    running all programs step by step, as a correct layer would, before any call is made.

    ``changed``: the share of messages sent with a tensor one row longer than their receiver
    expects (static or not): they fail on both sides, and so may others in flight on that pair.
    ``batches``: the share of calls that are a ``tf.batch`` of two to four messages (with any
    peers, both directions, all static or none), each of which goes as soon as it can, as with
    torch's ``batch_isend_irecv``: what gloo promises, not NCCL (where a batch goes once every
    message in it can).

    ``prepare``: every pair is made with ``tf.prepare`` before the first call, rather than by
    its first message (over NCCL: while other pairs' transfers run, see docs/transfers.md).

    Returns ``{tag: outcome}`` for this rank's side of each of its messages (as
    ``random_traffic``)."""
    import random

    script = random.Random(seed)
    pairs = [(a, b) for a in range(world) for b in range(world) if a != b]
    static = {pair: script.random() < 0.5 for pair in pairs}
    fixed = {pair: _random_layout(script) for pair in pairs}
    messages = []  # (src, dst, tag, layout)
    mistakes = set()
    for tag in range(8000, 8000 + count):
        src, dst = script.choice(pairs)
        layout = fixed[(src, dst)] if static[(src, dst)] else _random_layout(script)
        messages.append((src, dst, tag, layout))
        if changed > 0 and script.random() < changed:  # (no draw without: seeds stay as were)
            mistakes.add(tag)
    programs = [
        _random_program(script, r, messages, static, batches) for r in range(world)
    ]  # fmt: skip
    _drop_waits_that_cannot_end(programs, messages)
    own = random.Random(seed * 1013 + rank)  # this rank's buffers (poisoned or specs)
    try:
        _reset_my_pairs(rank, world)
    except TimeoutError:
        raise
    if prepare:
        tf.prepare([p for p in range(world) if p != rank])
    by_tag = {m[2]: m for m in messages}

    def side(tag: int) -> tuple:
        """(kind, peer, tensors or buffers, what arrives, static) of this rank's side."""
        src, dst, _, layout = by_tag[tag]
        if rank == src:
            shapes = _changed(layout) if tag in mistakes else layout
            sent = [payload(src, dst, tag * 8 + j, s, d).to(D()) for j, (s, d) in
                    enumerate(shapes)]  # fmt: skip
            return "send", dst, sent, None, static[(src, dst)]
        sent = [payload(src, dst, tag * 8 + j, s, d).to(D()) for j, (s, d) in enumerate(layout)]
        if own.random() < 0.5:
            buffers: list = [poisoned(s, d) for s, d in layout]
        else:
            buffers = [tf.TensorSpec(s, d) for s, d in layout]
        return "recv", src, buffers, sent, static[(src, dst)]

    handles: dict[tuple, tuple] = {}
    outcomes: dict[int, str] = {}
    for step, tags in programs[rank]:
        if step == "wait":
            handle, covers = handles.pop(tags)
            outcomes.update(_traffic_outcomes(handle, covers, wait))
            continue
        sides = [(tag, *side(tag)) for tag in tags]
        if len(sides) == 1:
            tag, kind, peer, tensors, sent, is_static = sides[0]
            call = tf.send if kind == "send" else tf.recv
            h = call(tensors, peer, static=is_static, transport=transport, timeout=wait)
            handles[tags] = (h, [(tag, h if kind == "recv" else None, sent)])
            continue
        batch = [(tag, kind, peer, tensors, sent) for tag, kind, peer, tensors, sent, _ in sides]
        handles[tags] = _traffic_batch(batch, sides[0][5], transport, wait)
    for tags in list(handles):  # the waits left to the end, in call order
        handle, covers = handles.pop(tags)
        outcomes.update(_traffic_outcomes(handle, covers, wait))
    return outcomes


def recv_from_doomed(rank: int, world: int, doomed: int, transport: str = "auto") -> dict:
    """Rank 0 waits for a message from ``doomed`` (killed by the test meanwhile); over an
    agreed static channel (see :func:`static_with`) when ``transport`` is given."""
    if rank != 0:
        return {}
    t0 = time.monotonic()
    static = transport != "auto"
    h = tf.recv(tf.TensorSpec((1 << 16,)), doomed, timeout=8.0, static=static, transport=transport)
    try:
        h.wait()
    except PeerLostError as exc:
        from tensorferry.runtime import communicator_cache

        return {
            "seconds": time.monotonic() - t0,
            "message": str(exc),
            "cache_keys": [list(k) for k in communicator_cache().keys()],  # noqa: SIM118
        }
    raise AssertionError("no PeerLostError")
