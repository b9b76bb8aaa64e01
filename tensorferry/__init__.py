"""tensorferry: fast tensor transfers between GPUs, and compiled actor graphs whose
communication hides behind their compute.

Three layers on one process-level runtime: :mod:`tensorferry.runtime` (stream pool,
communicator cache, completion pool, :class:`Client`), :mod:`tensorferry.p2p` (send/recv with
:class:`Transfer` handles) and :mod:`tensorferry.graph` (compiled actor graphs).
"""

from tensorferry.runtime._hardware_queues import widen_hardware_queues

# Before anything can initialise CUDA: the queue count is fixed when the context is created.
widen_hardware_queues()

from tensorferry import runtime  # noqa: E402
from tensorferry.errors import (  # noqa: E402
    ActorDiedError,
    ActorError,
    ClientClosedError,
    CompletionPoolShutdownError,
    DeadlockError,
    GraphCompileError,
    MismatchError,
    PeerLostError,
    StreamResetError,
    TensorFerryError,
    TransferTimeoutError,
    TransportError,
)
from tensorferry.graph import actor  # noqa: E402
from tensorferry.p2p import (  # noqa: E402
    Batch,
    TensorSpec,
    Transfer,
    batch,
    get_rank,
    get_world_size,
    init,
    is_initialized,
    prepare,
    recv,
    ring_all_gather,
    send,
    sendrecv,
    shutdown,
)
from tensorferry.runtime import Client, ClientConfig  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "runtime",
    "Client",
    "ClientConfig",
    # point to point
    "init",
    "shutdown",
    "is_initialized",
    "get_rank",
    "get_world_size",
    "prepare",
    "send",
    "recv",
    "sendrecv",
    "batch",
    "Batch",
    "ring_all_gather",
    "Transfer",
    "TensorSpec",
    # graphs
    "actor",
    "TensorFerryError",
    "ClientClosedError",
    "TransferTimeoutError",
    "PeerLostError",
    "MismatchError",
    "TransportError",
    "StreamResetError",
    "CompletionPoolShutdownError",
    "ActorDiedError",
    "ActorError",
    "GraphCompileError",
    "DeadlockError",
]
