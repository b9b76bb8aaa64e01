"""Point-to-point transfers between processes, one process per device.

::

    import tensorferry as tf

    tf.init()                                   # torchrun env, or rank=/world_size=/init_method=
    t = tf.send(x, dst=1)                       # returns at once: a Transfer
    y = tf.recv(tf.TensorSpec((4, 4), torch.float32), src=0).result(timeout=10)
    with tf.batch() as b:                       # one group call on exit
        b.send(x, 1)
        b.recv(z, 1)
    b.wait(timeout=10)

Routes: ``ce`` between GPUs of one host (the copy engine writes into the receiver's buffers),
``nccl`` between GPUs of different hosts, ``gloo`` for CPU tensors, and ``nvlink`` (the NVLink
copy kernels) when named; ``transport="auto"`` picks by device and host. See :class:`Transfer`
for the stream-ordering rules.
"""

from tensorferry.p2p._api import Batch, batch, prepare, recv, ring_all_gather, send, sendrecv
from tensorferry.p2p._context import get_rank, get_world_size, init, is_initialized, shutdown
from tensorferry.p2p._spec import TensorSpec
from tensorferry.p2p._transfer import Transfer

__all__ = [
    # set-up
    "init",
    "shutdown",
    "is_initialized",
    "get_rank",
    "get_world_size",
    "prepare",
    # transfers
    "send",
    "recv",
    "sendrecv",
    "batch",
    "Batch",
    "ring_all_gather",
    "Transfer",
    "TensorSpec",
]
