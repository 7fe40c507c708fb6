"""Plan: how a model is cut into stages and how many workers each stage gets.

A plan is plain data produced by the planner (or written by hand) and read by
the schedules, the simulator and the runtime. Stage ``s`` spans layers
``first..last`` of the profile, is replicated ``replicas`` ways and runs on
``ranks``, numbered stage by stage; ``workers`` says where those ranks sit on
the topology the plan was priced for. Its config string is the paper's
(``"15-1"``, ``"straight"``, ``"16"``), with ``t`` for a tensor-split stage
(``"2t4"``) and ``r`` for one that recomputes (``"2r"``).

A plan may run ``virtual_stages = v`` stages to a rank: stage ``s`` of ``p * v``
on rank ``s mod p`` (the loop placement, interleaved 1F1B), or two a rank, ``s`` and
``2p - 1 - s`` (the V placement of zbv and dualpipev,
:class:`~dreampipe.planning.placement.Placement`); a file without them runs one stage
per rank. The rules: docs/design.md §4, §4.6, §7.7 and §10.3; the words are
the glossary's (§13).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from dreampipe.errors import PlanError
from dreampipe.planning.config_string import config_string
from dreampipe.planning.in_flight import in_flight_counts
from dreampipe.planning.placement import (
    Placement,
    check_placement,
    position_firsts,
    rank_stages,
    rank_workers,
    stage_ranks,
    stray_stage,
)
from dreampipe.planning.plan_checks import PlanFields, check_agrees, read_stages
from dreampipe.planning.plan_stage import Stage, check_figure
from dreampipe.planning.plan_text import plan_text

__all__ = ["PLAN_FORMAT", "Heuristic", "Plan", "Stage"]

#: The "format" tag of a plan JSON file; a file with another tag is not a plan.
PLAN_FORMAT = "dreampipe.plan"
_VERSION = 1


class Heuristic(Enum):
    """A part of the search the planner cut short, so the plan may miss the optimum."""

    LAYER_BLOCKS = "layer-blocks"  #: stages cut only between blocks of layers
    WORKER_GRID = "worker-grid"  #: stage ranges start and end only on a grid of workers
    WHOLE_SERVERS = "whole-servers"  #: with a stage cap, outer stages on whole servers only
    #: the program's plan shares a server's link between cuts, priced after the search
    SHARED_LINKS = "shared-links"
    #: under a memory limit, stages that recompute replicated over servers only as one
    #: server's pipeline on every server
    SERVER_COPIES = "server-copies"
    #: under a memory limit, the fastest plan found held too few minibatches for whole
    #: rounds, so a plan of stages all as replicated stands in; other plans whose whole
    #: rounds fit are searched nowhere
    WHOLE_ROUNDS = "whole-rounds"
    #: under a memory limit, unreplicated neighbours hold too few minibatches in flight
    #: for their 1F1B loop, which the searches do not price
    LOOPS = "loops"


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Stages in pipeline order plus the predictions the planner made for them.

    ``baselines_s`` maps a strategy name (``"dp"``, ``"straight"``, ``"gpipe"``)
    to its predicted time per minibatch under the same cost model.

    Every time and size is finite and >= 0, checked on construction (a
    :class:`PlanError` names the figure), so :meth:`to_dict` never holds
    ``Infinity`` or ``NaN``, which JSON cannot carry. A time of 0 means "no
    prediction" (cost fields left at zero, or a profile whose layers take no
    time): :attr:`throughput_minibatches_per_s` and :meth:`speedup_over` are
    then 0.0, read as unknown, never an infinite throughput.
    """

    stages: tuple[Stage, ...]
    num_layers: int
    batch_size: int = 0
    model: str = ""
    topology: str = ""
    time_per_minibatch_s: float = 0.0
    baselines_s: dict[str, float] = field(default_factory=dict, compare=False, hash=False)
    layer_names: tuple[str, ...] = ()
    #: 0: the plan is the fastest the planner's search holds; ``g > 0``: the search was
    #: cut short as ``heuristics`` say and the plan is at most ``(1 + g)`` times the optimum.
    optimality_gap: float = 0.0
    heuristics: tuple[Heuristic, ...] = ()
    #: Stages per rank: stage ``s`` of ``p * v`` runs on rank ``s mod p`` (module doc).
    virtual_stages: int = 1
    #: Where those stages go: the loop (``s mod p``) or the V (``s`` and ``2p - 1 - s``).
    placement: Placement = Placement.LOOP

    def __post_init__(self) -> None:
        if not self.stages:
            raise PlanError("a plan needs at least one stage")
        expect = 0
        for i, st in enumerate(self.stages):
            if st.first != expect:
                raise PlanError(
                    f"stage {i} starts at layer {st.first} but the previous stage ended at "
                    f"{expect - 1}; stages must cover the layers contiguously"
                )
            expect = st.last + 1
        if expect != self.num_layers:
            raise PlanError(
                f"stages cover layers 0..{expect - 1} but the model has {self.num_layers} layers"
            )
        check_placement(self.stages, self.virtual_stages, self.placement)
        ranks = [r for st in self._rank_stages for r in st.ranks]
        if sorted(ranks) != list(range(len(ranks))):
            raise PlanError(f"ranks {ranks} must be 0..{len(ranks) - 1}, each used once")
        counts = [st.in_flight for st in self.stages]
        if any(c < 0 for c in counts) or (0 in counts and any(counts)):
            raise PlanError(
                f"stages hold {counts} minibatches in flight; give every stage a count >= 1, "
                "or 0 to all for the default"
            )
        placed = [w for s in range(len(self._rank_stages)) for w in self.stage_workers(s)]
        if len(set(placed)) != len(placed) or min(placed) < 0:
            raise PlanError(f"workers {placed} must be distinct positions >= 0")
        check_figure("the plan", "time_per_minibatch_s", self.time_per_minibatch_s)
        check_figure("the plan", "optimality_gap", self.optimality_gap)
        for key, value in self.baselines_s.items():
            check_figure("the plan", f"baselines_s[{key!r}]", value)

    @classmethod
    def from_config(
        cls, num_layers: int, bounds: Sequence[int], replicas: Sequence[int], **kw: Any
    ) -> Plan:
        """A plan with cost fields left at zero: stage s is ``bounds[s]..bounds[s+1]-1``.

        ``bounds`` starts with 0 and lists each stage's first layer;
        ``Plan.from_config(8, [0, 4], [1, 1])`` is two stages of four layers.
        ``virtual_stages=v`` puts stage ``s`` on position ``s mod p``, or with
        ``placement=Placement.V`` (``v = 2``) ``s`` and ``2p - 1 - s`` on one position; the
        stages of a position have as many replicas ``r_q``, its ranks, numbered position by
        position (``q r .. q r + r - 1`` when every ``r_q`` is ``r``).
        """
        if len(bounds) != len(replicas) or not bounds or bounds[0] != 0:
            raise PlanError(
                f"bounds {list(bounds)} and replicas {list(replicas)} must have one entry per "
                "stage, and bounds must start at layer 0"
            )
        edges = [*bounds, num_layers]
        v = int(kw.get("virtual_stages", 1))
        placement = kw.get("placement", Placement.LOOP)
        stray = stray_stage(replicas, v, placement) if v > 1 and len(replicas) % v == 0 \
            else None
        places = stage_ranks(len(replicas), v, placement)
        if stray is not None:
            q = places[stray]
            raise PlanError(f"virtual_stages={v} with replicas {list(replicas)}; stage {stray} "
                            f"shares position {q}'s ranks with stage {q}: give it "
                            f"{replicas[q]} replicas, as every stage of a position")
        firsts = position_firsts(replicas, v, placement) if v > 1 and not len(replicas) % v \
            else ()
        stages, rank = [], 0
        for s, r in enumerate(replicas):
            first = firsts[places[s]] if firsts else rank
            stages.append(Stage(first=edges[s], last=edges[s + 1] - 1, replicas=r,
                                ranks=tuple(range(first, first + r))))
            rank += r
        return cls(stages=tuple(stages), num_layers=num_layers, **kw)

    # ---- derived --------------------------------------------------------
    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def _rank_stages(self) -> tuple[Stage, ...]:
        """The first stage of every rank (all stages but under interleaving)."""
        return self.stages[:len(self.stages) // self.virtual_stages]

    @property
    def mixes_splits(self) -> bool:
        """Whether stages are split over different numbers of workers (``"1t4-2"``)."""
        return len({st.tensor_parallel for st in self.stages}) > 1

    @property
    def has_splits(self) -> bool:
        """Whether some stage is split over workers."""
        return any(st.tensor_parallel > 1 for st in self.stages)

    @property
    def tensor_parallel(self) -> int:
        """The workers each replica of every stage is split over (1: no split); a plan that
        mixes them has no one number (a :class:`PlanError`: read each stage's)."""
        if self.mixes_splits:
            raise PlanError(
                f"plan {self.config} mixes stages split over "
                f"{[st.tensor_parallel for st in self.stages]} workers: it has no one "
                "tensor_parallel; read each stage's (Stage.tensor_parallel)"
            )
        return self.stages[0].tensor_parallel

    @property
    def workers_used(self) -> int:
        """Workers the plan runs on (``stages / virtual_stages`` under interleaving)."""
        return sum(st.replicas * st.tensor_parallel for st in self._rank_stages)

    @property
    def config(self) -> str:
        return config_string([st.replicas for st in self.stages],
                             [st.tensor_parallel for st in self.stages],
                             [st.recompute for st in self.stages])

    def rank_first_worker(self, rank: int) -> int:
        """The first of schedule rank ``rank``'s workers in rank order: those of the ranks
        before it follow one another (``rank * t`` when every stage has the same ``t``)."""
        widths = [st.tensor_parallel for st in self._rank_stages for _ in st.ranks]
        return sum(widths[:rank])

    def stage_workers(self, s: int) -> tuple[int, ...]:
        """Where every worker of stage ``s`` sits on the topology: each replica's first
        worker (``workers``, else :meth:`rank_first_worker`) and the ``t - 1`` after it."""
        st = self.stages[s]
        firsts = st.workers or tuple(self.rank_first_worker(r) for r in st.ranks)
        return tuple(w + k for w in firsts for k in range(st.tensor_parallel))

    @property
    def throughput_minibatches_per_s(self) -> float:
        """Minibatches per second in steady state; 0.0 when there is no prediction."""
        return 1.0 / self.time_per_minibatch_s if self.time_per_minibatch_s > 0 else 0.0

    @property
    def in_flight(self) -> tuple[int, ...]:
        """Minibatches each stage's replicas hold under PipeDream's schedule: the
        stages' own counts, else :func:`~dreampipe.planning.in_flight.in_flight_counts`."""
        if self.stages[0].in_flight:
            return tuple(st.in_flight for st in self.stages)
        return in_flight_counts([st.replicas for st in self.stages])

    def zero_levels(self, run: int) -> tuple[int, ...]:
        """Each stage's ZeRO level: its own, else the run's ``run``."""
        return tuple(run if st.zero is None else st.zero for st in self.stages)

    def stage_of_rank(self, rank: int) -> int:
        """The stage process ``rank`` runs, where ``placement.rank_workers`` starts its
        schedule rank; its first where it runs several (:meth:`stages_of_rank`)."""
        placed = rank_workers(self)
        held = next((r for r, (first, t) in enumerate(placed) if first <= rank < first + t),
                    None)
        if held is None:
            raise PlanError(f"rank {rank} is not in this plan of {self.workers_used} workers")
        return next(s for s, st in enumerate(self._rank_stages) if held in st.ranks)

    def placed(self, placement: Placement) -> Plan:
        """This plan of several stages per rank in ``placement``: each stage on the rank
        (and workers) that placement gives it, the same stages and costs."""
        if placement is self.placement:
            return self
        v, n = self.virtual_stages, self.num_stages
        ranks = stage_ranks(n, v, placement)
        firsts = self._rank_stages
        at = position_firsts([st.replicas for st in self.stages], v, self.placement)
        stages = tuple(dataclasses.replace(st, ranks=tuple(range(at[ranks[s]],
                                                                 at[ranks[s] + 1])),
                                           workers=firsts[ranks[s]].workers)
                       for s, st in enumerate(self.stages))
        return dataclasses.replace(self, stages=stages, placement=placement)

    def stages_of_rank(self, rank: int) -> tuple[int, ...]:
        """Every stage worker ``rank`` runs, in pipeline order: one, or ``virtual_stages``
        placed as :attr:`placement` says."""
        first = self.stage_of_rank(rank)
        if self.virtual_stages == 1:
            return (first,)
        return rank_stages(first, self.num_stages, self.virtual_stages, self.placement)

    def layers_of_rank(self, rank: int) -> tuple[int, ...]:
        """Every layer worker ``rank`` runs (the layers of :meth:`stages_of_rank`)."""
        return tuple(i for s in self.stages_of_rank(rank)
                     for i in range(self.stages[s].first, self.stages[s].last + 1))

    def speedup_over(self, baseline: str) -> float:
        """Predicted speedup of this plan over ``baseline`` (``dp``, ``straight``, ``gpipe``)."""
        if baseline not in self.baselines_s:
            raise PlanError(f"no prediction for {baseline!r}; have {sorted(self.baselines_s)}")
        if self.time_per_minibatch_s <= 0:
            return 0.0
        return self.baselines_s[baseline] / self.time_per_minibatch_s

    # ---- JSON -----------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": PLAN_FORMAT,
            "version": _VERSION,
            "model": self.model,
            "topology": self.topology,
            "batch_size": self.batch_size,
            "num_layers": self.num_layers,
            "layer_names": list(self.layer_names),
            "config": self.config,
            "time_per_minibatch_s": self.time_per_minibatch_s,
            "baselines_s": dict(self.baselines_s),
            "optimality_gap": self.optimality_gap,
            "heuristics": [h.value for h in self.heuristics],
            "virtual_stages": self.virtual_stages,
            **({} if self.placement is Placement.LOOP else {"placement": self.placement.value}),
            "stages": [
                {
                    "first": st.first,
                    "last": st.last,
                    "replicas": st.replicas,
                    "ranks": list(st.ranks),
                    "compute_s": st.compute_s,
                    "comm_s": st.comm_s,
                    "allreduce_s": st.allreduce_s,
                    "allreduce_delay_s": st.allreduce_delay_s,
                    "memory_bytes": st.memory_bytes,
                    "forward_s": st.forward_s,
                    "workers": list(st.workers),
                    "tensor_parallel": st.tensor_parallel,
                    "splits": [x.value for x in st.splits],
                    "in_flight": st.in_flight,
                    "recompute": st.recompute,
                    **({} if st.zero is None else {"zero": st.zero}),
                    **({"shared_link_s": st.shared_link_s} if st.shared_link_s else {}),
                    **({"loop_s": st.loop_s} if st.loop_s else {}),
                }
                for st in self.stages
            ],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        got = data.get("format") if isinstance(data, dict) else type(data).__name__
        if got != PLAN_FORMAT:
            raise PlanError(f"format={got!r}: not a dreampipe plan (its 'format' is "
                            f"{PLAN_FORMAT!r}); give a plan JSON from 'dreampipe plan -o'")
        if data.get("version") != _VERSION or isinstance(data.get("version"), bool):
            raise PlanError(f"version={json.dumps(data.get('version'))}: this dreampipe reads "
                            f"plan format version {_VERSION}; write the plan again with "
                            "'dreampipe plan -o'")
        fields = PlanFields(data)
        try:
            plan = cls(
                stages=read_stages(fields), num_layers=fields.whole("num_layers"),
                batch_size=fields.whole("batch_size"), model=fields.text("model"),
                topology=fields.text("topology"),
                time_per_minibatch_s=fields.number("time_per_minibatch_s"),
                baselines_s=fields.numbers_by_name("baselines_s"),
                layer_names=fields.texts("layer_names", []),
                optimality_gap=fields.number("optimality_gap", 0.0),
                heuristics=fields.choices("heuristics", Heuristic),
                virtual_stages=fields.whole("virtual_stages", 1),
                placement=fields.choice("placement", Placement, Placement.LOOP),
            )
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, PlanError):
                raise
            raise PlanError(f"malformed plan JSON: {exc!r}") from exc
        check_agrees(fields, config=plan.config, names=len(plan.layer_names),
                     num_layers=plan.num_layers, batch_size=plan.batch_size)
        return plan

    def to_json(self, extra: dict[str, Any] | None = None) -> str:
        """Strict JSON: no ``Infinity`` or ``NaN`` (see the class docstring); ``extra``:
        keys beside the plan's, which :meth:`from_dict` leaves to whoever wrote them."""
        return json.dumps({**self.to_dict(), **(extra or {})}, indent=1, allow_nan=False)

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise PlanError(
                f"cannot read plan {str(path)!r}: {exc}; give a plan JSON from 'dreampipe plan -o'"
            ) from exc
        except PlanError as exc:
            raise PlanError(f"plan {str(path)!r}: {exc}") from exc

    def save(self, path: str | Path, extra: dict[str, Any] | None = None) -> None:
        Path(path).write_text(self.to_json(extra) + "\n")

    def __str__(self) -> str:
        return plan_text(self)
