"""A synchronous plan: its layout, schedule, microbatches and each stage's terms.

What :func:`~dreampipe.planning.sync_search.plan_sync` returns. ``d`` copies of a
pipeline of ``p`` stages (``p v`` chunks under interleaving), each replica split over
``t`` workers, run ``m`` microbatches of ``b`` samples an update of ``B = d m b``; the
update takes :attr:`SyncPlan.time_per_update_s`, the largest stage term
(:mod:`dreampipe.planning.sync_objective`). :meth:`SyncPlan.plan` writes it as a
:class:`~dreampipe.planning.plan.Plan` with per-minibatch figures, so that ``simulate``,
``train`` and the check run it; interleaving is a plan only on unsplit, unreplicated
stages, as the schedule runs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dreampipe.planning.plan import Plan, Stage
from dreampipe.planning.sync_dp import StageTerms
from dreampipe.planning.sync_objective import PipelineKind
from dreampipe.planning.sync_stage_option import Recompute, StageOption
from dreampipe.planning.sync_tables import StageTables
from dreampipe.profiling.gpt_shapes import blocks_recomputed
from dreampipe.profiling.gpt_spec import BY_SHAPE, parse_gpt_spec
from dreampipe.profiling.graph import LayerGraph

__all__ = ["SyncPlan", "SyncStage"]


@dataclass(frozen=True)
class SyncStage:
    """A stage (a chunk under interleaving) of layers ``first..last`` run as ``option``,
    with its terms: ``tau_s`` per microbatch on a replica (``forward_s`` and ``compute_s``
    its forward, and forward and backward, before ZeRO's collectives), ``cut_s`` the cut
    after it per microbatch, ``tail_s`` what the update adds after its last backward,
    ``memory_bytes`` per worker holding ``held`` microbatches, on worker block ``block``;
    ``recomputed``: the layers whose forward its backward runs again, block by block."""

    first: int
    last: int
    option: StageOption
    tau_s: float
    forward_s: float
    compute_s: float
    cut_s: float
    tail_s: float
    allreduce_s: float
    memory_bytes: float
    held: int
    block: int
    recomputed: tuple[int, ...] = ()

    @classmethod
    def priced(cls, terms: StageTerms, tables: StageTables, block: int) -> SyncStage:
        """The stage ``terms`` chose on worker ``block``, its work and all-reduce read
        from ``tables`` (at their microbatch)."""
        c = terms.chosen
        return cls(c.first, c.last, tables.options[c.option], terms.tau_s,
                   *tables.work(c.option, c.first, c.last), terms.cut_s, terms.tail_s,
                   tables.allreduce(c.option, block, c.first, c.last), terms.memory_bytes,
                   terms.held, block, tables.recomputed(c.option, c.first, c.last))


@dataclass(frozen=True)
class SyncPlan:
    """The chosen layout and its prediction (module doc). ``optimality_gap`` is 0: the
    search is exact over its choices (docs/planner.md)."""

    stages: tuple[SyncStage, ...]
    schedule: PipelineKind
    tensor_parallel: int
    data_parallel: int
    pipeline: int
    virtual_stages: int
    microbatch_size: int
    microbatches: int
    global_batch: int
    time_per_update_s: float
    profile_batch: int
    num_layers: int
    model: str = ""
    topology: str = ""

    @property
    def workers_used(self) -> int:
        return self.tensor_parallel * self.data_parallel * self.pipeline

    @property
    def zero(self) -> int:
        """The highest ZeRO level a stage shards at (each stage's is its option's)."""
        return max(st.option.zero for st in self.stages)

    @property
    def layout(self) -> str:
        """The layout as ``--layout`` writes it (with ``v``, ``z`` and ``r`` where used)."""
        parts = [f"t{self.tensor_parallel}", f"p{self.pipeline}"]
        parts += [f"v{self.virtual_stages}"] if self.virtual_stages > 1 else []
        levels = {st.option.zero for st in self.stages}
        parts += [f"z{levels.pop()}"] if len(levels) == 1 and self.zero else []
        blocks = {st.option.blocks if st.option.recompute is Recompute.BLOCKS else None
                  for st in self.stages}  # -rK where every stage recomputes its first K
        parts += [f"r{blocks.pop()}"] if len(blocks) == 1 and None not in blocks else []
        return "-".join(parts)

    @property
    def recomputed_layers(self) -> tuple[int, ...]:
        """Every layer whose forward a backward runs again: a recomputed stage's all,
        else its recomputed blocks' (a chunk's under interleaving, once for all copies)."""
        return tuple(i for st in self.stages for i in (
            range(st.first, st.last + 1) if st.option.recompute is Recompute.STAGE
            else st.recomputed))

    def tflops_per_gpu(self, graph: LayerGraph, seconds: float) -> float | None:
        """Megatron-LM's teraFLOP/s per GPU of an update taking ``seconds`` for ``graph``, a
        profile by shape (None for others): the FLOPs of what the plan runs, its
        recomputed blocks included (:meth:`~dreampipe.profiling.gpt_shapes.GptShape.
        update_flops`)."""
        spec = graph.meta.get(BY_SHAPE)
        if not spec or seconds <= 0:
            return None
        again = blocks_recomputed(graph, self.recomputed_layers)
        flops = parse_gpt_spec(spec).shape.update_flops(self.global_batch, again)
        return flops / seconds / self.workers_used / 1e12

    @property
    def bubble_fraction(self) -> float:
        """The update's time beyond ``m`` microbatches on the slowest stage, over it."""
        busy = self.microbatches * max(st.tau_s for st in self.stages) * self.virtual_stages
        return max(0.0, 1.0 - busy / self.time_per_update_s) if self.time_per_update_s else 0.0

    def plan(self) -> Plan | None:
        """The plan the simulator and the runtime run (stage figures per profiled
        minibatch), or None for interleaving on split or replicated stages."""
        v, d, t = self.virtual_stages, self.data_parallel, self.tensor_parallel
        if v > 1 and (d > 1 or t > 1):
            return None
        per = self.profile_batch / self.microbatch_size  # profiled minibatch / microbatch
        stages, rank = [], 0
        for s, st in enumerate(self.stages):
            split = st.option.split
            ranks = (s % self.pipeline,) if v > 1 else tuple(range(rank, rank + d))
            rank += 0 if v > 1 else d
            stages.append(Stage(
                first=st.first, last=st.last, replicas=d, ranks=ranks,
                compute_s=st.compute_s * per, forward_s=st.forward_s * per,
                comm_s=st.cut_s * per / d, allreduce_s=st.allreduce_s,
                memory_bytes=round(st.memory_bytes), tensor_parallel=t,
                splits=() if split is None else split.layers(st.first, st.last),
                recompute=st.option.recompute is Recompute.STAGE,
                zero=st.option.zero or None))
        return Plan(stages=tuple(stages), num_layers=self.num_layers,
                    batch_size=self.profile_batch, model=self.model, topology=self.topology,
                    time_per_minibatch_s=self.time_per_update_s * self.profile_batch
                    / self.global_batch, virtual_stages=v)

    def to_dict(self) -> dict[str, Any]:
        """JSON data: the layout, schedule, batch, prediction and every stage's terms."""
        return {
            "objective": "sync", "layout": self.layout, "schedule": self.schedule.value,
            "tensor_parallel": self.tensor_parallel, "data_parallel": self.data_parallel,
            "pipeline_stages": self.pipeline, "virtual_stages": self.virtual_stages,
            "zero": self.zero, "global_batch": self.global_batch,
            "microbatch_size": self.microbatch_size, "microbatches": self.microbatches,
            "workers_used": self.workers_used, "time_per_update_s": self.time_per_update_s,
            "bubble_fraction": self.bubble_fraction, "optimality_gap": 0.0,
            "memory_bytes": [st.memory_bytes for st in self.stages],
            "stages": [{"first": st.first, "last": st.last, "option": st.option.label,
                        "zero": st.option.zero,
                        "tau_s": st.tau_s, "cut_s": st.cut_s, "tail_s": st.tail_s,
                        "memory_bytes": st.memory_bytes, "held": st.held,
                        "worker_block": st.block} for st in self.stages],
        }
