"""CPU tier: the p2p demo and the toy/batch benchmarks run end to end (2 spawned processes)."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest
import torch

from tensorferry.cli.main import main
from tensorferry.p2p.demo import ProgressBar, run_p2p_demo


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_redraws_on_a_terminal_and_writes_lines_elsewhere():
    terminal = _Terminal()
    bar = ProgressBar(4, width=8, stream=terminal)
    for _ in range(4):
        bar.advance("x")
    text = terminal.getvalue()
    assert text.count("\r") == 4 and text.count("\n") == 1 and text.endswith("\n")
    assert "[########] 4/4 x" in text
    log = io.StringIO()  # a file or a pipe: a line per new label and one at the end
    bar = ProgressBar(4, width=8, stream=log)
    for label in ("a", "a", "b", "b"):
        bar.advance(label)
    lines = log.getvalue().splitlines()
    assert lines == ["[##......] 1/4 a", "[######..] 3/4 b", "[########] 4/4 b"]
    with pytest.raises(ValueError):
        ProgressBar(0)


def test_p2p_demo_on_cpu_checks_every_byte():
    out = io.StringIO()
    rows = run_p2p_demo(device="cpu", sizes=[4096, 1 << 20], iters=2, stream=out)
    assert [r["bytes"] for r in rows] == [4096, 1 << 20]
    assert all(r["checked_bytes"] == 2 * 2 * r["bytes"] for r in rows)
    assert all(r["one_way_us"] > 0 and r["gb_per_s"] > 0 for r in rows)
    assert "1 MiB" in out.getvalue() and "ok" in out.getvalue()


def test_p2p_demo_rejects_bad_arguments():
    with pytest.raises(ValueError):
        run_p2p_demo(device="tpu")
    with pytest.raises(ValueError):
        run_p2p_demo(device="cpu", sizes=[3])


def test_bench_toy_cpu(tmp_path, capfd):
    code = main(
        [
            "bench",
            "toy",
            "--device",
            "cpu",
            "--steps",
            "2",
            "--arrays",
            "2",
            "--microbatches",
            "2",
            "--size",
            "32",
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 0
    captured = capfd.readouterr()  # at the descriptors: the ranks' progress lines too
    for program in ("basic_overlap", "overlap", "pp"):
        assert program in captured.out
        for mode in ("cached", "uncached"):  # as each run ends, on stderr
            assert f"toy: {program} {mode}: " in captured.err
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".csv", ".md"]


def test_bench_batch_cpu(tmp_path, capsys):
    code = main(
        [
            "bench",
            "batch",
            "--device",
            "cpu",
            "--count",
            "8",
            "--iters",
            "3",
            "--large-mib",
            "1",
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 0
    text = capsys.readouterr().out
    assert "torch batch_isend_irecv" in text and "tf send(list)" in text
    for call in ("tf.send", "tf.recv", "tf.send(list)", "tf.recv(list)"):
        assert f"{call} host time (median)" in text  # each call's host time, both sides
    md = next(p for p in tmp_path.iterdir() if p.suffix == ".md").read_text()
    assert "command:" in md and "torch:" in md


def test_bench_allgather_cpu(tmp_path, capsys):
    # 3 ranks: the ring's output is checked byte for byte against torch's before timing.
    argv = ["bench", "allgather", "--world", "3", "--sizes", "4K,68", "--iters", "2"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert text.count("tf ring (gloo)") == 2 and text.count("torch all_gather_into_tensor") == 2
    csv_rows = next(p for p in tmp_path.iterdir() if p.suffix == ".csv").read_text().splitlines()
    assert len(csv_rows) == 1 + 4 and all(",3," in row for row in csv_rows[1:])
    with pytest.raises(SystemExit, match="multiples of 4"):
        main(["bench", "allgather", "--sizes", "6"])
    with pytest.raises(SystemExit, match="byte count"):
        main(["bench", "allgather", "--sizes", "lots"])


@pytest.mark.parametrize("mixed", [False, True])
def test_packing_round_trips_every_byte(mixed):
    from tensorferry.p2p._packing import pack, unpack

    gen = torch.Generator().manual_seed(7)
    tensors = [torch.randn(3, 5, generator=gen), torch.randn(1, generator=gen)]
    tensors += [torch.randn(64, generator=gen) for _ in range(8)]
    if mixed:
        tensors += [torch.randint(-9, 9, (4, 2), generator=gen), torch.rand(6).double()]
    packed = pack(tensors)
    # The wire layout is the tensors' bytes back to back, whichever path packed them.
    assert torch.equal(packed, torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors]))
    targets = [torch.full_like(t, 99) for t in tensors]  # poisoned
    unpack(packed.clone(), targets)
    for got, want in zip(targets, tensors, strict=True):
        assert got.shape == want.shape and got.dtype == want.dtype
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def _random_message(gen: torch.Generator) -> list[torch.Tensor]:
    dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool]
    out = []
    for _ in range(int(torch.randint(1, 12, (1,), generator=gen))):
        dtype = dtypes[int(torch.randint(0, len(dtypes), (1,), generator=gen))]
        numel = int(torch.randint(0, 40, (1,), generator=gen)) ** 2  # 0 to 1521 elements
        out.append(torch.randint(0, 2, (numel,), generator=gen).to(dtype))
    return out


def test_layout_plan_sends_what_the_fresh_packing_sends():
    """A side packing through a kept buffer and a side packing afresh must put the same bytes
    on the wire: same tensors packed, in the same order, and the same ones alone."""
    from tensorferry.p2p._packing import wire_plan
    from tensorferry.p2p._spec import describe
    from tensorferry.p2p._staging import LayoutPlan

    gen = torch.Generator().manual_seed(3)
    aligned_seen = unaligned_seen = 0
    for _ in range(300):
        tensors = _random_message(gen)
        packed, alone = wire_plan(tensors, pack_below=2048)
        plan = LayoutPlan(describe(tensors), pack_below=2048)
        members = sorted((offset, i) for group in plan.groups.values() for i, offset in group)
        assert [i for _, i in members] == packed and plan.alone == alone
        sizes = [tensors[i].nbytes for i in packed]
        assert [offset for offset, _ in members] == [sum(sizes[:k]) for k in range(len(sizes))]
        assert plan.packed_bytes == sum(sizes)
        expect_aligned = all(offset % tensors[i].element_size() == 0 for offset, i in members)
        assert plan.aligned == expect_aligned
        aligned_seen += expect_aligned and bool(packed)
        unaligned_seen += not expect_aligned
    assert aligned_seen > 20 and unaligned_seen > 20  # both kinds were exercised


def test_staging_buffer_round_trips_every_byte_and_matches_fresh_packing():
    from tensorferry.p2p._packing import pack
    from tensorferry.p2p._spec import describe
    from tensorferry.p2p._staging import LayoutPlan, Staging

    gen = torch.Generator().manual_seed(11)
    tensors = [torch.randn(256, generator=gen) for _ in range(5)]
    tensors += [torch.randn(70_000, generator=gen), torch.randint(-5, 5, (9,), generator=gen)]
    tensors += [torch.randn(2, generator=gen), torch.randn(3, 7, generator=gen).bfloat16()]
    layout = describe(tensors)
    plan = LayoutPlan(layout, pack_below=4096)
    assert plan.aligned and plan.alone == [5]
    staging = Staging(plan, layout, torch.device("cpu"))
    for round_ in range(3):  # the buffer is reused: each round's bytes replace the last
        data = [t + round_ for t in tensors]
        staging.pack(data, None)
        assert torch.equal(staging.buffer, pack([data[i] for i in range(len(data)) if i != 5]))
        targets = [torch.full_like(t, 99) for t in data]  # poisoned
        staging.unpack(targets, None)
        for i, (got, want) in enumerate(zip(targets, data, strict=True)):
            if i == 5:  # travels alone: not the staging buffer's business
                assert torch.equal(got, torch.full_like(want, 99))
            else:
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (round_, i)


def test_staging_buffer_of_a_message_packed_whole_round_trips_every_byte():
    from tensorferry.p2p._spec import describe
    from tensorferry.p2p._staging import LayoutPlan, Staging

    gen = torch.Generator().manual_seed(12)
    tensors = tuple(torch.randn(64, generator=gen) for _ in range(6))  # one dtype, all small
    layout = describe(tensors)
    staging = Staging(LayoutPlan(layout, pack_below=4096), layout, torch.device("cpu"))
    staging.pack(tensors, None)
    assert torch.equal(staging.buffer.view(torch.float32), torch.cat(tensors))
    targets = tuple(torch.full_like(t, 99) for t in tensors)  # poisoned
    staging.unpack(targets, None)
    for got, want in zip(targets, tensors, strict=True):
        assert torch.equal(got, want)


def test_descriptors_of_one_layout_are_one_object_equal_to_the_plain_tuple():
    from tensorferry.p2p._spec import as_tensor_list, describe

    cpu = torch.device("cpu")
    tensors = [
        torch.zeros(3, 4),
        torch.ones(5, dtype=torch.int64),
        torch.nn.Parameter(torch.ones(2)),
    ]
    plain = (("float32", (3, 4)), ("int64", (5,)), ("float32", (2,)))
    checked, desc, single = as_tensor_list(tensors, cpu, "tensors")
    assert checked[0] is tensors[0] and checked[1] is tensors[1] and not single
    # The parameter goes detached: the same memory, outside autograd.
    assert checked[2].data_ptr() == tensors[2].data_ptr() and not checked[2].requires_grad
    assert desc == plain and hash(desc) == hash(plain) and {plain: 1}[desc] == 1
    assert describe(tensors) is desc  # the same layout: the same (interned) descriptor
    assert as_tensor_list([torch.zeros(3, 4)], cpu, "t")[1] == plain[:1]


def test_staging_cache_keeps_the_most_recent_layouts():
    from tensorferry.p2p._spec import describe
    from tensorferry.p2p._staging import LayoutPlan, Staging, StagingCache

    cache = StagingCache(capacity=2)
    cpu = torch.device("cpu")
    layouts = [describe([torch.zeros(n), torch.zeros(n)]) for n in (1, 2, 3)]
    made = [Staging(LayoutPlan(layout, pack_below=1024), layout, cpu) for layout in layouts]
    assert cache.get("a") is None
    cache.add("a", made[0])
    assert cache.get("a") is made[0]
    cache.add("b", made[1])
    assert cache.get("a") is made[0]  # "a" is now the most recent
    cache.add("c", made[2])  # drops "b"
    assert len(cache) == 2 and cache.get("b") is None
    assert cache.get("a") is made[0] and cache.get("c") is made[2]
    assert made[1].buffer.numel() == 16


def test_process_group_pairs_are_all_issued_before_the_stream_waits_for_any():
    # Each ProcessGroupNCCL pair's stream waits for the transfer's stream when its group is
    # issued: ordering that stream after a pair's send before the next pair's receive is issued
    # made a large sendrecv both ways hang (each receive waited for its own send).
    from tensorferry.p2p._nccl import NcclTransport

    calls = []

    class Pair:  # stands in for _GroupPair
        def __init__(self, name):
            self.name = name

        def enqueue(self, wire, stream):
            calls.append(("issued", self.name, [kind for kind, _ in wire]))
            return f"work of {self.name}"

        def order_after(self, work, stream):
            calls.append(("stream waits for", work))

    sending, receiving = Pair("send pair"), Pair("recv pair")
    tensor = torch.zeros(4)
    started = NcclTransport._enqueue(
        [(sending, [("send", tensor)]), (receiving, [("recv", tensor)])], stream=object()
    )
    assert calls == [
        ("issued", "send pair", ["send"]),
        ("issued", "recv pair", ["recv"]),
        ("stream waits for", "work of send pair"),
        ("stream waits for", "work of recv pair"),
    ]
    assert started == [(sending, "work of send pair"), (receiving, "work of recv pair")]


def test_a_done_callback_that_waits_on_another_transfers_completion_does_not_hang():
    import threading
    import time

    from tensorferry.p2p._transfer import Transfer

    deadline = time.monotonic() + 10
    first, second = Transfer(deadline), Transfer(deadline)
    first._finish()
    finished_elsewhere, hung = [], []

    def waits_for_second(transfer):
        # Completed on another thread, as the completion pool completes a transfer.
        finisher = threading.Thread(target=lambda: finished_elsewhere.append(second._finish()))
        finisher.start()
        finisher.join(5.0)
        hung.append(finisher.is_alive())  # (an assert here would only be logged)

    first.add_done_callback(waits_for_second)  # done already: runs here, now
    assert hung == [False] and finished_elsewhere == [None] and second.done()
    second.wait(1.0)


def test_the_nccl_library_loads_where_there_is_one():
    from tensorferry.p2p import _nccl_lib

    lib = _nccl_lib.library()  # None on a CPU-only build; never raises
    if lib is not None:
        assert lib.version() >= 21800
        assert len(lib.unique_id()) == 128
        with pytest.raises(ValueError, match="128 bytes"):
            lib.init_rank(2, b"short", 0)


def test_descriptor_text_round_trips_every_layout():
    from tensorferry.p2p._spec import describe, descriptor_from_text, descriptor_text

    tensors = [
        torch.zeros(()),  # a scalar
        torch.zeros(0, dtype=torch.int8),  # empty
        torch.zeros(3, 1, 5, dtype=torch.bfloat16),
        torch.zeros(7, dtype=torch.bool),
        torch.zeros(2, 2, dtype=torch.complex64),
    ]
    for items in ([], tensors[:1], tensors):
        desc = describe(items)
        text = descriptor_text(desc)
        assert descriptor_from_text(text) == desc
        assert not set(text) & set('"\\')  # goes into a JSON string as it is
    assert descriptor_text(describe(tensors[:1])) != descriptor_text(describe([]))


def test_peer_ranks_take_any_integer_but_bools_and_floats():
    import numpy as np

    from tensorferry.p2p._spec import check_peer

    for peer in (1, np.int64(1), np.int32(1), torch.tensor(1)):
        got = check_peer(peer, rank=0, world_size=2, what="dst")
        assert got == 1 and type(got) is int
    for peer in (True, np.bool_(True), 1.0, "1", torch.tensor(1.0), None):
        with pytest.raises(TypeError, match="dst must be an int rank"):
            check_peer(peer, rank=0, world_size=2, what="dst")
    with pytest.raises(ValueError, match="own rank"):
        check_peer(np.int64(0), rank=0, world_size=2, what="dst")
    with pytest.raises(ValueError, match="out of range"):
        check_peer(np.int64(2), rank=0, world_size=2, what="dst")


def test_receive_buffers_of_the_wrong_type_are_named_with_the_spec_hint():
    from tensorferry.p2p._spec import TensorSpec, as_recv_list

    cpu = torch.device("cpu")
    hint = r"must be a torch.Tensor or a tf.TensorSpec\(shape, dtype\), got tuple"
    for buffers in (
        [((2, 3), torch.float32)],  # a spec written as a tuple
        [torch.zeros(2), ((2,), torch.float32)],
        [TensorSpec((2,)), ((2,), torch.float32)],
    ):
        with pytest.raises(TypeError, match=r"buffers\[\d\] " + hint):
            as_recv_list(buffers, cpu, "buffers")
    tensors, _, single = as_recv_list([TensorSpec((2, 3)), torch.ones(4)], cpu, "buffers")
    assert [t.shape for t in tensors] == [(2, 3), (4,)] and not single


def test_timeouts_must_be_finite_seconds(monkeypatch):
    import tensorferry as tf
    from tensorferry import envs

    for endless in (float("inf"), float("nan"), -1):
        with pytest.raises(ValueError, match="timeout must be"):
            tf.init("gloo", rank=0, world_size=2, init_method="tcp://127.0.0.1:1", timeout=endless)
    with pytest.raises(TypeError, match="timeout must be a number of seconds, got str"):
        tf.init("gloo", rank=0, world_size=2, init_method="tcp://127.0.0.1:1", timeout="5")
    for raw in ("inf", "nan", "-3"):
        monkeypatch.setenv("TENSORFERRY_TRANSFER_TIMEOUT_S", raw)
        with pytest.raises(ValueError, match="must be a finite positive number"):
            envs.transfer_timeout_s()
    monkeypatch.setenv("TENSORFERRY_TRANSFER_TIMEOUT_S", "2.5")
    assert envs.transfer_timeout_s() == 2.5


def test_lazy_views_are_refused_with_what_to_pass_instead():
    """A conjugate or negative view's bytes are not its values: refused before anything moves,
    on the one-pass check of long messages and on the detailed one, sending and receiving."""
    from tensorferry.p2p._spec import TensorSpec, as_recv_list, as_tensor_list

    cpu = torch.device("cpu")
    plain = [torch.zeros(3) for _ in range(5)]
    conj = torch.tensor([1 + 2j, 3 - 4j]).conj()
    # One element: x.conj().imag is then contiguous, and negated by a flag only.
    neg = torch.tensor([1 + 2j]).conj().imag
    assert conj.is_contiguous() and neg.is_contiguous() and neg.is_neg()
    cases = [
        (conj, r"tensors\[0\] is a conjugate view .* pass tensor\.resolve_conj\(\)"),
        ([*plain, neg], r"tensors\[5\] is a negative view .* pass tensor\.resolve_neg\(\)"),
    ]
    for tensors, text in cases:
        with pytest.raises(ValueError, match=text):
            as_tensor_list(tensors, cpu, "tensors")
        with pytest.raises(ValueError, match=text):
            as_recv_list(tensors, cpu, "tensors")
    with pytest.raises(ValueError, match=r"tensors\[1\] is a conjugate view"):
        as_recv_list([TensorSpec((2,)), conj], cpu, "tensors")
    # What they tell the caller to pass goes through.
    as_tensor_list([conj.resolve_conj(), neg.resolve_neg(), *plain], cpu, "tensors")


def test_receive_buffers_must_not_share_memory_with_the_calls_other_tensors(monkeypatch):
    from tensorferry import _native
    from tensorferry.p2p._spec import as_recv_list, check_receives_apart

    _native.start()
    _native.wait(timeout=600)  # (None where it cannot be built: Python's way both times)

    buf = torch.zeros(16)
    fine = [
        [("s", "send", [buf[:8]]), ("r", "recv", [buf[8:]])],  # halves of one buffer
        [("s", "send", [buf, buf[2:4]]), ("r", "recv", [torch.zeros(2)])],  # sends may overlap
        [("r", "recv", [buf[:0], buf[:0], buf])],  # empty views hold no memory
        [("r", "recv", [buf[i : i + 4] for i in range(0, 16, 4)])],  # back to back
    ]
    for parts in fine:
        check_receives_apart(parts)
    clashes = [
        # Receives alone: views that overlap (checked only for a tensor listed twice, they
        # were taken, and what arrived was garbled), within a call and across a batch's.
        ([("r", "recv", [buf[:9], buf[8:]])], r"r\[1\] shares memory with r\[0\]"),
        ([("r", "recv", [buf[:4]]), ("q", "recv", [buf[2:6]])], r"q\[0\] shares .* r\[0\]"),
        ([("s", "send", [buf]), ("r", "recv", [buf])], r"r\[0\] shares memory with s\[0\]"),
        ([("r", "recv", [buf[:9], buf[8:]]), ("s", "send", [])], r"r\[1\] shares .* r\[0\]"),
        ([("r", "recv", [buf, buf])], r"r\[1\] shares memory with r\[0\]"),
        ([("s", "send", [buf[12:]]), ("r", "recv", [buf[4:13]])], r"s\[0\] shares memory with r"),
        (
            [("r", "recv", [buf[:4], buf[6:8]]), ("q", "recv", [buf[3:5]]), ("s", "send", [])],
            r"q\[0\] shares .* r\[0\]",
        ),
    ]
    for native in (True, False):  # the compiled check of receives alone, and Python's
        if not native:
            monkeypatch.setattr(_native, "helper", lambda: None)
        for parts in fine:
            check_receives_apart(parts)
        for parts, text in clashes:
            with pytest.raises(ValueError, match=text):
                check_receives_apart(parts)

    # Names may be made by a function (a batch's entries): only for the error that shows them.
    def never_shown(what: int) -> str:
        raise AssertionError("a name was made for a call with nothing wrong")

    check_receives_apart([(0, "send", [buf[:8]]), (1, "recv", [buf[8:]])], names=never_shown)
    with pytest.raises(ValueError, match=r"entry 1\[0\] shares memory with entry 0\[0\]"):
        check_receives_apart([(0, "send", [buf]), (1, "recv", [buf])], names="entry {}".format)
    # Buffers that require grad are detached first: one listed twice is still caught.
    weight = torch.zeros(4, requires_grad=True)
    items, _, _ = as_recv_list([weight, weight], torch.device("cpu"), "buffers")
    with pytest.raises(ValueError, match=r"buffers\[1\] shares memory with buffers\[0\]"):
        check_receives_apart([("buffers", "recv", items)])


def test_nccl_calls_keep_the_gil_only_on_a_connected_pair_with_few_transfers_in_flight(
    monkeypatch,
):
    # Held, nothing else of the process runs while NCCL launches; let go before the pair's
    # first message (which connects it, a rendezvous with the peer) and with many transfers in
    # flight, where a launch could wait for room in the device's queue.
    from tensorferry.p2p import _nccl, _transport
    from tensorferry.runtime import CompletionPool

    pool = CompletionPool(threads=1)
    monkeypatch.setattr(_transport, "completion_pool", lambda: pool)
    held = []

    class Library:  # stands in for NcclLibrary
        def move_alone(self, kind, address, nbytes, peer, comm, stream, hold_gil=False):
            held.append(("move", hold_gil))

        def group_start(self):
            pass

        def send(self, *args):
            pass

        def group_end(self, hold_gil=False):
            held.append(("group", hold_gil))

    pair = _nccl._NativePair(Library(), comm=1, other=1, epoch=0)
    tensor = torch.zeros(4)
    stream = SimpleNamespace(cuda_stream=0)
    try:
        pair.move_alone("send", tensor, 0)  # the warm-up: not connected yet
        pair.connected = True
        pair.move_alone("send", tensor, 0)
        pair.enqueue([("send", tensor), ("send", tensor)], stream)
        for _ in range(_transport.HOLD_GIL_BELOW):
            pool.call_when(lambda: False, lambda exc: None, deadline=1e18, delay=60.0)
        assert pool.waiting_hint() == _transport.HOLD_GIL_BELOW
        pair.move_alone("send", tensor, 0)
        pair.enqueue([("send", tensor), ("send", tensor)], stream)
    finally:
        pool.shutdown(wait=False)
    assert held == [
        ("move", False),
        ("move", True),
        ("group", True),
        ("move", False),
        ("group", False),
    ]
