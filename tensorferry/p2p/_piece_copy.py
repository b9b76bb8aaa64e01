"""Copying a message's pieces in and out of its packed buffer with one kernel launch.

``torch._foreach_copy_`` copies a list of tensors with one kernel, but its host work grows with
the list: about 30 µs for 64 small tensors on the GPU machine, the largest single step of such
a message's call once validation moved to C++. This kernel takes every piece's addresses and
size in its one argument (up to 128 pieces a launch), and the compiled helper
(``tensorferry/_native``) fills that argument and launches it: a few microseconds.

The kernel is compiled with NVRTC (through torch) once per device: ahead, on a thread that
``tf.init`` starts (:func:`prepare`), or else at the first packed message. Wherever that or the
helper is unavailable, or the calling thread's current device is another, the copy is
``torch._foreach_copy_``'s.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Sequence
from typing import Any

import torch

from tensorferry import _native

__all__ = ["copy", "prepare", "status"]

_log = logging.getLogger("tensorferry")

# One block copies (a share of) one piece; kPiecesPerLaunch and the struct layout are the
# helper's (tensor_walk.cpp). 16-byte steps where the piece allows, else bytes.
_SOURCE = r"""
struct Piece { const unsigned char* src; unsigned char* dst; long long nbytes; };
struct Pieces { long long count; Piece piece[128]; };

extern "C" __global__ void tensorferry_copy_pieces(const Pieces pieces) {
  const Piece p = pieces.piece[blockIdx.x];
  const long long first = (long long)blockIdx.y * blockDim.x + threadIdx.x;
  const long long stride = (long long)gridDim.y * blockDim.x;
  const unsigned long long bits =
      (unsigned long long)p.src | (unsigned long long)p.dst | (unsigned long long)p.nbytes;
  if ((bits & 15) == 0) {
    const uint4* src = (const uint4*)p.src;
    uint4* dst = (uint4*)p.dst;
    for (long long i = first; i < p.nbytes / 16; i += stride) dst[i] = src[i];
  } else {
    for (long long i = first; i < p.nbytes; i += stride) p.dst[i] = p.src[i];
  }
}
"""

_lock = threading.Lock()
# device index -> (CUfunction, CUcontext, device index), or None where it could not be made
_kernels: dict[int, tuple[int, int, int] | None] = {}
# device index -> why the kernel is not used there (yet), for `tensorferry doctor`
_problems: dict[int, str] = {}


def copy(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], stream: Any) -> None:
    """Copies each of ``srcs`` into the ``dsts`` tensor of the same place (contiguous, equal
    sizes: a staging buffer's views and a message's tensors), on ``stream`` (a CUDA stream of
    their device; ``None`` for CPU tensors)."""
    if stream is None:
        with torch.inference_mode():  # targets may be inference tensors
            torch._foreach_copy_(list(dsts), list(srcs))
        return
    native = _native.helper()
    if native is not None:
        kernel = _kernels.get(stream.device_index, False)
        if kernel is False:
            kernel = _make_kernel(stream.device_index)
        if kernel is not None and native.copy_pieces(*kernel, stream.cuda_stream, dsts, srcs):
            return
    with torch.cuda.stream(stream), torch.inference_mode():
        torch._foreach_copy_(list(dsts), list(srcs))


def prepare(device_index: int) -> threading.Thread:
    """Compiles the kernel for ``device_index`` on a background thread (NVRTC takes a moment),
    once the compiled helper is loaded, so that the first packed message does not wait.
    Returns the thread."""

    def compile_when_loaded() -> None:
        if _native.wait() is None:
            _problems[device_index] = f"the compiled helper is not loaded: {_native.status()}"
            return
        try:
            _bind_primary_context(device_index)
        except Exception as error:  # the first packed message compiles it on its own thread
            _problems[device_index] = f"not compiled ahead ({error}): compiled at first use"
            _log.info("tensorferry: the piece copy kernel is compiled at first use: %s", error)
            return
        _make_kernel(device_index)

    thread = threading.Thread(
        target=compile_when_loaded, name="tensorferry-piece-copy", daemon=True
    )
    thread.start()
    return thread


def status(device_index: int, timeout_s: float = 300.0) -> str:
    """How the packed messages of ``device_index`` are copied: compiles the kernel ahead as
    ``tf.init`` does (building the compiled helper first, if need be) and says whether it is
    used, or why not (for ``tensorferry doctor``)."""
    prepare(device_index).join(timeout_s)
    kernel = _kernels.get(device_index)
    if kernel is not None:
        return "one launch of tensorferry's kernel per message (compiled ahead at tf.init)"
    why = _problems.get(device_index, f"not compiled within {timeout_s:g} s")
    return f"torch's _foreach_copy_: {why}"


def _make_kernel(device_index: int) -> tuple[int, int, int] | None:
    with _lock:
        if device_index in _kernels:
            return _kernels[device_index]
        kernel = None
        try:
            with torch.cuda.device(device_index):
                compiled = torch.cuda._compile_kernel(_SOURCE, "tensorferry_copy_pieces")
                kernel = (_address(compiled.func), _current_context(), device_index)
        except Exception as error:  # a private torch API, NVRTC missing: torch's copy then
            _problems[device_index] = f"the kernel did not compile: {error}"
            _log.info(
                "tensorferry: the piece copy kernel is not used on cuda:%d: %s", device_index, error
            )
        _kernels[device_index] = kernel
        return kernel


def _bind_primary_context(device_index: int) -> None:
    """Makes the device's primary context (the one torch's runtime uses) current on this thread.

    A new thread has no current context, and ``torch.cuda.device(i)`` does not give it one when
    ``i`` is already the thread's current device (0, on a new thread): NVRTC's module load then
    fails with "invalid device context". The reference taken here is not given back: torch keeps
    the context for the process's life anyway, and the kernel's module lives in it."""
    lib = _driver()
    device, context = ctypes.c_int(), ctypes.c_void_p()
    for name, args in (
        ("cuDeviceGet", (ctypes.byref(device), device_index)),
        ("cuDevicePrimaryCtxRetain", (ctypes.byref(context), device)),
        ("cuCtxSetCurrent", (context,)),
    ):
        status = getattr(lib, name)(*args)
        if status != 0:
            raise RuntimeError(f"{name} failed ({status})")


def _address(handle: object) -> int:
    value = handle.value if isinstance(handle, ctypes.c_void_p) else handle
    if not isinstance(value, int) or value == 0:
        raise RuntimeError(f"no kernel handle: {handle!r}")
    return value


def _current_context() -> int:
    context = ctypes.c_void_p()
    status = _driver().cuCtxGetCurrent(ctypes.byref(context))
    if status != 0 or not context.value:
        raise RuntimeError(f"cuCtxGetCurrent failed ({status})")
    return context.value


def _driver() -> ctypes.CDLL:
    # Imported here: a private torch helper, which a torch without it must not fail to import.
    from torch.cuda._utils import _get_gpu_runtime_library

    return _get_gpu_runtime_library()
