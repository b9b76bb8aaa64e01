"""tensorferry: fast tensor transfers between GPUs, and compiled actor graphs whose
communication hides behind their compute.

Three layers on one process-level runtime: :mod:`tensorferry.runtime` (stream pool,
communicator cache, completion pool, :class:`Client`), :mod:`tensorferry.p2p` (send/recv with
:class:`Transfer` handles) and :mod:`tensorferry.graph` (compiled actor graphs).
"""

from tensorferry import runtime
from tensorferry.errors import (
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
from tensorferry.runtime import Client, ClientConfig

__version__ = "0.1.0"

__all__ = [
    "runtime",
    "Client",
    "ClientConfig",
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
