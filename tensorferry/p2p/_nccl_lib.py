"""The NCCL library called directly (``ctypes``): communicators and point-to-point calls.

Why not ``ProcessGroupNCCL``: it wraps every operation in a work object, CUDA events, a
watchdog entry and a stream hand-over of its own, which costs the issuing thread about
80–150 µs per small coalesced send on the GPU machine — more than the transfer. Here a send is
four short library calls that enqueue NCCL's kernel on the transport's stream; the layer's own
completion event and deadlines already do what the work object and the watchdog did.

The library is the one torch loaded (``libnccl.so.2``, found by its name when already in the
process), else the ``nvidia-nccl`` wheel's. Without one, :func:`library` returns ``None`` and the
transport uses ``ProcessGroupNCCL`` instead.

GIL: calls that only enqueue (``ncclSend``/``ncclRecv`` in a group, ``ncclGroupStart``, error
queries) keep the GIL (``ctypes.PyDLL``), so no other thread takes it in the middle of a
transfer's issue; calls that may wait — communicator creation (a rendezvous with the peer),
``ncclGroupEnd`` and a send or receive outside a group (each launches, and connects a pair not
yet connected), abort and destroy — release it, but for the launching calls where the caller
says they only launch (``hold_gil``: a connected pair, few transfers in flight; see
``_transport.few_in_flight``).
"""

from __future__ import annotations

import ctypes
import functools
import glob
import logging
import os
from typing import Any

from tensorferry import _native

__all__ = ["NcclLibrary", "NcclError", "UINT8", "library"]

log = logging.getLogger(__name__)

_SUCCESS = 0
UINT8 = 1  # ncclUint8: every dtype travels as bytes
_UNIQUE_ID_BYTES = 128


class NcclError(RuntimeError):
    """An NCCL call returned an error code."""


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * _UNIQUE_ID_BYTES)]


class NcclLibrary:
    """The NCCL calls the transport needs, with their C signatures declared once."""

    def __init__(self, path: str) -> None:
        self.path = path
        waits = ctypes.CDLL(path)  # releases the GIL for the call
        quick = ctypes.PyDLL(path)  # keeps it
        ptr, res = ctypes.c_void_p, ctypes.c_int
        self._get_version = _declare(quick.ncclGetVersion, [ctypes.POINTER(ctypes.c_int)], res)
        self._get_unique_id = _declare(quick.ncclGetUniqueId, [ctypes.POINTER(_UniqueId)], res)
        self._init_rank = _declare(
            waits.ncclCommInitRank,
            [ctypes.POINTER(ptr), ctypes.c_int, _UniqueId, ctypes.c_int],
            res,
        )
        self._abort = _declare(waits.ncclCommAbort, [ptr], res)
        self._destroy = _declare(waits.ncclCommDestroy, [ptr], res)
        self._async_error = _declare(
            quick.ncclCommGetAsyncError, [ptr, ctypes.POINTER(ctypes.c_int)], res
        )
        # For the compiled helper's poll (tensorferry/_native: nccl_async_error).
        self._async_error_entry = ctypes.cast(self._async_error, ctypes.c_void_p).value
        self._error_string = _declare(quick.ncclGetErrorString, [res], ctypes.c_char_p)
        transfer_args = [ptr, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ptr, ptr]
        self._send = _declare(quick.ncclSend, transfer_args, res)
        self._recv = _declare(quick.ncclRecv, transfer_args, res)
        self._group_start = _declare(quick.ncclGroupStart, [], res)
        self._group_end = _declare(waits.ncclGroupEnd, [], res)
        self._group_end_held = _declare(quick.ncclGroupEnd, [], res)
        # Outside a group NCCL launches the operation at once, as ncclGroupEnd does, and may
        # wait as it does (a connection still being made): these let go of the GIL, and the
        # quick ones above keep it where the caller knows the call only launches.
        self._send_alone = _declare(waits.ncclSend, transfer_args, res)
        self._recv_alone = _declare(waits.ncclRecv, transfer_args, res)
        # Their addresses, for the compiled helper's call of either outside a group
        # (tensorferry/_native: nccl_move), which lets go of the GIL around it or not.
        self.alone_entries = {
            kind: ctypes.cast(fn, ctypes.c_void_p).value
            for kind, fn in (("send", quick.ncclSend), ("recv", quick.ncclRecv))
        }

    # ------------------------------------------------------------------ set-up
    def version(self) -> int:
        out = ctypes.c_int()
        self._check(self._get_version(ctypes.byref(out)), "ncclGetVersion")
        return out.value

    def unique_id(self) -> bytes:
        """A fresh communicator id (one rank makes it; the others get it through a store)."""
        uid = _UniqueId()
        self._check(self._get_unique_id(ctypes.byref(uid)), "ncclGetUniqueId")
        return bytes(uid.internal)

    def init_rank(self, nranks: int, unique_id: bytes, rank: int) -> int:
        """Creates this rank's communicator; blocks until all ``nranks`` ranks joined. Returns
        the ``ncclComm_t`` handle. The current CUDA device must be this rank's."""
        if len(unique_id) != _UNIQUE_ID_BYTES:
            raise ValueError(
                f"an NCCL unique id has {_UNIQUE_ID_BYTES} bytes, got {len(unique_id)}"
            )
        uid = _UniqueId()
        ctypes.memmove(uid.internal, unique_id, _UNIQUE_ID_BYTES)
        comm = ctypes.c_void_p()
        self._check(self._init_rank(ctypes.byref(comm), nranks, uid, rank), "ncclCommInitRank")
        return int(comm.value)

    def abort(self, comm: int) -> None:
        """Frees ``comm`` at once, ending its operations still in flight (they never finish)."""
        self._check(self._abort(ctypes.c_void_p(comm)), "ncclCommAbort")

    def destroy(self, comm: int) -> None:
        self._check(self._destroy(ctypes.c_void_p(comm)), "ncclCommDestroy")

    # ------------------------------------------------------------------ operations
    def group_start(self) -> None:
        self._check(self._group_start(), "ncclGroupStart")

    def group_end(self, hold_gil: bool = False) -> None:
        """Ends the group, launching it; keeps the GIL through with ``hold_gil``."""
        self._check((self._group_end_held if hold_gil else self._group_end)(), "ncclGroupEnd")

    def send(self, address: int, nbytes: int, peer: int, comm: int, stream: int) -> None:
        code = self._send(address, nbytes, UINT8, peer, comm, stream)
        self._check(code, "ncclSend")

    def recv(self, address: int, nbytes: int, peer: int, comm: int, stream: int) -> None:
        code = self._recv(address, nbytes, UINT8, peer, comm, stream)
        self._check(code, "ncclRecv")

    def move_alone(
        self,
        kind: str,
        address: int,
        nbytes: int,
        peer: int,
        comm: int,
        stream: int,
        hold_gil: bool = False,
    ) -> None:
        """One ``ncclSend`` (``kind`` ``"send"``) or ``ncclRecv`` outside any group: what a group
        of that one operation does, without the two group calls. Keeps the GIL through with
        ``hold_gil``. Through the compiled helper where it is loaded, else through ctypes."""
        native = _native.helper()
        if native is not None:
            entry = self.alone_entries[kind]
            code = native.nccl_move(entry, address, nbytes, UINT8, peer, comm, stream, hold_gil)
        else:
            if kind == "send":
                call = self._send if hold_gil else self._send_alone
            else:
                call = self._recv if hold_gil else self._recv_alone
            code = call(address, nbytes, UINT8, peer, comm, stream)
        if code != _SUCCESS:
            self._check(code, "ncclSend" if kind == "send" else "ncclRecv")

    def async_error(self, comm: int) -> str | None:
        """What went wrong on ``comm`` in the background (a peer gone, a network error), or
        ``None``. Asked on every poll of a transfer in flight: through the compiled helper
        where it is loaded (no ctypes conversions), else through ctypes."""
        native = _native.helper()
        if native is not None:
            result = native.nccl_async_error(self._async_error_entry, comm)
            if result < 0:
                return self._describe(-result)
        else:
            out = ctypes.c_int()
            code = self._async_error(ctypes.c_void_p(comm), ctypes.byref(out))
            if code != _SUCCESS:
                return self._describe(code)
            result = out.value
        # ncclInProgress (7) is not an error: a non-blocking operation still running.
        return None if result in (_SUCCESS, 7) else self._describe(result)

    # ------------------------------------------------------------------ errors
    def _describe(self, code: int) -> str:
        text = self._error_string(code)
        return f"{text.decode(errors='replace') if text else 'unknown error'} (code {code})"

    def check(self, code: int, what: str) -> None:
        """Raises :class:`NcclError` when ``code``, returned by the call ``what``, is an error."""
        self._check(code, what)

    def _check(self, code: int, what: str) -> None:
        if code != _SUCCESS:
            raise NcclError(f"{what} failed: {self._describe(code)}")


def _declare(fn: Any, argtypes: list, restype: Any) -> Any:
    fn.argtypes = argtypes
    fn.restype = restype
    return fn


def _candidates() -> list[str]:
    # The name first: when torch already loaded its NCCL, dlopen hands back that same copy.
    names = ["libnccl.so.2"]
    import torch

    for directory in {os.path.dirname(torch.__file__), *map(os.path.dirname, torch.__path__)}:
        names += sorted(
            glob.glob(os.path.join(directory, "..", "nvidia", "nccl", "lib", "libnccl.so*"))
        )
        names += sorted(glob.glob(os.path.join(directory, "lib", "libnccl*.so*")))
    return names


@functools.cache
def library() -> NcclLibrary | None:
    """The process's NCCL library, or ``None`` when none can be loaded (CPU-only builds)."""
    for name in _candidates():
        try:
            lib = NcclLibrary(name)
            version = lib.version()
        except (OSError, AttributeError, NcclError):
            continue
        log.info("p2p: NCCL %d from %s", version, name)
        return lib
    return None
