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
