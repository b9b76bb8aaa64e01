"""What a benchmark asks of this machine's GPUs, checked before any process starts.

A benchmark that spawns ranks or actors and only then finds no GPU for them fails in each
process, with a traceback per rank; these checks make that one line, naming the flag.
"""

from __future__ import annotations

from collections.abc import Iterable

from tensorferry.runtime._devices import cuda_device_count

__all__ = [
    "cuda_device_count",
    "on_two_gpus",
    "require_cuda_devices",
    "require_transports_for",
]


def on_two_gpus(device: str, *, check: bool = True) -> bool:
    """Whether ``--device device`` runs on GPUs 0 and 1. With ``check``, raises ``SystemExit``
    where it does and this machine has fewer than two."""
    use_cuda = device == "cuda" or (device == "auto" and cuda_device_count() >= 2)
    if use_cuda and check:
        require_cuda_devices(2, "--device cuda")
    return use_cuda


def require_cuda_devices(count: int, what: str) -> None:
    """Raises ``SystemExit`` naming ``what`` unless this machine has ``count`` CUDA devices."""
    have = cuda_device_count()
    if have < count:
        raise SystemExit(f"{what} needs {count} CUDA devices; this machine has {have}")


def require_transports_for(device_type: str, names: Iterable[str], flag: str) -> None:
    """Raises ``SystemExit`` when one of ``names`` (p2p transports; ``auto`` always passes)
    cannot move ``device_type`` tensors, the kind this run uses (an unknown name fails later,
    in the ranks, with the layer's own error)."""
    moves_of = {"ce": "cuda", "gloo": "cpu", "nccl": "cuda", "nvlink": "cuda"}
    for name in names:
        moves = moves_of.get(name)
        if moves is not None and moves != device_type:
            raise SystemExit(
                f"{flag}: {name} moves {moves.upper()} tensors, and this run's are "
                f"{device_type.upper()} tensors ({cuda_device_count()} CUDA devices here)"
            )
