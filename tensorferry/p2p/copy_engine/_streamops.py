"""Stream memory operations (``cuStreamWriteValue32`` / ``cuStreamWaitValue32``) via cuda-python.

They let a stream publish and await 32-bit flags in (local or peer-mapped) device memory without
any kernel, so the copy-engine transport uses no SMs. Both are capturable in CUDA graphs.
"""

from __future__ import annotations

import functools
from typing import Any

from tensorferry.errors import TransportError

__all__ = ["write_value32", "wait_value32", "WAIT_GEQ", "WAIT_EQ", "available"]

# CUstreamWaitValue_flags: GEQ compares as (int32)(*addr - value) >= 0 (wrap-safe).
WAIT_GEQ = 0x0
WAIT_EQ = 0x1


@functools.cache
def _driver() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError:
        try:
            from cuda import cuda as driver  # older cuda-python layout
        except ImportError:
            return None
    return driver


def available() -> bool:
    """Whether cuda-python's driver bindings can be imported."""
    return _driver() is not None


def _check(result: Any, what: str) -> None:
    err = result[0] if isinstance(result, tuple) else result
    if int(err) != 0:
        raise TransportError(f"{what} failed with CUresult {int(err)}")


def write_value32(stream: Any, address: int, value: int) -> None:
    """Enqueues on ``stream``: after earlier work, store ``value`` at ``address`` (with a memory
    fence first, so the peer sees earlier copies of this stream before it sees the value)."""
    driver = _driver()
    if driver is None:
        raise TransportError("the copy-engine transport needs cuda-python (cuda.bindings)")
    _check(
        driver.cuStreamWriteValue32(
            driver.CUstream(stream.cuda_stream), driver.CUdeviceptr(address), value, 0
        ),
        "cuStreamWriteValue32",
    )


def wait_value32(stream: Any, address: int, value: int, flags: int) -> None:
    """Enqueues on ``stream``: later work waits until the word at ``address`` satisfies
    ``flags`` against ``value`` (:data:`WAIT_GEQ` or :data:`WAIT_EQ`)."""
    driver = _driver()
    if driver is None:
        raise TransportError("the copy-engine transport needs cuda-python (cuda.bindings)")
    _check(
        driver.cuStreamWaitValue32(
            driver.CUstream(stream.cuda_stream), driver.CUdeviceptr(address), value, flags
        ),
        "cuStreamWaitValue32",
    )
