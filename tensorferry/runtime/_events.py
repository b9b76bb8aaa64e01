"""Recording a CUDA event on the caller's stream without letting go of the GIL.

Every p2p call records an event on the caller's current stream (the transfer is ordered after
the work queued there). ``torch.cuda.Event.record`` releases the GIL around the CUDA call; any
other thread of the process that wants the GIL (the issuing thread, handling a peer's header)
then takes it and the caller waits for that thread's whole turn — on the GPU machine that made
the record cost 40–60 µs of a ``tf.send`` call. Here events come from a pool (made once, reused
once their consumer has been enqueued) and are recorded through the CUDA runtime's
``cudaEventRecord`` called with the GIL held (``ctypes.PyDLL``), a few microseconds.

Falls back to ``torch.cuda.Event.record`` when the runtime library cannot be loaded or the call
fails.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import threading
from typing import Any

import torch

__all__ = ["record_on_current_stream", "recycle"]

log = logging.getLogger(__name__)

# Created events free to record again, per device index.
_free: dict[int, collections.deque] = {}
_record: Any = None
_record_checked = False
_lock = threading.Lock()
_MAX_FREE = 1024


def _load_record() -> Any:
    from tensorferry.runtime._cuda_streams import _load_cudart

    try:
        lib = ctypes.PyDLL(_load_cudart()._name)  # same library, called with the GIL held
        fn = lib.cudaEventRecord
    except (OSError, RuntimeError, AttributeError) as exc:
        log.debug("events: no GIL-holding cudaEventRecord (%s); using torch's", exc)
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_void_p)
    fn.restype = ctypes.c_int
    return fn


def _recorder() -> Any:
    global _record, _record_checked
    if not _record_checked:
        with _lock:
            if not _record_checked:
                _record = _checked(_load_record())
                _record_checked = True
    return _record


def _checked(record: Any) -> Any:
    """``record`` if it demonstrably records on torch's current stream, else ``None``: an
    event recorded behind a long kernel must be pending, then fire."""
    if record is None:
        return None
    stream = torch.cuda.Stream()  # a private one: the caller's stream is not synchronised
    event = torch.cuda.Event()
    event.record(stream)
    stream.synchronize()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(20_000_000)  # tens of milliseconds of spinning on the device
    code = record(event.cuda_event, stream.cuda_stream)
    pending = not event.query()
    stream.synchronize()
    if code != 0 or not pending or not event.query():
        log.warning("events: cudaEventRecord through ctypes did not behave (%s); using torch", code)
        return None
    recycle(event)
    return record


def record_on_current_stream() -> torch.cuda.Event:
    """An event recorded on the current CUDA stream (see the module docstring)."""
    record = _recorder()
    if record is not None:
        index = torch.cuda.current_device()
        free = _free.get(index)
        event = None
        if free:
            try:
                event = free.popleft()
            except IndexError:  # another thread took the last one
                event = None
        if event is not None:
            # The raw handle of the current stream: torch's Stream object costs microseconds.
            if record(event.cuda_event, torch._C._cuda_getCurrentRawStream(index)) == 0:
                return event
            _disable("cudaEventRecord failed")
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream())  # also creates the CUDA event, for recycling
    return event


def recycle(event: Any) -> None:
    """Returns ``event`` to the pool: only once every wait on it has been enqueued (a later
    record does not change what an enqueued wait waits for)."""
    if event is None:
        return
    free = _free.setdefault(event.device.index, collections.deque())
    if len(free) < _MAX_FREE:
        free.append(event)


def _disable(why: str) -> None:
    global _record
    log.warning("events: %s; recording with torch from now on", why)
    _record = None
