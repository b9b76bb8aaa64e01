"""The p2p layer's own host time per message, with the wire taken out.

Two processes share one device (a GPU, or the CPU with ``--cpu``) and move 1 KiB messages over
a registered transport that moves nothing: its ``start`` enqueues no work and is ready at once.
Like NCCL's, it takes its stream as an argument, so the layer switches no streams around it
(before 2026-11-23 evening it did: numbers from before then include a stream switch). What is
left is everything tensorferry does around a transport: validation, the message's
numbering and header, the stream ordering with the caller (CUDA events), the completion
handling. So it needs no second GPU and no NCCL, and shows how the layer's cost changes with
the engine's settings. Rank 0 sends with ``static=True``; rank 1 receives. Median host µs:

- ``lone``: one ``tf.send`` at a time, waited for before the next (``call`` is the time until
  it returns, ``round`` until its ``wait()`` returned);
- ``burst``: 64 ``tf.send`` calls back to back, then one wait for all (``call`` per send,
  ``round`` for all 64).

Rank 1's ``tf.recv`` calls are timed the same way; their ``call`` rows are printed after rank
0's.

``--busy-us N`` makes each message's work finish N µs after it starts (the transport's
``ready()`` says false until then), as real device work does; ``--ready-us N`` makes each
``ready()`` cost N µs of the caller's thread, the GIL held (NCCL's async-error query costs about
2). With ``--busy-us 5000`` the lone rows show what a call costs right after its thread waited
milliseconds for the previous transfer.

Each row is measured with the engine's short way for agreed static messages on and off
(``TENSORFERRY_P2P_SHORT_PATH``), twice, interleaved.

``lone cpu`` is the sending thread's own CPU time per call: where it is well below ``lone
call``, the thread waited (for the GIL, most likely, held by another of the process's threads).

``--nccl`` (two GPUs) runs the same over the real NCCL transport, one GPU per rank: the wire
back in, for comparison. ``--one-gpu`` runs it with both ranks on ``cuda:0``, each posing to
NCCL as a host of its own (``NCCL_HOSTID``), so over NCCL's network transport: the host work of
a real NCCL message (staging copies, NCCL's calls) on a machine with one GPU.

Usage: ``python scripts/send_overhead_probe.py [--cpu | --nccl | --one-gpu] [--tensors N]
[--busy-us N] [--ready-us N] [--profile | --phases | --reads | --opcodes]``
(``--tensors N``: each message a list of N tensors of 4 KiB, as ``bench batch``'s, instead of
one of 1 KiB; ``--profile``: the short-way ``tf.send`` calls (rank 0) and ``tf.recv`` calls
(rank 1) of the lone rows under ``cProfile``, each rank's 25 costliest functions;
``--phases``: median µs per lone call spent in the main steps of a short-way send (rank 0) and
receive (rank 1), timed by wrappers, which add a little each (a step a side never takes reads
0); ``--reads``: how often the short way's read of the peer's frames, on each rank, finds any,
and how many;
``--answered``: calls without ``static`` whose peer called first (its header came before the
call: the short way's *answered* case), short way on and off; each rank's median call time;
``--ab-native``: the short way's rows with the compiled validation loop (``tensorferry/_native``)
and without it, alternately in one process, five rounds;
``--ab-lone-call`` (over NCCL): the same with a lone tensor's issue in one call of the compiled
helper (``Transport.start_lone_between``) and without it, six rounds, the order flipped each;
``--ab-gil`` (over NCCL): the same with NCCL's launching calls keeping the GIL (the default
on a connected pair while few transfers are in flight) and letting go of it, six rounds, the
order flipped each;
``--ab-link-calls``: the same with the side channel's system calls made through the compiled
helper, holding the GIL (the default where it is loaded), and through the socket's methods,
six rounds, the order flipped each;
``--ab-event-calls`` (CUDA): the same with the CUDA event calls (the caller's event, the
completion event's polls) made through the compiled helper (the default where it is loaded)
and through ctypes, six rounds, the order flipped each;
``--opcodes``: the Python opcodes and calls one short-way ``tf.send`` runs on the caller's
thread, averaged, and each function's own share: a count that the machine's speed does not
move, for A/Bs of small changes; it varies between runs, by up to about 40 opcodes on the CPU
machine, with how often the short way's read finds the peer's frames and the poller is woken).
"""

import cProfile
import io
import pstats
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp

from tensorferry.p2p._launch import reserved_port

ROUNDS = 400
BURST = 64


def _null_transport(device_type, ready_us=0.0, busy_us=0.0):
    from tensorferry.p2p._transport import PendingOps, Transport

    class Finished(PendingOps):
        def __init__(self):
            self.done_at = time.perf_counter() + busy_us * 1e-6

        def ready(self):
            if ready_us:  # what a real transport's check costs, the GIL held (NCCL's: a query)
                end = time.perf_counter() + ready_us * 1e-6
                while time.perf_counter() < end:
                    pass
            return time.perf_counter() >= self.done_at

        def abort(self):
            pass

    class Null(Transport):
        """Moves nothing; agreed static channels issue ahead of the peer's header, as NCCL."""

        name = "null"
        static_speculates = True
        makes_stream_current = True  # as NCCL's: no stream switch around start()

        def prepare(self, peers):
            pass

        def start(self, ops, *, stream=None):
            return Finished()

    Null.device_type = device_type
    return Null


TRANSPORT = "null"


def _measure(rank, x, short, prof, bursts=True):
    import tensorferry.p2p as tf

    tf._context.current().engine._short_path = short
    peer = 1 - rank
    lone_call, lone_cpu, lone_round, burst_call, burst_round = [], [], [], [], []
    for i in range(ROUNDS + 20):
        c0 = time.thread_time()
        t0 = time.perf_counter()
        if rank == 0:
            if prof is not None and short and i >= 20:
                prof.enable()
            handle = tf.send(x, peer, static=True, transport=TRANSPORT)
            if prof is not None:
                prof.disable()
        else:
            if prof is not None and short and i >= 20:
                prof.enable()
            handle = tf.recv(x, peer, static=True, transport=TRANSPORT)
            if prof is not None:
                prof.disable()
        t1 = time.perf_counter()
        c1 = time.thread_time()
        handle.wait()
        if i >= 20:
            lone_call.append(t1 - t0)
            lone_cpu.append(c1 - c0)
            lone_round.append(time.perf_counter() - t0)
    for i in range(ROUNDS // 8 + 2 if bursts else 0):
        handles = []
        t0 = time.perf_counter()
        for _ in range(BURST):
            t1 = time.perf_counter()
            if rank == 0:
                handles.append(tf.send(x, peer, static=True, transport=TRANSPORT))
            else:
                handles.append(tf.recv(x, peer, static=True, transport=TRANSPORT))
            if i >= 2:
                burst_call.append(time.perf_counter() - t1)
        for handle in handles:
            handle.wait()
        if i >= 2:
            burst_round.append(time.perf_counter() - t0)

    def med(values):
        return statistics.median(values) * 1e6 if values else float("nan")

    return {
        "lone call": med(lone_call),
        "lone cpu": med(lone_cpu),
        "lone round": med(lone_round),
        "burst call": med(burst_call),
        "burst round (64)": med(burst_round),
    }


ANSWERED = 16


def _measure_answered(rank, x, short, rounds=40):
    """Messages without ``static`` whose peer called first. Each round one rank makes
    ``ANSWERED`` calls at once (rank 1 receives in even rounds, rank 0 sends in odd ones); the
    other waits until all their headers came, then makes its own calls, each timed: the calls
    the engine's short way takes when its peer's header is there (``answered``)."""
    import tensorferry.p2p as tf

    engine = tf._context.current().engine
    engine._short_path = short
    peer = 1 - rank
    kind = "send" if rank == 0 else "recv"
    timed = []

    def call():
        if rank == 0:
            return tf.send(x, peer, transport=TRANSPORT)
        return tf.recv(x, peer, transport=TRANSPORT)

    call().wait()  # the pair's side channel and transport are made by a first message
    for i in range(rounds):
        first = 1 if i % 2 == 0 else 0
        if rank == first:
            handles = [call() for _ in range(ANSWERED)]
        else:
            deadline = time.monotonic() + 60
            # The engine's own state: how many of the peer's headers for our channel came.
            while len(engine._peer(peer).channels[kind].peer_headers) < ANSWERED:
                if time.monotonic() > deadline:
                    raise TimeoutError("the peer's headers never came")
                engine.drive()
            handles = []
            for _ in range(ANSWERED):
                t0 = time.perf_counter()
                handles.append(call())
                if i >= 4:
                    timed.append(time.perf_counter() - t0)
        for handle in handles:
            handle.wait()
    name = "answered send call" if rank == 0 else "answered recv call"
    return {name: statistics.median(timed) * 1e6}


# What --phases times: (label, owner, attribute); the owner is resolved on the running layer.
_PHASES = (
    ("lane's call (Lanes.call, all)", "lanes", "call"),
    ("  lane's check (lone_of_layout)", "lanes_module", "lone_of_layout"),
    ("  lane's caller event (to record at issue)", "lanes_module", "to_record_on_current_stream"),
    ("validate (_api._message)", "api", "_message"),
    ("caller's event (_api._caller_event)", "api", "_caller_event"),
    ("Transfer()", "transfer", "__init__"),
    ("submitted (_api._submit, all)", "api", "_submit"),
    ("engine.submit, all", "engine", "submit"),
    ("engine: short way, all", "engine", "_issue_short"),
    ("  peer's frames handled", "engine", "_handle_frames"),
    ("  header written", "engine", "_send_header"),
    ("  links flushed", "engine", "_flush_links"),
    ("    socket written", "link", "flush"),
    ("  started (issue and completion)", "engine", "_start"),
    ("    issued (ctx.issue)", "ctx", "issue"),
    ("      lone start (ctx._start_lone_between)", "ctx", "_start_lone_between"),
    ("        pooled event (_events.pooled)", "events", "pooled"),
    ("        compiled call (issue_lone)", "native", "issue_lone"),
    ("    caller's event recorded (ctx.record_caller)", "ctx", "record_caller"),
    ("    completion handed to the pool", "pool", "call_when"),
    ("    marked issued", "transfer", "_mark_issued"),
    ("      transport's start", "transport", "start"),
    ("        staging copy (packing)", "staging", "pack"),
    ("        staging copy (unpacking)", "staging", "unpack"),
    ("        ncclGroupEnd", "nccl_lib", "group_end"),
    ("        NCCL call alone", "nccl_lib", "move_alone"),
    ("  peer's headers checked (_confirm)", "engine", "_confirm"),
    ("  frames parsed (Link.receive)", "link", "receive"),
    ("overlap check (check_receives_apart)", "api", "check_receives_apart"),
)


def _wrap_phases():
    """Wraps each step of ``_PHASES`` in a timer; returns ``{label: [seconds, ...]}``."""
    import tensorferry.p2p as tf
    from tensorferry import _native
    from tensorferry.p2p import _api, _lanes, _link, _staging, _transfer
    from tensorferry.p2p._nccl_lib import library as nccl_library
    from tensorferry.runtime import _events

    ctx = tf._context.current()
    owners = {
        "api": _api,
        "transfer": _transfer.Transfer,
        "engine": ctx.engine,
        "lanes": ctx.engine.lanes,
        "lanes_module": _lanes,
        "ctx": ctx,
        "pool": ctx.completions,
        "link": _link.Link,
        "staging": _staging.Staging,
        "transport": ctx.transport(TRANSPORT),
        "nccl_lib": nccl_library() if TRANSPORT == "nccl" else None,
        "events": _events,
        "native": _native.helper() if TRANSPORT == "nccl" else None,
    }
    spent = {}
    for label, owner_name, attr in _PHASES:
        owner = owners[owner_name]
        if owner is None:
            continue
        inner = getattr(owner, attr)
        spent[label] = []

        def timed(*args, _inner=inner, _times=spent[label], **kwargs):
            t0 = time.perf_counter()
            try:
                return _inner(*args, **kwargs)
            finally:
                _times.append(time.perf_counter() - t0)

        setattr(owner, attr, timed)
    return spent


class _OpcodeCount:
    """Counts the Python opcodes and calls the sending thread runs while enabled (``_measure``
    enables it around each lone short-way send, as it does a profiler)."""

    def __init__(self):
        self.opcodes = self.calls = self.sends = 0
        self.by_function = {}
        self._names = {}

    def _trace(self, frame, event, arg):
        frame.f_trace_opcodes = True
        if event == "opcode":
            self.opcodes += 1
            code = frame.f_code
            where = self._names.get(code)
            if where is None:
                where = f"{code.co_filename.rsplit('/', 2)[-1]}:{code.co_firstlineno}"
                where = f"{where}({code.co_qualname})"
                if code.co_filename == "<string>" and "self" in frame.f_locals:  # a dataclass's
                    where = f"{type(frame.f_locals['self']).__name__}.{code.co_name} (generated)"
                self._names[code] = where
            self.by_function[where] = self.by_function.get(where, 0) + 1
        elif event == "call":
            self.calls += 1
        return self._trace

    def enable(self):
        self.sends += 1
        sys.settrace(self._trace)

    def disable(self):
        sys.settrace(None)


def _count_reads():
    """Counts the short way's reads of the peer's frames and what they find; returns the
    counts, filled in as the calls run."""
    import tensorferry.p2p as tf

    engine = tf._context.current().engine
    counts = {"short-way calls": 0, "reads that found frames": 0, "frames found": 0}
    issue_short, handle_frames = engine._issue_short, engine._handle_frames
    inside = []

    def counted_issue(unit):
        counts["short-way calls"] += 1
        inside.append(True)
        try:
            return issue_short(unit)
        finally:
            inside.pop()

    def counted_handle(link, frames):
        found = handle_frames(link, frames)
        if inside and found > 0:
            counts["reads that found frames"] += 1
            counts["frames found"] += found
        return found

    engine._issue_short, engine._handle_frames = counted_issue, counted_handle
    return counts


def init_with_null(rank, port, device, ready_us=0.0, busy_us=0.0):
    """``tf.init`` of ``rank`` in a world of two on loopback, with the transport that moves
    nothing registered as ``"null"``."""
    import tensorferry.p2p as tf
    from tensorferry.p2p._transport import register_transport

    tf.init(
        "gloo" if device == "cpu" else "nccl",
        rank=rank,
        world_size=2,
        init_method=f"tcp://127.0.0.1:{port}",
        device=device,
        timeout=120,
    )
    null = _null_transport(torch.device(device).type, ready_us, busy_us)
    register_transport("null", null, replace=True)


def profile_text(prof):
    """The 25 costliest functions of ``prof`` by their own time."""
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    return text.getvalue()


def run_ranks(target, args_of_rank, kwargs=None):
    """Runs ``target(rank, port, *args_of_rank(rank), queue, **kwargs)`` in two spawned
    processes, ``port`` their rendezvous port (held for them until both are done); each puts
    ``(rank, result)`` on the queue. Returns the results by rank; exits if a rank dies or five
    minutes pass."""
    with reserved_port() as port:
        return _run_ranks(target, port, args_of_rank, kwargs)


def _run_ranks(target, port, args_of_rank, kwargs):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(
            target=target, args=(rank, port, *args_of_rank(rank), queue), kwargs=kwargs or {}
        )
        for rank in range(2)
    ]
    for proc in procs:
        proc.start()
    results = {}
    deadline = time.monotonic() + 300
    while len(results) < len(procs):
        try:
            rank, out = queue.get(timeout=1)
            results[rank] = out
        except Exception:  # queue.Empty: a rank that died will never answer
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                for proc in procs:
                    proc.kill()
                sys.exit(f"a rank failed (exit codes {[p.exitcode for p in procs]})")
    for proc in procs:
        proc.join(30)
    return results


def _worker(
    rank,
    port,
    device,
    profile,
    queue,
    transport,
    tensors=1,
    ready_us=0.0,
    busy_us=0.0,
    one_gpu=False,
):
    global TRANSPORT
    TRANSPORT = transport
    import tensorferry.p2p as tf

    if one_gpu:  # each rank poses to NCCL as a host of its own (scripts/one_gpu_ranks.py)
        import os

        os.environ["NCCL_HOSTID"] = f"tensorferry-probe-rank-{rank}"

    init_with_null(rank, port, device, ready_us, busy_us)
    try:
        x = torch.ones(256, device=device)
        if tensors > 1:  # a list, as bench batch's: 4 KiB each
            x = [torch.ones(1024, device=device) for _ in range(tensors)]
        prof = cProfile.Profile() if profile == "profile" else None
        if profile == "phases":
            spent = _wrap_phases()
            _measure(rank, x, True, None, bursts=False)
            medians = {k: statistics.median(v or [0]) * 1e6 for k, v in spent.items()}
            queue.put((rank, {"phases": medians}))
            return
        if profile == "opcodes":
            counter = _OpcodeCount() if rank == 0 else None
            _measure(rank, x, True, counter, bursts=False)
            per_send = {"opcodes": counter.opcodes, "calls": counter.calls} if counter else {}
            sends = counter.sends if counter else 1
            by_function = counter.by_function if counter else {}
            functions = sorted(by_function.items(), key=lambda kv: -kv[1])
            out = {k: v / sends for k, v in per_send.items()}
            out["functions"] = [(name, count / sends) for name, count in functions]
            queue.put((rank, {"opcodes": out}))
            return
        if profile == "reads":
            counts = _count_reads()
            _measure(rank, x, True, None)
            queue.put((rank, {"reads": counts}))
            return
        if profile == "answered":
            rows = {}
            for _ in range(2):  # interleaved: this machine's host times drift
                for short in (True, False):
                    for name, value in _measure_answered(rank, x, short).items():
                        rows.setdefault(f"{name}, short way {'on' if short else 'off'}", [])
                        rows[f"{name}, short way {'on' if short else 'off'}"].append(value)
            queue.put((rank, {"rows": rows}))
            return
        alternated = {
            "ab-native": _ab_native,
            "ab-lone-call": _ab_lone_call,
            "ab-gil": _ab_gil,
            "ab-link-calls": _ab_link_calls,
            "ab-event-calls": _ab_event_calls,
        }
        if profile in alternated:
            queue.put((rank, {"rows": alternated[profile](rank, x)}))
            return
        rows = {}
        for _ in range(2):  # interleaved: this machine's host times drift
            for short in (True, False):
                for name, value in _measure(rank, x, short, prof).items():
                    key = f"{name}, short way {'on' if short else 'off'}"
                    rows.setdefault(key, []).append(value)
        out = {"rows": rows}
        if prof is not None:
            out["profile"] = profile_text(prof)
        queue.put((rank, out))
    finally:
        tf.shutdown()


def _ab_native(rank, x, rounds=5):
    """The short way's rows with the compiled validation loop and without it, alternately in
    one process (this host's times drift between processes), ``rounds`` times each."""
    from tensorferry import _native

    module = _native.wait()
    if module is None:
        sys.exit(f"the compiled helper is not loaded: {_native.status()}")
    rows = {}
    try:
        for _ in range(rounds):
            for use in (True, False):
                _native._loaded = module if use else None
                for name, value in _measure(rank, x, True, None).items():
                    rows.setdefault(f"{name}, compiled check {'on' if use else 'off'}", []).append(
                        value
                    )
    finally:
        _native._loaded = module
    return rows


def _alternated(rank, x, switch, labels, rounds=6):
    """The short way's rows under two settings, alternately in one process, the order flipped
    each round, ``rounds`` times each: ``switch(True)`` and ``switch(False)`` put each in place
    (the first is the default, put back at the end); ``labels[True]`` and ``labels[False]``
    name them in the rows."""
    rows = {}
    try:
        for round_ in range(rounds):
            for setting in (True, False) if round_ % 2 == 0 else (False, True):
                switch(setting)
                for name, value in _measure(rank, x, True, None).items():
                    rows.setdefault(f"{name}, {labels[setting]}", []).append(value)
    finally:
        switch(True)
    return rows


def _ab_lone_call(rank, x):
    """The short way's rows with a lone tensor issued in one call of the compiled helper
    (``NcclTransport.start_lone_between``) and without it (the stream's wait, the NCCL call and
    the completion event from Python), alternated (see :func:`_alternated`)."""
    from tensorferry.p2p._nccl import NcclTransport

    one_call = NcclTransport.start_lone_between

    def switch(use):
        NcclTransport.start_lone_between = (
            one_call if use else lambda self, op, stream, caller_event: None
        )

    return _alternated(rank, x, switch, {True: "one call on", False: "one call off"})


def _ab_gil(rank, x):
    """The short way's rows with NCCL's launching calls made holding the GIL (the default on a
    connected pair while few transfers are in flight: ``_transport.HOLD_GIL_BELOW``) and
    letting go of it (that bound set to 0), alternated (see :func:`_alternated`)."""
    from tensorferry.p2p import _transport

    bound = _transport.HOLD_GIL_BELOW

    def switch(hold):
        _transport.HOLD_GIL_BELOW = bound if hold else 0

    return _alternated(rank, x, switch, {True: "GIL held", False: "GIL let go"})


def _ab_link_calls(rank, x):
    """The short way's rows with the side channel's system calls made through the compiled
    helper, holding the GIL (the default where it is loaded: ``_link.NATIVE_CALLS``), and
    through the socket's methods, which let go of it, alternated (see :func:`_alternated`)."""
    from tensorferry.p2p import _link

    def switch(native):
        _link.NATIVE_CALLS = native

    labels = {True: "links' calls compiled", False: "links' calls Python's"}
    return _alternated(rank, x, switch, labels)


def _ab_event_calls(rank, x):
    """The short way's rows with the CUDA event calls (record, wait, query) made through the
    compiled helper (the default once it is loaded: ``_events._use_compiled``) and through
    ctypes, alternated (see :func:`_alternated`). Both hold the GIL; the rows of a round trip
    include the polls of the transfer's completion event."""
    from tensorferry.runtime import _events

    _events._runtime()
    compiled, through_ctypes = _events._calls, _events._ctypes_calls
    if compiled is None or compiled is through_ctypes:
        sys.exit("the compiled event calls are not in use (no CUDA, or no compiled helper)")

    def switch(use):
        _events._calls = compiled if use else through_ctypes

    labels = {True: "event calls compiled", False: "event calls ctypes"}
    return _alternated(rank, x, switch, labels)


# The modes that alternate two settings in one process.
_AB_MODES = ("ab-native", "ab-lone-call", "ab-gil", "ab-link-calls", "ab-event-calls")


def _option(name, default):
    """The number given after ``name`` on the command line, or ``default``."""
    return float(sys.argv[sys.argv.index(name) + 1]) if name in sys.argv else default


def main():
    one_gpu = "--one-gpu" in sys.argv
    nccl = "--nccl" in sys.argv or one_gpu
    device = "cpu" if "--cpu" in sys.argv or not torch.cuda.is_available() else "cuda:0"
    modes = ("--profile", "--phases", "--reads", "--opcodes", "--answered")
    modes += tuple(f"--{mode}" for mode in _AB_MODES)
    mode = next((a[2:] for a in sys.argv if a in modes), None)
    tensors = int(_option("--tensors", 1))
    ready_us, busy_us = _option("--ready-us", 0.0), _option("--busy-us", 0.0)
    results = run_ranks(
        _worker,
        lambda rank: (f"cuda:{rank}" if nccl and not one_gpu else device, mode),
        {
            "transport": "nccl" if nccl else "null",
            "tensors": tensors,
            "ready_us": ready_us,
            "busy_us": busy_us,
            "one_gpu": one_gpu,
        },
    )
    if "reads" in results[0]:
        print(f"the short way's reads of the peer's frames, lone and burst rows, on {device}:")
        for rank in sorted(results):
            print(f"  rank {rank}: {results[rank]['reads']}")
        return
    if "opcodes" in results[0]:
        counts = results[0]["opcodes"]
        print(
            f"one short-way tf.send on {device} (rank 0): {counts['opcodes']:.0f} Python "
            f"opcodes, {counts['calls']:.0f} Python calls; each function's own opcodes:"
        )
        for name, count in counts["functions"]:
            if count >= 0.5:
                print(f"  {count:7.1f}  {name}")
        return
    if "phases" in results[0]:
        over = " over NCCL" if nccl else ""
        print(f"median µs per call in each step of a short-way call{over} on {device}:")
        print(f"  {'':38s} {'send':>8s} {'recv':>8s}")
        for label, value in results[0]["phases"].items():
            print(f"  {label:38s} {value:8.1f} {results[1]['phases'][label]:8.1f}")
        return
    if mode == "answered":
        where = "over NCCL" if nccl else f"with no wire, on {device}"
        print(f"host µs per call whose peer called first, {where}, two interleaved runs:")
        for rank in sorted(results):
            for name, values in sorted(results[rank]["rows"].items()):
                print(f"  {name:40s} " + "  ".join(f"{v:8.1f}" for v in values))
        return
    where = "over NCCL, one GPU per rank" if nccl else f"with no wire, on {device}"
    if one_gpu:
        where = "over NCCL's network transport, both ranks on cuda:0"
    what = f"message of {tensors} × 4 KiB" if tensors > 1 else "message"
    runs = "interleaved runs" if mode in _AB_MODES else "two interleaved runs"
    print(f"host µs per {what} {where} (rank 0 sends), {runs}:")
    for name, values in sorted(results[0]["rows"].items()):
        print(f"  {name:34s} " + "  ".join(f"{v:8.1f}" for v in values))
    print("the receiving side (rank 1's tf.recv calls, the same rows):")
    for name, values in sorted(results[1]["rows"].items()):
        if "call" in name:
            print(f"  {name:34s} " + "  ".join(f"{v:8.1f}" for v in values))
    print(results[0].get("profile", ""))
    if "profile" in results[1]:
        print("rank 1's short-way tf.recv calls of the lone rows:")
        print(results[1]["profile"])


if __name__ == "__main__":
    main()
