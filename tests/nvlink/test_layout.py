"""CPU tests: launch plans, channel configuration checks, signal and flag layouts."""

from __future__ import annotations

import math

import pytest
import torch

from tensorferry.p2p.copy_engine.ce_op import CeLayout, agreement_codes, plan_chunks
from tensorferry.p2p.nvlink._layout import (
    ChannelConfig,
    SignalLayout,
    dtype_code,
    plan_launch,
)

SIZES = [1, 15, 16, 17, 1023, 1024, 4099, 65536, (1 << 20) + 3, (64 << 20) + 5, 1 << 30]


@pytest.mark.parametrize("nbytes", SIZES)
@pytest.mark.parametrize("ctas", [1, 2, 4, 7, 16, 32])
def test_plan_covers_every_byte_once(nbytes: int, ctas: int) -> None:
    cfg = ChannelConfig()
    plan = plan_launch(nbytes, ctas, cfg)
    assert 1 <= plan.num_ctas <= ctas
    assert plan.chunk % 1024 == 0 and plan.chunk <= cfg.slot_bytes
    assert plan.body % 16 == 0 and 0 <= nbytes - plan.body < 16
    covered = 0
    for lane in range(plan.num_ctas):
        count = plan.chunks_of_lane(lane)
        assert count >= 1, "every lane needs at least one chunk (the receiver waits on it)"
        for k in range(count):
            offset = (k * plan.num_ctas + lane) * plan.chunk
            assert offset < nbytes
            covered += min(plan.chunk, nbytes - offset)
    assert covered == nbytes


def test_plan_adapts_stride_to_size() -> None:
    cfg = ChannelConfig()
    assert plan_launch(17, 32, cfg).num_ctas == 1
    mid = plan_launch(1 << 20, 32, cfg)
    assert mid.num_ctas == 32 and mid.chunk == 32 * 1024
    big = plan_launch(1 << 30, 32, cfg)
    assert big.chunk == cfg.slot_bytes and big.num_chunks == (1 << 30) // cfg.slot_bytes


def test_plan_rejects_empty() -> None:
    with pytest.raises(ValueError):
        plan_launch(0, 4, ChannelConfig())


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"max_ctas": 0}, ValueError),
        ({"max_ctas": 65, "max_blocks": 32}, ValueError),
        ({"slot_bytes": 1000}, ValueError),
        ({"slot_bytes": 128 << 20}, ValueError),
        ({"block_words": 3000}, ValueError),
        ({"num_warps": 3}, ValueError),
        ({"timeout_s": 0}, ValueError),
        ({"timeout_s": float("inf")}, ValueError),  # overflowed the kernels' deadline at launch
        ({"timeout_s": "60"}, TypeError),
        ({"num_slots": 1.5}, TypeError),
    ],
)
def test_config_rejects_bad_values(kwargs: dict, error: type) -> None:
    with pytest.raises(error):
        ChannelConfig(**kwargs)


def test_budget_per_direction() -> None:
    cfg = ChannelConfig(max_ctas=8, max_blocks=16)
    assert cfg.ctas_per_direction(bidirectional=False) == 8
    assert cfg.ctas_per_direction(bidirectional=True) == 4
    assert cfg.ctas_per_direction(bidirectional=True, max_ctas=4) == 2
    with pytest.raises(ValueError, match="no CTA"):
        cfg.ctas_per_direction(bidirectional=True, max_ctas=1)
    with pytest.raises(ValueError, match="max_blocks"):
        cfg.ctas_per_direction(bidirectional=False, max_ctas=17)
    with pytest.raises(TypeError):
        cfg.ctas_per_direction(bidirectional=False, max_ctas=True)


@pytest.mark.parametrize("world", [2, 3, 8])
def test_signal_words_are_disjoint(world: int) -> None:
    lay = SignalLayout(world, 4)
    words: list[int] = []
    for r in range(world):
        for b in range(4):
            words += [lay.ready(r, b), lay.free(r, b), lay.send_step(r, b), lay.recv_step(r, b)]
            words.append(lay.send_msg(r, b))
        words += [lay.post(r) + i for i in range(8)] + [lay.recv_msg(r)]
    words += [lay.status, lay.status + 1]
    assert len(words) == len(set(words))
    assert max(words) < lay.num_words


def test_ce_layout_and_chunks() -> None:
    lay = CeLayout(4, 2)
    words = [lay.ready(r, s) for r in range(4) for s in range(2)]
    words += [lay.free(r, s) for r in range(4) for s in range(2)]
    words += [lay.post(r) + i for r in range(4) for i in range(2)]
    words += [lay.sent(r) + i for r in range(4) for i in range(2)]
    words += [lay.ack(r) for r in range(4)]
    assert len(words) == len(set(words)) and max(words) < lay.num_words
    for nbytes in SIZES:
        chunks = plan_chunks(nbytes, 32 << 20)
        assert sum(length for _, length in chunks) == nbytes
        assert all(0 < length <= 32 << 20 for _, length in chunks)
        assert [off for off, _ in chunks] == list(itertools_accumulate(chunks))
    assert len(plan_chunks(100 << 20, 32 << 20)) == 4
    assert plan_chunks(0, 1 << 20) == []


def itertools_accumulate(chunks: list[tuple[int, int]]) -> list[int]:
    out, pos = [], 0
    for _, length in chunks:
        out.append(pos)
        pos += length
    return out


def test_agreement_codes_differ_for_size_and_dtype() -> None:
    a = agreement_codes(1000, torch.float32)
    assert all(0 < w < 2**31 for w in a)
    assert agreement_codes(1001, torch.float32)[0] != a[0]
    assert agreement_codes(1000, torch.int32)[1] != a[1]
    assert dtype_code(torch.bfloat16) != dtype_code(torch.float16)
    assert math.prod([1]) == 1


def test_ce_words_starting_at_one_are_the_acks_and_free_slots() -> None:
    lay = CeLayout(3, 2)
    ones = lay.starting_at_one()
    assert sorted(ones) == sorted(
        [lay.ack(r) for r in range(3)] + [lay.free(r, s) for r in range(3) for s in range(2)]
    )
    zeros = [lay.ready(r, s) for r in range(3) for s in range(2)]
    zeros += [lay.post(r) + i for r in range(3) for i in range(2)]
    zeros += [lay.sent(r) + i for r in range(3) for i in range(2)]
    assert not set(ones) & set(zeros)
