"""One symmetric-memory pair set-up at a time per process, entered only with the peer.

torch's symmetric-memory rendezvous is not safe to run twice at once in one process (the file
descriptors travel over one socket named after the process; the exchange counter is shared),
and it holds the process until the peer enters the same rendezvous. Pairs of the nvlink and ce
transports are made lazily, on helper threads and on the caller's, so without care two set-ups
overlap in one process, or each rank of a ring waits, inside a rendezvous, for a neighbour
that sits inside another one.

So a set-up runs under one process-wide lock, and only after both ranks of the pair committed
to it while holding their locks. The commitment is a small agreement over the pair's store:

- arriving, a rank claims the ``turn`` key (``"" → "w<me>"``) and waits a short while on the
  ``go`` key; if the peer's claim is already there, it turns it into ``"go"`` and sets ``go``;
- a rank whose wait ran out withdraws its claim (``"w<me>" → ""``), releases its lock, backs off
  a random moment and tries again — unless the withdrawal finds ``"go"``: then the peer
  committed first and both proceed.

Every compare-and-set is atomic in the store, so either both ranks enter the rendezvous or
neither does, and no rank holds its lock for more than a moment waiting on a peer that is busy
elsewhere.
"""

from __future__ import annotations

import datetime
import random
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from tensorferry.errors import TransferTimeoutError, TransportError
from tensorferry.p2p.nvlink._symm import pair_group_name

__all__ = ["set_up_pair", "with_peer_turn"]

T = TypeVar("T")

_setup_lock = threading.Lock()
"""Held for a whole set-up, from commitment to the end of the rendezvous."""

HOLD_S = 0.25
"""How long a rank, holding its lock, waits for its peer to arrive before withdrawing."""
BACKOFF_S = 0.05
"""Upper bound of the random pause between attempts (well under HOLD_S: a peer that arrives
while we pause finds us back in time)."""


def set_up_pair(
    ctx: Any, peer: int, kind: str, build: Callable[[str, int, Any], T], *, lock: Any = None
) -> T:
    """Makes the ``kind`` channel of this rank's pair with ``peer``: a fresh group name and
    ``build(group_name, rank_in_pair, pair_store)``, in the pair's turn (:func:`with_peer_turn`).

    Args:
        ctx: the transports' ``TransportContext``.
        peer: the other rank.
        kind: the transport's name (names the pair's store and group).
        build: makes the channel; runs on this thread under the set-up lock.
        lock: as for :func:`with_peer_turn`.
    """
    me = ctx.rank_in_pair(peer)
    store = ctx.pair_store(peer, kind)

    def set_up() -> T:
        return build(pair_group_name(kind, store, first=me == 0), me, store)

    return with_peer_turn(
        store,
        me,
        set_up,
        timeout_s=ctx.timeout.total_seconds(),
        what=f"{kind} set-up with rank {peer}",
        lock=lock,
    )


def with_peer_turn(
    store: Any,
    me: int,
    make: Callable[[], T],
    *,
    timeout_s: float,
    what: str,
    lock: Any = None,
) -> T:
    """Runs ``make`` (a set-up that rendezvouses with the peer) once both ranks of the pair
    committed to it, under the process-wide set-up lock.

    Args:
        store: the pair's store (private to this pair and epoch).
        me: this rank's index in the pair, 0 or 1.
        make: the set-up; runs on this thread.
        timeout_s: give up after this many seconds without the peer committing.
        what: names the set-up in errors.
        lock: the set-up lock; default: the process-wide one (tests give one per simulated
            process).

    Raises:
        TransferTimeoutError: the peer did not commit within ``timeout_s``.
    """
    lock = _setup_lock if lock is None else lock
    deadline = time.monotonic() + timeout_s
    claim = f"w{me}".encode()
    while True:
        with lock:
            if _commit(store, claim):
                return make()
        if time.monotonic() > deadline:
            raise TransferTimeoutError(
                f"{what}: the peer did not join the set-up within {timeout_s:.0f} s"
            )
        time.sleep(random.uniform(0.0, BACKOFF_S))


def _commit(store: Any, claim: bytes) -> bool:
    """One attempt: True once both ranks committed (the caller holds the set-up lock)."""
    seen = store.compare_set("turn", "", claim)
    if seen == b"go":
        raise TransportError(
            "the pair's store already holds a finished set-up: it was used by an earlier world "
            "with the same keys (give each world its own store or prefix)"
        )
    if seen != claim:  # the peer's claim is there: commit both
        if store.compare_set("turn", seen, "go") == b"go":
            store.set("go", "1")
            return True
        return False  # the peer withdrew in between: start over
    try:
        store.wait(["go"], datetime.timedelta(seconds=HOLD_S))
        return True
    except RuntimeError:  # c10d's wait timeout (DistStoreError, a RuntimeError)
        pass
    left = store.compare_set("turn", claim, "")
    if left == b"go":  # the peer committed while we gave up: it is entering; so do we
        store.wait(["go"])
        return True
    return False
