"""Two ranks agreeing, over their pair's store, to enter a rendezvous together or not at all.

A library's rendezvous (gloo's process group, NCCL's communicator, symmetric memory) blocks in
native code until the peer enters it too, or until its timeout; nothing cuts it short. A rank
that entered one alone holds up its pair for that long, and with it every later making of the
pair. So a rank enters only once both ranks committed, and a rank that gives up before the peer
came withdraws in a way that keeps the peer from committing afterwards.

The agreement is one key, ``turn``, changed only by compare-and-set (atomic in every c10d
store):

- arriving, a rank claims it (``"" → "w<me>"``); if the peer's claim is there instead, it turns
  that into ``"go"``, which commits both, and sets the ``go`` key for the peer to see;
- a waiting rank that gives up withdraws its claim (``"w<me>" → ""``), unless the withdrawal
  finds ``"go"``: then the peer committed first and is entering, and so must this rank.

A marker-per-rank meeting (each sets its mark, then polls for the other's) lacks the second
rule: a rank could see the peer's mark in the moment before the peer took it back, and enter
alone.
"""

from __future__ import annotations

import datetime
from typing import Any

from tensorferry.errors import TransportError

__all__ = ["arrive", "peer_committed", "wait_committed", "withdraw"]

_TURN = "turn"
_GO = "go"


def _claim(me: int) -> bytes:
    return f"w{me}".encode()


def arrive(store: Any, me: int) -> bool:
    """Claims the turn for this rank (``me``: 0 or 1 within the pair). Returns true when that
    committed both ranks (the peer was waiting), false when this rank now waits for the peer
    (:func:`peer_committed`, :func:`withdraw`).

    Raises:
        TransportError: the store holds a finished agreement: it was used before under the same
            keys (an earlier world's store, or a pair's making retried in one epoch).
    """
    claim = _claim(me)
    while True:
        seen = store.compare_set(_TURN, "", claim)
        if seen == claim:
            return False
        if seen == b"go":
            raise TransportError(
                "the pair's store already holds a finished set-up: it was used before with the "
                "same keys (by an earlier world: give each world its own store or prefix; or by "
                "a set-up retried in one epoch)"
            )
        if store.compare_set(_TURN, seen, "go") == b"go":
            store.set(_GO, "1")
            return True
        # The peer withdrew between our two steps: claim again.


def peer_committed(store: Any) -> bool:
    """Whether the peer committed both ranks while this one waited; never blocks."""
    return store.check([_GO])


def wait_committed(store: Any, seconds: float) -> bool:
    """Waits up to ``seconds`` for the peer to commit both ranks; returns whether it did."""
    try:
        store.wait([_GO], datetime.timedelta(seconds=seconds))
    except RuntimeError:  # c10d's wait timeout (DistStoreError, a RuntimeError)
        return False
    return True


def withdraw(store: Any, me: int) -> bool:
    """Takes back this waiting rank's claim. Returns false when the peer committed first: then
    the claim stays, the peer is entering the rendezvous, and this rank must enter it too."""
    return store.compare_set(_TURN, _claim(me), "") != b"go"
