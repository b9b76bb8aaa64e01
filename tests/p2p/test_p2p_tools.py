"""CPU tier: the p2p demo and the toy/batch benchmarks run end to end (2 spawned processes)."""

from __future__ import annotations

import io

import pytest

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
