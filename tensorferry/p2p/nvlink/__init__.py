"""NVLink transport: Triton copy kernels over PyTorch symmetric memory.

- :class:`NvlinkChannel` — one rank's staging buffers and signals; ``send``/``recv``/``sendrecv``.
- :func:`empty` — a symmetric receive buffer the sender writes directly (zero-copy).
- :class:`ChannelConfig`, :func:`plan_launch` — buffer sizing, CTA budget, adaptive stride.
- :class:`AutoTable`, :func:`default_table` — a measured size table of the kernel-level channels.

``tensorferry.p2p.nvlink.transport`` carries ``tf.send(..., transport="nvlink")`` messages.

Triton is imported only when a kernel launches, so this package imports on machines without it.
"""

from tensorferry.p2p.nvlink._autotable import AutoTable, default_table
from tensorferry.p2p.nvlink._layout import ChannelConfig, LaunchPlan, plan_launch
from tensorferry.p2p.nvlink._symm import empty
from tensorferry.p2p.nvlink.sendrecv_op import NvlinkChannel, validate_message

__all__ = [
    "NvlinkChannel",
    "ChannelConfig",
    "LaunchPlan",
    "plan_launch",
    "empty",
    "validate_message",
    "AutoTable",
    "default_table",
]
