"""Making ``ProcessGroupNCCL`` groups whose errors the library handles itself.

The NCCL transport falls back to ``ProcessGroupNCCL`` pairs where the NCCL library cannot be
called directly (:mod:`tensorferry.p2p._nccl`), and a graph's NCCL edges to one group per graph
(:mod:`tensorferry.graph._nccl`). Both see a lost peer themselves and abort the group, and both
promise that the survivor goes on: its transfers with other peers, its next graph.

torch's default error handling (``TORCH_NCCL_ASYNC_ERROR_HANDLING`` unset: 3) breaks that
promise. A receive from a peer that was killed fails with ``ncclRemoteError``; the group's
watchdog thread then waits for a debug dump (``TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC``, 60 s
by default) and takes the whole process down, aborted group or not: a graph actor that had
stopped cleanly after its peer's death was seen gone about a minute after the error (one H100,
torch 2.11). With 0, the watchdog only reports.

``ProcessGroupNCCL`` reads the variable when a group is made, so :func:`errors_left_to_us`
sets it around the making only, where the environment does not set it: a user's explicit
choice stands (1 or 3 then take the process down after such an error, as asked).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

__all__ = ["errors_left_to_us"]

ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
_NO_HANDLING = "0"  # torch's NoHandling: the watchdog reports, the library aborts

_making = threading.Lock()  # two makings at once must not restore each other's value


@contextlib.contextmanager
def errors_left_to_us() -> Iterator[None]:
    """Inside it, a ``ProcessGroupNCCL`` being made leaves its errors to the library (see the
    module docstring); the environment is as before afterwards."""
    with _making:
        if ERROR_HANDLING in os.environ:
            yield
            return
        os.environ[ERROR_HANDLING] = _NO_HANDLING
        try:
            yield
        finally:
            os.environ.pop(ERROR_HANDLING, None)
