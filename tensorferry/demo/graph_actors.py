"""The graph demo's actors: senders produce tensors from known seeds, one receiver multiplies
each by a fixed weight. The driver recomputes every result from the same seeds to check it.

Module-level classes, so that an actor process imports them by name.
"""

from __future__ import annotations

import torch

__all__ = ["DemoSender", "DemoReceiver", "demo_data", "demo_weight", "expected_result", "check"]


def demo_data(
    seed: int, step: int, size: int, dtype: torch.dtype, device: str = "cpu"
) -> torch.Tensor:
    """The ``size x size`` tensor of branch ``seed`` at execution ``step``.

    Generated where it is used (a 10000 x 10000 randn on the host takes seconds); the same seed
    on the same kind of device gives the same numbers, so the driver can recompute it.
    """
    generator = torch.Generator(device=device).manual_seed(seed * 100_003 + step)
    return torch.randn(size, size, generator=generator, device=device).to(dtype)


def demo_weight(size: int, dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    """The receiver's fixed weight, scaled so that products keep the inputs' magnitude."""
    generator = torch.Generator(device=device).manual_seed(7)
    return (torch.randn(size, size, generator=generator, device=device) / size**0.5).to(dtype)


class DemoSender:
    """Produces one ``size x size`` tensor per branch per execution, from a known seed."""

    def __init__(self, size: int, dtype: torch.dtype, device: str) -> None:
        self.size, self.dtype, self.device = size, dtype, torch.device(device)

    def produce(self, step: int, branch: int) -> torch.Tensor:
        return demo_data(branch, step, self.size, self.dtype, str(self.device))


class DemoReceiver:
    """Multiplies each tensor it receives by a fixed weight; returns the column sums."""

    def __init__(self, size: int, dtype: torch.dtype, device: str) -> None:
        self.device = torch.device(device)
        self.weight = demo_weight(size, dtype, device)

    def consume(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.weight).float().sum(dim=0)


def expected_result(
    step: int, branch: int, size: int, dtype: torch.dtype, device: str = "cpu"
) -> torch.Tensor:
    """What ``consume(produce(step, branch))`` must return, recomputed by the driver.

    On the host in float64; for GPU data (``device`` a CUDA device of the same kind as the
    sender's) in float32 on that device.
    """
    wide = torch.float64 if device == "cpu" else torch.float32
    x = demo_data(branch, step, size, dtype, device).to(wide)
    return (x @ demo_weight(size, dtype, device).to(wide)).sum(dim=0).double().cpu()


def check(results: list, step: int, size: int, dtype: torch.dtype, device: str = "cpu") -> None:
    """Raises ``AssertionError`` unless every branch's result of execution ``step`` matches the
    reference within the dtype's tolerance."""
    for branch, got in enumerate(results):
        want = expected_result(step, branch, size, dtype, device)
        tolerance = 1e-3 if dtype == torch.float32 else 3e-2
        scale = want.abs().max().item() + 1.0
        error = (got.double().cpu() - want).abs().max().item() / scale
        if error > tolerance:
            raise AssertionError(
                f"step {step} branch {branch}: result differs from the reference "
                f"(relative error {error:.2e} > {tolerance:.0e})"
            )
