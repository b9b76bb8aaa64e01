"""CPU tests of the nvlink/ce transport adapters: registration, estimates, refusals."""

from __future__ import annotations

from datetime import timedelta

import torch

from tensorferry.p2p._transport import TransportContext, registered_transports


def _ctx() -> TransportContext:
    return TransportContext(
        rank=0, world_size=2, device=torch.device("cpu"), store=None, timeout=timedelta(seconds=5)
    )


def test_importing_registers_both() -> None:
    import tensorferry.p2p.copy_engine.transport as ce
    import tensorferry.p2p.nvlink.transport as nv

    names = registered_transports()
    assert names["nvlink"] is nv.NvlinkTransport
    assert names["ce"] is ce.CopyEngineTransport


def test_estimates_grow_with_size_and_tensors() -> None:
    from tensorferry.p2p.copy_engine.transport import estimate_ce_seconds
    from tensorferry.p2p.nvlink.transport import estimate_nvlink_seconds

    for estimate in (estimate_nvlink_seconds, estimate_ce_seconds):
        assert estimate(1 << 30, 1) > estimate(1 << 20, 1) > 0
        assert estimate(4096, 8) > estimate(4096, 1)
    assert estimate_nvlink_seconds(256, 1) < estimate_ce_seconds(256, 1)


def test_cpu_tensors_are_refused() -> None:
    from tensorferry.p2p.copy_engine.transport import CopyEngineTransport
    from tensorferry.p2p.nvlink.transport import NvlinkTransport

    for cls in (NvlinkTransport, CopyEngineTransport):
        reason = cls(_ctx()).unsupported_reason(peer=1, tensors=[torch.zeros(4)])
        assert reason and "cuda" in reason


def test_pair_group_names_agree_and_symmetric_memory_can_resolve_them():
    import torch.distributed as dist

    from tensorferry.p2p.nvlink._symm import join_group, pair_group_name

    store = dist.HashStore()
    name = pair_group_name("ce", store, first=True)
    assert pair_group_name("ce", store, first=False) == name  # the other rank reads it
    assert pair_group_name("ce", dist.HashStore(), first=True) != name  # fresh per pair
    group = join_group(name, 0, 1, dist.PrefixStore("join", store))
    # Resolvable by name, as a symmetric-memory rendezvous on newer torch needs it to be.
    assert torch._C._distributed_c10d._resolve_process_group(name) is not None
    assert group is not None


def test_ce_step_issues_every_copy_before_the_caller_waits(monkeypatch) -> None:
    """A ring step (send right, receive left) over ``ce``: every copy is issued after ONE event
    of the caller's stream, and the caller's stream waits for them only afterwards. Waiting for
    each copy before issuing the next queued a rank's receive behind its own send, and rings of
    four deadlocked on the device."""
    import tensorferry.p2p.copy_engine.transport as ce
    from tensorferry.p2p._transport import P2POp

    log: list[tuple] = []

    class Event:
        def __init__(self, name: str = "start") -> None:
            self.name = name

        def record(self, stream) -> None:
            log.append(("record", self.name))

    class Stream:
        def wait_event(self, event) -> None:
            log.append(("caller waits", event.name))

    class Channel:
        broken = None

        def __init__(self, peer: int) -> None:
            self.peer = peer

        def issue(self, send, send_peer, recv, recv_peer, *, after):
            kind = "send" if send is not None else "recv"
            log.append(("issue", kind, self.peer, after.name))
            done = Event(f"{kind} {self.peer} done")
            return type("Issued", (), {"events": (done,), "ready": lambda self: True})()

    monkeypatch.setattr(ce.torch.cuda, "Event", Event)
    transport = ce.CopyEngineTransport(
        TransportContext(
            rank=1, world_size=4, device=torch.device("cpu"), store=None, timeout=timedelta(1)
        )
    )
    monkeypatch.setattr(transport, "_channel", lambda peer: (Channel(peer), 0))
    x = torch.ones(4)
    transport.start(
        [P2POp("send", 2, (x, x)), P2POp("recv", 0, (torch.empty(4), torch.empty(4)))],
        stream=Stream(),
    )
    issues = [entry for entry in log if entry[0] == "issue"]
    waits = [entry for entry in log if entry[0] == "caller waits"]
    assert log[0] == ("record", "start")
    assert [entry[1:3] for entry in issues] == [("send", 2)] * 2 + [("recv", 0)] * 2
    assert {entry[3] for entry in issues} == {"start"}  # all after the one event
    assert log.index(waits[0]) > log.index(issues[-1])  # the caller waits last
    assert len(waits) == 4
