"""Two-rank GPU checks: launches ``_worker.py`` under torchrun and checks exit code + verdict."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("_worker.py")


def _run(*parts: str, timeout: float = 280) -> None:
    env = dict(os.environ)
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    env.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    env.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(WORKER),
        *parts,
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    assert "VERDICT: PASS" in output, output[-6000:]


@pytest.mark.multigpu
def test_nvlink_kernels() -> None:
    _run("nvlink")


@pytest.mark.multigpu
def test_nvlink_mismatch() -> None:
    _run("mismatch")


@pytest.mark.multigpu
def test_copy_engine() -> None:
    _run("ce")
