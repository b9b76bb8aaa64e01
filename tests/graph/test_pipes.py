"""What direct calls and ``spawn`` hand over (``graph._pipes``), in one process: pickled as the
pipe pickles it, then loaded."""

from __future__ import annotations

import os
import pickle
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
from channel_values import every_raw_dtype, same_bytes

from tensorferry.graph._pipes import _INLINE_MAX, _private_tensor, pipe_message


def _through_pipe(value):
    return pickle.loads(ForkingPickler.dumps(pipe_message(value)))


def _descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("numel", [3, _INLINE_MAX // 4 + 1000])  # inside the message, and not
def test_a_tensor_arrives_as_a_copy_holding_no_descriptor(numel):
    _through_pipe(torch.randn(numel))  # (the first one opens multiprocessing's fd sharer)
    sent = torch.randn(numel)
    before = _descriptors()
    kept = [_through_pipe(sent) for _ in range(20)]
    assert _descriptors() <= before  # none held while the copies live (others may close)
    got = kept[0]
    assert torch.equal(got, sent) and got.data_ptr() != sent.data_ptr()
    assert not sent.is_shared()  # the sender's own tensor was not moved into shared memory
    sent.add_(1.0)
    got.mul_(2.0)
    assert not torch.equal(got, sent) and not torch.equal(got / 2.0, sent)


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")  # torch, repeating
@pytest.mark.parametrize("repeat", [1, 40_000])  # every dtype small, and past _INLINE_MAX
def test_every_dtype_arrives_bit_for_bit(repeat):
    tensors = [t.repeat(repeat) if t.dim() else t for t in every_raw_dtype()]
    got = _through_pipe(tensors)
    assert all(same_bytes(g, t) for g, t in zip(got, tensors, strict=True))


def test_what_makes_a_weight_a_weight_comes_along():
    param = torch.nn.Parameter(torch.randn(_INLINE_MAX // 4 + 1))
    small = torch.randn(3, requires_grad=True)
    got = _through_pipe({"param": param, "small": small, "twice": [small, small]})
    assert type(got["param"]) is torch.nn.Parameter and got["param"].requires_grad
    assert got["small"].requires_grad and got["small"].is_leaf
    assert got["twice"][0] is got["twice"][1]  # one tensor listed twice stays one
    assert torch.equal(got["param"], param) and torch.equal(got["small"], small)


def test_a_tensor_not_in_shared_memory_is_copied_out():
    # What the receiver does where it cannot map the memory again.
    tensor = torch.randn(5, 4)
    data = tensor.view(-1).view(torch.uint8)
    got = _private_tensor(data, tensor.dtype, (5, 4), False, False)
    assert torch.equal(got, tensor) and got.data_ptr() != tensor.data_ptr()
