"""The few CUDA driver calls the one-sided route makes, through ``ctypes`` on ``libcuda``.

Each is one foreign call (about a microsecond), with no Python wrapper objects to build: the
route makes several per message. The calls a message makes (copy, stream memory operations,
pointer queries) keep the GIL: they only enqueue or look up, and letting go of the GIL around
each would hand the caller's thread to any other thread that wants it (a hand-off costs tens of
microseconds). The calls that may block (mapping, pinning) let go of it. They act in the calling
thread's current context: callers make the rank's device current first (``torch.cuda.device``,
or :func:`bind_context` where it is current already: a thread that made no CUDA runtime call,
such as a library thread, has no context even though device 0 reads as current).
"""

from __future__ import annotations

import ctypes
import functools
import threading

from tensorferry.errors import TransportError

__all__ = [
    "IPC_HANDLE_BYTES",
    "allocation_of",
    "bind_context",
    "host_register",
    "host_unregister",
    "ipc_handle",
    "ipc_open",
    "memcpy_async",
    "wait_value32",
    "write_value32",
]

IPC_HANDLE_BYTES = 64
_RANGE_START, _RANGE_SIZE, _BUFFER_ID = 11, 12, 7  # CUpointer_attribute
_LAZY_ENABLE_PEER_ACCESS = 0x1
_HOST_REGISTER_PORTABLE_DEVICEMAP = 0x1 | 0x2
_WAIT_GEQ = 0x0


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


def _symbol(lib: ctypes.CDLL, *names: str) -> ctypes._CFuncPtr:
    for name in names:
        fn = getattr(lib, name, None)
        if fn is not None:
            return fn
    raise TransportError(f"libcuda has none of {names}")


@functools.cache
def _lib() -> ctypes.CDLL:
    """libcuda, its calls letting go of the GIL."""
    return _declared(ctypes.CDLL)


@functools.cache
def _fast() -> ctypes.PyDLL:
    """libcuda, its calls keeping the GIL (for the calls that only enqueue or look up)."""
    return _declared(ctypes.PyDLL)


def _declared(kind: type) -> ctypes.CDLL:
    try:
        lib = kind("libcuda.so.1")
    except OSError as exc:
        raise TransportError(f"the copy-engine route needs libcuda: {exc}") from None
    u64, u64p, c_uint = ctypes.c_uint64, ctypes.POINTER(ctypes.c_uint64), ctypes.c_uint
    lib.cuPointerGetAttributes.argtypes = [
        c_uint,
        ctypes.POINTER(ctypes.c_int),
        ctypes.POINTER(ctypes.c_void_p),
        u64,
    ]
    lib.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(_IpcHandle), u64]
    _symbol(lib, "cuIpcOpenMemHandle_v2", "cuIpcOpenMemHandle").argtypes = [
        u64p,
        _IpcHandle,
        c_uint,
    ]
    lib.cuMemcpyAsync.argtypes = [u64, u64, ctypes.c_size_t, ctypes.c_void_p]
    for name in ("cuStreamWriteValue32_v2", "cuStreamWriteValue32"):
        if hasattr(lib, name):
            getattr(lib, name).argtypes = [ctypes.c_void_p, u64, ctypes.c_uint32, c_uint]
    for name in ("cuStreamWaitValue32_v2", "cuStreamWaitValue32"):
        if hasattr(lib, name):
            getattr(lib, name).argtypes = [ctypes.c_void_p, u64, ctypes.c_uint32, c_uint]
    _symbol(lib, "cuMemHostRegister_v2", "cuMemHostRegister").argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        c_uint,
    ]
    _symbol(lib, "cuMemHostGetDevicePointer_v2", "cuMemHostGetDevicePointer").argtypes = [
        u64p,
        ctypes.c_void_p,
        c_uint,
    ]
    lib.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
    lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
    lib.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
    lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
    lib.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
    return lib


def _check(result: int, what: str) -> None:
    if result != 0:
        name = ctypes.c_char_p()
        _lib().cuGetErrorName(result, ctypes.byref(name))
        text = name.value.decode() if name.value else str(result)
        raise TransportError(f"{what} failed: {text}")


def allocation_of(address: int) -> tuple[int, int, int]:
    """``(buffer id, base, size)`` of the device allocation holding ``address``: the id is
    unique for the process's life, so a freed and remade allocation at the same address is
    told apart."""
    out = _query.out
    if out is None:  # this thread's reusable arguments: building them cost more than the call
        out = _query.out = _Query()
    code = _fast().cuPointerGetAttributes(3, out.attrs, out.data, address)
    _check(code, "cuPointerGetAttributes")
    return out.ident.value, out.base.value, out.size.value


class _Query:
    def __init__(self) -> None:
        self.base, self.size, self.ident = ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_uint64()
        self.attrs = (ctypes.c_int * 3)(_BUFFER_ID, _RANGE_START, _RANGE_SIZE)
        self.data = (ctypes.c_void_p * 3)(
            ctypes.addressof(self.ident), ctypes.addressof(self.base), ctypes.addressof(self.size)
        )


class _PerThread(threading.local):
    out: _Query | None = None


_query = _PerThread()


def ipc_handle(base: int) -> bytes:
    """The IPC handle of the allocation starting at ``base``."""
    handle = _IpcHandle()
    _check(_lib().cuIpcGetMemHandle(ctypes.byref(handle), base), "cuIpcGetMemHandle")
    return ctypes.string_at(ctypes.addressof(handle), IPC_HANDLE_BYTES)


def ipc_open(handle: bytes) -> int:
    """Maps another process's allocation into the current context (peer access enabled)."""
    ptr = ctypes.c_uint64()
    fn = _symbol(_lib(), "cuIpcOpenMemHandle_v2", "cuIpcOpenMemHandle")
    raw = _IpcHandle.from_buffer_copy(handle)
    _check(fn(ctypes.byref(ptr), raw, _LAZY_ENABLE_PEER_ACCESS), "cuIpcOpenMemHandle")
    return ptr.value


def memcpy_async(dst: int, src: int, nbytes: int, stream: int) -> None:
    _check(_fast().cuMemcpyAsync(dst, src, nbytes, stream), "cuMemcpyAsync")


def write_value32(stream: int, address: int, value: int) -> None:
    """After the stream's earlier work (and a memory fence), stores ``value`` at ``address``."""
    fn = _symbol(_fast(), "cuStreamWriteValue32_v2", "cuStreamWriteValue32")
    _check(fn(stream, address, value, 0), "cuStreamWriteValue32")


def wait_value32(stream: int, address: int, value: int) -> None:
    """The stream's later work waits until the word at ``address`` is at least ``value``."""
    fn = _symbol(_fast(), "cuStreamWaitValue32_v2", "cuStreamWaitValue32")
    _check(fn(stream, address, value, _WAIT_GEQ), "cuStreamWaitValue32")


_bound = threading.local()  # the device whose primary context this thread made current


def bind_context(index: int) -> None:
    """Makes device ``index``'s primary context current on this thread unless this thread has
    done so already (a thread-local look after the first time)."""
    if getattr(_bound, "index", None) == index:
        return
    lib = _lib()
    current = ctypes.c_void_p()
    _check(lib.cuCtxGetCurrent(ctypes.byref(current)), "cuCtxGetCurrent")
    if not current.value:
        device = ctypes.c_int()
        _check(lib.cuDeviceGet(ctypes.byref(device), index), "cuDeviceGet")
        retained = lib.cuDevicePrimaryCtxRetain(ctypes.byref(current), device)
        _check(retained, "cuDevicePrimaryCtxRetain")
        _check(lib.cuCtxSetCurrent(current), "cuCtxSetCurrent")
    _bound.index = index


def host_register(address: int, nbytes: int) -> int:
    """Pins host memory for the device; returns its device address."""
    lib = _lib()
    register = _symbol(lib, "cuMemHostRegister_v2", "cuMemHostRegister")
    _check(register(address, nbytes, _HOST_REGISTER_PORTABLE_DEVICEMAP), "cuMemHostRegister")
    device = ctypes.c_uint64()
    pointer = _symbol(lib, "cuMemHostGetDevicePointer_v2", "cuMemHostGetDevicePointer")
    _check(pointer(ctypes.byref(device), address, 0), "cuMemHostGetDevicePointer")
    return device.value


def host_unregister(address: int) -> None:
    _lib().cuMemHostUnregister(address)
