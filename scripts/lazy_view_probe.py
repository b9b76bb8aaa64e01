"""What a conjugate or a negative view turns into over ``tf.send`` (two ranks, NCCL).

``x.conj()`` keeps ``x``'s memory and a flag; so does ``x.conj().imag`` (a negative one).
Rank 0 sends both, one message each; rank 1 receives into plain tensors and says what arrived:
the values, the memory under the view (wrong), or zeros, which rank 0 sends instead when
``tf.send`` refuses the view. Run from the tree to probe (its directory goes first on the path):

    python3 -m torch.distributed.run --standalone --nproc-per-node 2 scripts/lazy_view_probe.py
"""

import torch

import tensorferry as tf
from tensorferry.p2p import _context


def _name(got: torch.Tensor, values: torch.Tensor, memory: torch.Tensor) -> str:
    if torch.equal(got, values):
        return "its values"
    if torch.equal(got, memory):
        return "the memory under the view (WRONG)"
    return "zeros (refused)" if not got.any() else "something else (WRONG)"


def main() -> None:
    tf.init("nccl")
    ctx = _context.current()
    torch.manual_seed(0)
    x = torch.randn(8, dtype=torch.complex64, device=ctx.device)
    views = {
        "conjugate view x.conj()": (x.conj(), x),
        "negative view x[:1].conj().imag": (x[:1].conj().imag, x[:1].imag),
    }
    for name, (view, memory) in views.items():
        values = view.resolve_conj().resolve_neg()
        if ctx.rank == 0:
            try:
                tf.send(view, 1).wait(30)
            except ValueError as exc:
                print(f"rank 0: {name} refused: {exc}", flush=True)
                tf.send(torch.zeros_like(values), 1).wait(30)
        else:
            got = torch.empty_like(values)
            tf.recv(got, 0).wait(30)
            print(f"rank 1: {name} arrived as {_name(got, values, memory)}", flush=True)
    tf.shutdown()


if __name__ == "__main__":
    main()
