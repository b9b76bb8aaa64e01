"""Importing tensorferry asks CUDA for all 32 hardware queues, unless the user chose a count or
CUDA already runs (then the count is what the context has)."""

import os
import subprocess
import sys

import pytest
import torch

from tensorferry.runtime import _hardware_queues as hq


def _after_import(env_value: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "CUDA_DEVICE_MAX_CONNECTIONS"}
    if env_value is not None:
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = env_value
    code = (
        "import os, tensorferry; from tensorferry.runtime._hardware_queues import "
        "hardware_queues; print(os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS'), "
        "hardware_queues())"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_import_asks_for_32_queues_when_unset():
    assert _after_import(None) == "32 32"


def test_a_count_the_user_set_stands():
    assert _after_import("1") == "1 1"


def test_too_late_once_cuda_is_initialised(monkeypatch):
    monkeypatch.setattr(hq, "_decided", None)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    hq.widen_hardware_queues()
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in os.environ
    assert hq.hardware_queues() == 8  # CUDA's default: the context was made without the variable
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32")  # setting it later changes nothing
    assert hq.hardware_queues() == 8


@pytest.mark.parametrize("raw", ["", "many"])
def test_unreadable_values_mean_cudas_default(monkeypatch, raw):
    monkeypatch.setattr(hq, "_decided", None)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", raw)
    assert hq.hardware_queues() == 8
