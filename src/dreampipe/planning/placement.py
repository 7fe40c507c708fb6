"""Where a plan's stages run: one per rank, or ``virtual_stages`` to a rank.

A plan with ``virtual_stages = v > 1`` runs its ``p * v`` stages on ``p``
ranks, stage ``s`` on rank ``s mod p`` (interleaved 1F1B,
:mod:`dreampipe.scheduling.interleave`); every stage is one unsplit
replica, and its ``ranks`` say where it runs. The plan carries ``v``:
whoever runs it reads ``v`` from the plan (:func:`virtual_stages_of`), so a
flag or argument asking for another count is an error, and so is a plan
whose ranks a topology cannot hold (:func:`check_fits`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from dreampipe.errors import ConfigError, DreampipeError, PlanError
from dreampipe.planning.plan_stage import Stage
from dreampipe.planning.topology import Topology

__all__ = ["check_fits", "check_placement", "check_schedule", "stage_ranks",
           "virtual_stages_of"]

class Plan(Protocol):
    """What placement reads of a :class:`~dreampipe.planning.plan.Plan` (which checks its
    own placement with this module, so it is not imported here)."""

    @property
    def virtual_stages(self) -> int: ...

    @property
    def num_stages(self) -> int: ...

    @property
    def stages(self) -> Sequence[Stage]: ...

    def stage_workers(self, s: int) -> tuple[int, ...]: ...


#: The one schedule that runs several stages per rank.
_INTERLEAVED = "interleaved-1f1b"


def stage_ranks(num_stages: int, virtual_stages: int) -> tuple[int, ...]:
    """Each stage's rank: ``s mod (num_stages / v)``, or ``s`` where ``v`` does not divide."""
    per = virtual_stages if virtual_stages >= 1 and num_stages % virtual_stages == 0 else 1
    return tuple(s % (num_stages // per) for s in range(num_stages))


def check_placement(stages: Sequence[Stage], virtual_stages: int) -> None:
    """``virtual_stages`` divides the stages; with ``v > 1`` each stage is one unsplit
    replica on rank ``s mod p``, at the position of stage ``s mod p`` (a PlanError)."""
    v, n = virtual_stages, len(stages)
    if v < 1 or n % v:
        raise PlanError(f"virtual_stages={v} for a plan of {n} stages; give a divisor of {n} "
                        "(stages per rank), or 1 for one stage per rank")
    if v == 1:
        return
    for s, st in enumerate(stages):
        if st.replicas != 1 or st.tensor_parallel != 1:
            raise PlanError(
                f"virtual_stages={v} with stage {s} on {st.replicas} replicas split over "
                f"{st.tensor_parallel} workers; interleaving runs each stage on one worker: "
                "give every stage 1 replica, unsplit, or virtual_stages=1")
    p = n // v
    want, got = list(stage_ranks(n, v)), [r for st in stages for r in st.ranks]
    if got != want:
        raise PlanError(f"virtual_stages={v} runs stage s on rank s mod {p}, ranks {want}, but "
                        f"the stages have ranks {got}; number them so "
                        f"(Plan.from_config(..., virtual_stages={v}))")
    moved = [s for s, st in enumerate(stages) if st.workers != stages[s % p].workers]
    if moved:
        s = moved[0]
        raise PlanError(f"stage {s} sits on workers {list(stages[s].workers)} but shares rank "
                        f"{s % p} with stage {s % p} on {list(stages[s % p].workers)}; give "
                        "the stages of a rank the same workers")


def virtual_stages_of(plan: Plan, asked: int | None, source: str = "the plan",
                      remake: str = "dreampipe plan --virtual-stages {v}") -> int:
    """The stages per rank a run of ``plan`` uses: the plan's own. ``asked`` (a flag or an
    argument; None: not given) must agree with it, else a ConfigError names both and the
    fix (``remake``, with ``{v}`` the count asked for)."""
    v = plan.virtual_stages
    if asked is not None and asked != v:
        raise ConfigError(
            f"virtual_stages={asked} but {source} runs {_per_rank(v)} (its virtual_stages "
            f"is {v}); drop virtual_stages={asked} to run it as planned, or make the plan "
            f"with {_per_rank(asked)} ({remake.format(v=asked)})", "virtual_stages")
    return v


def check_schedule(plan: Plan, schedule: str, source: str = "the plan") -> None:
    """A plan of several stages per rank runs only under interleaved 1F1B (a ConfigError)."""
    v = plan.virtual_stages
    if v > 1 and schedule != _INTERLEAVED:
        raise ConfigError(
            f"schedule={schedule} for {source}, which runs {_per_rank(v)} (its "
            f"virtual_stages is {v}); only {_INTERLEAVED} runs several: use "
            f"schedule={_INTERLEAVED}", "schedule")


def check_fits(plan: Plan, topology: Topology, source: str = "the plan",
               error: type[DreampipeError] = PlanError) -> None:
    """The plan's workers must be workers of ``topology`` (an ``error`` naming both)."""
    placed = 1 + max(w for s in range(plan.num_stages) for w in plan.stage_workers(s))
    have = topology.num_workers
    if placed <= have:
        return
    name = topology.name or topology.shape
    hint = ""
    n = plan.num_stages
    if plan.virtual_stages == 1 and n % have == 0 and all(
            st.replicas == 1 and st.tensor_parallel == 1 for st in plan.stages):
        hint = (f", or, for {n // have} stages per worker, make the plan with dreampipe plan "
                f"--virtual-stages {n // have} (the plan then says so)")
    raise error(
        f"{source} needs {placed} workers (a rank at position {placed - 1}) but topology "
        f"{name} has {have}; pick a larger --topology, of {placed} workers or more{hint}")


def _per_rank(v: int) -> str:
    return "one stage per worker" if v == 1 else f"{v} stages per worker"
