"""What each of the two ranks of ``tensorferry bench peers`` runs.

Every row's buffers are made first (NIXL registers them all before its agents exchange
metadata), then each row is timed for each contender in turn: torch.distributed, NIXL,
tensorferry; a floor row instead times its one measurement (the pipeline's compute alone, or the
timing alone). Both ranks return the same results.
"""

from __future__ import annotations

import contextlib
import datetime
import sys
import traceback
from typing import Any

from tensorferry.bench._peers_plan import COMPUTE_ONLY, CONTENDERS, NOTHING_MOVED, Plan, Row
from tensorferry.bench._peers_timing import Case, Outcome, median_us, time_case

__all__ = ["rank_main"]


def rank_main(rank: int, world: int, plan: Plan, nixl_reason: str | None) -> dict[str, Any]:
    """One rank's run (``tensorferry.p2p._launch.run_world`` calls it after ``tf.init``).

    What it prints goes to stderr (NIXL's agents print as they start): stdout carries the
    report, which ``--json`` keeps for its document alone.

    Returns:
        ``{"rows": [...], "wrong_bytes": None or {...}}``: one entry per row with each
        contender's times or the reason it has none; what a byte check found, if anything.
    """
    with contextlib.redirect_stdout(sys.stderr):
        return _rank_main(rank, world, plan, nixl_reason)


def _rank_main(rank: int, world: int, plan: Plan, nixl_reason: str | None) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from tensorferry.bench._peers_cases import Workspace
    from tensorferry.bench._peers_nixl import open_nixl
    from tensorferry.p2p._launch import torch_group

    if world != 2:
        raise SystemExit(f"tensorferry bench peers runs on exactly 2 ranks, not {world}")
    with torch_group("bench/peers/torch", timeout_s=plan.timeout_s):
        # Barriers and time exchange on a gloo group of their own, outlasting a stuck wait.
        control_timeout = datetime.timedelta(seconds=2 * plan.timeout_s + 60)
        control = dist.new_group(backend="gloo", timeout=control_timeout)
        if plan.device == "cuda":
            device = torch.device("cuda", torch.cuda.current_device())

            def sync_device() -> None:
                torch.cuda.synchronize(device)
        else:
            device = torch.device("cpu")
            # One core per rank: two ranks with a thread per core each would take turns on
            # the cores, which times the scheduler as much as the contenders.
            torch.set_num_threads(1)

            def sync_device() -> None:
                pass

        spaces = {row.key: Workspace(row, rank, device) for row in plan.rows}
        nixl, peer_regions, nixl_reason = open_nixl(
            spaces, rank, plan.timeout_s, nixl_reason, control
        )
        runner = _RowRunner(plan, rank, sync_device, control, nixl, peer_regions, nixl_reason)
        try:
            for row in plan.rows:
                runner.run(row, spaces[row.key])
                if runner.wrong_bytes is not None:
                    break
        finally:
            if nixl is not None:
                nixl.close()
        return {"rows": runner.results, "wrong_bytes": runner.wrong_bytes}


class _RowRunner:
    """Times rows for every contender, and keeps what came of each."""

    def __init__(
        self,
        plan: Plan,
        rank: int,
        sync_device: Any,
        control: Any,
        nixl: Any,
        peer_regions: dict[str, Any],
        nixl_reason: str | None,
    ) -> None:
        self.plan, self.rank, self.sync_device, self.control = plan, rank, sync_device, control
        self.nixl, self.peer_regions, self.nixl_reason = nixl, peer_regions, nixl_reason
        self.results: list[dict[str, Any]] = []
        self.wrong_bytes: dict[str, str] | None = None
        self._failed: dict[str, str] = {}  # contender -> title of a row it failed

    def run(self, row: Row, ws: Any) -> None:
        warmup, iters = self.plan.iterations(row)
        result = {
            "key": row.key,
            "number": row.number,
            "title": row.title,
            "bytes": row.total_bytes,
            "bandwidth": row.bandwidth,
            "warmup": warmup,
            "iterations": iters,
            "contenders": {},
        }
        self.results.append(result)
        for name in (row.floor,) if row.floor else CONTENDERS:
            skip = self._skip_reason(name, row)
            if skip is not None:
                result["contenders"][name] = {"skipped": skip}
                continue
            case = self._case(name, ws)
            outcome = time_case(
                case,
                rank=self.rank,
                warmup=warmup,
                iters=iters,
                sync_device=self.sync_device,
                control=self.control,
            )
            result["contenders"][name] = self._entry(name, row, outcome)
            if self.wrong_bytes is not None:
                return

    def _skip_reason(self, name: str, row: Row) -> str | None:
        from tensorferry.bench._peers_nixl import NIXL_SKIPS

        if name != "nixl":
            return None
        return self.nixl_reason or NIXL_SKIPS.get(row.key)

    def _case(self, name: str, ws: Any) -> Case:
        """The contender's case; one whose set-up raised fails at its first iteration, so both
        ranks learn of it at the same barrier."""
        from tensorferry.bench import _peers_cases as cases
        from tensorferry.bench._peers_nixl import nixl_case

        try:
            if name == COMPUTE_ONLY:
                return cases.compute_only_case(ws)
            if name == NOTHING_MOVED:
                return cases.nothing_moved_case(ws)
            if name == "torch":
                return cases.torch_case(ws, self.sync_device)
            if name == "nixl":
                return nixl_case(ws, self.nixl, self.peer_regions[ws.row.key])
            return cases.tensorferry_case(ws, self.sync_device, self.plan.timeout_s)
        except Exception:
            error = traceback.format_exc()

            def fail(iteration: int) -> None:
                raise RuntimeError(f"set-up failed: {error.strip().splitlines()[-1]}")

            return Case(prepare=fail, run=fail, check=lambda iteration: None)

    def _entry(self, name: str, row: Row, outcome: Outcome) -> dict[str, Any]:
        if outcome.wrong_bytes is not None:
            earlier = self._failed.get(name)
            detail = outcome.wrong_bytes
            if earlier is not None:
                detail += f" (this contender failed earlier, in row {earlier!r}: a cause?)"
            self.wrong_bytes = {"row": row.title, "contender": name, "detail": detail}
            return {"skipped": "wrong bytes received"}
        if outcome.failure is not None:
            failure = outcome.failure
            earlier = self._failed.setdefault(name, row.title)
            if earlier != row.title:  # what an earlier row left in flight may be the cause
                failure += f" (after this contender's failure in row {earlier.strip()!r})"
            _progress(self.rank, f"{row.title}: {name} failed: {failure}")
            return {"skipped": failure}
        samples_us = [t / 1e3 for t in outcome.times_ns]
        us = median_us(outcome.times_ns)
        entry = {
            "median_us": us,
            "min_us": min(samples_us),
            "max_us": max(samples_us),
            "samples_us": samples_us,
        }
        if row.total_bytes:
            entry["gb_per_s"] = row.total_bytes / (us * 1e3)
        _progress(self.rank, f"{row.title}: {name} {us:.1f} µs")
        return entry


def _progress(rank: int, text: str) -> None:
    """One line per timed contender (rank 0, stderr): a long run shows how far it got."""
    if rank == 0:
        print(f"peers: {text}", file=sys.stderr, flush=True)
