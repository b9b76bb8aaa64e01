"""NVLink send/recv copy kernels over PyTorch symmetric memory (Triton).

Protocol
========
Each rank owns two symmetric allocations, mapped into every peer's address space:

- ``stage`` (``uint8``): receive staging, ``[src rank][lane][slot]`` of ``SLOT_BYTES`` each.
  Only rank ``src`` writes ``stage[src]`` of a receiver (remote stores over NVLink).
- ``sig`` (``int64`` words, see :mod:`tensorferry.p2p.nvlink._layout`): signal and counter
  words. Peers write ``READY``, ``FREE``, ``POST`` and the peer half of ``STATUS``; the owner
  alone writes its step counters.

A message of ``nbytes`` is cut into chunks of ``chunk`` bytes; chunk ``c`` belongs to lane
``c % num_ctas`` (the *adaptive stride*: a lane's consecutive chunks are ``num_ctas * chunk``
bytes apart, and ``chunk`` grows with the message up to ``SLOT_BYTES``). One CTA runs one
lane of one direction. A launch has ``recv_ctas`` receiver CTAs first, then ``send_ctas``
sender CTAs (receivers first, so that when the GPU is too busy to make the whole grid resident,
the CTAs the *peer* waits for are the ones that start).

Data flow of one message, sender S (lane ``b``) → receiver R (lane ``b``)::

    R lane 0: POST meta (nbytes, dtype, ctas, chunk, zero-copy target) ──► S.sig[POST(R)]
    S lane b: wait POST, compare meta with its own (mismatch → STATUS + poison R, stop)
    for each chunk k of lane b (step = lane counter + k):
        S: wait S.sig[FREE(R, b)] >= step - NUM_SLOTS + 1        (slot free again)
        S: remote stores  chunk ──► R.stage[S][b][step % NUM_SLOTS]  (or straight into R's
           symmetric receive tensor when R posted a zero-copy target)
        S: fence.sys, CTA barrier, R.sig[READY(S, b)] = step + 1     (release, atomic max)
        R: wait R.sig[READY(S, b)] >= step + 1                      (acquire)
        R: local copy stage slot ──► receive tensor
        R: fence.sys, CTA barrier, S.sig[FREE(R, b)] = step + 1

Only stores cross NVLink; every wait spins on the waiter's own memory.

Counters and CUDA graphs
========================
Lane step counters (``SEND_STEP``, ``RECV_STEP``) and message counters (``SEND_MSG`` per
lane, ``RECV_MSG``) live in device memory and are read at kernel start and written at kernel
end, so a launch carries no host-side step number: the same launch captured in a CUDA graph
replays correctly any number of times. Signals only grow, so slots never need resetting.

Memory ordering
===============
Writer: data stores (weak) → ``fence.acq_rel.sys`` by every thread → ``bar.sync`` → one
``atom.release.sys.max`` on the signal. Reader: ``ld.acquire.sys`` on the signal → ``bar.sync``
(implicit in the loop structure: every thread spins itself) → data loads with ``.cg`` (L2,
never a stale L1 line of an earlier use of the slot).

Errors
======
Every wait is bounded by ``timeout_ns`` of the global timer. A sender that finds the
receiver's meta different writes an error code to its own and the receiver's ``STATUS`` and
poisons all of the receiver's ``READY`` words for it, so no receiver CTA waits forever. The
host reads ``STATUS`` when asked (``NvlinkChannel.check``); a channel that failed is broken.

Scope: any world size, ``send_peer`` ≠ ``recv_peer`` allowed (rings); one peer per direction
per launch; no NVLink multicast.
"""

import triton
import triton.language as tl

from tensorferry.p2p.nvlink.utils import fence_system, globaltimer, signal, wait_at_least

# Error codes (mirrored by tensorferry.p2p.nvlink._layout).
ERR_NBYTES = tl.constexpr(1)
ERR_DTYPE = tl.constexpr(2)
ERR_NUM_CTAS = tl.constexpr(3)
ERR_CHUNK = tl.constexpr(4)
ERR_TIMEOUT = tl.constexpr(8)
ERR_PEER_ABORT = tl.constexpr(9)
POISON = tl.constexpr(1 << 62)
META_WORDS = tl.constexpr(8)


@triton.jit
def _copy_chunk(
    src,
    dst,
    n_body,
    n_total,
    BLOCK: tl.constexpr,
    ALIGNED: tl.constexpr,
    FROM_STAGE: tl.constexpr,
):
    """Copies ``n_total`` bytes ``src`` → ``dst`` (``uint8`` pointers).

    ``ALIGNED``: both pointers are 16-byte aligned and ``n_body`` (a multiple of 16, at most
    15 bytes short of ``n_total``) is copied as ``int32`` words, four per thread per access, so
    loads and stores are 16-byte vectors; the last ``n_total - n_body`` bytes go one by one.
    Example: ``n_total = 4099`` → 1024 words in one masked vector pass, then 3 bytes.
    """
    if ALIGNED:
        src_words = src.to(tl.pointer_type(tl.int32), bitcast=True)
        dst_words = dst.to(tl.pointer_type(tl.int32), bitcast=True)
        n_words = tl.multiple_of(n_body // 4, 4)
        for start in range(0, n_words, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < n_words
            if FROM_STAGE:
                x = tl.load(src_words + offs, mask=mask, cache_modifier=".cg")
            else:
                x = tl.load(src_words + offs, mask=mask)
            tl.store(dst_words + offs, x, mask=mask)
        if n_total > n_body:
            offs = tl.arange(0, 16)
            mask = offs < n_total - n_body
            if FROM_STAGE:
                x = tl.load(src + n_body + offs, mask=mask, cache_modifier=".cg")
            else:
                x = tl.load(src + n_body + offs, mask=mask)
            tl.store(dst + n_body + offs, x, mask=mask)
    else:
        for start in range(0, n_total, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < n_total
            if FROM_STAGE:
                x = tl.load(src + offs, mask=mask, cache_modifier=".cg")
            else:
                x = tl.load(src + offs, mask=mask)
            tl.store(dst + offs, x, mask=mask)


@triton.jit
def _send_lane(
    send_ptr,
    local_sig,
    peer_sig,
    peer_stage,
    zc_delta,
    rank,
    world_size,
    peer,
    lane,
    nbytes,
    body,
    num_ctas,
    chunk,
    dtype_code,
    timeout_ns,
    deadline,
    MAX_BLOCKS: tl.constexpr,
    NUM_SLOTS: tl.constexpr,
    SLOT_BYTES: tl.constexpr,
    BLOCK: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    """One sender CTA: lane ``lane`` of the message to ``peer`` (see the protocol above)."""
    lanes = world_size * MAX_BLOCKS
    post = local_sig + 5 * lanes + peer * META_WORDS
    status = local_sig + 5 * lanes + 9 * world_size
    msg_word = local_sig + 4 * lanes + peer * MAX_BLOCKS + lane
    step_word = local_sig + 2 * lanes + peer * MAX_BLOCKS + lane
    msg = tl.load(msg_word, volatile=True)
    seen = wait_at_least(post, msg + 1, deadline)
    error = 0
    if seen < msg + 1:
        error = ERR_TIMEOUT
    else:
        if tl.load(post + 1, volatile=True) != nbytes:
            error = ERR_NBYTES
        elif tl.load(post + 2, volatile=True) != dtype_code:
            error = ERR_DTYPE
        elif tl.load(post + 3, volatile=True) != num_ctas:
            error = ERR_NUM_CTAS
        elif tl.load(post + 4, volatile=True) != chunk:
            error = ERR_CHUNK
    if error != 0:
        tl.atomic_max(status, error, sem="relaxed", scope="sys")
        if error != ERR_TIMEOUT:
            # Tell the receiver why, then wake every receiver CTA waiting on us.
            tl.atomic_max(peer_sig + 5 * lanes + 9 * world_size + 1, error, scope="sys")
            fence_system()
            for b in range(MAX_BLOCKS):
                signal(peer_sig + rank * MAX_BLOCKS + b, POISON)
    else:
        zc_id = tl.load(post + 5, volatile=True)
        zc_offset = tl.load(post + 6, volatile=True)
        step0 = tl.load(step_word, volatile=True)
        num_chunks = tl.cdiv(nbytes, chunk)
        count = tl.cdiv(num_chunks - lane, num_ctas)
        ready = peer_sig + rank * MAX_BLOCKS + lane
        free = local_sig + lanes + peer * MAX_BLOCKS + lane
        k = 0
        while (k < count) & (error == 0):
            step = step0 + k
            offset = (k * num_ctas + lane) * chunk
            n_total = tl.minimum(nbytes - offset, chunk)
            n_body = tl.minimum(body - offset, chunk)
            n_body = tl.maximum(n_body, 0)
            if zc_id >= 0:
                delta = tl.load(zc_delta + zc_id * world_size + peer)
                dst = peer_stage + tl.multiple_of(delta + zc_offset + offset, 16)
            else:
                # The slot is free once the receiver consumed the step that used it before.
                got = wait_at_least(free, step - NUM_SLOTS + 1, deadline)
                if got < step - NUM_SLOTS + 1:
                    error = ERR_TIMEOUT
                slot = (rank * MAX_BLOCKS + lane) * NUM_SLOTS + step % NUM_SLOTS
                dst = peer_stage + slot * SLOT_BYTES
            if error == 0:
                _copy_chunk(send_ptr + offset, dst, n_body, n_total, BLOCK, ALIGNED, False)
                fence_system()
                tl.debug_barrier()
                signal(ready, step + 1)
            k += 1
        if error != 0:
            tl.atomic_max(status, error, sem="relaxed", scope="sys")
        tl.store(step_word, step0 + count)
        # Every lane's copy of the message count advances, including lanes this launch does
        # not run (a later message may use more lanes); lane j is written only by lane
        # j % num_ctas, so no lane of this launch reads a word another lane already wrote.
        msg_base = local_sig + 4 * lanes + peer * MAX_BLOCKS
        for j in range(lane, MAX_BLOCKS, num_ctas):
            tl.store(msg_base + j, msg + 1)


@triton.jit
def _recv_lane(
    recv_ptr,
    local_sig,
    local_stage,
    peer_sig,
    rank,
    world_size,
    peer,
    lane,
    nbytes,
    body,
    num_ctas,
    chunk,
    dtype_code,
    zc_id,
    zc_offset,
    deadline,
    MAX_BLOCKS: tl.constexpr,
    NUM_SLOTS: tl.constexpr,
    SLOT_BYTES: tl.constexpr,
    BLOCK: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    """One receiver CTA: lane ``lane`` of the message from ``peer``."""
    lanes = world_size * MAX_BLOCKS
    status = local_sig + 5 * lanes + 9 * world_size
    step_word = local_sig + 3 * lanes + peer * MAX_BLOCKS + lane
    if lane == 0:
        # Post what we expect (and where to write it) into the sender's memory.
        msg_word = local_sig + 5 * lanes + 8 * world_size + peer
        msg = tl.load(msg_word, volatile=True)
        post = peer_sig + 5 * lanes + rank * META_WORDS
        tl.store(post + 1, nbytes)
        tl.store(post + 2, dtype_code)
        tl.store(post + 3, num_ctas)
        tl.store(post + 4, chunk)
        tl.store(post + 5, zc_id)
        tl.store(post + 6, zc_offset)
        fence_system()
        tl.debug_barrier()
        signal(post, msg + 1)
        tl.store(msg_word, msg + 1)
    step0 = tl.load(step_word, volatile=True)
    num_chunks = tl.cdiv(nbytes, chunk)
    count = tl.cdiv(num_chunks - lane, num_ctas)
    ready = local_sig + peer * MAX_BLOCKS + lane
    free = peer_sig + lanes + rank * MAX_BLOCKS + lane
    error = 0
    if zc_id >= 0:
        # Zero-copy: the sender wrote straight into our tensor; wait for its last chunk.
        got = wait_at_least(ready, step0 + count, deadline)
        if got >= POISON:
            error = ERR_PEER_ABORT
        elif got < step0 + count:
            error = ERR_TIMEOUT
        else:
            signal(free, step0 + count)
    else:
        k = 0
        while (k < count) & (error == 0):
            step = step0 + k
            got = wait_at_least(ready, step + 1, deadline)
            if got >= POISON:
                error = ERR_PEER_ABORT
            elif got < step + 1:
                error = ERR_TIMEOUT
            else:
                offset = (k * num_ctas + lane) * chunk
                n_total = tl.minimum(nbytes - offset, chunk)
                n_body = tl.maximum(tl.minimum(body - offset, chunk), 0)
                slot = (peer * MAX_BLOCKS + lane) * NUM_SLOTS + step % NUM_SLOTS
                src = local_stage + slot * SLOT_BYTES
                _copy_chunk(src, recv_ptr + offset, n_body, n_total, BLOCK, ALIGNED, True)
                fence_system()
                tl.debug_barrier()
                signal(free, step + 1)
            k += 1
    if error != 0:
        tl.atomic_max(status, error, sem="relaxed", scope="sys")
    tl.store(step_word, step0 + count)


@triton.jit
def _sendrecv_kernel(
    send_ptr,
    recv_ptr,
    local_sig,
    local_stage,
    send_peer_sig,
    send_peer_stage,
    recv_peer_sig,
    zc_delta,
    rank,
    world_size,
    send_peer,
    recv_peer,
    send_nbytes,
    send_body,
    send_ctas,
    send_chunk,
    send_dtype,
    recv_nbytes,
    recv_body,
    recv_ctas,
    recv_chunk,
    recv_dtype,
    recv_zc_id,
    recv_zc_offset,
    timeout_ns,
    HAS_SEND: tl.constexpr,
    HAS_RECV: tl.constexpr,
    SEND_ALIGNED: tl.constexpr,
    RECV_ALIGNED: tl.constexpr,
    MAX_BLOCKS: tl.constexpr,
    NUM_SLOTS: tl.constexpr,
    SLOT_BYTES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Send ``send_nbytes`` to ``send_peer`` and/or receive ``recv_nbytes`` from ``recv_peer``.

    Grid: ``(recv_ctas if HAS_RECV else 0) + (send_ctas if HAS_SEND else 0)``; program ids
    below ``recv_ctas`` are receiver lanes, the rest sender lanes. ``*_body`` is the byte count
    rounded down to 16; ``*_dtype`` a small code both sides compare.

    Example: a 1 MiB one-way send with 8 CTAs and 128 KiB chunks launches 8 sender programs on
    the sender and 8 receiver programs on the receiver; sender lane 3 writes bytes
    [384 KiB, 512 KiB) into the receiver's ``stage[sender][3][step % NUM_SLOTS]`` and raises
    ``READY(sender, 3)`` by one.
    """
    pid = tl.program_id(0)
    deadline = globaltimer() + timeout_ns
    num_recv = 0
    if HAS_RECV:
        num_recv = recv_ctas
    if HAS_RECV and pid < num_recv:
        _recv_lane(
            recv_ptr,
            local_sig,
            local_stage,
            recv_peer_sig,
            rank,
            world_size,
            recv_peer,
            pid,
            recv_nbytes,
            recv_body,
            recv_ctas,
            recv_chunk,
            recv_dtype,
            recv_zc_id,
            recv_zc_offset,
            deadline,
            MAX_BLOCKS,
            NUM_SLOTS,
            SLOT_BYTES,
            BLOCK,
            RECV_ALIGNED,
        )
    if HAS_SEND and pid >= num_recv:
        _send_lane(
            send_ptr,
            local_sig,
            send_peer_sig,
            send_peer_stage,
            zc_delta,
            rank,
            world_size,
            send_peer,
            pid - num_recv,
            send_nbytes,
            send_body,
            send_ctas,
            send_chunk,
            send_dtype,
            timeout_ns,
            deadline,
            MAX_BLOCKS,
            NUM_SLOTS,
            SLOT_BYTES,
            BLOCK,
            SEND_ALIGNED,
        )
