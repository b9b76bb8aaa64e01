"""Test tiers: CPU tests always run; ``gpu``/``multigpu`` tests skip without enough CUDA devices."""

from __future__ import annotations

import pytest
import torch


def _cuda_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_sessionstart(session: pytest.Session) -> None:
    """Builds (or loads) the compiled helpers before any test runs: every rank a test starts
    then loads them from the cache, and no compiler competes for the CPU with timed tests.
    ``TENSORFERRY_NATIVE=0`` runs the whole tier on the Python path."""
    from tensorferry import _native

    _native.start()
    _native.wait(timeout=600)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    count = _cuda_count()
    for item in items:
        if "multigpu" in item.keywords and count < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs 2 CUDA devices, found {count}"))
        elif "gpu" in item.keywords and count < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
