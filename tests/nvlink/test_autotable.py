"""CPU tests of the ``transport="auto"`` table."""

from __future__ import annotations

import json

import pytest

from tensorferry.p2p.nvlink._autotable import DEFAULT_TABLES, AutoTable, default_table


def table() -> AutoTable:
    return AutoTable(
        rules={
            "one_way": [(64 << 10, "nvlink"), (256 << 20, "nvlink"), (None, "ce")],
            "both": [(8 << 20, "nvlink"), (None, "nccl")],
        },
        concurrent_compute_min_bytes=1 << 20,
        min_ctas_for_nvlink=2,
    )


def test_choose_by_size_and_direction() -> None:
    t = table()
    assert t.choose(256, bidirectional=False) == "nvlink"
    assert t.choose(256 << 20, bidirectional=False) == "nvlink"
    assert t.choose((256 << 20) + 1, bidirectional=False) == "ce"
    assert t.choose(8 << 20, bidirectional=True) == "nvlink"
    assert t.choose(9 << 20, bidirectional=True) == "nccl"


def test_sm_budget_and_concurrent_compute() -> None:
    t = table()
    assert t.choose(4096, bidirectional=False, max_ctas=1) == "ce"
    assert t.choose(4096, bidirectional=False, max_ctas=2) == "nvlink"
    assert t.choose(4096, bidirectional=False, concurrent_compute=True) == "nvlink"
    assert t.choose(2 << 20, bidirectional=False, concurrent_compute=True) == "ce"
    with pytest.raises(ValueError):
        t.choose(-1, bidirectional=False)


@pytest.mark.parametrize(
    "rules",
    [
        {"one_way": [(None, "nvlink")]},  # a mode missing
        {"one_way": [(10, "nvlink")], "both": [(None, "nvlink")]},  # last rule bounded
        {"one_way": [(None, "nvlink"), (10, "ce")], "both": [(None, "ce")]},
        {"one_way": [(10, "x"), (None, "ce")], "both": [(None, "ce")]},
        {"one_way": [(10, "ce"), (5, "nvlink"), (None, "ce")], "both": [(None, "ce")]},
    ],
)
def test_bad_tables_are_rejected(rules: dict) -> None:
    with pytest.raises(ValueError):
        AutoTable(rules=rules)


def test_json_round_trip(tmp_path) -> None:
    t = table()
    path = tmp_path / "auto.json"
    t.save(str(path))
    assert json.loads(path.read_text())["rules"]["both"][-1] == [None, "nccl"]
    assert AutoTable.load(str(path)) == t


def test_from_measurements_merges_neighbours() -> None:
    times = {
        ("one_way", 256): {"nvlink": 3.0, "ce": 30.0, "nccl": 10.0},
        ("one_way", 1 << 20): {"nvlink": 20.0, "ce": 30.0, "nccl": 25.0},
        ("one_way", 1 << 30): {"nvlink": 3000.0, "ce": 2800.0, "nccl": 2900.0},
        ("both", 256): {"nvlink": 3.0, "nccl": 10.0},
        ("both", 1 << 30): {"nvlink": 3000.0, "nccl": 3100.0},
    }
    t = AutoTable.from_measurements(times)
    assert list(t.rules["one_way"]) == [(1 << 20, "nvlink"), (None, "ce")]
    assert list(t.rules["both"]) == [(None, "nvlink")]


def test_defaults_and_a_table_from_a_file(tmp_path) -> None:
    for data in DEFAULT_TABLES.values():
        AutoTable.from_json(data)
    assert "H100" in default_table("NVIDIA H100 80GB HBM3").source
    assert "H200" in default_table("NVIDIA H200").source
    path = tmp_path / "t.json"
    table().save(str(path))
    assert default_table(path=str(path)).choose(9 << 20, bidirectional=True) == "nccl"
