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


def _ce_channel_with_fake_streams(monkeypatch, log: list) -> object:
    """A ``CopyEngineChannel`` (rank 0 of 2, one 4 KiB slot per peer) whose stream operations
    are only written down: ``("wait", word, value)`` / ``("write", rank, word, value)``."""
    import contextlib

    from tensorferry.p2p.copy_engine import _streamops, ce_op

    channel = object.__new__(ce_op.CopyEngineChannel)
    channel.rank, channel.world_size, channel.slot_bytes = 0, 2, 4096
    channel.layout = ce_op.CeLayout(2, 1)
    channel._flags = torch.zeros(channel.layout.num_words, dtype=torch.int32)
    base = {0: channel._flags.data_ptr(), 1: 1 << 62}  # the peer's flags: a fake address
    channel._flag_ptr = [base[0], base[1]]
    channel._stage = torch.zeros(2 * 4096, dtype=torch.uint8)
    channel._peer_stage = [channel._stage, torch.zeros(2 * 4096, dtype=torch.uint8)]

    class Stream:
        def wait_event(self, event) -> None:
            pass

    channel._send_stream = channel._recv_stream = Stream()

    def where(address: int) -> tuple[int, int]:
        rank = 1 if address >= base[1] else 0
        return rank, (address - base[rank]) // 4

    def write(stream, address, value) -> None:
        log.append(("write", *where(address), value))

    def wait(stream, address, value, flags) -> None:
        rank, word = where(address)
        assert rank == 0, "every wait spins on this rank's own flags"
        log.append(("wait", word, value))

    class Event:
        def record(self, stream=None) -> None:
            pass

    monkeypatch.setattr(_streamops, "write_value32", write)
    monkeypatch.setattr(_streamops, "wait_value32", wait)
    monkeypatch.setattr(ce_op.torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(ce_op.torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(ce_op.torch.cuda, "Event", Event)
    return channel


def test_ce_sender_waits_for_the_last_ack_before_it_writes_sent(monkeypatch) -> None:
    """The ACK (the receiver consumed the last SENT) is waited for before the next SENT is
    written — not between the agreement and the chunks, where it cost every message a round
    trip — and the receiver sets it right after consuming SENT, before its chunks."""
    log: list[tuple] = []
    channel = _ce_channel_with_fake_streams(monkeypatch, log)
    lay = channel.layout
    channel._issue_send(torch.arange(8, dtype=torch.float32), 1, start=None)
    ack_wait = log.index(("wait", lay.ack(1), 1))
    sent_writes = [i for i, e in enumerate(log) if e[:3] == ("write", 1, lay.sent(0))]
    post_waits = [i for i, e in enumerate(log) if e[0] == "wait" and e[1] == lay.post(1)]
    first_free = next(i for i, e in enumerate(log) if e[:2] == ("wait", lay.free(1, 0)))
    assert log[ack_wait + 1] == ("write", 0, lay.ack(1), 0), "the ACK is reset once seen"
    assert ack_wait < sent_writes[0] < post_waits[0] < first_free
    log.clear()
    channel._issue_recv(torch.empty(8, dtype=torch.float32), 1, start=None)
    sent_resets = [i for i, e in enumerate(log) if e[:3] == ("write", 0, lay.sent(1))]
    ack_write = log.index(("write", 1, lay.ack(0), 1))
    first_ready = next(i for i, e in enumerate(log) if e[:2] == ("wait", lay.ready(1, 0)))
    assert sent_resets and sent_resets[-1] < ack_write < first_ready
