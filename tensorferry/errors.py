"""Every error tensorferry raises on purpose derives from :class:`TensorFerryError`.

User mistakes that are plain argument errors also derive from ``ValueError`` or ``TypeError``
so that callers who only know the standard exceptions still catch them.
"""

from __future__ import annotations

__all__ = [
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


class TensorFerryError(Exception):
    """Base class of every error raised by tensorferry."""


class ClientClosedError(TensorFerryError, RuntimeError):
    """A :class:`~tensorferry.Client` was used after ``close()``."""


class TransferTimeoutError(TensorFerryError, TimeoutError):
    """A wait on a transfer (or any other tensorferry wait) ran past its timeout."""


class PeerLostError(TensorFerryError, ConnectionError):
    """The process on the other end of a transfer died or stopped answering."""


class MismatchError(TensorFerryError, ValueError):
    """Sender and receiver disagree on what is transferred (count, shape, dtype or size).

    Attributes:
        field: name of the field that differs (``"count"``, ``"shape"``, ``"dtype"``, ``"nbytes"``).
    """

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class TransportError(TensorFerryError, RuntimeError):
    """A transport failed (communicator error, unsupported configuration at run time)."""


class StreamResetError(TensorFerryError, RuntimeError):
    """A device stream could not be reset before reuse (it is destroyed, never pooled)."""


class CompletionPoolShutdownError(TensorFerryError, RuntimeError):
    """A future was cancelled because the completion pool shut down before it completed."""


class ActorDiedError(TensorFerryError, RuntimeError):
    """An actor process of a compiled graph died; its pending and later results raise this."""


class ActorError(TensorFerryError, RuntimeError):
    """An actor method raised; the message carries the remote traceback."""


class GraphCompileError(TensorFerryError, ValueError):
    """A graph cannot be compiled (unbound input, lost leaf, transport that cannot work …)."""


class DeadlockError(GraphCompileError):
    """The compiled schedules can deadlock; the message names the cycle of waiting operations."""
