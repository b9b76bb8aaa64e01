"""Host time of one small NCCL send, from the bare library call up to ``tf.send``.

Rank 0 sends a 1 KiB tensor to rank 1 over and over; each row is the median host time of the
sending call only (the receiver posts the matching receives), 500 calls after a warm-up, on
one process per GPU:

- ``ncclSend`` in a group: ``ncclGroupStart``/``ncclSend``/``ncclGroupEnd`` through ``ctypes``
  on a communicator of the probe's own (the floor for any Python caller of NCCL);
- ``ncclSend`` alone, with no group around it (NCCL launches it at once): what a lone
  message's issue would cost without the two group calls, which the transport makes today;
- the same plus an event recorded after it (what a completion needs);
- a lean path in Python: what an agreed static message cannot skip, done with the layer's own
  pieces and nothing else (validation and description, the caller's event, the transfer
  stream's wait for it, the group call, the done event, a header written to the peer's socket,
  a future for the result): the floor of a shortcut through the engine;
- ``torch.distributed.isend`` (``ProcessGroupNCCL``);
- ``tf.send(x, 1, static=True)`` (validation, message numbering, header, issue, completion),
  by the engine's short way for agreed static messages and, for comparison, by its full step
  (the short way switched off on the running engine, as ``TENSORFERRY_P2P_SHORT_PATH=0`` does).

Usage (2 GPUs): ``python scripts/send_floor_probe.py [--profile] [--elements N]``
(``--profile``: the ``tf.send`` calls under ``cProfile``, its 25 most costly functions;
``--elements N``: a message of N float32 values instead of 256, i.e. 1 KiB).
"""

import contextlib
import cProfile
import socket
import statistics
import time
from concurrent.futures import Future

import torch

CALLS = 500


def worker(rank, world, cfg):
    import torch.distributed as dist

    import tensorferry.p2p as tf
    from tensorferry.p2p._launch import torch_group
    from tensorferry.p2p._nccl_lib import library
    from tensorferry.p2p._spec import _check_tensors, describe, descriptor_text
    from tensorferry.runtime._events import record_on_current_stream, recycle
    from tensorferry.runtime._stream_switch import on_stream

    peer = 1 - rank
    prof = cProfile.Profile() if cfg["profile"] and rank == 0 else None
    device = tf._context.current().device
    x = torch.ones(cfg["elements"], device=device)
    out = {}
    with torch_group("probe/send_floor", timeout_s=120):
        lib = library()
        ids = [lib.unique_id() if rank == 0 else None]
        dist.broadcast_object_list(ids, src=0)
        comm = lib.init_rank(2, ids[0], rank)
        stream = torch.cuda.Stream(device)

        def raw(record, group=True):
            event = torch.cuda.Event()
            samples = []
            for i in range(CALLS + 50):
                t0 = time.perf_counter()
                if group:
                    lib.group_start()
                if rank == 0:
                    lib.send(x.data_ptr(), x.numel() * 4, peer, comm, stream.cuda_stream)
                else:
                    lib.recv(x.data_ptr(), x.numel() * 4, peer, comm, stream.cuda_stream)
                if group:
                    lib.group_end()
                if record:
                    event.record(stream)
                if i >= 50:
                    samples.append(time.perf_counter() - t0)
                if i % 50 == 49:
                    stream.synchronize()
            stream.synchronize()
            return statistics.median(samples) * 1e6

        # The lean path's header channel: a TCP connection from rank 0 to rank 1.
        listener = socket.create_server(("127.0.0.1", 0)) if rank == 1 else None
        ports = [listener.getsockname()[1] if listener else None]
        dist.broadcast_object_list(ports, src=1)
        if rank == 0:
            link = socket.create_connection(("127.0.0.1", ports[0]))
        else:
            link, _ = listener.accept()
        link.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        link.setblocking(rank == 0)

        def lean():
            samples = []
            header = b'{"k":"h","e":0,"c":"s","q":%d,"d":"%s","st":true,"t":"nccl"}\n'
            for i in range(CALLS + 50):
                t0 = time.perf_counter()
                if rank == 0:
                    items = _check_tensors([x], device, "tensors")
                    text = descriptor_text(describe(items))
                    caller = record_on_current_stream(device.index)
                    with on_stream(stream):
                        stream.wait_event(caller)
                        lib.group_start()
                        lib.send(x.data_ptr(), x.numel() * 4, peer, comm, stream.cuda_stream)
                        lib.group_end()
                        done = torch.cuda.Event()
                        done.record(stream)
                    recycle(caller)
                    link.send(header % (i, text.encode()))
                    future = Future()
                    if i >= 50:
                        samples.append(time.perf_counter() - t0)
                    done.synchronize()
                    future.set_result(None)
                else:
                    lib.group_start()
                    lib.recv(x.data_ptr(), x.numel() * 4, peer, comm, stream.cuda_stream)
                    lib.group_end()
                    with contextlib.suppress(BlockingIOError):
                        link.recv(65536)  # the headers that came (never waits for one)
                    stream.synchronize()
            return statistics.median(samples) * 1e6 if samples else 0.0

        def torch_isend():
            samples = []
            for i in range(CALLS + 50):
                t0 = time.perf_counter()
                work = dist.isend(x, peer) if rank == 0 else dist.irecv(x, peer)
                if i >= 50:
                    samples.append(time.perf_counter() - t0)
                work.wait()
            torch.cuda.synchronize()
            return statistics.median(samples) * 1e6

        def tf_send(short=True):
            tf._context.current().engine._short_path = short
            samples = []
            for i in range(CALLS + 50):
                t0 = time.perf_counter()
                if prof is not None and i >= 50 and short:
                    prof.enable()
                handle = tf.send(x, peer, static=True) if rank == 0 else None
                if prof is not None:
                    prof.disable()
                if i >= 50 and rank == 0:
                    samples.append(time.perf_counter() - t0)
                if rank == 0:
                    handle.wait()
                else:
                    tf.recv(x, peer, static=True).wait()
            torch.cuda.synchronize()
            return statistics.median(samples) * 1e6 if samples else 0.0

        for _ in range(2):  # twice, interleaved: this machine's host times drift
            for name, fn in (
                ("ncclSend in a group (ctypes)", lambda: raw(False)),
                ("ncclSend alone, no group (ctypes)", lambda: raw(False, group=False)),
                ("  + an event recorded", lambda: raw(True)),
                ("lean path (Python)", lean),
                ("torch.distributed.isend", torch_isend),
                ("tf.send(static=True)", tf_send),
                ("  the same, full engine step", lambda: tf_send(short=False)),
            ):
                dist.barrier()
                out.setdefault(name, []).append(fn())
        link.close()
        lib.destroy(comm)
    if prof is not None:
        import io
        import pstats

        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
        out["profile"] = text.getvalue()
    return out


if __name__ == "__main__":
    import sys

    from tensorferry.p2p._launch import run_world

    profile = "--profile" in sys.argv  # tf.send under cProfile (its times inflate)
    elements = int(sys.argv[sys.argv.index("--elements") + 1]) if "--elements" in sys.argv else 256
    cfg = {"profile": profile, "elements": elements}
    res = run_world(worker, cfg, backend="nccl", timeout=300)
    print(f"median host µs of the sending call (rank 0, {elements * 4} bytes), two rounds:")
    for name, values in res[0].items():
        if name != "profile":
            print(f"  {name:32s} " + "  ".join(f"{v:7.1f}" for v in values))
    print(res[0].get("profile", ""))
