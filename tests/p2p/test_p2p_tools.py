"""CPU tier: the p2p demo and the toy/batch benchmarks run end to end (2 spawned processes)."""

from __future__ import annotations

import io

import pytest
import torch

from tensorferry.cli.main import main
from tensorferry.p2p.demo import ProgressBar, run_p2p_demo


def test_progress_bar():
    stream = io.StringIO()
    bar = ProgressBar(4, width=8, stream=stream)
    for _ in range(4):
        bar.advance("x")
    assert "[########] 4/4" in stream.getvalue() and stream.getvalue().endswith("\n")
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


def test_bench_toy_cpu(tmp_path, capsys):
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
    text = capsys.readouterr().out
    for program in ("basic_overlap", "overlap", "pp"):
        assert program in text
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


def test_transfer_latch_releases_every_waiter_and_tolerates_races():
    import threading
    import time

    from tensorferry.p2p._transfer import _Latch

    latch = _Latch()
    assert not latch.is_set() and not latch.wait(0.01)
    woke = []
    waiters = [threading.Thread(target=lambda: woke.append(latch.wait(5.0))) for _ in range(8)]
    for thread in waiters:
        thread.start()
    time.sleep(0.05)
    setters = [threading.Thread(target=latch.set) for _ in range(4)]  # racing setters
    for thread in setters:
        thread.start()
    for thread in (*setters, *waiters):
        thread.join(5.0)
    assert woke == [True] * 8
    assert latch.is_set() and latch.wait(0.0) and latch.wait(1.0)


def test_nccl_calls_setting(monkeypatch):
    from tensorferry import envs
    from tensorferry.p2p import _nccl_lib

    monkeypatch.delenv("TENSORFERRY_NCCL_CALLS", raising=False)
    assert envs.nccl_calls() == "direct"
    monkeypatch.setenv("TENSORFERRY_NCCL_CALLS", "torch")
    assert envs.nccl_calls() == "torch"
    monkeypatch.setenv("TENSORFERRY_NCCL_CALLS", "nvlink")
    with pytest.raises(ValueError, match="TENSORFERRY_NCCL_CALLS"):
        envs.nccl_calls()
    lib = _nccl_lib.library()  # None on a CPU-only build; never raises
    if lib is not None:
        assert lib.version() >= 21800
        assert len(lib.unique_id()) == 128
        with pytest.raises(ValueError, match="128 bytes"):
            lib.init_rank(2, b"short", 0)
