"""``on_stream``: the stream and device it sets, and what it restores (torch's CUDA calls faked,
so this runs without a GPU; the GPU tiers run it for real inside the graph and p2p layers)."""

from types import SimpleNamespace

import pytest
import torch

from tensorferry.runtime._stream_switch import on_stream


class FakeCuda:
    """Per-device current streams and a current device, as torch's C API keeps them."""

    def __init__(self) -> None:
        self.device = 0
        self.current = {0: 100, 1: 200}  # device -> current stream id
        self.calls: list[tuple] = []

    def get_device(self) -> int:
        return self.device

    def get_current_stream(self, index: int) -> tuple[int, int, int]:
        return (self.current[index], index, 1)

    def set_stream(self, *, stream_id: int, device_index: int, device_type: int) -> None:
        self.calls.append(("set_stream", stream_id, device_index))
        self.device = device_index  # torch makes the stream's device current too
        self.current[device_index] = stream_id

    def set_device(self, index: int) -> None:
        self.calls.append(("set_device", index))
        self.device = index


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    fake = FakeCuda()
    monkeypatch.setattr(torch._C, "_cuda_getDevice", fake.get_device, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentStream", fake.get_current_stream, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_setStream", fake.set_stream, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_setDevice", fake.set_device, raising=False)
    return fake


def stream(stream_id: int, device: int) -> SimpleNamespace:
    return SimpleNamespace(stream_id=stream_id, device_index=device, device_type=1)


def test_the_stream_is_current_inside_and_the_previous_one_after(cuda: FakeCuda) -> None:
    with on_stream(stream(7, 0)):
        assert cuda.current[0] == 7 and cuda.device == 0
    assert cuda.current == {0: 100, 1: 200}
    assert cuda.device == 0
    assert ("set_device", 0) not in cuda.calls  # same device: no device switch


def test_a_stream_of_another_device_switches_the_device_and_back(cuda: FakeCuda) -> None:
    with on_stream(stream(9, 1)):
        assert cuda.device == 1 and cuda.current[1] == 9
        assert cuda.current[0] == 100  # the other device's stream is untouched
    assert cuda.current == {0: 100, 1: 200}
    assert cuda.device == 0


def test_restored_when_the_block_raises(cuda: FakeCuda) -> None:
    with pytest.raises(ValueError, match="inside"), on_stream(stream(9, 1)):
        raise ValueError("inside")
    assert cuda.current == {0: 100, 1: 200}
    assert cuda.device == 0


def test_nested_blocks_unwind_in_order(cuda: FakeCuda) -> None:
    with on_stream(stream(7, 0)):
        with on_stream(stream(8, 0)):
            assert cuda.current[0] == 8
        assert cuda.current[0] == 7
    assert cuda.current[0] == 100
