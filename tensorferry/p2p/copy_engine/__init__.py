"""Copy-engine transport: peer copies by DMA engines, signalled with stream memory operations.

Zero SMs: nothing here launches a kernel, so transfers overlap compute without slowing it.
"""

from tensorferry.p2p.copy_engine.ce_op import (
    CeLayout,
    CeTransfer,
    CopyEngineChannel,
    agreement_codes,
    plan_chunks,
)

__all__ = ["CopyEngineChannel", "CeTransfer", "CeLayout", "plan_chunks", "agreement_codes"]
