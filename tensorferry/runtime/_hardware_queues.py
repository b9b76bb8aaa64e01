"""CUDA's hardware work queues, and why tensorferry asks for all of them.

A GPU runs the work of many streams through a few hardware queues (``CUDA_DEVICE_MAX_CONNECTIONS``,
8 by default, at most 32); streams beyond that share a queue, in order. A stream waiting on a
flag that a peer sets (the copy-engine transport's ``cuStreamWaitValue32``) then holds up every
stream queued behind it, which may carry the very signal some peer waits for: a deadlock across
ranks. A rank of a ring over ``ce`` uses some twenty streams. With 8 queues on an H200, one
stream waiting on a flag is enough: allocating and filling 1 GiB on the default stream does
not finish, nor does the copy, on a third stream, that is to set the flag. 32 queues make such
sharing rarer; they do not rule it out.

The count is read once, when CUDA creates the process's context. Importing tensorferry
before CUDA is initialised raises it to 32 unless the user set it; set explicitly, the user's
value stands (some frameworks set 1 on purpose, for ordering).
"""

from __future__ import annotations

import os

import torch

__all__ = ["WANTED_QUEUES", "widen_hardware_queues", "hardware_queues"]

_VARIABLE = "CUDA_DEVICE_MAX_CONNECTIONS"
_CUDA_DEFAULT = 8
WANTED_QUEUES = 32

# What the process's CUDA context has (or will have): fixed by the first call that decides.
_decided: int | None = None


def widen_hardware_queues() -> None:
    """Asks for 32 queues when nobody chose a count and CUDA is not initialised yet."""
    global _decided
    if _decided is not None:
        return
    if torch.cuda.is_initialized():  # too late: the context exists
        _decided = _configured() or _CUDA_DEFAULT
        return
    if not os.environ.get(_VARIABLE):
        os.environ[_VARIABLE] = str(WANTED_QUEUES)


def hardware_queues() -> int:
    """The hardware queues per device this process's CUDA context has (best knowledge)."""
    if _decided is not None:
        return _decided
    return _configured() or _CUDA_DEFAULT


def _configured() -> int | None:
    raw = os.environ.get(_VARIABLE, "")
    try:
        return int(raw) if raw else None
    except ValueError:
        return None
