"""Host side of the NVLink copy kernels: buffers, validation, launch.

:class:`NvlinkChannel` owns one rank's symmetric staging buffer and signal words for a process
group and launches :func:`~tensorferry.p2p.nvlink.sendrecv._sendrecv_kernel`. The protocol is
documented in ``sendrecv.py``. A channel is not thread-safe: one thread issues on it.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from tensorferry.errors import MismatchError, TransferTimeoutError, TransportError
from tensorferry.p2p._packing import as_bytes
from tensorferry.p2p._spec import lazy_view_problem
from tensorferry.p2p.nvlink import _symm
from tensorferry.p2p.nvlink._layout import (
    ERR_PEER_ABORT,
    ERR_TIMEOUT,
    ERROR_FIELDS,
    ChannelConfig,
    LaunchPlan,
    SignalLayout,
    dtype_code,
    plan_launch,
)

__all__ = ["NvlinkChannel", "validate_message"]

log = logging.getLogger(__name__)


def validate_message(tensor: Any, *, what: str, device: torch.device) -> None:
    """Checks one tensor of a transfer before anything moves.

    Raises:
        TypeError: not a tensor.
        ValueError: wrong device, not contiguous, or a conjugate or negative view.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device != device:
        raise ValueError(f"{what} is on {tensor.device}, the channel is on {device}")
    if not tensor.is_contiguous():
        raise ValueError(f"{what} must be contiguous")
    problem = lazy_view_problem(tensor)
    if problem is not None:
        raise ValueError(f"{what} {problem}")


class NvlinkChannel:
    """One rank's end of the NVLink copy kernels for a process group.

    Construction is collective over ``group`` (a rendezvous of the symmetric buffers): every
    rank creates its channel with an equal ``config``, in the same order.

    Args:
        group: the process group (default: the world). Its ranks must share NVLink.
        device: this rank's CUDA device (default: the current one).
        config: buffer sizes, CTA budget and timeouts; equal on every rank.

    Example::

        ch = NvlinkChannel()
        ch.sendrecv(x, (rank + 1) % world, y, (rank - 1) % world)   # a ring step
        ch.check()                                                  # raise if it failed
    """

    def __init__(
        self,
        group: Any = None,
        *,
        device: Any = None,
        config: ChannelConfig | None = None,
        members: tuple[str, int, int, Any] | None = None,
    ) -> None:
        """``members``: instead of a process group, ``(group name, rank, world size, store)``
        of a symmetric-memory group registered here (the pair channels of the transport)."""
        import torch.distributed as dist
        from torch.distributed import _symmetric_memory as symm_mem

        self.config = config if config is not None else ChannelConfig()
        if not isinstance(self.config, ChannelConfig):
            raise TypeError(f"config must be a ChannelConfig, got {type(self.config).__name__}")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = torch.device(device)
        if self.device.type != "cuda" or self.device.index is None:
            raise ValueError(f"device must be an indexed CUDA device, got {self.device}")
        self.group = group
        self._store = None
        self._own_group = None
        if members is not None:
            self.group_name, self.rank, self.world_size, self._store = members
            self._own_group = _symm.join_group(
                self.group_name, self.rank, self.world_size, self._store
            )
        else:
            self.group_name = _symm.group_name_of(group)
            self.rank = dist.get_rank(group)
            self.world_size = dist.get_world_size(group)
        if self.world_size < 2:
            raise ValueError("an NVLink channel needs a group of at least 2 ranks")
        self.layout = SignalLayout(self.world_size, self.config.max_blocks)
        with _symm.setup_stream(self.device):
            self._sig = symm_mem.empty(self.layout.num_words, dtype=torch.int64, device=self.device)
            self._sig.zero_()
            self._stage = symm_mem.empty(
                self.config.staging_bytes(self.world_size), dtype=torch.uint8, device=self.device
            )
            sig_handle = symm_mem.rendezvous(self._sig, self.group_name)
            stage_handle = symm_mem.rendezvous(self._stage, self.group_name)
            self._handles = (sig_handle, stage_handle)
            self._peer_sig = [
                sig_handle.get_buffer(r, (self.layout.num_words,), torch.int64)
                for r in range(self.world_size)
            ]
            self._peer_stage = [
                stage_handle.get_buffer(r, (self._stage.numel(),), torch.uint8)
                for r in range(self.world_size)
            ]
            self._zc_delta = torch.zeros(
                _symm.MAX_REGISTRATIONS * self.world_size, dtype=torch.int64, device=self.device
            )
        self._zc_version = -1
        self._broken: str | None = None
        self._closed = False
        # Every rank's signals are zero before any peer may write them.
        if self._store is not None:
            self._store.add("zeroed", 1)
            deadline = time.monotonic() + 300
            while int(self._store.add("zeroed", 0)) < self.world_size:
                if time.monotonic() > deadline:
                    raise TransferTimeoutError("NVLink channel: peers did not initialise")
                time.sleep(1e-3)
        else:
            dist.barrier(group=group, device_ids=[self.device.index])
        log.info(
            "nvlink channel rank %d/%d on %s: %d signal words, %d staging bytes",
            self.rank,
            self.world_size,
            self.device,
            self.layout.num_words,
            self._stage.numel(),
        )

    # ------------------------------------------------------------------ transfers
    def send(self, tensor: torch.Tensor, peer: int, **options: Any) -> None:
        """One-way send to ``peer`` (which calls :meth:`recv`); see :meth:`sendrecv`."""
        self.sendrecv(tensor, peer, None, None, **options)

    def recv(self, tensor: torch.Tensor, peer: int, **options: Any) -> None:
        """One-way receive into ``tensor`` from ``peer``. See :meth:`sendrecv`."""
        self.sendrecv(None, None, tensor, peer, **options)

    def sendrecv(
        self,
        send: torch.Tensor | None,
        send_peer: int | None,
        recv: torch.Tensor | None,
        recv_peer: int | None,
        *,
        stream: Any = None,
        max_ctas: int | None = None,
        zero_copy: bool = True,
    ) -> None:
        """Sends ``send`` to ``send_peer`` while receiving ``recv`` from ``recv_peer``, in one
        kernel launch on ``stream``. Returns once the launch is queued.

        ``send_peer`` may differ from ``recv_peer`` (a ring). Capturable in a CUDA graph; the
        captured launch may be replayed any number of times (the peer replays its own).

        Args:
            send: contiguous tensor on this device, or ``None`` for receive only. Its byte
                count and dtype must equal the receiver's ``recv``.
            send_peer: group rank to send to (not ours).
            recv: contiguous tensor written with the peer's bytes, or ``None``. A tensor from
                :func:`~tensorferry.p2p.nvlink.empty` is written directly by the sender.
            recv_peer: group rank to receive from (not ours).
            stream: CUDA stream to launch on (default: the current stream).
            max_ctas: CTA budget of this launch (default ``config.max_ctas``); halved per
                direction when both are present. Must equal the peer's for the same message.
            zero_copy: post a symmetric ``recv`` for direct writes (else always stage).

        Raises:
            TypeError / ValueError: a bad tensor, peer or budget (nothing launched).
            TransportError: the channel is closed or broken by an earlier failure.
        """
        self._check_usable()
        if send is None and recv is None:
            raise ValueError("sendrecv needs a tensor to send, to receive, or both")
        if (send is None) != (send_peer is None):
            raise ValueError("send and send_peer go together")
        if (recv is None) != (recv_peer is None):
            raise ValueError("recv and recv_peer go together")
        if send is not None:
            validate_message(send, what="send tensor", device=self.device)
            self._check_peer(send_peer, "send_peer")
        if recv is not None:
            validate_message(recv, what="recv tensor", device=self.device)
            self._check_peer(recv_peer, "recv_peer")
        has_send = send is not None and send.numel() > 0
        has_recv = recv is not None and recv.numel() > 0
        if not (has_send or has_recv):
            return  # nothing to move; empty messages agree trivially on both sides
        bidirectional = has_send and has_recv
        ctas = self.config.ctas_per_direction(bidirectional=bidirectional, max_ctas=max_ctas)
        send_plan = recv_plan = None
        if has_send:
            send_plan = plan_launch(send.numel() * send.element_size(), ctas, self.config)
        zc = None
        if has_recv:
            recv_plan = plan_launch(recv.numel() * recv.element_size(), ctas, self.config)
            if zero_copy:
                zc = _symm.lookup(self.group_name, recv)
        if has_send:
            self._refresh_zero_copy_table()
        self._launch(
            send if has_send else None,
            send_peer,
            send_plan,
            recv if has_recv else None,
            recv_peer,
            recv_plan,
            zc,
            stream,
        )

    def _launch(
        self,
        send: torch.Tensor | None,
        send_peer: int | None,
        send_plan: LaunchPlan | None,
        recv: torch.Tensor | None,
        recv_peer: int | None,
        recv_plan: LaunchPlan | None,
        zc: tuple[int, int] | None,
        stream: Any,
    ) -> None:
        from tensorferry.p2p.nvlink.sendrecv import _sendrecv_kernel

        cfg = self.config
        send_bytes = as_bytes(send) if send is not None else self._stage
        recv_bytes = as_bytes(recv) if recv is not None else self._stage
        sp = send_peer if send is not None else self.rank
        rp = recv_peer if recv is not None else self.rank
        grid = (recv_plan.num_ctas if recv_plan else 0) + (send_plan.num_ctas if send_plan else 0)
        zc_id, zc_offset = zc if zc is not None else (-1, 0)
        stream = torch.cuda.current_stream(self.device) if stream is None else stream
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            _sendrecv_kernel[(grid,)](
                send_bytes,
                recv_bytes,
                self._sig,
                self._stage,
                self._peer_sig[sp],
                self._peer_stage[sp],
                self._peer_sig[rp],
                self._zc_delta,
                self.rank,
                self.world_size,
                sp,
                rp,
                send_plan.nbytes if send_plan else 0,
                send_plan.body if send_plan else 0,
                send_plan.num_ctas if send_plan else 1,
                send_plan.chunk if send_plan else 16,
                dtype_code(send.dtype) if send is not None else 0,
                recv_plan.nbytes if recv_plan else 0,
                recv_plan.body if recv_plan else 0,
                recv_plan.num_ctas if recv_plan else 1,
                recv_plan.chunk if recv_plan else 16,
                dtype_code(recv.dtype) if recv is not None else 0,
                zc_id,
                zc_offset,
                int(cfg.timeout_s * 1e9),
                HAS_SEND=send is not None,
                HAS_RECV=recv is not None,
                SEND_ALIGNED=send is not None and send_bytes.data_ptr() % 16 == 0,
                RECV_ALIGNED=recv is not None and recv_bytes.data_ptr() % 16 == 0,
                MAX_BLOCKS=cfg.max_blocks,
                NUM_SLOTS=cfg.num_slots,
                SLOT_BYTES=cfg.slot_bytes,
                BLOCK=cfg.block_words,
                num_warps=cfg.num_warps,
            )

    # ------------------------------------------------------------------ state
    def check(self) -> None:
        """Waits for this device's queued work and raises if a kernel of this channel failed.

        Raises:
            MismatchError: the peer's message differs (``field`` names what: ``nbytes``,
                ``dtype``, ``num_ctas`` or ``chunk``). The channel is broken afterwards.
            TransferTimeoutError: a kernel gave up waiting for the peer (``config.timeout_s``).
            TransportError: the channel is closed.
        """
        if self._closed:
            raise TransportError("the NVLink channel is closed")
        own, reported = self.status()
        if own == 0 and reported == 0:
            return
        code = reported if reported in ERROR_FIELDS else own
        if code in ERROR_FIELDS:
            field = ERROR_FIELDS[code]
            self._broken = f"{field} mismatch"
            raise MismatchError(
                f"rank {self.rank}: sender and receiver disagree on the message's {field}",
                field=field,
            )
        if own == ERR_TIMEOUT:
            self._broken = "timeout"
            raise TransferTimeoutError(
                f"rank {self.rank}: an NVLink kernel waited more than {self.config.timeout_s} s "
                "for its peer"
            )
        self._broken = f"error code {own or reported}"
        if own == ERR_PEER_ABORT:
            raise TransportError(f"rank {self.rank}: the peer aborted the transfer")
        raise TransportError(f"rank {self.rank}: NVLink kernel error code {own or reported}")

    def status(self) -> tuple[int, int]:
        """``(own error code, code a peer reported)``; ``(0, 0)`` when all is well. Syncs."""
        torch.cuda.synchronize(self.device)
        words = self._sig[self.layout.status : self.layout.status + 2].tolist()
        return int(words[0]), int(words[1])

    @property
    def broken(self) -> str | None:
        """Why the channel cannot be used any more, or ``None``."""
        return self._broken

    def close(self) -> None:
        """Releases the buffers (after this device's queued work). A second call does nothing."""
        if self._closed:
            return
        self._closed = True
        torch.cuda.synchronize(self.device)
        self._peer_sig = self._peer_stage = []
        self._handles = ()
        self._sig = self._stage = self._zc_delta = None

    def abort(self) -> None:
        """Drops the buffers without waiting for queued kernels (they end at their timeout)."""
        self._broken = self._broken or "aborted"
        self._closed = True
        self._peer_sig = self._peer_stage = []
        self._handles = ()

    def __enter__(self) -> NvlinkChannel:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ helpers
    def _check_usable(self) -> None:
        if self._closed:
            raise TransportError("the NVLink channel is closed")
        if self._broken is not None:
            raise TransportError(f"the NVLink channel is broken ({self._broken}); create a new one")

    def _check_peer(self, peer: Any, what: str) -> None:
        if not isinstance(peer, int) or isinstance(peer, bool):
            raise TypeError(f"{what} must be an int, got {type(peer).__name__}")
        if not 0 <= peer < self.world_size:
            raise ValueError(f"{what}={peer} is out of range for a group of {self.world_size}")
        if peer == self.rank:
            raise ValueError(f"{what}={peer} is this rank; transfers to self are not supported")

    def _refresh_zero_copy_table(self) -> None:
        """Writes peer-address deltas of new registrations into the device table."""
        version = _symm.registry_version()
        if version == self._zc_version:
            return
        regs = _symm.registrations(self.group_name)
        if not regs:
            self._zc_version = version
            return
        if torch.cuda.is_current_stream_capturing():
            raise TransportError(
                "symmetric buffers were allocated since this channel last ran; run one transfer "
                "outside CUDA graph capture first"
            )
        stage_bases = [t.data_ptr() for t in self._peer_stage]
        table = torch.zeros(len(regs), self.world_size, dtype=torch.int64)
        for reg in regs:
            for r in range(self.world_size):
                table[reg.reg_id, r] = reg.peer_bases[r] - stage_bases[r]
        self._zc_delta[: table.numel()].copy_(table.reshape(-1).to(self.device))
        self._zc_version = version
