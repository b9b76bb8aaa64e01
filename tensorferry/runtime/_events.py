"""CUDA events and stream queries on the p2p critical path, without letting go of the GIL.

A p2p call asks whether the caller's current stream is idle; where work is still queued there,
it records an event on that stream (the transfer is ordered after that work) and makes the
transfer's stream wait for it. torch's ``Event.record``, ``Event.wait``, ``Event.query`` and
``Stream.query`` release the GIL around the CUDA call; any other thread of the process that
wants the GIL then takes it and the caller waits for that thread's whole turn — on the GPU
machine that made one record cost 40–60 µs of a ``tf.send`` call. Here events come from a pool
(made once, reused once nothing can wait on them any more) and the CUDA runtime's
``cudaEventRecord``, ``cudaStreamWaitEvent``, ``cudaEventQuery`` and ``cudaStreamQuery`` are
called with the GIL held (``ctypes.PyDLL``): each a microsecond or less.

Falls back to torch's calls when the runtime library cannot be loaded or a call fails, and for
the one call when the calling thread's current device is not the stream's: the runtime's record
and wait work in the current device's context only (``cudaErrorInvalidResourceHandle``
otherwise), and torch's calls switch the device around them. A failed call's error is cleared
from the runtime's last error, which torch would otherwise raise from the thread's next kernel
launch.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import logging
import threading
from typing import Any, NamedTuple

import torch

from tensorferry import _native

__all__ = [
    "calls_report",
    "current_stream_idle",
    "current_stream_wait",
    "entry_points",
    "give_up_calls",
    "is_done",
    "pooled",
    "record_again",
    "record_on_current_stream",
    "record_on_stream",
    "recycle",
    "stream_wait",
]

log = logging.getLogger(__name__)

# Created events free to record again, per device index.
_free: dict[int, collections.deque] = {}
_calls: Any = None
_calls_checked = False
_lock = threading.Lock()
_MAX_FREE = 1024
_NOT_READY = 600  # cudaErrorNotReady


class _Runtime(NamedTuple):
    """The CUDA runtime calls made with the GIL held."""

    record: Any  # cudaEventRecord(event, stream)
    wait: Any  # cudaStreamWaitEvent(stream, event, flags)
    query: Any  # cudaEventQuery(event)
    query_stream: Any  # cudaStreamQuery(stream)
    clear: Any  # cudaGetLastError(): reads and resets the thread's last error


def _load_calls() -> _Runtime | None:
    from tensorferry.runtime._cuda_streams import _load_cudart

    if not torch.cuda.is_available():  # nothing to call them on (a CUDA library may be there)
        return None
    try:
        lib = ctypes.PyDLL(_load_cudart()._name)  # same library, called with the GIL held
        calls = _Runtime(
            lib.cudaEventRecord,
            lib.cudaStreamWaitEvent,
            lib.cudaEventQuery,
            lib.cudaStreamQuery,
            lib.cudaGetLastError,
        )
    except (OSError, RuntimeError, AttributeError) as exc:
        log.debug("events: no GIL-holding CUDA event calls (%s); using torch's", exc)
        _note_why(f"the CUDA runtime could not be loaded: {exc}")
        return None
    calls.record.argtypes = (ctypes.c_void_p, ctypes.c_void_p)
    calls.wait.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint)
    calls.query.argtypes = (ctypes.c_void_p,)
    calls.query_stream.argtypes = (ctypes.c_void_p,)
    calls.clear.argtypes = ()
    for fn in calls:
        fn.restype = ctypes.c_int
    return calls


def _runtime() -> _Runtime | None:
    global _calls, _calls_checked, _ctypes_calls
    if not _calls_checked:
        checked_now = False
        with _lock:
            if not _calls_checked:
                _calls = _ctypes_calls = _checked(_load_calls())
                _calls_checked = True
                checked_now = _calls is not None
        if checked_now:  # outside the lock: the callback takes it, and may run right away
            _native.when_loaded(_use_compiled)
    return _calls


# The checked ctypes calls, kept for the probes' A/Bs once the compiled ones replace them.
_ctypes_calls: _Runtime | None = None


def _use_compiled(native: Any) -> None:
    """Replaces the ctypes calls with the compiled helper's (``record_event``, ``wait_event``,
    ``query`` of ``tensorferry/_native``) through the same entry points: the same CUDA
    calls, the GIL held as before, without ctypes' conversion of the arguments (about a
    microsecond a call on the GPU machine's host; a query is made on every poll of a transfer).
    Nothing changes once the calls were given up, or where they are not the ones checked."""
    global _calls
    with _lock:
        calls = _calls
        if calls is None or calls is not _ctypes_calls:
            return
        address = lambda fn: ctypes.cast(fn, ctypes.c_void_p).value  # noqa: E731
        _calls = calls._replace(
            record=functools.partial(native.record_event, address(calls.record)),
            wait=functools.partial(native.wait_event, address(calls.wait)),
            query=functools.partial(native.query, address(calls.query)),
            query_stream=functools.partial(native.query, address(calls.query_stream)),
        )


# Device clock cycles the check's kernel spins (tens of milliseconds): its event must still be
# pending when the host looks. A host that was descheduled that long meanwhile (processes
# starting together, sharing one GPU and a busy machine) finds it finished: the check then runs
# once more with a spin twenty times as long, rather than give up the calls for the process.
_CHECK_SPINS = (20_000_000, 400_000_000)
_FINISHED_TOO_SOON = "an event recorded behind a spinning kernel, or a stream made to wait for it"


def _checked(calls: _Runtime | None) -> _Runtime | None:
    """``calls`` if they demonstrably work on torch's events and streams, else ``None`` (see
    :func:`_misbehaviour`)."""
    if calls is None:
        return None
    for cycles in _CHECK_SPINS:
        problem = _misbehaviour(calls, cycles)
        if problem is None:
            return calls
        if not problem.startswith(_FINISHED_TOO_SOON):
            break  # a failed call or an event that never fired: no second look needed
        log.info("events: checking the CUDA event calls: %s; looking again", problem)
    log.warning("events: CUDA event calls through ctypes misbehaved (%s); using torch", problem)
    _note_why(f"they misbehaved: {problem}")
    return None


def _misbehaviour(calls: _Runtime, cycles: int) -> str | None:
    """What ``calls`` did wrong on torch's events and streams, or ``None``: an event recorded
    behind a kernel spinning ``cycles`` device cycles must be pending, a stream made to wait
    for it must wait, and both must fire once the kernel ended."""
    stream, waiter = torch.cuda.Stream(), torch.cuda.Stream()  # private: nobody else waits
    event, after = torch.cuda.Event(), torch.cuda.Event()
    event.record(stream)  # creates the CUDA events
    after.record(waiter)
    stream.synchronize()
    waiter.synchronize()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(cycles)
    codes = [calls.record(event.cuda_event, stream.cuda_stream)]
    codes.append(calls.wait(waiter.cuda_stream, event.cuda_event, 0))
    codes.append(calls.record(after.cuda_event, waiter.cuda_stream))
    busy = calls.query_stream(stream.cuda_stream)
    pending = calls.query(event.cuda_event) == _NOT_READY and not after.query()
    stream.synchronize()
    waiter.synchronize()
    if any(codes):
        calls.clear()
        return f"record, wait and record returned {codes}"
    if not (calls.query(event.cuda_event) == 0 and event.query() and after.query()):
        return "an event did not fire after its stream's work ended"
    if calls.query_stream(stream.cuda_stream) != 0:
        return "a stream whose work ended did not read as idle"
    if not pending or busy != _NOT_READY:
        return f"{_FINISHED_TOO_SOON} was already done ({cycles} cycles)"
    recycle(event)
    recycle(after)
    return None


def entry_points() -> tuple[int, int] | None:
    """The addresses of ``cudaStreamWaitEvent`` and ``cudaEventRecord`` as the GIL-holding
    calls reach them, for a compiled caller (``tensorferry/_native``); ``None`` while those
    calls are not used (see the module doc)."""
    global _entry_points
    calls = _calls if _calls_checked else _runtime()
    if calls is None:
        return None
    if _entry_points is None:  # the calls are loaded once, and only ever given up after
        loaded = _ctypes_calls if _ctypes_calls is not None else calls
        _entry_points = (
            ctypes.cast(loaded.wait, ctypes.c_void_p).value,
            ctypes.cast(loaded.record, ctypes.c_void_p).value,
        )
    return _entry_points


_entry_points: tuple[Any, Any] | None = None


_why_torch: str | None = None  # why torch's calls are used, once they are


def _note_why(why: str) -> None:
    global _why_torch
    _why_torch = why


def calls_report() -> str:
    """Which event calls this process makes (for ``tensorferry doctor``): the CUDA runtime's,
    holding the GIL, or torch's and why. Runs the one-time check of the runtime's calls."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    if _runtime() is not None:
        return "the CUDA runtime's, called holding the GIL"
    return f"torch's, which let go of the GIL around each ({_why_torch or 'no CUDA runtime'})"


def pooled(index: int) -> Any:
    """A free pooled event of device ``index`` (created: recorded before), or ``None``; give it
    back with :func:`recycle`."""
    free = _free.get(index)
    if free:
        try:
            return free.popleft()
        except IndexError:  # another thread took the last one
            pass
    return None


def _record_raw(event: torch.cuda.Event, index: int, raw_stream: Any) -> bool:
    """Records ``event`` (its CUDA event created) on the raw stream handle ``raw_stream`` of
    device ``index`` through the GIL-holding call: whether it did. Not where there is no such
    call or the calling thread is on another device; a failed call gives the calls up."""
    calls = _runtime()
    if calls is None or not _on_current_device(index):
        return False
    if calls.record(event.cuda_event, raw_stream) == 0:
        return True
    give_up_calls("cudaEventRecord failed")
    return False


def _record_pooled(index: int, raw_stream: Any) -> Any:
    """A pooled event of device ``index`` recorded on the raw stream handle ``raw_stream``
    through the GIL-holding call, or ``None`` (no such call, the calling thread on another
    device, or no free event)."""
    event = pooled(index)
    if event is not None and not _record_raw(event, index, raw_stream):
        recycle(event, index)
        return None
    return event


def record_on_current_stream(index: int) -> torch.cuda.Event:
    """An event recorded on the calling thread's current stream of device ``index``.

    The device is given, not the thread's current one: that is per thread, and a thread the
    caller started is on device 0 until it says otherwise, whatever device its tensors are on.
    """
    # The raw handle of the current stream: torch's Stream object costs microseconds.
    event = _record_pooled(index, torch._C._cuda_getCurrentRawStream(index))
    if event is None:
        event = _torch_record(index, torch.cuda.current_stream(index))
    return event


def record_on_stream(stream: torch.cuda.Stream) -> torch.cuda.Event:
    """An event recorded on ``stream``."""
    event = _record_pooled(stream.device_index, stream.cuda_stream)
    if event is None:
        event = _torch_record(stream.device_index, stream)
    return event


def _torch_record(index: int, stream: torch.cuda.Stream) -> torch.cuda.Event:
    """A pooled (or new) event recorded on ``stream`` by torch's call, which switches to the
    stream's device around it (and creates the CUDA event of a new one)."""
    event = pooled(index) or torch.cuda.Event()
    event.record(stream)
    return event


def record_again(event: torch.cuda.Event, stream: torch.cuda.Stream) -> None:
    """``event.record(stream)`` for an event its owner keeps and records use after use (the
    first record, through torch, creates the CUDA event)."""
    if not (event.cuda_event and _record_raw(event, stream.device_index, stream.cuda_stream)):
        event.record(stream)


def stream_wait(stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
    """Makes ``stream`` wait on the device for ``event`` (``stream.wait_event(event)``)."""
    calls = _runtime()
    if calls is not None and _on_current_device(stream.device_index):
        if calls.wait(stream.cuda_stream, event.cuda_event, 0) == 0:
            return
        give_up_calls("cudaStreamWaitEvent failed")
    stream.wait_event(event)


def current_stream_wait(index: int, event: torch.cuda.Event) -> None:
    """Makes the calling thread's current stream of device ``index`` wait on the device for
    ``event``: :func:`stream_wait` without torch's ``Stream`` object of the current stream,
    which costs microseconds to make (about 7 on the GPU machine's host)."""
    calls = _runtime()
    if calls is not None and _on_current_device(index):
        raw = torch._C._cuda_getCurrentRawStream(index)
        if calls.wait(raw, event.cuda_event, 0) == 0:
            return
        give_up_calls("cudaStreamWaitEvent failed")
    torch.cuda.current_stream(index).wait_event(event)


def current_stream_idle(index: int) -> bool:
    """Whether the calling thread's current stream of device ``index`` has nothing left to do:
    the work queued on it so far is over. Where it is, a transfer needs no event to follow
    that work (one query, where an event costs a record, a query and a wait)."""
    calls = _runtime()
    if calls is not None and _on_current_device(index):
        over = _over(calls, calls.query_stream(torch._C._cuda_getCurrentRawStream(index)))
        if over is not None:
            return over
    return torch.cuda.current_stream(index).query()  # torch raises the CUDA error, if any


def is_done(event: torch.cuda.Event) -> bool:
    """``event.query()``: whether the work before the event's record finished."""
    calls = _runtime()
    if calls is not None:
        over = _over(calls, calls.query(event.cuda_event))
        if over is not None:
            return over
    return event.query()  # torch raises the CUDA error, if any


def _over(calls: Any, code: int) -> bool | None:
    """What a query's ``code`` says: the work is over, or not yet; ``None`` for an error,
    cleared here so that torch's own query, which the caller makes next, raises it."""
    if code == 0:
        return True
    if code == _NOT_READY:
        return False
    calls.clear()
    return None


def recycle(event: Any, index: int | None = None) -> None:
    """Returns ``event`` to the pool: only once every wait on it has been enqueued (a later
    record does not change what an enqueued wait waits for) and nothing polls it any more.
    ``index``: its device's, where the caller knows it (``event.device`` makes an object)."""
    if event is None:
        return
    if index is None:
        index = event.device.index
    free = _free.get(index)  # not setdefault: that would make a deque on every call
    if free is None:
        free = _free.setdefault(index, collections.deque())
    if len(free) < _MAX_FREE:
        free.append(event)


def _on_current_device(index: int) -> bool:
    """Whether the calling thread's current CUDA device is ``index`` (a thread starts on device 0,
    whatever device the caller's tensors are on)."""
    return torch._C._cuda_getDevice() == index


def give_up_calls(why: str) -> None:
    """A GIL-holding CUDA call failed (here, or a compiled caller's through
    :func:`entry_points`): clears its error and takes torch's calls from now on."""
    global _calls
    calls = _calls
    if calls is not None:
        calls.clear()  # or torch raises it from the thread's next launch
    log.warning("events: %s; using torch's event calls from now on", why)
    _note_why(why)
    with _lock:  # against _use_compiled putting calls back
        _calls = None
