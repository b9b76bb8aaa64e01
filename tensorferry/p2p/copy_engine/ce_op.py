"""Copy-engine transport: ``cudaMemcpyAsync`` between symmetric staging and tensors, zero SMs.

Protocol
========
Each rank owns a symmetric ``uint8`` staging buffer ``[dst rank][slot]`` of ``slot_bytes`` (its
outgoing chunks, by destination) and a symmetric ``int32`` flag area. A message is cut into
chunks (at most a slot each) that take slots in turn. Flags are set to 1 by one side and reset
to 0 by the other after waiting, so each message leaves them as it found them and a captured
CUDA graph replays correctly.

The receiver *pulls*: its copy engine reads each chunk out of the sender's staging straight into
the output over NVLink. So the receiving GPU, which is usually the one computing, sees only the
message's own writes into its memory: no staging copy of its own competes with its kernels for
memory bandwidth (pushing into the receiver's staging and copying out there slowed a matmul loop
on the receiver by 16% for 4 GiB; a plain cross-device copy by 6-7%). The sender's staging
copy stays on the sending GPU.

Sender S, on its own send stream::

    wait  S.ACK(R) >= 1; reset                            (R consumed the last SENT; starts 1)
    write R.SENT(S) = codes(nbytes, dtype)               (remote, for R's agreement wait)
    wait  S.POST(R) == codes; reset                       (R posted the same message)
    per chunk i, slot = i % num_slots:
        wait S.FREE(R, slot) >= 1; reset                 (R copied the slot out)
        memcpy chunk ──► S.stage[R][slot]                 (copy engine, local)
        write R.READY(S, slot) = 1                        (remote; fenced after the memcpy)

Receiver R, on its own recv stream::

    write S.POST(R) = codes; wait R.SENT(S) == codes; reset; write S.ACK(R) = 1
    per chunk i: wait R.READY(S, slot) >= 1; reset;
                 memcpy S.stage[R][slot] ──► out          (copy engine, over NVLink)
                 write S.FREE(R, slot) = 1                (remote; after the memcpy finished)

Why the ACK: without it the sender of several messages in a row could write the next message's
codes into R.SENT before R's stream had compared (or reset) the previous ones, and R would then
wait for codes that never come back (it hung a message of seven tensors of different sizes).
The sender waits for it before it writes SENT, not after: R sets it as soon as it matched, so by
the next message it is long there, and no message waits a round trip for its own ACK. Like the
FREE slots it starts at 1.

A size or dtype mismatch leaves both streams waiting on the agreement words; the host-side
``wait(timeout)`` then reads the words the peer posted, satisfies its own streams' waits from the
host until they drain (so the caller's stream is not blocked forever; the receive tensor holds
garbage) and raises :class:`~tensorferry.MismatchError`. Such a channel is broken; close it
with ``force=True``.
"""

from __future__ import annotations

import collections
import functools
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from tensorferry._seconds import checked_seconds
from tensorferry.errors import MismatchError, TransferTimeoutError, TransportError
from tensorferry.p2p._packing import as_bytes
from tensorferry.p2p.copy_engine import _streamops
from tensorferry.p2p.nvlink._layout import dtype_code
from tensorferry.p2p.nvlink._symm import group_name_of, join_group, setup_stream
from tensorferry.p2p.nvlink.sendrecv_op import validate_message
from tensorferry.runtime._hardware_queues import WANTED_QUEUES, hardware_queues

__all__ = ["CopyEngineChannel", "CeTransfer", "CeLayout", "plan_chunks", "agreement_codes"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CeLayout:
    """Word offsets of the ``int32`` flag area."""

    world_size: int
    num_slots: int

    def ready(self, src: int, slot: int) -> int:
        return src * self.num_slots + slot

    def free(self, dst: int, slot: int) -> int:
        return (self.world_size + dst) * self.num_slots + slot

    def post(self, dst: int) -> int:
        return 2 * self.world_size * self.num_slots + 2 * dst

    def sent(self, src: int) -> int:
        return 2 * self.world_size * self.num_slots + 2 * self.world_size + 2 * src

    def ack(self, dst: int) -> int:
        return 2 * self.world_size * self.num_slots + 4 * self.world_size + dst

    @property
    def num_words(self) -> int:
        return 2 * self.world_size * self.num_slots + 5 * self.world_size

    def starting_at_one(self) -> list[int]:
        """The words that start at 1 (all others at 0): every ``ACK`` (the first ``SENT`` may be
        written) and every ``FREE`` slot (the first chunks may be staged)."""
        words = [self.ack(dst) for dst in range(self.world_size)]
        words += [
            self.free(dst, slot) for dst in range(self.world_size) for slot in range(self.num_slots)
        ]
        return words


def agreement_codes(nbytes: int, dtype: torch.dtype) -> tuple[int, int]:
    """Two non-zero 31-bit words both sides must post equal: one for the size, one for dtype."""
    return nbytes % 2147483629 + 1, dtype_code(dtype) + 1


def plan_chunks(nbytes: int, slot_bytes: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of each chunk: about a quarter of the message (so copies in and
    out of staging overlap), at least 1 MiB, at most a slot.

    Example: 100 MiB with 32 MiB slots → four chunks of 25 MiB.
    """
    if nbytes <= 0:
        return []
    chunk = max(1 << 20, -(-math.ceil(nbytes / 4) // 4096) * 4096)
    chunk = min(chunk, slot_bytes)
    return [(off, min(chunk, nbytes - off)) for off in range(0, nbytes, chunk)]


class CeTransfer:
    """Handle of queued copy-engine work.

    Attributes:
        events: one per direction, each recorded after that direction's last copy.
        event: the last of them.
    """

    def __init__(self, channel: CopyEngineChannel, events: list[Any], checks: list[tuple]) -> None:
        self._channel = channel
        self.events = tuple(events)
        self._checks = checks
        self.event = events[-1] if events else None

    def ready(self) -> bool:
        """True once the copies finished. Never blocks."""
        return all(e.query() for e in self.events)

    def wait(self, timeout: float | None = None) -> None:
        """Blocks until done (polling; never past ``timeout`` seconds, default the channel's).

        Raises:
            MismatchError: the peer posted a different size (``field="nbytes"``) or dtype.
            TransferTimeoutError: the peer did not take part within the timeout.
        """
        limit = self._channel.timeout_s if timeout is None else checked_seconds(timeout, "timeout")
        deadline = time.monotonic() + limit
        delay = 1e-5
        while not self.ready():
            if time.monotonic() > deadline:
                self._channel._diagnose(self._checks)
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)


@functools.cache
def _warn_if_queues_shared() -> None:
    queues = hardware_queues()
    if queues < WANTED_QUEUES:
        log.warning(
            "copy-engine transfers wait on device flags, and this process has %d CUDA hardware "
            "queue(s) per device (CUDA_DEVICE_MAX_CONNECTIONS): streams share queues, and a "
            "wait can hold up a signal a peer needs that is queued behind it. Import "
            "tensorferry before CUDA is initialised, or set "
            "CUDA_DEVICE_MAX_CONNECTIONS=%d.",
            queues,
            WANTED_QUEUES,
        )


class CopyEngineChannel:
    """One rank's end of the copy-engine transport for a process group.

    Collective to construct (symmetric buffers). Work runs on two exclusive streams leased from
    the tensorferry runtime; the caller's stream is ordered before and after with events.

    Args:
        group: process group (default: the world).
        device: this rank's CUDA device (default: the current one).
        slot_bytes: bytes per staging slot (largest chunk).
        num_slots: staging slots per source rank.
        timeout_s: default bound of :meth:`CeTransfer.wait`.
        members: instead of ``group``, ``(group name, rank, world size, store)`` of a
            symmetric-memory group registered here (the transport's pair channels).
    """

    def __init__(
        self,
        group: Any = None,
        *,
        device: Any = None,
        slot_bytes: int = 32 << 20,
        num_slots: int = 2,
        timeout_s: float = 60.0,
        members: tuple[str, int, int, Any] | None = None,
    ) -> None:
        import torch.distributed as dist
        from torch.distributed import _symmetric_memory as symm_mem

        from tensorferry.runtime import Client

        store = None
        self._own_group = None
        if members is not None:
            group_name, rank, world_size, store = members
            # Kept alive with the channel: c10d holds registered groups weakly.
            self._own_group = join_group(group_name, rank, world_size, store)

        if not _streamops.available():
            raise TransportError("the copy-engine transport needs cuda-python (cuda.bindings)")
        if not isinstance(slot_bytes, int) or slot_bytes <= 0 or slot_bytes % 4096:
            raise ValueError(f"slot_bytes must be a positive multiple of 4096, got {slot_bytes}")
        if not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"num_slots must be a positive int, got {num_slots}")
        timeout_s = checked_seconds(timeout_s, "timeout_s")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = torch.device(device)
        if self.device.type != "cuda" or self.device.index is None:
            raise ValueError(f"device must be an indexed CUDA device, got {self.device}")
        if members is None:
            group_name = group_name_of(group)
            rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        self.group_name, self.rank, self.world_size = group_name, rank, world_size
        self.slot_bytes = slot_bytes
        self.timeout_s = timeout_s
        self.layout = CeLayout(self.world_size, num_slots)
        _warn_if_queues_shared()
        log.debug("ce channel %s: set-up starts (rank %d of %d)", group_name, rank, world_size)
        self._client = Client(devices=[self.device])
        log.debug("ce channel %s: streams leased", group_name)
        self._send_stream = self._client.stream(self.device, "send")
        self._recv_stream = self._client.stream(self.device, "recv")
        with setup_stream(self.device):
            self._flags = symm_mem.empty(
                self.layout.num_words, dtype=torch.int32, device=self.device
            )
            self._flags.zero_()
            for word in self.layout.starting_at_one():
                self._flags[word] = 1
            self._stage = symm_mem.empty(
                self.world_size * num_slots * slot_bytes, dtype=torch.uint8, device=self.device
            )
            log.debug("ce channel %s: buffers allocated, rendezvous", group_name)
            flag_handle = symm_mem.rendezvous(self._flags, self.group_name)
            stage_handle = symm_mem.rendezvous(self._stage, self.group_name)
            self._handles = (flag_handle, stage_handle)
            self._flag_ptr = list(flag_handle.buffer_ptrs)
            self._peer_stage = [
                stage_handle.get_buffer(r, (self._stage.numel(),), torch.uint8)
                for r in range(self.world_size)
            ]
        self._diag_stream = torch.cuda.Stream(self.device)
        self._broken: str | None = None
        self._closed = False
        # Transfers issued and not yet seen finished, oldest first (drained in that order).
        self._unfinished: collections.deque[CeTransfer] = collections.deque()
        if store is not None:
            store.add("ce-ready", 1)
            deadline = time.monotonic() + 300
            while int(store.add("ce-ready", 0)) < self.world_size:
                if time.monotonic() > deadline:
                    raise TransferTimeoutError("copy-engine channel: peers did not initialise")
                time.sleep(1e-3)
        else:
            dist.barrier(group=group)
        log.info(
            "copy-engine channel rank %d/%d on %s: %d x %d B slots",
            self.rank,
            self.world_size,
            self.device,
            num_slots,
            slot_bytes,
        )

    # ------------------------------------------------------------------ transfers
    def send(self, tensor: torch.Tensor, peer: int, **options: Any) -> CeTransfer:
        """One-way send; see :meth:`sendrecv`."""
        return self.sendrecv(tensor, peer, None, None, **options)

    def recv(self, tensor: torch.Tensor, peer: int, **options: Any) -> CeTransfer:
        """One-way receive; see :meth:`sendrecv`."""
        return self.sendrecv(None, None, tensor, peer, **options)

    def sendrecv(
        self,
        send: torch.Tensor | None,
        send_peer: int | None,
        recv: torch.Tensor | None,
        recv_peer: int | None,
        *,
        stream: Any = None,
    ) -> CeTransfer:
        """Queues a send and/or a receive on the channel's copy streams and returns at once.

        ``stream`` (default: the current stream) is ordered both ways: the copies start after
        work queued on it so far, and work queued on it later waits for the copies.

        Args:
            send: contiguous tensor on this device, or ``None``. Byte count and dtype must equal
                the receiver's ``recv``.
            send_peer: group rank to send to.
            recv: contiguous tensor to fill, or ``None``.
            recv_peer: group rank to receive from.
            stream: the caller's stream.

        Returns:
            A :class:`CeTransfer`.

        Raises:
            TypeError / ValueError: bad tensors or peers (nothing queued).
            TransportError: closed or broken channel.
        """
        if self._closed:
            raise TransportError("the copy-engine channel is closed")
        if self._broken:
            raise TransportError(f"the copy-engine channel is broken ({self._broken})")
        if send is None and recv is None:
            raise ValueError("sendrecv needs a tensor to send, to receive, or both")
        if (send is None) != (send_peer is None) or (recv is None) != (recv_peer is None):
            raise ValueError("a tensor and its peer go together")
        for tensor, peer, what in ((send, send_peer, "send"), (recv, recv_peer, "recv")):
            if tensor is None:
                continue
            validate_message(tensor, what=f"{what} tensor", device=self.device)
            if not isinstance(peer, int) or isinstance(peer, bool):
                raise TypeError(f"{what}_peer must be an int, got {type(peer).__name__}")
            if not 0 <= peer < self.world_size or peer == self.rank:
                raise ValueError(f"{what}_peer={peer} is out of range or this rank")
        caller = torch.cuda.current_stream(self.device) if stream is None else stream
        start = torch.cuda.Event()
        start.record(caller)
        transfer = self.issue(send, send_peer, recv, recv_peer, after=start)
        for event in transfer.events:
            caller.wait_event(event)
        return transfer

    def issue(
        self,
        send: torch.Tensor | None,
        send_peer: int | None,
        recv: torch.Tensor | None,
        recv_peer: int | None,
        *,
        after: Any,
    ) -> CeTransfer:
        """Queues the copies after the event ``after`` and returns at once, leaving the
        caller's stream alone (arguments already checked, as by :meth:`sendrecv`).

        For a caller with several channels (a ring: sending right, receiving left): it issues
        on every channel after one event and only then makes its stream wait for them all.
        Waiting for each before issuing the next would queue our receive behind our send,
        which finishes only once the right-hand peer received — itself queued behind its own
        send: around a ring, nobody receives.
        """
        events, checks = [], []
        if recv is not None and recv.numel() > 0:
            events.append(self._issue_recv(recv, recv_peer, after))
            checks.append(("recv", recv_peer, agreement_codes(recv.nbytes, recv.dtype)))
        if send is not None and send.numel() > 0:
            events.append(self._issue_send(send, send_peer, after))
            checks.append(("send", send_peer, agreement_codes(send.nbytes, send.dtype)))
        transfer = CeTransfer(self, events, checks)
        if not torch.cuda.is_current_stream_capturing():  # an event query breaks a capture
            while self._unfinished and self._unfinished[0].ready():
                self._unfinished.popleft()
            self._unfinished.append(transfer)
        log.debug("ce channel %s: issued %s", self.group_name, checks)
        return transfer

    def _issue_send(self, tensor: torch.Tensor, peer: int, start: Any) -> Any:
        s, lay = self._send_stream, self.layout
        flag = self._flags.data_ptr()
        peer_flag = self._flag_ptr[peer]
        nbytes_code, dtype_word = agreement_codes(tensor.nbytes, tensor.dtype)
        src = as_bytes(tensor)
        s.wait_event(start)
        _streamops.wait_value32(s, flag + 4 * lay.ack(peer), 1, _streamops.WAIT_GEQ)
        _streamops.write_value32(s, flag + 4 * lay.ack(peer), 0)
        _streamops.write_value32(s, peer_flag + 4 * lay.sent(self.rank), nbytes_code)
        _streamops.write_value32(s, peer_flag + 4 * (lay.sent(self.rank) + 1), dtype_word)
        for word, value in ((lay.post(peer), nbytes_code), (lay.post(peer) + 1, dtype_word)):
            _streamops.wait_value32(s, flag + 4 * word, value, _streamops.WAIT_EQ)
            _streamops.write_value32(s, flag + 4 * word, 0)
        stage = self._stage  # ours: the receiver pulls from it
        with torch.cuda.stream(s):
            for i, (off, length) in enumerate(plan_chunks(tensor.nbytes, self.slot_bytes)):
                slot = i % lay.num_slots
                free = flag + 4 * lay.free(peer, slot)
                _streamops.wait_value32(s, free, 1, _streamops.WAIT_GEQ)
                _streamops.write_value32(s, free, 0)
                base = (peer * lay.num_slots + slot) * self.slot_bytes
                stage[base : base + length].copy_(src[off : off + length], non_blocking=True)
                _streamops.write_value32(s, peer_flag + 4 * lay.ready(self.rank, slot), 1)
        if not torch.cuda.is_current_stream_capturing():
            tensor.record_stream(s)
        done = torch.cuda.Event()
        done.record(s)
        return done

    def _issue_recv(self, tensor: torch.Tensor, peer: int, start: Any) -> Any:
        s, lay = self._recv_stream, self.layout
        flag = self._flags.data_ptr()
        peer_flag = self._flag_ptr[peer]
        nbytes_code, dtype_word = agreement_codes(tensor.nbytes, tensor.dtype)
        dst = as_bytes(tensor)
        s.wait_event(start)
        _streamops.write_value32(s, peer_flag + 4 * lay.post(self.rank), nbytes_code)
        _streamops.write_value32(s, peer_flag + 4 * (lay.post(self.rank) + 1), dtype_word)
        for word, value in ((lay.sent(peer), nbytes_code), (lay.sent(peer) + 1, dtype_word)):
            _streamops.wait_value32(s, flag + 4 * word, value, _streamops.WAIT_EQ)
            _streamops.write_value32(s, flag + 4 * word, 0)
        _streamops.write_value32(s, peer_flag + 4 * lay.ack(self.rank), 1)
        stage = self._peer_stage[peer]  # the sender's: pulled over NVLink by our copy engine
        # Inference mode: the receive buffer may be an inference tensor (see _packing.unpack).
        with torch.cuda.stream(s), torch.inference_mode():
            for i, (off, length) in enumerate(plan_chunks(tensor.nbytes, self.slot_bytes)):
                slot = i % lay.num_slots
                ready = flag + 4 * lay.ready(peer, slot)
                _streamops.wait_value32(s, ready, 1, _streamops.WAIT_GEQ)
                _streamops.write_value32(s, ready, 0)
                base = (self.rank * lay.num_slots + slot) * self.slot_bytes
                dst[off : off + length].copy_(stage[base : base + length], non_blocking=True)
                _streamops.write_value32(s, peer_flag + 4 * lay.free(self.rank, slot), 1)
        if not torch.cuda.is_current_stream_capturing():
            tensor.record_stream(s)
        done = torch.cuda.Event()
        done.record(s)
        return done

    # ------------------------------------------------------------------ failures
    def _diagnose(self, checks: list[tuple]) -> None:
        """Called when a wait timed out: mismatch if the peer posted different codes."""
        lay = self.layout
        with torch.cuda.stream(self._diag_stream):
            words = self._flags.to("cpu", non_blocking=True)
        self._diag_stream.synchronize()
        for role, peer, (nbytes_code, dtype_word) in checks:
            base = lay.post(peer) if role == "send" else lay.sent(peer)
            got_n, got_d = int(words[base]), int(words[base + 1])
            if got_n and got_n != nbytes_code:
                self._broken = "nbytes mismatch"
                self._drain()
                raise MismatchError(
                    f"rank {self.rank}: {role} to/from rank {peer}: the peer's message has a "
                    "different size",
                    field="nbytes",
                )
            if got_d and got_d != dtype_word:
                self._broken = "dtype mismatch"
                self._drain()
                raise MismatchError(
                    f"rank {self.rank}: {role} to/from rank {peer}: the peer's dtype differs",
                    field="dtype",
                )
        self._broken = "timeout"
        # Left waiting, our streams would hold up for good whatever shares their hardware
        # queues (and a device-wide synchronize anywhere in the process).
        self._drain()
        raise TransferTimeoutError(
            f"rank {self.rank}: copy-engine transfer did not finish in time (peer absent?)"
        )

    def _drain(self, budget_s: float = 2.0) -> None:
        """After a mismatch or a timeout, satisfies our own streams' waits from the host, one
        unfinished transfer after the other (a stream runs them in issue order), until they
        finish, so the caller's stream (which waits on them) is not blocked forever. What
        lands in the receive tensors is then garbage — the caller gets the error instead."""
        deadline = time.monotonic() + budget_s
        while self._unfinished and time.monotonic() < deadline:
            transfer = self._unfinished[0]
            while not transfer.ready() and time.monotonic() < deadline:
                self._post_from_host(transfer._checks)
                time.sleep(1e-3)
            if transfer.ready():
                self._unfinished.popleft()
        if self._unfinished:
            log.warning(
                "ce channel %s: %d transfer(s) still wait on the device after draining",
                self.group_name,
                len(self._unfinished),
            )

    def _post_from_host(self, checks: list[tuple]) -> None:
        """Writes, into our own flags, what the peer would have: its agreement words for these
        messages and every slot ready (for a receive) or free (for a send)."""
        lay = self.layout
        with torch.cuda.stream(self._diag_stream):
            for role, peer, (nbytes_code, dtype_word) in checks:
                base = lay.post(peer) if role == "send" else lay.sent(peer)
                self._flags[base] = nbytes_code
                self._flags[base + 1] = dtype_word
                if role == "send":
                    self._flags[lay.ack(peer)] = 1
                for slot in range(lay.num_slots):
                    word = lay.free(peer, slot) if role == "send" else lay.ready(peer, slot)
                    self._flags[word] = 1
        self._diag_stream.synchronize()

    @property
    def broken(self) -> str | None:
        return self._broken

    def abort(self) -> None:
        """Drops the channel without waiting for the peer: our streams' pending waits are
        satisfied from the host first (bounded), so they do not stay blocked for good."""
        self._broken = self._broken or "aborted"
        if not self._closed:
            self._drain()
        self.close(force=True)

    def close(self, *, force: bool = False) -> None:
        """Releases buffers and streams. A broken channel's streams may be blocked forever:
        pass ``force=True`` to drop them without waiting (they are not reused)."""
        if self._closed:
            return
        self._closed = True
        if not force or self._broken is None:
            self._send_stream.synchronize()
            self._recv_stream.synchronize()
            self._client.close()
        # else: leak the blocked streams' lease rather than hang in a reset.
        self._peer_stage = []
        self._handles = ()
