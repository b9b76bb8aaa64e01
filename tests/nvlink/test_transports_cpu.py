"""CPU tests of the nvlink/ce transport adapters: registration, estimates, refusals."""

from __future__ import annotations

from datetime import timedelta

import torch

from tensorferry.p2p._transport import TransportContext


def _ctx() -> TransportContext:
    return TransportContext(
        rank=0, world_size=2, device=torch.device("cpu"), store=None, timeout=timedelta(seconds=5)
    )


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
