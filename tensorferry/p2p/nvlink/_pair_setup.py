"""One symmetric-memory pair set-up at a time per process, entered only with the peer.

torch's symmetric-memory rendezvous is not safe to run twice at once in one process (the file
descriptors travel over one socket named after the process; the exchange counter is shared),
and it holds the process until the peer enters the same rendezvous. Pairs of the nvlink and ce
transports are made lazily, on helper threads and on the caller's, so without care two set-ups
overlap in one process, or each rank of a ring waits, inside a rendezvous, for a neighbour
that sits inside another one.

So a set-up runs under one process-wide lock, and only after both ranks of the pair committed
to it (:mod:`tensorferry.p2p._agreement`) while holding their locks. A rank waits for its peer's
commitment a short while only; then it withdraws, releases its lock, backs off a random moment
and tries again. So either both ranks enter the rendezvous or neither does, and no rank holds
its lock for more than a moment waiting on a peer that is busy elsewhere.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from tensorferry.errors import TransferTimeoutError
from tensorferry.p2p._agreement import arrive, wait_committed, withdraw
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
    while True:
        with lock:
            if _commit(store, me):
                return make()
        if time.monotonic() > deadline:
            raise TransferTimeoutError(
                f"{what}: the peer did not join the set-up within {timeout_s:.0f} s"
            )
        time.sleep(random.uniform(0.0, BACKOFF_S))


def _commit(store: Any, me: int) -> bool:
    """One attempt: True once both ranks committed (the caller holds the set-up lock)."""
    # After a refused withdrawal the peer is entering the rendezvous: so do we.
    return arrive(store, me) or wait_committed(store, HOLD_S) or not withdraw(store, me)
