"""What one CUDA event call costs the calling thread, made three ways.

The p2p layer records an event on the caller's stream for every message, and polls each
transfer's completion event until it fires. Each row is the best of seven runs of 20,000 calls,
in ns per call, on one stream and two events of ``cuda:0``, the stream idle:

- ``torch``: ``Event.record``, ``Stream.wait_event``, ``Event.query`` (they let go of the GIL);
- ``ctypes``: the CUDA runtime's functions through ``ctypes.PyDLL``, the GIL held (what
  ``tensorferry/runtime/_events.py`` called before the compiled helper was loaded);
- ``compiled``: the same entry points through the compiled helper's ``record_event``,
  ``wait_event`` and ``query_event`` (``tensorferry/_native``), the GIL held: what the events
  module calls once the helper is loaded.

Then the NCCL transport's poll of a communicator's background errors
(``NcclLibrary.async_error``, asked on every poll of a transfer in flight) on a communicator of
one rank, through ctypes and through the compiled helper's ``nccl_async_error``; and what
finding the calling thread's current stream costs, as ``Transfer.wait_stream()``
with no stream needs it: torch's ``Stream`` object (``torch.cuda.current_stream(0)``, what it
made before) against its raw handle (``torch._C._cuda_getCurrentRawStream(0)``, what it reads
now).

Usage (a CUDA device): ``TENSORFERRY_NATIVE=wait python scripts/event_calls_probe.py``
"""

import sys
import timeit

import torch


def main():
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    from tensorferry import _native
    from tensorferry.runtime import _events

    _native.start()
    if _native.wait(timeout=600) is None:
        sys.exit(f"the compiled helper is not loaded: {_native.status()}")
    _events._runtime()
    compiled, through_ctypes = _events._calls, _events._ctypes_calls
    if compiled is None or compiled is through_ctypes:
        sys.exit("the compiled event calls are not in use")
    stream, event, other = torch.cuda.Stream(), torch.cuda.Event(), torch.cuda.Event()
    event.record(stream)
    other.record(stream)
    stream.synchronize()
    handle, ev, ev2 = stream.cuda_stream, event.cuda_event, other.cuda_event
    ways = {
        "torch": {
            "record": lambda: event.record(stream),
            "wait": lambda: stream.wait_event(other),
            "query": lambda: event.query(),
        },
    }
    for name, calls in (("ctypes", through_ctypes), ("compiled", compiled)):
        ways[name] = {
            "record": lambda calls=calls: calls.record(ev, handle),
            "wait": lambda calls=calls: calls.wait(handle, ev2, 0),
            "query": lambda calls=calls: calls.query(ev),
        }
    print(f"ns per call on {torch.cuda.get_device_name(0)}, best of 7 × 20,000:")
    print(f"  {'':10s} {'record':>8s} {'wait':>8s} {'query':>8s}")
    for name, calls in ways.items():
        costs = []
        for fn in calls.values():
            best = min(timeit.repeat(fn, number=20_000, repeat=7)) / 20_000
            costs.append(f"{best * 1e9:8.0f}")
        stream.synchronize()
        print(f"  {name:10s} " + " ".join(costs))
    _async_error_rows(native=_native.helper())
    print("ns per look-up of the current stream, best of 7 × 20,000:")
    for name, fn in (
        ("torch.cuda.current_stream(0)", lambda: torch.cuda.current_stream(0)),
        ("torch._C._cuda_getCurrentRawStream(0)", lambda: torch._C._cuda_getCurrentRawStream(0)),
    ):
        best = min(timeit.repeat(fn, number=20_000, repeat=7)) / 20_000
        print(f"  {name:40s} {best * 1e9:8.0f}")


def _async_error_rows(native):
    """``NcclLibrary.async_error`` on a one-rank communicator, ctypes against compiled."""
    from tensorferry import _native
    from tensorferry.p2p._nccl_lib import library

    lib = library()
    if lib is None:
        print("no NCCL library: no async-error rows")
        return
    comm = lib.init_rank(1, lib.unique_id(), 0)
    try:
        print("ns per NCCL async-error poll (NcclLibrary.async_error), best of 7 × 20,000:")
        for name, module in (("ctypes", None), ("compiled", native)):
            _native._loaded = module
            best = min(timeit.repeat(lambda: lib.async_error(comm), number=20_000, repeat=7))
            print(f"  {name:10s} {best / 20_000 * 1e9:8.0f}")
    finally:
        _native._loaded = native
        lib.destroy(comm)


if __name__ == "__main__":
    main()
