"""Exclusive CUDA streams, created and destroyed through the CUDA runtime.

``torch.cuda.Stream()`` does not create a stream: it hands out one of 32 pooled streams per
priority per device, round robin, so two owners can silently share one. The stream pool needs
streams that belong to exactly one owner, so it creates them itself (``cuda.bindings`` when it
is installed, else the CUDA runtime library through ctypes) and wraps them in
``torch.cuda.ExternalStream``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import glob
import os
from typing import Any

import torch

from tensorferry.runtime._streams import StreamKey

__all__ = ["CudaStreamFactory"]

_CUDA_SUCCESS = 0
_CUDA_ERROR_NOT_READY = 600
_STREAM_NON_BLOCKING = 0x1


class _CtypesRuntime:
    """The four CUDA runtime calls the pool needs, through ctypes."""

    def __init__(self) -> None:
        self._lib = _load_cudart()
        self._lib.cudaStreamCreateWithPriority.argtypes = [
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.c_uint,
            ctypes.c_int,
        ]
        self._lib.cudaStreamQuery.argtypes = [ctypes.c_void_p]
        self._lib.cudaStreamDestroy.argtypes = [ctypes.c_void_p]
        self._lib.cudaDeviceGetStreamPriorityRange.argtypes = [
            ctypes.POINTER(ctypes.c_int),
            ctypes.POINTER(ctypes.c_int),
        ]

    def create(self, flags: int, priority: int) -> int:
        handle = ctypes.c_void_p()
        _check(self._lib.cudaStreamCreateWithPriority(ctypes.byref(handle), flags, priority))
        return int(handle.value or 0)

    def query(self, handle: int) -> int:
        return int(self._lib.cudaStreamQuery(ctypes.c_void_p(handle)))

    def destroy(self, handle: int) -> None:
        _check(self._lib.cudaStreamDestroy(ctypes.c_void_p(handle)))

    def priority_range(self) -> tuple[int, int]:
        least, greatest = ctypes.c_int(), ctypes.c_int()
        _check(
            self._lib.cudaDeviceGetStreamPriorityRange(ctypes.byref(least), ctypes.byref(greatest))
        )
        return least.value, greatest.value


class _BindingsRuntime:
    """The same calls through ``cuda.bindings`` (cuda-python)."""

    def __init__(self) -> None:
        from cuda.bindings import runtime  # type: ignore[import-not-found]

        self._rt = runtime

    def create(self, flags: int, priority: int) -> int:
        err, stream = self._rt.cudaStreamCreateWithPriority(flags, priority)
        _check(int(err))
        return int(stream)

    def query(self, handle: int) -> int:
        (err,) = self._rt.cudaStreamQuery(handle)
        return int(err)

    def destroy(self, handle: int) -> None:
        (err,) = self._rt.cudaStreamDestroy(handle)
        _check(int(err))

    def priority_range(self) -> tuple[int, int]:
        err, least, greatest = self._rt.cudaDeviceGetStreamPriorityRange()
        _check(int(err))
        return int(least), int(greatest)


def _check(code: int) -> None:
    if code != _CUDA_SUCCESS:
        raise RuntimeError(f"CUDA runtime call failed with error {code}")


def _load_cudart() -> ctypes.CDLL:
    candidates = []
    for directory in {os.path.dirname(torch.__file__), *map(os.path.dirname, torch.__path__)}:
        candidates += glob.glob(
            os.path.join(directory, "..", "nvidia", "*", "lib", "libcudart.so*")
        )
        candidates += glob.glob(os.path.join(directory, "lib", "libcudart*.so*"))
    found = ctypes.util.find_library("cudart")
    if found:
        candidates.append(found)
    candidates += ["libcudart.so.13", "libcudart.so.12", "libcudart.so"]
    for name in candidates:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise RuntimeError("could not load the CUDA runtime library (libcudart)")


@functools.cache
def _runtime() -> Any:
    try:
        return _BindingsRuntime()
    except ImportError:
        return _CtypesRuntime()


class CudaStreamFactory:
    """Creates, queries and destroys exclusive CUDA streams for the stream pool."""

    def create(self, key: StreamKey) -> int:
        rt = _runtime()
        with torch.cuda.device(key.device):
            least, greatest = rt.priority_range()
            priority = greatest if key.priority == "high" else least
            flags = _STREAM_NON_BLOCKING if key.non_blocking else 0
            return rt.create(flags, priority)

    def is_idle(self, handle: int) -> bool:
        code = _runtime().query(handle)
        if code == _CUDA_SUCCESS:
            return True
        if code == _CUDA_ERROR_NOT_READY:
            return False
        raise RuntimeError(f"cudaStreamQuery failed with error {code}")

    def destroy(self, handle: int) -> None:
        _runtime().destroy(handle)

    def wrap(self, handle: int, key: StreamKey) -> torch.cuda.ExternalStream:
        return torch.cuda.ExternalStream(handle, device=torch.device("cuda", key.device))
