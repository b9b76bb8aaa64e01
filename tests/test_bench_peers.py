"""``tensorferry bench peers``: a quick CPU run end to end, its byte check and its pure pieces;
and the options it shares with every other benchmark (``--out``, ``--json``, ``--help``)."""

import csv
import json

import pytest
import torch

from tensorferry.bench import _peers_plan, _peers_report, _peers_timing
from tensorferry.bench._peers_payload import POISON_BYTE, Payload, first_difference, poison
from tensorferry.cli.main import BENCHMARKS, main


def test_quick_cpu_run_times_torch_and_tensorferry_on_every_row(tmp_path, capsys):
    assert main(["bench", "peers", "--device", "cpu", "--quick", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "scaled down" in printed and "tf/torch" in printed
    names = {p.name for p in tmp_path.iterdir()}
    assert {"peers.csv", "peers.md", "peers.json"} <= names
    pytest.importorskip("matplotlib")
    assert "peers.png" in names

    rows = json.loads((tmp_path / "peers.json").read_text())["rows"]
    keys = [row["key"] for row in rows]
    small_rows, after = _peers_plan.ROW_KEYS[:6], _peers_plan.ROW_KEYS[6:]
    assert keys == [*small_rows, "idle", *after, "floor"]
    floors = {"floor": "compute only", "idle": "nothing moved"}
    for row in rows:
        if row["key"] in floors:
            assert list(row["contenders"]) == [floors[row["key"]]]
            assert row["contenders"][floors[row["key"]]]["median_us"] > 0
            assert row["bytes"] == 0
            continue
        for name in ("torch", "tensorferry"):
            assert row["contenders"][name]["median_us"] > 0, (row["key"], name)
        assert row["contenders"]["nixl"]["skipped"]  # n/a with its reason on the CPU
    with (tmp_path / "peers.csv").open() as f:
        lines = list(csv.DictReader(f))
    timed = [line for line in lines if line["contender"] in ("torch", "tensorferry")]
    assert len(timed) == 2 * len(_peers_plan.ROW_KEYS)
    assert all(float(line["median_us"]) > 0 for line in timed)
    assert sum(line["contender"] == "nothing moved" for line in lines) == 1
    md = (tmp_path / "peers.md").read_text()
    assert "- command: `tensorferry" in md and "| row | torch µs |" in md and "n/a [1]" in md
    assert "the timing alone, nothing moved" in md and "not a contender" in md


def test_json_flag_prints_one_document_and_nothing_else(tmp_path, capsys):
    argv = ["bench", "peers", "--device", "cpu", "--quick", "--rows", "small", "--json"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["benchmark"] == "peers"
    (report,) = document["reports"]
    row, idle = report["rows"]  # the 4 KiB row brings the timing alone
    assert row["contenders"]["tensorferry"]["median_us"] > 0
    assert idle["key"] == "idle" and idle["contenders"]["nothing moved"]["median_us"] > 0


def test_wrong_bytes_fail_the_run_naming_row_and_contender(tmp_path, monkeypatch):
    import tensorferry.p2p._launch

    wrong = {"row": "3. one 4 KiB tensor one way", "contender": "tensorferry", "detail": "1 of"}
    monkeypatch.setattr(
        tensorferry.p2p._launch,
        "run_world",
        lambda *args, **kwargs: [{"rows": [], "wrong_bytes": wrong}] * 2,
    )
    with pytest.raises(SystemExit) as exc:
        main(["bench", "peers", "--device", "cpu", "--out", str(tmp_path / "out")])
    assert "row '3. one 4 KiB tensor one way', contender tensorferry" in str(exc.value.code)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("values", [False, True])
def test_the_check_finds_one_corrupted_byte_and_names_it(values):
    dtype = torch.bfloat16 if values else torch.uint8
    payload = Payload(count=4, numel=64, dtype=dtype, device="cpu", values=values)
    arena = torch.empty(4 * 64, dtype=dtype)
    payload.write(arena, rank=0, iteration=3)
    assert payload.problem(arena, rank=0, iteration=3) is None
    assert payload.problem(arena, rank=0, iteration=4) is not None  # a stale message
    assert payload.problem(arena, rank=1, iteration=3) is not None  # another rank's
    arena.view(torch.uint8)[2 * payload.tensor_bytes + 5] ^= 0x10
    problem = payload.problem(arena, rank=0, iteration=3)
    assert problem.startswith("1 of 512 bytes wrong" if values else "1 of 256 bytes wrong")
    assert "byte 5 of tensor 2" in problem


def test_poisoned_buffers_fail_the_check_and_swapped_tensors_too():
    payload = Payload(count=2, numel=4096, dtype=torch.uint8, device="cpu", values=False)
    arena = torch.empty(2 * 4096, dtype=torch.uint8)
    poison(arena)
    assert bool((arena == POISON_BYTE).all())
    wrong = int(payload.problem(arena, rank=0, iteration=0).split()[0])
    assert wrong > 8000  # all but the few random bytes that happen to be 0xA5
    payload.write(arena, rank=0, iteration=0)
    swapped = torch.cat([arena[4096:], arena[:4096]])
    assert "of tensor 0" in payload.problem(swapped, rank=0, iteration=0)


def test_pipeline_payload_survives_matmuls_by_the_identity():
    payload = Payload(count=1, numel=16 * 64, dtype=torch.bfloat16, device="cpu", values=True)
    x = torch.empty(16 * 64, dtype=torch.bfloat16)
    payload.write(x, rank=0, iteration=7)
    eye = torch.eye(64, dtype=torch.bfloat16)
    out = (x.view(16, 64) @ eye @ eye @ eye).reshape(-1)
    assert payload.problem(out, rank=0, iteration=7) is None


def test_first_difference_of_equal_bytes_is_none():
    a = torch.arange(10, dtype=torch.uint8)
    assert first_difference(a, a.clone(), 5) is None
    b = a.clone()
    b[7] = 0
    assert first_difference(b, a, 5) == (
        "1 of 10 bytes wrong; the first is byte 2 of tensor 1: 0x00, expected 0x07"
    )


def test_iteration_time_is_the_later_done_minus_the_senders_start():
    starts = [100, 1000]
    dones = [[150, 1010], [170, 1300]]  # rank 0's, rank 1's
    assert _peers_timing.iteration_times_ns(starts, dones) == [70, 300]


def test_median_in_microseconds():
    assert _peers_timing.median_us([3000, 1000, 2000]) == 2.0
    assert _peers_timing.median_us([1000, 2000]) == 1.5
    with pytest.raises(ValueError):
        _peers_timing.median_us([])


def test_ratio_and_cell_formats():
    assert _peers_report.ratio(50.0, 100.0) == 0.5
    assert _peers_report.ratio(None, 100.0) is None
    assert _peers_report.ratio(5.0, None) is None
    assert _peers_report.format_ratio(0.8123) == "0.81×"
    assert _peers_report.format_ratio(None) == ""
    assert _peers_report.format_time(12.345) == "12.3"
    assert _peers_report.format_time(5432.1, 197.66) == "5432 (197.7 GB/s)"


def test_table_shows_n_a_with_numbered_reasons_and_tf_over_others():
    rows = [
        {
            "title": "3. one 4 KiB tensor one way",
            "bandwidth": False,
            "contenders": {
                "torch": {"median_us": 20.0},
                "nixl": {"skipped": "nixl is not importable"},
                "tensorferry": {"median_us": 30.0},
            },
        },
        {
            "title": "2. one 1 GiB tensor one way",
            "bandwidth": True,
            "contenders": {
                "torch": {"median_us": 5000.0, "gb_per_s": 214.7},
                "nixl": {"skipped": "nixl is not importable"},
                "tensorferry": {"skipped": "TransferTimeoutError"},
            },
        },
        {
            "title": "  floor",
            "bandwidth": False,
            "contenders": {"compute only": {"median_us": 9.0}},
        },
    ]
    lines, footnotes = _peers_report.table_rows(rows)
    assert lines[0] == {
        "row": "3. one 4 KiB tensor one way",
        "torch µs": "20.0",
        "NIXL µs": "n/a [1]",
        "tensorferry µs": "30.0",
        "tf/torch": "1.50×",
        "tf/NIXL": "",
    }
    assert lines[1]["torch µs"] == "5000 (214.7 GB/s)"
    assert lines[1]["tensorferry µs"] == "n/a [2]" and lines[1]["tf/torch"] == ""
    assert [lines[2][c] for c in ("torch µs", "NIXL µs", "tensorferry µs", "tf/torch")] == [
        "9.0",
        "9.0",
        "9.0",
        "",
    ]
    assert footnotes == [
        "[1] NIXL: nixl is not importable",
        "[2] tensorferry: TransferTimeoutError",
    ]


def test_rows_are_chosen_by_key_in_table_order():
    assert _peers_plan.parse_rows("all") == list(_peers_plan.ROW_KEYS)
    assert _peers_plan.parse_rows("pipeline,kv") == ["kv", "pipeline"]
    with pytest.raises(ValueError, match="unknown rows"):
        _peers_plan.parse_rows("kv,teleport")


def test_plans_scale_sizes_and_iterations():
    gpu = _peers_plan.make_plan(
        "cuda", quick=False, rows=["kv", "large", "small", "pipeline"], iters_scale=1.0, timeout_s=9
    )
    kv, large, small, idle, pipeline, floor = gpu.rows
    assert kv.count == 64 and kv.tensor_bytes == 2 << 20 and kv.title.startswith("1. KV-cache")
    assert large.total_bytes == 1 << 30 and "1 GiB" in large.title
    assert gpu.iterations(small) == (20, 200) and gpu.iterations(large) == (5, 20)
    assert pipeline.shape == (4096, 8192) and pipeline.weight_side == 8192
    assert floor.compute_only and floor.floor == "compute only" and floor.total_bytes == 0
    assert idle.key == "idle" and idle.floor == "nothing moved" and not idle.compute_only
    assert idle.total_bytes == 0 and gpu.iterations(idle) == gpu.iterations(small)
    assert idle.title == "  the timing alone, nothing moved (floor of the 4 KiB rows)"
    cpu = _peers_plan.make_plan("cpu", quick=False, rows=["large"], iters_scale=0.5, timeout_s=9)
    (cpu_large,) = cpu.rows
    assert cpu_large.total_bytes < large.total_bytes
    assert cpu.iterations(cpu_large) == (2, 5)
    assert _peers_plan.size_text(4096) == "4 KiB" and _peers_plan.size_text(100) == "100 B"


def _quick_rows(rows):
    plan = _peers_plan.make_plan("cpu", quick=True, rows=rows, iters_scale=1.0, timeout_s=9)
    return {row.key: row for row in plan.rows}


def _plan_keys(rows):
    return list(_quick_rows(rows))


def test_the_timing_alone_comes_with_any_4_kib_row_and_only_then():
    assert _plan_keys(["kv"]) == ["kv"]
    assert _plan_keys(["large", "pipeline"]) == ["large", "pipeline", "floor"]
    assert _plan_keys(["roundtrip"]) == ["roundtrip", "idle"]
    assert _plan_keys(["small", "pipeline"]) == ["small", "idle", "pipeline", "floor"]
    assert "idle" not in _peers_plan.ROW_KEYS
    with pytest.raises(ValueError, match="unknown rows"):
        _peers_plan.parse_rows("idle")


def test_the_timing_alone_shows_in_every_column_without_ratios():
    row = {
        "title": "  the timing alone, nothing moved (floor of the 4 KiB rows)",
        "bandwidth": False,
        "contenders": {"nothing moved": {"median_us": 7.5}},
    }
    (line,), footnotes = _peers_report.table_rows([row])
    assert [line[c] for c in ("torch µs", "NIXL µs", "tensorferry µs")] == ["7.5", "7.5", "7.5"]
    assert line["tf/torch"] == line["tf/NIXL"] == "" and footnotes == []


def test_the_timing_alone_has_no_buffers_and_nothing_to_check():
    from tensorferry.bench._peers_cases import Workspace, nothing_moved_case

    idle = _quick_rows(["small"])["idle"]
    for rank in (0, 1):
        ws = Workspace(idle, rank, torch.device("cpu"))
        assert ws.arenas == [] and ws.out == [] and ws.into == []
        case = nothing_moved_case(ws)
        case.prepare(0)
        case.run(0)
        assert case.check(0) is None


def test_bad_rows_are_one_line_before_anything_starts():
    with pytest.raises(SystemExit, match="--rows 'kv,nope'"):
        main(["bench", "peers", "--rows", "kv,nope"])


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_every_benchmark_has_the_same_out_default_and_json(name, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", name, "--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--out OUT folder for the result files" in text
    assert f"(default: bench-results/{name}/)" in text
    assert "--json print the results as JSON on stdout" in text
    assert "(default: None)" not in text and "(default: False)" not in text
    if name == "sendrecv":
        assert "Needs two CUDA GPUs on this machine" in text


def test_json_of_another_benchmark_is_one_document_too(tmp_path, capsys):
    assert main(["bench", "lifecycle", "--cycles", "3", "--json", "--out", str(tmp_path)]) == 0
    document = json.loads(capsys.readouterr().out)
    (report,) = document["reports"]
    assert report["theme"] == "lifecycle" and len(report["rows"]) == 3
    assert all(path.startswith(str(tmp_path)) for path in report["files"])
