"""The ``nvlink`` transport: :class:`NvlinkChannel` behind the p2p layer's transport contract.

One channel per pair of ranks (a 2-rank symmetric-memory group on the pair's store, so only the
two ranks rendezvous), cached in the runtime's communicator cache under ``("nvlink", lo, hi)``.
``start`` pairs the i-th send and the i-th receive tensor of each peer into one bidirectional
launch (both ranks pair the same way, so the CTA split agrees) and runs receive-only launches on
a second internal stream, so rings (send to one peer, receive from another) cannot deadlock
behind each other on one stream.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from tensorferry.errors import TransportError
from tensorferry.p2p._transport import P2POp, PendingOps, Transport
from tensorferry.p2p.nvlink._layout import ERR_TIMEOUT, ERROR_FIELDS, ChannelConfig
from tensorferry.p2p.nvlink._pair_setup import set_up_pair
from tensorferry.runtime import communicator_cache

__all__ = ["NvlinkTransport"]


class _NvlinkPending(PendingOps):
    def __init__(self, event: Any, channels: list[Any], status_host: list[Any]) -> None:
        self._event = event
        self._channels = channels
        self._status_host = status_host

    def ready(self) -> bool:
        if not self._event.query():
            return False
        for host in self._status_host:
            own, reported = int(host[0]), int(host[1])
            code = reported if reported in ERROR_FIELDS else own
            if code == ERR_TIMEOUT:
                raise TransportError("nvlink: a kernel timed out waiting for its peer")
            if code:
                raise TransportError(f"nvlink: kernel error code {code}")
        return True

    def abort(self) -> None:
        # Kernels end by themselves at their device-side timeout; nothing to cancel.
        return None


class NvlinkTransport(Transport):
    """Moves agreed messages with the Triton copy kernels over NVLink."""

    name = "nvlink"
    device_type = "cuda"

    def __init__(self, ctx: Any, *, config: ChannelConfig | None = None) -> None:
        super().__init__(ctx)
        self.config = config if config is not None else ChannelConfig()
        self._lock = threading.Lock()
        self._client = None

    # ------------------------------------------------------------------ contract
    def unsupported_reason(self, *, peer: int, tensors: Sequence[torch.Tensor]) -> str | None:
        reason = super().unsupported_reason(peer=peer, tensors=tensors)
        if reason:
            return reason
        try:
            import triton  # noqa: F401
        except ImportError:
            return "nvlink needs Triton"
        if self.ctx.device.type != "cuda":
            return "nvlink needs a CUDA device"
        return None

    def prepare(self, peers: Sequence[int]) -> None:
        for peer in peers:
            self._channel(peer)

    def start(self, ops: Sequence[P2POp], *, stream: Any = None) -> PendingOps:
        stream = torch.cuda.current_stream(self.ctx.device) if stream is None else stream
        sends: dict[int, list[torch.Tensor]] = {}
        recvs: dict[int, list[torch.Tensor]] = {}
        for op in ops:
            target = sends if op.kind == "send" else recvs
            target.setdefault(op.peer, []).extend(op.tensors)
        recv_stream = self._streams()
        start = torch.cuda.Event()
        start.record(stream)
        recv_stream.wait_event(start)
        channels, status_host = [], []
        for peer in sorted(set(sends) | set(recvs)):
            channel, other = self._channel(peer)
            outgoing, incoming = sends.get(peer, []), recvs.get(peer, [])
            for i in range(max(len(outgoing), len(incoming))):
                x = outgoing[i] if i < len(outgoing) else None
                y = incoming[i] if i < len(incoming) else None
                on = stream if x is not None else recv_stream
                channel.sendrecv(
                    x,
                    other if x is not None else None,
                    y,
                    other if y is not None else None,
                    stream=on,
                )
            channels.append(channel)
        done_recv = torch.cuda.Event()
        done_recv.record(recv_stream)
        stream.wait_event(done_recv)
        for channel in channels:
            host = torch.empty(2, dtype=torch.int64, pin_memory=True)
            status = channel._sig[channel.layout.status : channel.layout.status + 2]
            with torch.cuda.stream(stream):
                host.copy_(status, non_blocking=True)
            status_host.append(host)
        done = torch.cuda.Event()
        done.record(stream)
        return _NvlinkPending(done, channels, status_host)

    def evict(self, peer: int, *, abort: bool, reason: str = "") -> None:
        lo, hi = self.ctx.pair(peer)
        communicator_cache().evict(("nvlink", lo, hi), abort=abort)

    def close(self) -> None:
        self._evict_cached("shutdown")
        if self._client is not None:
            self._client.close()
            self._client = None

    # ------------------------------------------------------------------ helpers
    def _streams(self) -> Any:
        with self._lock:
            if self._client is None:
                from tensorferry.runtime import Client

                self._client = Client(devices=[self.ctx.device])
            return self._client.stream(self.ctx.device, "recv")

    def _channel(self, peer: int) -> tuple[Any, int]:
        from tensorferry.p2p.nvlink.sendrecv_op import NvlinkChannel

        lo, hi = self.ctx.pair(peer)
        me = self.ctx.rank_in_pair(peer)

        def make() -> Any:
            return set_up_pair(
                self.ctx,
                peer,
                "nvlink",
                lambda group, index, store: NvlinkChannel(
                    device=self.ctx.device, config=self.config, members=(group, index, 2, store)
                ),
            )

        channel = communicator_cache().get_or_create(("nvlink", lo, hi), make)
        return channel, 1 - me
