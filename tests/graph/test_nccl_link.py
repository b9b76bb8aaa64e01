"""The graph's NCCL link on the CPU: which link ``make_link`` picks, and what
``DirectNcclLink`` asks of the NCCL library (a fake one that records its calls)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from tensorferry.errors import TransferTimeoutError
from tensorferry.graph import _nccl
from tensorferry.graph._nccl import DirectNcclLink, NcclSetup, make_link

STREAM = 7  # what the fake "current stream" handle reads
PAIRS = ((0, 1), (0, 2), (1, 2))


def setup_for(rank: int) -> NcclSetup:
    return NcclSetup(
        rank=rank,
        world_size=3,
        ranks={"a": 0, "b": 1, "c": 2},
        store_port=0,
        prefix="graph",
        pairs=PAIRS,
        timeout_s=5.0,
    )


class FakeLibrary:
    """Stands in for ``NcclLibrary``: records each call in ``calls`` (shared with the store)."""

    def __init__(self, calls: list) -> None:
        self.calls = calls
        self.num_ids = 0
        self.num_comms = 0
        self.fail_send = False

    def unique_id(self) -> bytes:
        self.num_ids += 1
        uid = f"made-{self.num_ids}".encode()
        self.calls.append(("unique_id", uid))
        return uid

    def init_rank(self, nranks: int, unique_id: bytes, rank: int) -> int:
        self.num_comms += 1
        comm = 100 + self.num_comms
        self.calls.append(("init_rank", nranks, unique_id, rank, comm))
        return comm

    def group_start(self) -> None:
        self.calls.append(("group_start",))

    def group_end(self) -> None:
        self.calls.append(("group_end",))

    def send(self, address: int, nbytes: int, peer: int, comm: int, stream: int) -> None:
        if self.fail_send:
            raise RuntimeError("ncclSend failed")
        self.calls.append(("send", address, nbytes, peer, comm, stream))

    def recv(self, address: int, nbytes: int, peer: int, comm: int, stream: int) -> None:
        self.calls.append(("recv", address, nbytes, peer, comm, stream))

    def abort(self, comm: int) -> None:
        self.calls.append(("abort", comm))


class FakeStore:
    """Holds the ids the peers published; a missing key fails like a store wait timing out."""

    def __init__(self, calls: list, published: dict[str, bytes]) -> None:
        self.calls = calls
        self.values = dict(published)

    def set(self, key: str, value: bytes) -> None:
        self.calls.append(("store.set", key, value))
        self.values[key] = value

    def get(self, key: str) -> bytes:
        self.calls.append(("store.get", key))
        if key not in self.values:
            raise RuntimeError(f"wait timeout after 5000ms, keys: /{key}")
        return self.values[key]


# What the other ranks publish: the id of every direction they send on.
PUBLISHED = {
    f"nccl/{src}-to-{dst}": f"from-{src}-to-{dst}".encode() for src in range(3) for dst in range(3)
}


@pytest.fixture
def calls(monkeypatch):
    """The recorded calls; CUDA stands in: no device switch, a fixed stream handle, and a
    warm-up that records which communicator it would probe."""
    recorded: list = []
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(_nccl, "_current_stream_handle", lambda index: STREAM)

    def warm_up(self, comm: int, sending: bool, peer: int) -> None:
        recorded.append(("warm_up", comm, sending, peer))

    monkeypatch.setattr(DirectNcclLink, "_warm_up", warm_up)
    return recorded


def direct_link(rank: int, calls: list, published: dict[str, bytes] = PUBLISHED):
    lib = FakeLibrary(calls)
    store = FakeStore(calls, published)
    link = DirectNcclLink(setup_for(rank), torch.device("cuda", 0), lib, store=store)
    return link, lib


# ---------------------------------------------------------------------- make_link


class Recorded:
    def __init__(self, *args) -> None:
        self.args = args


@pytest.fixture
def fake_links(monkeypatch):
    monkeypatch.setattr(_nccl, "TorchNcclLink", type("FakeTorch", (Recorded,), {}))
    monkeypatch.setattr(_nccl, "DirectNcclLink", type("FakeDirect", (Recorded,), {}))


def test_make_link_calls_nccl_directly_by_default(monkeypatch, fake_links):
    lib = object()
    monkeypatch.setattr(_nccl, "nccl_library", lambda: lib)
    setup, device = setup_for(0), torch.device("cuda", 0)
    link = make_link(setup, device)
    assert type(link).__name__ == "FakeDirect"
    assert link.args == (setup, device, lib)


def test_make_link_falls_back_to_torch_without_the_library(monkeypatch, fake_links):
    monkeypatch.setattr(_nccl, "nccl_library", lambda: None)
    setup, device = setup_for(0), torch.device("cuda", 0)
    link = make_link(setup, device)
    assert type(link).__name__ == "FakeTorch"
    assert link.args == (setup, device)


# ---------------------------------------------------------------------- creation


def test_creation_walks_pairs_in_order_and_the_sender_makes_each_id(calls):
    link, _ = direct_link(1, calls)
    assert calls == [
        # pair (0, 1): 0 → 1, rank 1 receives
        ("store.get", "nccl/0-to-1"),
        ("init_rank", 2, b"from-0-to-1", 1, 101),
        ("warm_up", 101, False, 0),
        # 1 → 0: rank 1 sends, so it makes and publishes the id
        ("unique_id", b"made-1"),
        ("store.set", "nccl/1-to-0", b"made-1"),
        ("init_rank", 2, b"made-1", 0, 102),
        ("warm_up", 102, True, 0),
        # (0, 2) is not rank 1's; pair (1, 2): 1 → 2, then 2 → 1
        ("unique_id", b"made-2"),
        ("store.set", "nccl/1-to-2", b"made-2"),
        ("init_rank", 2, b"made-2", 0, 103),
        ("warm_up", 103, True, 2),
        ("store.get", "nccl/2-to-1"),
        ("init_rank", 2, b"from-2-to-1", 1, 104),
        ("warm_up", 104, False, 2),
    ]
    link.close()


@pytest.mark.parametrize(
    ("rank", "directions"),
    [
        (0, ["0-to-1", "1-to-0", "0-to-2", "2-to-0"]),
        (1, ["0-to-1", "1-to-0", "1-to-2", "2-to-1"]),
        (2, ["0-to-2", "2-to-0", "1-to-2", "2-to-1"]),
    ],
)
def test_every_rank_creates_its_directions_in_one_global_order(calls, rank, directions):
    link, _ = direct_link(rank, calls)
    keys = [c[1].removeprefix("nccl/") for c in calls if c[0] in ("store.get", "store.set")]
    assert keys == directions
    link.close()


def test_a_missing_id_names_the_peer_and_aborts_what_was_made(calls):
    published = {k: v for k, v in PUBLISHED.items() if k != "nccl/2-to-1"}
    with pytest.raises(TransferTimeoutError, match=r"rank 1: no NCCL id from rank 2 for 2 → 1"):
        direct_link(1, calls, published)
    assert calls[-4:] == [
        ("store.get", "nccl/2-to-1"),
        ("abort", 101),
        ("abort", 102),
        ("abort", 103),
    ]


def test_the_warm_up_wait_is_bounded_and_names_the_peer():
    class NeverFires:
        def query(self) -> bool:
            return False

    with pytest.raises(TransferTimeoutError, match="first NCCL transfer with rank 2"):
        _nccl._wait_for_event(NeverFires(), 0.01, "rank 1: first NCCL transfer with rank 2")


# ---------------------------------------------------------------------- transfers


def test_send_and_recv_use_their_directions_communicator(calls):
    link, _ = direct_link(1, calls)
    del calls[:]
    outgoing = torch.arange(6, dtype=torch.float32)
    incoming = torch.empty(3, dtype=torch.bfloat16)
    flags = torch.zeros(5, dtype=torch.bool)
    assert link.send(outgoing, 0).wait() is None
    assert link.recv(incoming, 2).wait() is None
    link.send(flags, 2)
    link.recv(flags, 0)
    # In each direction's communicator the sender is rank 0 and the receiver rank 1.
    assert calls == [
        ("group_start",),
        ("send", outgoing.data_ptr(), 24, 1, 102, STREAM),  # 1 → 0
        ("group_end",),
        ("group_start",),
        ("recv", incoming.data_ptr(), 6, 0, 104, STREAM),  # 2 → 1
        ("group_end",),
        ("group_start",),
        ("send", flags.data_ptr(), 5, 1, 103, STREAM),  # 1 → 2
        ("group_end",),
        ("group_start",),
        ("recv", flags.data_ptr(), 5, 0, 101, STREAM),  # 0 → 1
        ("group_end",),
    ]
    link.close()


def test_zero_byte_tensors_are_skipped_on_both_sides(calls):
    link, _ = direct_link(1, calls)
    del calls[:]
    link.send(torch.empty(0, 4), 0).wait()
    link.recv(torch.empty(3, 0, dtype=torch.int64), 2).wait()
    assert calls == []
    link.close()


def test_the_group_is_closed_when_an_operation_fails(calls):
    link, lib = direct_link(1, calls)
    del calls[:]
    lib.fail_send = True
    with pytest.raises(RuntimeError, match="ncclSend failed"):
        link.send(torch.ones(2), 0)
    assert calls == [("group_start",), ("group_end",)]
    link.close()


def test_bad_tensors_and_peers_are_refused(calls):
    link, _ = direct_link(1, calls)
    del calls[:]
    with pytest.raises(ValueError, match="contiguous"):
        link.send(torch.ones(4, 4).t(), 0)
    with pytest.raises(ValueError, match="no NCCL communicator with rank 1"):
        link.recv(torch.ones(1), 1)
    assert calls == []
    link.close()


def test_close_aborts_each_communicator_once(calls):
    link, _ = direct_link(1, calls)
    del calls[:]
    link.close()
    link.close()
    assert calls == [("abort", 101), ("abort", 102), ("abort", 103), ("abort", 104)]
    with pytest.raises(ValueError, match="link is closed"):
        link.send(torch.ones(1), 0)


# ---------------------------------------------------------------------- ce / nvlink edges
def test_make_links_gives_each_transport_its_link_and_closes_what_it_made(monkeypatch):
    import dataclasses

    from tensorferry.graph import _p2p_link

    made = []

    class FakeP2P:
        def __init__(self, setup, device):
            made.append(("p2p", setup.p2p_transports))
            self.links = {t: f"{t}-link" for t in setup.p2p_transports}

        def close(self):
            made.append(("p2p closed",))

    class FakeNccl:
        def close(self):
            made.append(("nccl closed",))

    monkeypatch.setattr(_p2p_link, "P2PLinks", FakeP2P)
    monkeypatch.setattr(_nccl, "make_link", lambda setup, device: FakeNccl())
    setup = dataclasses.replace(
        setup_for(0), p2p_pairs=(("nvlink", 0, 2), ("ce", 0, 1), ("ce", 1, 2))
    )
    links, owners = _nccl.make_links(setup, torch.device("cpu"))
    assert set(links) == {"nccl", "ce", "nvlink"} and links["ce"] == "ce-link"
    assert made == [("p2p", ("ce", "nvlink"))]  # sorted: every rank prepares in one order
    for owner in reversed(owners):
        owner.close()
    assert made[1:] == [("p2p closed",), ("nccl closed",)]

    # Only p2p edges: no NCCL communicator is made at all.
    made.clear()
    only_p2p = dataclasses.replace(setup, pairs=())
    links, owners = _nccl.make_links(only_p2p, torch.device("cpu"))
    assert set(links) == {"ce", "nvlink"} and len(owners) == 1

    # A failing p2p set-up closes the NCCL link made before it.
    made.clear()

    def broken(setup, device):
        raise TransferTimeoutError("peer never came")

    monkeypatch.setattr(_p2p_link, "P2PLinks", broken)
    with pytest.raises(TransferTimeoutError, match="never came"):
        _nccl.make_links(setup, torch.device("cpu"))
    assert made == [("nccl closed",)]


def test_p2p_partners_per_transport():
    import dataclasses

    from tensorferry.graph._p2p_link import _partners

    pairs = (("ce", 0, 1), ("ce", 1, 2), ("nvlink", 0, 2), ("ce", 0, 2))
    setup = dataclasses.replace(setup_for(0), p2p_pairs=pairs)
    assert _partners(setup, "ce") == [1, 2] and _partners(setup, "nvlink") == [2]
    setup = dataclasses.replace(setup_for(1), p2p_pairs=pairs)
    assert _partners(setup, "ce") == [0, 2] and _partners(setup, "nvlink") == []


def test_copy_engine_edge_that_cannot_run_here_fails_at_compile(monkeypatch):
    from types import SimpleNamespace

    from tensorferry.cli import doctor
    from tensorferry.errors import GraphCompileError
    from tensorferry.graph._compiled import _check_p2p_transports

    monkeypatch.setattr(
        doctor, "transport_report", lambda: {"ce": "no peer access between devices", "nccl": None}
    )
    edge = SimpleNamespace(src_actor="a", dst_actor="b", transport="ce")
    with pytest.raises(GraphCompileError, match=r"a -> b: transport 'ce'.*no peer access"):
        _check_p2p_transports(SimpleNamespace(edges=[edge]))
    edge.transport = "nccl"  # only ce and nvlink edges are looked at
    _check_p2p_transports(SimpleNamespace(edges=[edge]))
