"""The compiled validation loop (``tensorferry/_native``): the same answers as the Python loop,
no references leaked, and a build that fails or is turned off leaves the Python path."""

from __future__ import annotations

import contextlib
import gc
import shutil
import sys
import time
import tracemalloc

import pytest
import torch

from tensorferry import _native, envs
from tensorferry.p2p import _spec
from tensorferry.p2p._spec import TensorSpec, descriptor_from_text, descriptor_text

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def native():
    """The helper, built (or loaded from the cache) before the tests that need it."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler on this machine")
    if envs.native_mode() == "0":
        pytest.skip("TENSORFERRY_NATIVE=0: the Python path only")
    _native.start()
    module = _native.wait(timeout=600)
    assert module is not None, _native.status()
    return module


class _Subclass(torch.Tensor):
    pass


def _messages() -> dict[str, list]:
    """Item lists of every kind the one-pass check meets: plain ones it describes and unusual
    ones it hands to the detailed check."""
    complex_x = torch.randn(4, dtype=torch.complex64)
    grid = torch.randn(4, 6)
    leaf = torch.randn(3, requires_grad=True)
    return {
        "one": [torch.randn(3, 4)],
        "many": [torch.randn(1024) for _ in range(64)],
        "dtypes": [
            torch.randn(2, 3).half(),
            torch.arange(5),
            torch.ones(2, dtype=torch.bool),
            complex_x.clone(),
            torch.randn(7).bfloat16(),
            torch.tensor(3.5),  # 0-d
            torch.empty(0, 5),
        ],
        "requires grad": [leaf, torch.randn(2)],
        "parameter": [torch.nn.Parameter(torch.randn(3)), torch.randn(3)],
        "listed twice": [grid, grid],
        "contiguous slice": [grid[1:], grid[0]],
        "non-contiguous": [torch.randn(2), grid.t()],
        "expanded": [torch.randn(1, 3).expand(4, 3)],
        "channels last": [torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)],
        "subclass": [torch.randn(2).as_subclass(_Subclass)],
        "conjugate view": [torch.randn(2), complex_x.conj()],
        "negative view": [complex_x.conj().imag],
        "sparse": [torch.randn(3, 3).to_sparse()],
        "sparse csr": [torch.randn(3, 3).to_sparse_csr()],
        "quantized": [torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)],
        "nested": [torch.nested.nested_tensor([torch.randn(2), torch.randn(3)])],
        "other device": [torch.randn(2), torch.empty(2, device="meta")],
        "meta only": [torch.empty(2, 3, device="meta")],
        "not a tensor": [torch.randn(2), 3],
        "a spec": [TensorSpec((2,))],
        "none": [None],
    }


def _answers(items, device=CPU) -> list:
    """What the one-pass check and the two public checks give, or the errors they raise."""
    calls = [_spec.as_tensor_list, _spec.as_recv_list]
    if type(items[0]) in _spec._PLAIN_TYPES:  # as its callers call it
        calls.append(_spec._inspect_plain)
    answers = []
    for call in calls:
        try:
            answers.append(_comparable(call(items, device, "tensors"), items))
        except (TypeError, ValueError) as error:
            answers.append((type(error), str(error)))
    return answers


def _comparable(result, items):
    """``result`` with each tensor as what it is: the item it is (or shares memory with), its
    shape, dtype and whether it requires grad."""
    if result is None:
        return None
    tensors, desc, *single = result

    def origin(t):
        for i, item in enumerate(items):
            if item is t:
                return i, "same object"
            strided = isinstance(item, torch.Tensor) and item.layout == torch.strided
            if strided and item.nbytes and t.data_ptr() == item.data_ptr():
                return i, "same memory"
        return None

    described = [(origin(t), tuple(t.shape), t.dtype, t.requires_grad) for t in tensors]
    return described, desc, hash(desc), single


def _python_answers(items, monkeypatch, device=CPU):
    with monkeypatch.context() as patch:
        patch.setattr(_native, "_loaded", None)
        return _answers(items, device)


@pytest.mark.parametrize("name", list(_messages()))
def test_the_compiled_check_gives_the_python_checks_answer(native, name, monkeypatch):
    _spec._inspect([torch.randn(1)], CPU, "warm")  # float32 known, as after any message
    items = _messages()[name]
    python = _python_answers(items, monkeypatch)
    monkeypatch.setattr(_spec, "_last_walked", None)
    assert _answers(items) == python
    assert _answers(items) == python  # now with its hint


def _cuda_messages() -> dict[str, list]:
    cuda = torch.device("cuda", torch.cuda.current_device())
    other = torch.device("cuda", (cuda.index + 1) % torch.cuda.device_count())
    grid = torch.randn(4, 6, device=cuda)
    return {
        "many": [torch.randn(1024, device=cuda) for _ in range(64)],
        "dtypes": [torch.randn(3, device=cuda).half(), torch.arange(4, device=cuda)],
        "with a cpu tensor": [grid, torch.randn(2)],
        "cpu first": [torch.randn(2), grid],
        "non-contiguous": [grid, grid.t()],
        "requires grad": [torch.randn(3, device=cuda, requires_grad=True)],
        "another device": [torch.randn(2, device=other)] if other != cuda else [grid[0]],
    }


@pytest.mark.gpu
@pytest.mark.parametrize(
    "name",
    [
        "many",
        "dtypes",
        "with a cpu tensor",
        "cpu first",
        "non-contiguous",
        "requires grad",
        "another device",
    ],
)
def test_the_compiled_check_gives_the_python_checks_answer_on_cuda(native, name, monkeypatch):
    monkeypatch.setattr(_spec, "_last_walked", None)
    device = torch.device("cuda", torch.cuda.current_device())
    _spec._inspect([torch.randn(1, device=device).half()], device, "warm")  # dtypes known
    _spec._inspect([torch.arange(1)], device, "warm")
    items = _cuda_messages()[name]
    python = _python_answers(items, monkeypatch, device)
    assert _answers(items, device) == python
    assert _answers(items, device) == python


def test_a_dtype_no_message_carried_yet_takes_the_detailed_path(native, monkeypatch):
    monkeypatch.delitem(_spec._PLAIN_DTYPES, torch.int16, raising=False)
    items = [torch.ones(3, dtype=torch.int16)]
    assert _spec._inspect_plain(items, CPU, "tensors") is None
    _, desc = _spec._inspect(items, CPU, "tensors")  # the detailed path learns the dtype
    assert desc == (("int16", (3,)),)
    assert _spec._inspect_plain(items, CPU, "tensors")[1] == desc


def test_a_layout_met_before_is_given_back_as_the_same_object(native, monkeypatch):
    _spec._inspect([torch.randn(1), torch.randn(1).double()], CPU, "warm")  # dtypes known
    monkeypatch.setattr(_spec, "_last_walked", None)
    tensors = [torch.randn(8) for _ in range(5)] + [torch.randn(2, 3)]
    first = _spec._inspect_plain(tensors, CPU, "tensors")[1]
    fresh = [torch.randn(8) for _ in range(5)] + [torch.randn(2, 3)]
    assert _spec._inspect_plain(fresh, CPU, "tensors")[1] is first
    # The hint is checked in full: any one tensor differing, at any place, gives a new layout.
    for index, other in ((0, torch.randn(9)), (3, torch.randn(8).double()), (5, torch.randn(3, 2))):
        changed = list(fresh)
        changed[index] = other
        got = _spec._inspect_plain(changed, CPU, "tensors")[1]
        assert got == tuple((_spec._dtype_name(t.dtype), tuple(t.shape)) for t in changed), (
            f"tensor {index} changed"
        )
        assert _spec._inspect_plain(fresh, CPU, "tensors")[1] == first
    # A hint read from a peer's header (names and sizes of other objects) matches too.
    header = descriptor_from_text(descriptor_text(first))
    monkeypatch.setattr(_spec, "_last_walked", header)
    assert _spec._inspect_plain(fresh, CPU, "tensors")[1] is header
    # A hint of another length is not used.
    assert _spec._inspect_plain(fresh[:2], CPU, "tensors")[1] == first[:2]


def test_the_compiled_check_takes_no_reference_it_keeps(native):
    tensors = [torch.randn(16) for _ in range(8)]
    names = _spec._PLAIN_DTYPES
    hint = native.inspect_plain(tensors, _spec._PLAIN_TYPE_TUPLE, names, None)[1]
    mismatched = [*tensors[:-1], torch.randn(3)]
    unusual = [*tensors[:4], torch.randn(4, 4).t()]
    watched = [hint, *tensors, *hint, *names.values(), mismatched[-1], unusual[-1]]
    before = [sys.getrefcount(x) for x in watched]

    def round_of_calls():
        for items in (tensors, mismatched, unusual, tuple(tensors)):
            for given in (hint, None, ()):
                native.inspect_plain(items, _spec._PLAIN_TYPE_TUPLE, names, given)

    for _ in range(200):
        round_of_calls()
    gc.collect()
    assert [sys.getrefcount(x) for x in watched] == before
    tracemalloc.start()
    try:
        for _ in range(200):
            round_of_calls()
        gc.collect()
        start, _ = tracemalloc.get_traced_memory()
        for _ in range(2000):
            round_of_calls()
        gc.collect()
        end, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert end - start < 64 * 1024, f"{end - start} bytes kept by 16000 calls"


def test_receive_buffers_that_share_memory_are_found_as_the_python_way_finds_them(
    native, monkeypatch
):
    from tensorferry import _native

    base = torch.zeros(64)
    apart = [base[0:4], base[4:8], torch.zeros(3), base[8:8], base[8:8], base[60:64]]
    assert native.first_overlap(apart) is None and native.first_overlap(tuple(apart)) is None
    assert native.first_overlap([]) is None and native.first_overlap(apart[:1]) is None
    cases = {
        "listed twice": ([apart[2], base[0:4], apart[2]], (0, 2)),
        "views that overlap": ([base[0:4], base[2:6]], (0, 1)),
        "one inside another": ([base[10:20], torch.ones(2), base[12:13]], (0, 2)),
        "another dtype's view": ([base[:8], base.view(torch.int8)[4:5]], (0, 1)),
        "the later one first in memory": ([base[30:40], base[20:31]], (1, 0)),
    }
    tensors = [torch.randn(2) for _ in range(40)]
    cases["far apart in a long list"] = ([*tensors, tensors[17]], (17, 40))
    for name, (listed, pair) in cases.items():
        assert native.first_overlap(listed) == pair, name
    monkeypatch.setattr(_native, "helper", lambda: None)
    for name, (listed, pair) in cases.items():
        assert _spec._first_overlap(listed) == pair, f"Python way: {name}"
    assert _spec._first_overlap(apart) is None
    before = sys.getrefcount(tensors[0])
    for _ in range(1000):
        native.first_overlap(tensors)
    after = sys.getrefcount(tensors[0])  # read outside the assert, which keeps operands
    assert after == before


def test_the_addresses_are_each_tensors_data_pointer_as_the_python_way_reads_them(
    native, monkeypatch
):
    import struct

    from tensorferry import _native
    from tensorferry.p2p.copy_engine import one_sided

    base = torch.zeros(64, dtype=torch.float32)
    tensors = (base[3:7], base, torch.ones(2, 2, dtype=torch.bfloat16), base[10:10])
    words = struct.unpack(f"={len(tensors)}Q", native.addresses(tensors))
    assert list(words) == [t.data_ptr() for t in tensors]
    assert words[0] == base.data_ptr() + 12, "a view's address counts its offset"
    assert native.addresses([]) == b"" and native.addresses(list(tensors)) == one_sided._addresses(
        tensors
    )
    monkeypatch.setattr(_native, "helper", lambda: None)  # the route's Python way
    assert one_sided._addresses(tensors) == native.addresses(tensors)
    with pytest.raises(TypeError, match="item 1 is not a tensor"):
        native.addresses([base, 5])
    with pytest.raises(TypeError, match="list or a tuple"):
        native.addresses(base)


def test_the_compiled_check_refuses_wrong_arguments(native):
    with pytest.raises(TypeError, match="inspect_plain"):
        native.inspect_plain([torch.ones(1)], [torch.Tensor], _spec._PLAIN_DTYPES, None)
    with pytest.raises(TypeError, match="list or a tuple"):
        native.inspect_plain(5, _spec._PLAIN_TYPE_TUPLE, _spec._PLAIN_DTYPES, None)
    with pytest.raises(TypeError, match="list or a tuple"):
        native.first_overlap(5)
    with pytest.raises(TypeError, match="item 1 is not a tensor"):
        native.first_overlap([torch.ones(1), 5])
    with pytest.raises(TypeError, match="copy_pieces"):
        native.copy_pieces(1, 2)
    with pytest.raises(TypeError, match="dsts must be a list or a tuple"):
        native.copy_pieces(1, 1, 0, 1, 5, [])
    # No CUDA driver in this process, or not this context: nothing launched, the caller copies.
    t = torch.ones(4)
    assert native.copy_pieces(1, 1, 0, 1, [t], [t]) is False
    with pytest.raises(TypeError, match="send_now"):
        native.send_now(1)
    with pytest.raises(TypeError, match="recv_now"):
        native.recv_now(1, bytearray(4), 2)
    with pytest.raises(BufferError, match="not writable"):
        native.recv_now(1, b"a read-only buffer")


def test_the_side_channel_calls_send_receive_and_report_errors(native):
    import errno
    import socket

    ours, theirs = socket.socketpair()
    with ours, theirs:
        ours.setblocking(False)
        payload = bytes(range(256)) * 3
        assert native.send_now(ours.fileno(), payload) == len(payload)
        assert native.send_now(ours.fileno(), bytearray(b"and more")) == 8
        into = bytearray(1024)
        assert native.recv_now(theirs.fileno(), into) == len(payload) + 8
        assert bytes(into[: len(payload) + 8]) == payload + b"and more"
        assert native.recv_now(ours.fileno(), into) == -errno.EAGAIN  # nothing there: no wait
        theirs.close()
        assert native.recv_now(ours.fileno(), into) == 0  # the end of the stream
        assert native.send_now(ours.fileno(), b"x") == -errno.EPIPE  # and no SIGPIPE
    assert native.send_now(-1, b"x") == -errno.EBADF


def _address(fn):
    """The address of the C function pointer ``fn`` (a ctypes function or callback)."""
    import ctypes

    return ctypes.cast(fn, ctypes.c_void_p).value


def _entry_point(signature, fn):
    """A C function pointer to the Python function ``fn`` (kept alive by the caller), standing
    in for a CUDA entry point."""
    import ctypes

    return ctypes.CFUNCTYPE(ctypes.c_int, *signature)(fn)


def test_the_event_calls_pass_their_arguments_in_order_and_return_the_code(native):
    import ctypes

    seen = []
    record = _entry_point((ctypes.c_void_p, ctypes.c_void_p), lambda *a: seen.append(a) or 7)
    wait = _entry_point(
        (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint), lambda *a: seen.append(a) or 0
    )
    query = _entry_point((ctypes.c_void_p,), lambda *a: seen.append(a) or 600)
    assert native.record_event(_address(record), 0x1000, 0x2000) == 7  # (event, stream)
    assert native.wait_event(_address(wait), 0x3000, 0x4000, 0) == 0  # (stream, event, flags)
    assert native.query(_address(query), 0x5000) == 600  # (event or stream)
    assert seen == [(0x1000, 0x2000), (0x3000, 0x4000, 0), (0x5000,)]
    with pytest.raises(TypeError, match=r"record_event\(record, event, stream\)"):
        native.record_event(_address(record), 1)
    with pytest.raises(TypeError, match=r"wait_event\(wait, stream, event, flags\)"):
        native.wait_event(_address(wait), 1, 2)
    with pytest.raises(TypeError, match=r"query\(entry, handle\)"):
        native.query(_address(query))
    with pytest.raises(ValueError, match="null entry point"):
        native.query(0, 1)
    with pytest.raises(TypeError):
        native.record_event(_address(record), "not an address", 1)
    assert len(seen) == 3, "nothing was called after a refused argument"


def test_nccl_async_errors_read_alike_through_the_helper_and_through_ctypes(native, monkeypatch):
    """``NcclLibrary.async_error`` with a stand-in ``ncclCommGetAsyncError``: the compiled
    poll and the ctypes one name the same errors, and find none where there is none."""
    import ctypes

    from tensorferry.p2p import _nccl_lib

    answers = {}  # comm -> (the call's code, the async result it writes)

    def get_async_error(comm, out):
        code, result = answers[comm]
        out[0] = result
        return code

    entry = _entry_point((ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)), get_async_error)
    entry.argtypes = (ctypes.c_void_p, ctypes.POINTER(ctypes.c_int))
    texts = {3: b"internal error", 5: b"invalid usage", 6: b"remote error"}
    lib = _nccl_lib.NcclLibrary.__new__(_nccl_lib.NcclLibrary)
    lib._async_error = entry
    lib._async_error_entry = _address(entry)
    lib._error_string = lambda code: texts.get(code)
    answers.update({0x10: (0, 0), 0x20: (0, 7), 0x30: (0, 6), 0x40: (5, 0)})
    expected = {
        0x10: None,  # nothing went wrong
        0x20: None,  # ncclInProgress: still running, not an error
        0x30: "remote error (code 6)",
        0x40: "invalid usage (code 5)",  # the call itself failed
    }
    for use_helper in (True, False):
        monkeypatch.setattr(_native, "_loaded", native if use_helper else None)
        got = {comm: lib.async_error(comm) for comm in answers}
        assert got == expected, ("compiled" if use_helper else "ctypes", got)
    with pytest.raises(TypeError, match=r"nccl_async_error\(entry, comm\)"):
        native.nccl_async_error(lib._async_error_entry)


def test_nccl_moves_alone_alike_through_the_helper_and_through_ctypes(native, monkeypatch):
    """``NcclLibrary.move_alone`` with stand-in ``ncclSend``/``ncclRecv``: the compiled call and
    the ctypes ones pass the same arguments, keep or let go of the GIL alike (both answer),
    and a failed call raises ``NcclError`` naming it, either way."""
    import ctypes

    from tensorferry.p2p import _nccl_lib

    seen = []
    codes = {"send": 0, "recv": 0}
    signature = (
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
    )

    def stand_in(kind):
        def move(*args):
            seen.append((kind, *args))
            return codes[kind]

        fn = _entry_point(signature, move)
        fn.argtypes = signature
        return fn

    send, recv = stand_in("send"), stand_in("recv")
    lib = _nccl_lib.NcclLibrary.__new__(_nccl_lib.NcclLibrary)
    lib._send = lib._send_alone = send
    lib._recv = lib._recv_alone = recv
    lib.alone_entries = {"send": _address(send), "recv": _address(recv)}
    lib._error_string = lambda code: b"unhandled cuda error"
    for use_helper in (True, False):
        monkeypatch.setattr(_native, "_loaded", native if use_helper else None)
        seen.clear()
        for hold in (True, False):
            lib.move_alone("send", 0x1000, 4096, 1, 0x2000, 0x3000, hold)
            lib.move_alone("recv", 0x4000, 64, 0, 0x5000, 0x6000, hold)
        uint8 = _nccl_lib.UINT8
        sent = ("send", 0x1000, 4096, uint8, 1, 0x2000, 0x3000)
        received = ("recv", 0x4000, 64, uint8, 0, 0x5000, 0x6000)
        assert seen == [sent, received] * 2, ("compiled" if use_helper else "ctypes", seen)
        codes["send"] = 1
        with pytest.raises(_nccl_lib.NcclError, match=r"ncclSend failed: unhandled cuda error"):
            lib.move_alone("send", 0x1000, 4096, 1, 0x2000, 0x3000, True)
        codes["send"] = 0
    with pytest.raises(TypeError, match=r"nccl_move\(move, buffer, nbytes"):
        native.nccl_move(lib.alone_entries["send"], 1, 2)
    with pytest.raises(ValueError, match="null entry point or a negative size"):
        native.nccl_move(0, 1, 2, 0, 1, 2, 3, True)
    with pytest.raises(ValueError, match="null entry point or a negative size"):
        native.nccl_move(lib.alone_entries["send"], 1, -2, 0, 1, 2, 3, True)


def test_the_event_module_takes_the_compiled_calls_through_the_same_entry_points(
    native, monkeypatch
):
    import ctypes

    from tensorferry.runtime import _events

    seen = []
    pointer = (ctypes.c_void_p,)
    calls = _events._Runtime(
        _entry_point(pointer * 2, lambda *a: seen.append(("record", *a)) or 0),
        _entry_point((*pointer * 2, ctypes.c_uint), lambda *a: seen.append(("wait", *a)) or 0),
        _entry_point(pointer, lambda *a: seen.append(("query", *a)) or 600),
        _entry_point(pointer, lambda *a: seen.append(("query_stream", *a)) or 0),
        _entry_point((), lambda: 0),
    )
    for fn, argtypes in zip(
        calls, (pointer * 2, (*pointer * 2, ctypes.c_uint), pointer, pointer, ()), strict=True
    ):
        fn.argtypes = argtypes
    monkeypatch.setattr(_events, "_calls", calls)
    monkeypatch.setattr(_events, "_ctypes_calls", calls)
    monkeypatch.setattr(_events, "_calls_checked", True)
    monkeypatch.setattr(_events, "_entry_points", None)
    monkeypatch.setattr(_events, "_why_torch", None)
    points = _events.entry_points()
    _events._use_compiled(native)
    swapped = _events._calls
    assert swapped is not calls and swapped.clear is calls.clear
    assert swapped.record(11, 12) == 0 and swapped.wait(13, 14, 0) == 0
    assert swapped.query(15) == 600 and swapped.query_stream(16) == 0
    assert seen == [("record", 11, 12), ("wait", 13, 14, 0), ("query", 15), ("query_stream", 16)]
    assert _events.entry_points() == points, "a compiled caller still gets the CUDA calls"
    _events._use_compiled(native)
    assert _events._calls is swapped, "swapped once"
    monkeypatch.setattr(_events, "_calls", calls)
    _events.give_up_calls("cudaEventRecord failed (1)")
    _events._use_compiled(native)
    assert _events._calls is None, "given up: torch's calls for good"
    other = calls._replace(clear=_entry_point((), lambda: 0))
    monkeypatch.setattr(_events, "_calls", other)  # not the calls the check passed
    _events._use_compiled(native)
    assert _events._calls is other


def test_load_callbacks_run_once_now_or_when_the_helper_loads(monkeypatch, tmp_path, caplog):
    from types import ModuleType

    module = ModuleType("stand_in")
    got = []
    monkeypatch.setattr(_native, "_loaded", None)
    monkeypatch.setattr(_native, "_problem", None)
    monkeypatch.setattr(_native, "_on_load", [])
    _native.when_loaded(lambda m: got.append(("early", m)))
    _native.when_loaded(lambda m: 1 / 0)  # logged; the others still run
    assert got == []
    built = tmp_path / "built.so"
    built.touch()
    monkeypatch.setattr(_native, "_built_path", lambda: built)
    monkeypatch.setattr(_native, "_import", lambda path: module)
    _native._load_or_build()
    assert _native.helper() is module
    _native.when_loaded(lambda m: got.append(("late", m)))
    assert got == [("early", module), ("late", module)]
    assert _native._on_load == []
    assert "load callback failed" in caplog.text


# ---------------------------------------------------------------- building and turning it off
@pytest.fixture
def fresh_state(monkeypatch, tmp_path):
    """The module as in a process that has not started it, building into ``tmp_path``."""
    monkeypatch.setattr(_native, "_loaded", None)
    monkeypatch.setattr(_native, "_thread", None)
    monkeypatch.setattr(_native, "_problem", None)
    monkeypatch.setenv("TENSORFERRY_NATIVE_DIR", str(tmp_path))
    monkeypatch.delenv("TENSORFERRY_NATIVE", raising=False)
    return tmp_path


def test_a_failed_build_leaves_the_python_path_and_is_not_retried(fresh_state, monkeypatch):
    monkeypatch.setenv("CXX", "false")  # a compiler that fails
    _native.start()
    assert _native.wait(timeout=60) is None
    assert _native.helper() is None
    status = _native.status()
    assert status.startswith("not available: the build failed"), status
    assert list(fresh_state.glob("*.failed"))
    # Another process of this host (this one, started afresh) does not try again.
    monkeypatch.setattr(_native, "_thread", None)
    monkeypatch.setattr(_native, "_problem", None)
    _native.start()
    _native.wait(timeout=60)
    assert "an earlier build failed" in _native.status()
    items = [torch.randn(3)]
    _spec._inspect(items, CPU, "tensors")  # float32 known, as after any message
    assert _spec._inspect_plain(items, CPU, "tensors")[1] == (("float32", (3,)),)


def test_a_missing_compiler_is_named(fresh_state, monkeypatch):
    monkeypatch.setenv("CXX", str(fresh_state / "no-such-compiler"))
    _native.start()
    _native.wait(timeout=60)
    assert "the compiler did not run" in _native.status()
    assert not list(fresh_state.glob("*.so"))


def test_a_build_outlives_a_program_that_exits_first(fresh_state):
    """A short program (one that exits while the compiler runs) leaves the build to finish:
    the next process loads it rather than compiling again."""
    import subprocess
    import textwrap
    import time

    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler on this machine")
    program = textwrap.dedent(
        """
        import time
        from tensorferry import _native
        _native.start()  # builds in the background
        time.sleep(3)  # the builder has started; the compiler takes longer than this
        assert _native.helper() is None
        """
    )
    subprocess.run([sys.executable, "-c", program], check=True, timeout=120)
    deadline = time.monotonic() + 200
    while not list(fresh_state.glob("*.so")) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert list(fresh_state.glob("*.so")), list(fresh_state.iterdir())
    assert not list(fresh_state.glob("*.tmp*"))  # renamed into place, nothing left behind
    _native.start()
    assert _native.wait(timeout=60) is not None, _native.status()


def test_the_helper_can_be_turned_off(fresh_state, monkeypatch):
    monkeypatch.setenv("TENSORFERRY_NATIVE", "0")
    _native.start()
    assert _native.helper() is None and _native._thread is None
    assert _native.status() == "off (TENSORFERRY_NATIVE=0)"
    monkeypatch.setenv("TENSORFERRY_NATIVE", "sometimes")
    with pytest.raises(ValueError, match="TENSORFERRY_NATIVE='sometimes'"):
        _native.start()


# ---------------------------------------------------------------- the piece copy's status
@pytest.fixture
def no_kernels(monkeypatch):
    from tensorferry.p2p import _piece_copy

    monkeypatch.setattr(_piece_copy, "_kernels", {})
    monkeypatch.setattr(_piece_copy, "_problems", {})
    return _piece_copy


def test_the_piece_copy_says_why_without_the_compiled_helper(no_kernels, monkeypatch):
    monkeypatch.setattr(_native, "wait", lambda timeout=None: None)
    monkeypatch.setattr(_native, "status", lambda: "off (TENSORFERRY_NATIVE=0)")
    assert no_kernels.status(0) == (
        "torch's _foreach_copy_: the compiled helper is not loaded: off (TENSORFERRY_NATIVE=0)"
    )


def test_the_piece_copy_says_why_it_was_not_compiled_ahead(no_kernels, monkeypatch):
    def no_context(index):
        raise RuntimeError(f"cuDeviceGet failed for {index}")

    monkeypatch.setattr(_native, "wait", lambda timeout=None: object())
    monkeypatch.setattr(no_kernels, "_bind_primary_context", no_context)
    assert no_kernels.status(3) == (
        "torch's _foreach_copy_: not compiled ahead (cuDeviceGet failed for 3): compiled at "
        "first use"
    )
    assert 3 not in no_kernels._kernels, "the first packed message still tries to compile it"


def test_the_piece_copy_says_why_the_kernel_did_not_compile(no_kernels, monkeypatch):
    def no_nvrtc(source, name):
        raise RuntimeError("NVRTC is missing")

    monkeypatch.setattr(_native, "wait", lambda timeout=None: object())
    monkeypatch.setattr(no_kernels, "_bind_primary_context", lambda index: None)
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "_compile_kernel", no_nvrtc, raising=False)
    assert no_kernels.status(0) == (
        "torch's _foreach_copy_: the kernel did not compile: NVRTC is missing"
    )
    assert no_kernels._kernels == {0: None}, "not tried again: torch's copy from now on"


# ---------------------------------------------------------------- the piece copy (CUDA)
@pytest.fixture
def piece_kernel(native):
    from tensorferry.p2p import _piece_copy

    device = torch.cuda.current_device()
    kernel = _piece_copy._make_kernel(device)
    assert kernel is not None, "the piece copy kernel did not compile (see the log)"
    return kernel


def _pieces(device, count, seed):
    """``count`` source pieces of 1 byte to 64 KiB, some at addresses not 16-byte aligned, and
    poisoned targets of the same sizes (some views of one buffer at odd offsets)."""
    gen = torch.Generator().manual_seed(seed)
    sizes = [int(s) for s in torch.randint(1, 64 << 10, (count,), generator=gen)]
    sizes[:4] = [1, 15, 16, 4096]
    data = torch.randint(0, 256, (sum(sizes) + count,), dtype=torch.uint8, generator=gen)
    data = data.to(device)
    srcs, offset = [], 0
    for i, size in enumerate(sizes):
        offset += i % 2  # every other piece one byte further: not 16-byte aligned
        srcs.append(data[offset : offset + size])
        offset += size
    targets = torch.full((sum(sizes) + 3 * count,), 0xAB, dtype=torch.uint8, device=device)
    dsts, offset = [], 0
    for i, size in enumerate(sizes):
        if i % 3 == 0:
            dsts.append(torch.full((size,), 0xCD, dtype=torch.uint8, device=device))
        else:
            offset += i % 5
            dsts.append(targets[offset : offset + size])
            offset += size
    return srcs, dsts


@pytest.mark.gpu
@pytest.mark.parametrize("count", [2, 128, 300])  # 300: three launches
def test_pieces_copied_by_one_kernel_arrive_byte_for_byte(native, piece_kernel, count):
    device = torch.device("cuda", torch.cuda.current_device())
    srcs, dsts = _pieces(device, count, seed=count)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    versions = [t._version for t in dsts]
    assert native.copy_pieces(*piece_kernel, stream.cuda_stream, dsts, srcs) is True
    stream.synchronize()
    for i, (dst, src) in enumerate(zip(dsts, srcs, strict=True)):
        assert torch.equal(dst, src), f"piece {i} of {src.numel()} bytes"
    assert all(t._version > v for t, v in zip(dsts, versions, strict=True))


@pytest.mark.gpu
def test_the_kernel_compiled_ahead_on_a_thread_of_its_own_launches(native, monkeypatch):
    # tf.init compiles it on a new thread, which has no CUDA context of its own; on device 0
    # torch.cuda.device(0) gives it none either, and the kernel was silently never used.
    from tensorferry.p2p import _piece_copy

    device = torch.cuda.current_device()
    monkeypatch.setattr(_piece_copy, "_kernels", {})
    _piece_copy.prepare(device)
    deadline = time.monotonic() + 60
    while device not in _piece_copy._kernels:
        assert time.monotonic() < deadline, "the kernel was not compiled within 60 s"
        time.sleep(0.01)
    kernel = _piece_copy._kernels[device]
    assert kernel is not None, "compiling the kernel ahead failed (see the log)"
    srcs, dsts = _pieces(torch.device("cuda", device), 16, seed=5)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    assert native.copy_pieces(*kernel, stream.cuda_stream, dsts, srcs) is True
    stream.synchronize()
    for dst, src in zip(dsts, srcs, strict=True):
        assert torch.equal(dst, src)


@pytest.mark.gpu
def test_the_piece_copy_writes_typed_and_inference_tensors(native, piece_kernel):
    from tensorferry.p2p import _piece_copy

    device = torch.device("cuda", torch.cuda.current_device())
    srcs = [torch.randn(1000, device=device), torch.randn(3, 5, device=device).bfloat16()]
    with torch.inference_mode():  # written outside inference mode: refused to torch's copy_
        dsts = [
            torch.full((1000,), float("nan"), device=device),
            torch.zeros(3, 5, device=device, dtype=torch.bfloat16),
        ]
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    _piece_copy.copy(dsts, srcs, stream)
    stream.synchronize()
    for dst, src in zip(dsts, srcs, strict=True):
        assert torch.equal(dst.view(torch.uint8), src.view(torch.uint8))


@pytest.mark.gpu
def test_the_piece_copy_launches_nothing_it_cannot_launch_right(native, piece_kernel):
    device = torch.device("cuda", torch.cuda.current_device())
    srcs, dsts = _pieces(device, 8, seed=3)
    before = [t.clone() for t in dsts]
    function, context, index = piece_kernel
    stream = torch.cuda.current_stream(device).cuda_stream
    grid = torch.full((6, 4), 7.0, device=device)
    refusals = {
        "another context": (function, context + 8, index, stream, dsts, srcs),
        "another device": (function, context, index + 1, stream, dsts, srcs),
        "no kernel": (0, context, index, stream, dsts, srcs),
        "lengths differ": (function, context, index, stream, dsts, srcs[:-1]),
        "sizes differ": (function, context, index, stream, [dsts[0]], [srcs[1]]),
        "a CPU tensor": (function, context, index, stream, [dsts[0].cpu()], [srcs[0]]),
        "not contiguous": (
            function,
            context,
            index,
            stream,
            [grid],
            [torch.randn(4, 6, device=device).t()],
        ),
    }
    for name, args in refusals.items():
        assert native.copy_pieces(*args) is False, name
    torch.cuda.synchronize()
    for got, want in zip(dsts, before, strict=True):
        assert torch.equal(got, want)
    assert torch.equal(grid, torch.full((6, 4), 7.0, device=device))


# ---------------------------------------------------------------- whole messages, both paths
def _many_tensors_round_trip(rank: int, world: int, python: bool) -> int:
    """Rank 0 sends messages of many tensors (mixed dtypes, two layouts, then static ones)
    and rank 1 checks every byte; the same path on both ranks."""
    import tensorferry.p2p as tf

    assert (_native.wait() is None) is python, _native.status()
    gen = torch.Generator().manual_seed(21)
    # Before a static channel is agreed, each message may have a layout of its own.
    layouts = [
        [(64,)] * 40 + [(3, 5), (0,), (7,)],
        [(64,)] * 39 + [(2, 2), (3, 5), (0,), (7,)],
    ]
    checked = 0
    for round_ in range(6):
        shapes = layouts[min(round_, 1)]
        static = round_ >= 2
        want = [
            (torch.randn(s, generator=gen) * 100).to(torch.int32 if i % 7 == 3 else torch.float32)
            for i, s in enumerate(shapes)
        ]
        if rank == 0:
            tf.send(want, 1, static=static).wait(timeout=30)
        else:
            got = [torch.full_like(t, -9) for t in want]  # poisoned
            tf.recv(got, 0, static=static).wait(timeout=30)
            for g, w in zip(got, want, strict=True):
                assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))
                checked += 1
    return checked


@pytest.mark.parametrize("mode", ["0", "wait"])
def test_messages_of_many_tensors_arrive_whole_on_either_path(mode, monkeypatch):
    from tensorferry.p2p._launch import run_world

    if mode == "wait" and shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler on this machine")
    monkeypatch.setenv("TENSORFERRY_NATIVE", mode)
    results = run_world(_many_tensors_round_trip, mode == "0", backend="gloo", timeout=60)
    assert results == [0, 6 * 43]
