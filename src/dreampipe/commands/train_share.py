"""What rank 0 of a torchrun ``dreampipe train`` job shares with the other ranks.

Under ``torchrun`` every rank must run the *same* plan, but a profile is a
measurement and differs a little from rank to rank. So only rank 0 profiles
and plans (and, with ``--schedule auto``, chooses the schedule); it
publishes the result in torchrun's own rendezvous store (the agent's TCP
store at ``MASTER_ADDR:MASTER_PORT``), and the other ranks read it there.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta

from dreampipe.errors import PeerTimeoutError, PlanError
from dreampipe.planning.plan import Plan
from dreampipe.scheduling.actions import ScheduleKind

__all__ = ["share_plan", "torchrun_world"]


def torchrun_world() -> tuple[int, int] | None:
    """``(rank, world_size)`` when started by torchrun (or any env:// launcher), else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


def share_plan(plan: Plan | None, timeout_s: float,
               chosen: tuple[ScheduleKind, int] | None = None
               ) -> tuple[Plan, tuple[ScheduleKind, int] | None]:
    """Rank 0 passes its ``plan`` (and the schedule ``--schedule auto`` chose, with its
    microbatches); every other rank passes None and gets rank 0's.

    Uses the torchrun agent's store; other launchers need a plan every rank
    can compute alone (a plan file or a forced partition).
    """
    import torch.distributed as dist

    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        raise PlanError(
            "this launcher has no torchrun agent store to share rank 0's plan through; "
            "give every rank the same plan: a plan file, or stages (with config if replicated)"
        )
    store = dist.TCPStore(  # type: ignore[attr-defined]
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
        timeout=timedelta(seconds=timeout_s),
    )
    key = (f"dreampipe/plan/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/"
           f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")
    if plan is not None:
        store.set(key, json.dumps({"plan": plan.to_dict(), "schedule": None if chosen is None
                                   else [chosen[0].value, chosen[1]]}))
        return plan, chosen
    try:
        shared = json.loads(store.get(key))
        pick = shared["schedule"]
        return (Plan.from_dict(shared["plan"]),
                None if pick is None else (ScheduleKind(pick[0]), int(pick[1])))
    except RuntimeError as exc:
        raise PeerTimeoutError(
            f"rank {os.environ.get('RANK')} waited {timeout_s:g} s for rank 0's plan ({exc}); "
            "check rank 0's output, or raise timeout_s"
        ) from exc


