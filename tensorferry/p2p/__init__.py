"""Point-to-point transfers between processes (one process per device): send, recv, sendrecv,
batch, with :class:`Transfer` handles, over pluggable transports (see ``_transport.py``)."""

from tensorferry.p2p._transport import (
    P2POp,
    PendingOps,
    Transport,
    TransportContext,
    register_transport,
    registered_transports,
    unregister_transport,
)

__all__ = [
    "register_transport",
    "unregister_transport",
    "registered_transports",
    "Transport",
    "TransportContext",
    "P2POp",
    "PendingOps",
]
