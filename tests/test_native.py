"""The compiled validation loop (``tensorferry/_native``): the same answers as the Python loop,
no references leaked, and a build that fails or is turned off leaves the Python path."""

from __future__ import annotations

import gc
import shutil
import sys
import tracemalloc

import pytest
import torch

from tensorferry import _native
from tensorferry.p2p import _spec
from tensorferry.p2p._spec import TensorSpec, descriptor_from_text, descriptor_text

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def native():
    """The helper, built (or loaded from the cache) before the tests that need it."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler on this machine")
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


def test_a_tensor_listed_twice_is_found_wherever_it_is(native):
    tensors = [torch.randn(2) for _ in range(40)]
    assert native.listed_once(tensors) and native.listed_once(tuple(tensors))
    assert native.listed_once([]) and native.listed_once(tensors[:1])
    for first, second in ((0, 1), (0, 39), (17, 23), (38, 39)):
        listed = list(tensors)
        listed[second] = listed[first]
        assert not native.listed_once(listed), (first, second)
    before = sys.getrefcount(tensors[0])
    for _ in range(1000):
        native.listed_once(tensors)
    after = sys.getrefcount(tensors[0])  # read outside the assert, which keeps operands
    assert after == before


def test_the_compiled_check_refuses_wrong_arguments(native):
    with pytest.raises(TypeError, match="inspect_plain"):
        native.inspect_plain([torch.ones(1)], [torch.Tensor], _spec._PLAIN_DTYPES, None)
    with pytest.raises(TypeError, match="list or a tuple"):
        native.inspect_plain(5, _spec._PLAIN_TYPE_TUPLE, _spec._PLAIN_DTYPES, None)
    with pytest.raises(TypeError, match="list or a tuple"):
        native.listed_once(5)


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
    assert status.startswith("not available: the compiler failed"), status
    assert list(fresh_state.glob("*.failed"))
    # Another process of this host (this one, started afresh) does not try again.
    monkeypatch.setattr(_native, "_thread", None)
    monkeypatch.setattr(_native, "_problem", None)
    _native.start()
    _native.wait(timeout=60)
    assert "an earlier build failed" in _native.status()
    items = [torch.randn(3)]
    assert _spec._inspect_plain(items, CPU, "tensors")[1] == (("float32", (3,)),)


def test_a_missing_compiler_is_named(fresh_state, monkeypatch):
    monkeypatch.setenv("CXX", str(fresh_state / "no-such-compiler"))
    _native.start()
    _native.wait(timeout=60)
    assert "the compiler did not run" in _native.status()
    assert not list(fresh_state.glob("*.so"))


def test_the_helper_can_be_turned_off(fresh_state, monkeypatch):
    monkeypatch.setenv("TENSORFERRY_NATIVE", "0")
    _native.start()
    assert _native.helper() is None and _native._thread is None
    assert _native.status() == "off (TENSORFERRY_NATIVE=0)"
    monkeypatch.setenv("TENSORFERRY_NATIVE", "sometimes")
    with pytest.raises(ValueError, match="TENSORFERRY_NATIVE='sometimes'"):
        _native.start()
