"""Where a plan's stages run: one per rank, or ``virtual_stages`` to a rank.

A plan with ``virtual_stages = v > 1`` runs its ``p * v`` stages on ``p``
ranks, each stage one unsplit replica whose ``ranks`` say where it runs, in one
of two placements (:class:`Placement`): the loop, stage ``s`` on rank ``s mod p``
(interleaved 1F1B, :mod:`dreampipe.scheduling.interleave`), or the V, two stages a
rank, ``s`` and ``2p - 1 - s`` together (:mod:`dreampipe.scheduling.v_shape`).
:func:`stage_rank` and :func:`rank_stages` are the one rule both ways, which plans,
schedules and the runtime read. A position may be replicated: its ``r_q`` ranks run every
stage of it (:func:`position_firsts`, docs/design.md §7.7). The plan carries ``v`` and its
placement: whoever runs it reads them from the plan (:func:`virtual_stages_of`), so a
flag or argument asking for another count is an error, and so is a plan whose ranks a
topology cannot hold (:func:`check_fits`).
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from typing import Protocol

from dreampipe.errors import ConfigError, DreampipeError, PlanError
from dreampipe.planning.plan_stage import Stage
from dreampipe.planning.topology import Topology

__all__ = ["Placement", "check_fits", "check_placement", "check_schedule",
           "check_virtual_count", "moved_stages", "position_firsts", "position_replicas",
           "rank_stages", "rank_workers", "stage_rank", "stage_ranks", "stray_stage",
           "virtual_stages_of"]


class Placement(Enum):
    """Where the stages of a plan of several stages per rank go (docs/design.md §7.12)."""

    LOOP = "loop"  #: stage ``s`` on rank ``s mod p``
    V = "v"  #: two stages a rank: ``s`` and ``2p - 1 - s``


class Plan(Protocol):
    """What placement reads of a :class:`~dreampipe.planning.plan.Plan` (which checks its
    own placement with this module, so it is not imported here)."""

    @property
    def virtual_stages(self) -> int: ...

    @property
    def placement(self) -> Placement: ...

    @property
    def num_stages(self) -> int: ...

    @property
    def config(self) -> str: ...

    @property
    def stages(self) -> Sequence[Stage]: ...

    def stage_workers(self, s: int) -> tuple[int, ...]: ...

    def rank_first_worker(self, rank: int) -> int: ...


#: The schedules that run several stages per rank, by placement.
_SEVERAL = {Placement.LOOP: ("interleaved-1f1b",), Placement.V: ("zbv", "dualpipev")}


def stage_rank(stage: int, num_stages: int, virtual_stages: int,
               placement: Placement = Placement.LOOP) -> int:
    """The rank of ``stage`` of ``num_stages``, ``virtual_stages`` of them to a rank."""
    ranks = num_stages // virtual_stages
    if placement is Placement.V:
        return stage if stage < ranks else 2 * ranks - 1 - stage
    return stage % ranks


def rank_stages(rank: int, num_stages: int, virtual_stages: int,
                placement: Placement = Placement.LOOP) -> tuple[int, ...]:
    """The stages ``rank`` runs, in pipeline order: :func:`stage_rank` inverted."""
    ranks = num_stages // virtual_stages
    if placement is Placement.V:
        return (rank, 2 * ranks - 1 - rank)
    return tuple(range(rank, num_stages, ranks))


def stage_ranks(num_stages: int, virtual_stages: int,
                placement: Placement = Placement.LOOP) -> tuple[int, ...]:
    """Each stage's rank (:func:`stage_rank`), or ``s`` where ``v`` does not divide."""
    per = virtual_stages if virtual_stages >= 1 and num_stages % virtual_stages == 0 else 1
    return tuple(stage_rank(s, num_stages, per, placement if per > 1 else Placement.LOOP)
                 for s in range(num_stages))


def position_replicas(replicas: Sequence[int], virtual_stages: int,
                      placement: Placement = Placement.LOOP) -> tuple[int, ...]:
    """Each position's replica count: that of its first stage, ``q`` (every stage of a
    position has it, :func:`stray_stage`); one position a stage with ``v = 1``."""
    if virtual_stages <= 1:
        return tuple(replicas)
    return tuple(replicas[: len(replicas) // virtual_stages])


def stray_stage(replicas: Sequence[int], virtual_stages: int,
                placement: Placement = Placement.LOOP) -> int | None:
    """The first stage whose replica count is not its position's, None if all agree: a
    position's ranks run all its stages, so its stages have as many replicas."""
    if virtual_stages <= 1:
        return None
    counts = position_replicas(replicas, virtual_stages, placement)
    places = stage_ranks(len(replicas), virtual_stages, placement)
    return next((s for s, r in enumerate(replicas) if r != counts[places[s]]), None)


def position_firsts(replicas: Sequence[int], virtual_stages: int,
                    placement: Placement = Placement.LOOP) -> tuple[int, ...]:
    """The first rank of each position, and the rank count last: ranks are numbered
    position by position, a position's replicas side by side (docs/design.md §7.7)."""
    firsts = [0]
    for r in position_replicas(replicas, virtual_stages, placement):
        firsts.append(firsts[-1] + r)
    return tuple(firsts)


def check_placement(stages: Sequence[Stage], virtual_stages: int,
                    placement: Placement = Placement.LOOP) -> None:
    """``virtual_stages`` divides the stages; with ``v > 1`` each stage is one unsplit
    replica on the rank ``placement`` gives it, at the position of that rank's first
    stage; the V takes exactly 2 a rank (a PlanError)."""
    v, n = virtual_stages, len(stages)
    if v < 1 or n % v:
        raise PlanError(f"virtual_stages={v} for a plan of {n} stages; give a divisor of {n} "
                        "(stages per rank), or 1 for one stage per rank")
    if placement is Placement.V and v != 2:
        raise PlanError(f"the V placement with virtual_stages={v}; it puts exactly 2 stages "
                        "on each rank: give virtual_stages=2, or the loop placement")
    if v == 1:
        return
    counts = [st.replicas for st in stages]
    stray = stray_stage(counts, v, placement)
    p = n // v
    if stray is not None or any(st.tensor_parallel != 1 for st in stages):
        s = stray if stray is not None else next(
            s for s, st in enumerate(stages) if st.tensor_parallel != 1)
        q = stage_ranks(n, v, placement)[s]
        raise PlanError(
            f"virtual_stages={v} with stage {s} on {stages[s].replicas} replicas split over "
            f"{stages[s].tensor_parallel} workers; the stages of one position (rank) run on "
            f"its ranks, each stage on one worker a replica: give stage {s} the "
            f"{stages[q].replicas} replicas of stage {q}, its position's, unsplit, or "
            "virtual_stages=1")
    firsts = position_firsts(counts, v, placement)
    want = [firsts[q] + j for q in stage_ranks(n, v, placement) for j in range(counts[q])]
    got = [r for st in stages for r in st.ranks]
    if got != want:
        where = "position" if max(counts) > 1 else "rank"
        rule = (f"stage s and {2 * p - 1}-s on {where} min(s, {2 * p - 1}-s)"
                if placement is Placement.V else f"stage s on {where} s mod {p}")
        extra = "" if placement is Placement.LOOP else ", placement=Placement.V"
        rule += (", the ranks numbered position by position, a position's replicas side by "
                 "side" if max(counts) > 1 else "")
        raise PlanError(f"virtual_stages={v} runs {rule}, ranks {want}, but "
                        f"the stages have ranks {got}; number them so "
                        f"(Plan.from_config(..., virtual_stages={v}{extra}))")
    home = stage_ranks(n, v, placement)
    moved = [s for s, st in enumerate(stages) if st.workers != stages[home[s]].workers]
    if moved:
        s = moved[0]
        r = home[s]
        raise PlanError(f"stage {s} sits on workers {list(stages[s].workers)} but shares rank "
                        f"{r} with stage {r} on {list(stages[r].workers)}; give "
                        "the stages of a rank the same workers")


def check_virtual_count(v: int | None) -> None:
    """Stages per worker, where given (None: not), are 1 or more."""
    if v is not None and v < 1:
        raise ConfigError(f"virtual_stages={v}; a worker runs 1 stage or more: use 1, or "
                          "leave it out", "virtual_stages")


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
    """A plan of several stages per rank runs only under the schedules of its placement
    (interleaved 1F1B the loop's, zbv and dualpipev the V's), and those run only such a
    plan (a ConfigError)."""
    v, placed = plan.virtual_stages, plan.placement
    fits = _SEVERAL[placed]
    needs = next((p for p, kinds in _SEVERAL.items() if schedule in kinds), None)
    if needs is Placement.V and (v, placed) != (2, Placement.V):
        where = f" in the {placed.value} placement" if v > 1 else ""
        raise ConfigError(
            f"schedule={schedule} for {source}, which runs {_per_rank(v)}{where}; "
            f"{schedule} runs 2 stages a rank in the V placement: "
            "give 2 x workers split points, or make the plan with dreampipe plan "
            f"--schedule {schedule}", "schedule")
    if v > 1 and schedule not in fits:
        names = " or ".join(f"schedule={k}" for k in fits)
        where, verb = (" in a V", "run that") if placed is Placement.V else ("", "runs several")
        raise ConfigError(
            f"schedule={schedule} for {source}, which runs {_per_rank(v)}{where} (its "
            f"virtual_stages is {v}); only {' and '.join(fits)} {verb}: use {names}",
            "schedule")


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


def rank_workers(plan: Plan) -> tuple[tuple[int, int], ...]:
    """Each schedule rank's first process and its count of workers, in rank order: a
    stage's ``i``-th rank on its ``i``-th replica's first worker (the order minibatches
    are dealt in), each worker the plan lays numbered by its place among them all (a plan
    on workers 0-2 and 8-10 of two servers runs on processes 0-5, three a node). The
    runtime starts schedule rank ``r`` there, so a plan runs on the links it was priced
    on (docs/design.md §4.6)."""
    out: dict[int, tuple[int, int]] = {}
    for s, st in enumerate(plan.stages):
        t = st.tensor_parallel
        firsts = plan.stage_workers(s)[::t]
        for r, w in zip(st.ranks, firsts, strict=True):
            out.setdefault(r, (w, t))  # under interleaving a rank's first stage says
    laid = sorted(w + k for w, t in out.values() for k in range(t))
    place = {w: i for i, w in enumerate(laid)}
    return tuple((place[out[r][0]], out[r][1]) for r in sorted(out))


def moved_stages(plan: Plan) -> tuple[int, ...]:
    """The stages whose ranks :func:`rank_workers` starts on other processes than rank
    order gives them (:meth:`~dreampipe.planning.plan.Plan.rank_first_worker`): a plan
    that copies one server's stages onto others lays them so. The runtime then talks on
    routes between those processes (docs/design.md §4.6)."""
    placed = rank_workers(plan)
    return tuple(s for s, st in enumerate(plan.stages)
                 if any(placed[r][0] != plan.rank_first_worker(r) for r in st.ranks))


def _per_rank(v: int) -> str:
    return "one stage per worker" if v == 1 else f"{v} stages per worker"
