"""The NIXL contender of ``tensorferry bench peers`` (GPUs only; when ``import nixl`` works).

NIXL moves data one-sided: the initiator WRITEs into memory the target registered, and the
target learns that the data is there from a notification. So the receive buffers of every row
are registered once, before any timing, both agents exchange their metadata and buffer
addresses over the bench's gloo group, each transfer is initialized once per row, and each
iteration only posts it (``transfer``). Sender done: the transfer's state is ``DONE``;
receiver done: its notification arrived.
"""

from __future__ import annotations

import collections
import contextlib
import importlib.metadata
import time
from collections.abc import Callable
from typing import Any

from tensorferry.bench._peers_cases import Workspace, consume, produce
from tensorferry.bench._peers_timing import Case

__all__ = ["NIXL_SKIPS", "NixlPeer", "nixl_case", "nixl_version", "open_nixl", "unavailable_reason"]

# Rows NIXL does not run, and why (the same on both ranks, so no agreement is needed).
NIXL_SKIPS = {
    "batch": "NIXL has no batch of separate messages: row 1 times its one transfer of 64 "
    "descriptors, row 5 its 64 separate transfers",
}

# (address, bytes, device index) of one buffer, as NIXL's descriptor lists take them.
Region = tuple[int, int, int]


def unavailable_reason(device_type: str) -> str | None:
    """Why NIXL cannot run here (``None`` when it can be tried)."""
    if device_type != "cuda":
        return "this bench runs NIXL between GPUs only"
    try:
        _api()
    except Exception as exc:  # ImportError, or a broken install raising anything
        return f"nixl is not importable ({type(exc).__name__}: {exc})"
    return None


def _api() -> Any:
    """NIXL's Python API module: the CUDA 13 wheel ships it as ``nixl_cu13``, others as
    ``nixl``."""
    try:
        import nixl_cu13 as api
    except ImportError:
        from nixl import _api as api
    return api


def nixl_version() -> str | None:
    """The installed NIXL package's version (it ships under a few names), or ``None``."""
    for name in ("nixl", "nixl-cu13", "nixl-cu12"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _regions(tensors: list[Any]) -> list[Region]:
    return [(t.data_ptr(), t.numel() * t.element_size(), t.device.index or 0) for t in tensors]


class NixlPeer:
    """This rank's NIXL agent, talking to the other rank's.

    Args:
        rank: this rank (the agent's name says it).
        timeout_s: bound of each wait for a transfer or a notification.
    """

    def __init__(self, rank: int, timeout_s: float) -> None:
        api = _api()
        config = api.nixl_agent_config(backends=["UCX"])
        self.agent = api.nixl_agent(f"tensorferry-peers-{rank}", config)
        self.timeout_s = timeout_s
        self.remote: str | None = None
        self._registered: list[Any] = []
        self._handles: list[Any] = []
        self._arrived: collections.Counter[bytes] = collections.Counter()

    def register(self, arenas: list[Any]) -> None:
        """Registers the buffers transfers read from or write into (before the metadata)."""
        if arenas:
            self._registered.append(self.agent.register_memory(arenas))

    def metadata(self) -> bytes:
        return self.agent.get_agent_metadata()

    def connect(self, peer_metadata: bytes) -> None:
        self.remote = self.agent.add_remote_agent(peer_metadata)

    def writer(self, local: list[Any], remote: list[Region], tag: bytes) -> Any:
        """A WRITE of ``local`` into the peer's ``remote`` regions that notifies ``tag``; made
        once, posted once per iteration."""
        handle = self.agent.initialize_xfer(
            "WRITE",
            self.agent.get_xfer_descs(local),
            self.agent.get_xfer_descs(remote, "cuda"),
            self.remote,
            tag,
        )
        self._handles.append(handle)
        return handle

    def post(self, handle: Any) -> None:
        if self.agent.transfer(handle) == "ERR":
            raise RuntimeError("NIXL could not post the transfer")

    def wait_done(self, handle: Any) -> None:
        deadline = time.monotonic() + self.timeout_s
        while (state := self.agent.check_xfer_state(handle)) != "DONE":
            if state == "ERR":
                raise RuntimeError("NIXL transfer failed")
            if time.monotonic() > deadline:
                raise TimeoutError(f"NIXL transfer not done within {self.timeout_s} s")

    def wait_notifications(self, tag: bytes, count: int = 1) -> None:
        """Waits until ``count`` notifications ``tag`` arrived (those that came early count)."""
        deadline = time.monotonic() + self.timeout_s
        while self._arrived[tag] < count:
            for messages in self.agent.get_new_notifs().values():
                self._arrived.update(messages)
            if self._arrived[tag] < count and time.monotonic() > deadline:
                raise TimeoutError(f"NIXL notification {tag!r} not here within {self.timeout_s} s")
        self._arrived[tag] -= count

    def close(self) -> None:
        """Releases what this agent made; the first error is raised after all were tried."""
        steps: list[Callable[[], Any]] = [
            *(lambda h=h: self.agent.release_xfer_handle(h) for h in self._handles),
            *(lambda r=r: self.agent.deregister_memory(r) for r in self._registered),
        ]
        if self.remote is not None:
            steps.append(lambda: self.agent.remove_remote_agent(self.remote))
        errors = []
        for step in steps:
            try:
                step()
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]


def open_nixl(
    spaces: dict[str, Workspace], rank: int, timeout_s: float, reason: str | None, control: Any
) -> tuple[NixlPeer | None, dict[str, list[Region]], str | None]:
    """Both ranks' agents, connected, with every row's buffers registered.

    Collective over the gloo group ``control``: a failure on either rank is a reason on both.

    Returns:
        ``(peer, peer's receive regions by row key, None)``, or ``(None, {}, reason)``.
    """
    import torch.distributed as dist

    peer, mine, metadata = None, {}, b""
    if reason is None:
        try:
            peer = NixlPeer(rank, timeout_s)
            peer.register([a for ws in spaces.values() for a in ws.arenas])
            mine = {key: _regions(ws.into) for key, ws in spaces.items()}
            metadata = peer.metadata()
        except Exception as exc:
            reason = f"NIXL set-up failed on rank {rank} ({type(exc).__name__}: {exc})"
    gathered: list[Any] = [None, None]
    dist.all_gather_object(gathered, (reason, metadata, mine), group=control)
    theirs = gathered[1 - rank]
    reason = reason or theirs[0]
    if reason is None:
        try:
            peer.connect(theirs[1])
        except Exception as exc:
            reason = f"NIXL could not load rank {1 - rank}'s metadata ({type(exc).__name__}: {exc})"
    agreed: list[Any] = [None, None]
    dist.all_gather_object(agreed, reason, group=control)
    reason = agreed[0] or agreed[1]
    if reason is not None:
        if peer is not None:
            # It is not used: what it holds would go with the process anyway.
            with contextlib.suppress(Exception):
                peer.close()
        return None, {}, reason
    return peer, theirs[2], None


def nixl_case(ws: Workspace, nixl: NixlPeer, peer_regions: list[Region]) -> Case:
    """NIXL's part of ``ws``'s row on this rank; its transfers are initialized here, once.

    Args:
        ws: the row's buffers.
        nixl: this rank's agent, connected.
        peer_regions: the peer's receive buffers of this row.
    """
    import torch

    key, sends, count = ws.row.key, ws.rank == 0, ws.row.count
    tag = f"peers/{key}".encode()

    def complete(handle: Any) -> None:
        nixl.post(handle)
        nixl.wait_done(handle)

    if key in ("kv", "large", "small"):  # one transfer of all the row's descriptors
        if sends:
            handle = nixl.writer(ws.out, peer_regions, tag)
            return Case(ws.prepare, lambda it: complete(handle), ws.check)
        return Case(ws.prepare, lambda it: nixl.wait_notifications(tag), ws.check)
    if key == "separate":  # one transfer per tensor
        if not sends:
            return Case(ws.prepare, lambda it: nixl.wait_notifications(tag, count), ws.check)
        handles = [nixl.writer([t], [r], tag) for t, r in zip(ws.out, peer_regions, strict=True)]

        def separate(it: int) -> None:
            for handle in handles:
                nixl.post(handle)
            for handle in handles:
                nixl.wait_done(handle)

        return Case(ws.prepare, separate, ws.check)
    if key == "roundtrip":
        there, back = tag + b"/there", tag + b"/back"
        handle = nixl.writer(ws.out if sends else ws.into, peer_regions, there if sends else back)

        def round_trip(it: int) -> None:
            if sends:
                complete(handle)
                nixl.wait_notifications(back)
            else:
                nixl.wait_notifications(there)
                complete(handle)

        return Case(ws.prepare, round_trip, ws.check)
    if key == "pipeline":
        tags = [tag + f"/{mb}".encode() for mb in range(count)]
        if not sends:

            def stage_1(it: int) -> None:
                for microbatch in range(count):
                    nixl.wait_notifications(tags[microbatch])
                    consume(ws, microbatch)

            return Case(ws.prepare, stage_1, ws.check)
        handles = [
            nixl.writer([t], [r], mb_tag)
            for t, r, mb_tag in zip(ws.out, peer_regions, tags, strict=True)
        ]

        def stage_0(it: int) -> None:
            for microbatch in range(count):
                produce(ws, microbatch)
                # NIXL posts from the host: the activation must be computed before its write.
                torch.cuda.current_stream().synchronize()
                nixl.post(handles[microbatch])
            for handle in handles:
                nixl.wait_done(handle)

        return Case(ws.prepare, stage_0, ws.check)
    raise ValueError(f"NIXL does not run row {key!r}: {NIXL_SKIPS.get(key, 'unknown row')}")
