"""Why each stage of a plan has its replicas, its split and its recomputation.

``dreampipe plan`` prints one line per stage from the plan's own terms: the
slowest of a stage's terms (its compute over its replicas, its round with
the all-reduce, the cut after it, the server link that cut shares) against
the pipeline's time, what one replica fewer would take, and its memory per
worker, with and without recomputation, against ``--memory``; on a topology of
several servers, also where its workers sit, where its ranks start.
"""

from __future__ import annotations

from collections.abc import Sequence

from dreampipe.planning.costs import RangeCosts
from dreampipe.planning.memory_terms import STATELESS, OptimizerTerms
from dreampipe.planning.plan import Plan, Stage
from dreampipe.profiling.graph import LayerGraph
from dreampipe.quantities import format_bytes

__all__ = ["stage_reasons"]


def _terms(stage: Stage) -> dict[str, float]:
    """The stage's per-minibatch terms whose max is its time (:attr:`Stage.time_s`)."""
    r = stage.replicas
    return {
        "compute": stage.compute_s / r,
        "all-reduce": (stage.forward_s + stage.allreduce_delay_s + stage.allreduce_s) / r,
        "cut": stage.comm_s,
        "shared server link": stage.shared_link_s,
        "1F1B loop with the stages after it": stage.loop_s,
    }


def _replicas(stage: Stage, pipeline_s: float) -> str:
    """Why the stage has its replica count: what its round would take on one fewer (the
    all-reduce kept as it is)."""
    r = stage.replicas
    if r == 1:
        return "1 replica"
    terms = _terms(stage)
    fewer = max(terms["compute"], terms["all-reduce"]) * r / (r - 1)
    if fewer > pipeline_s:
        return (f"{r} replicas (on {r - 1} its round would take {fewer * 1e3:.2f} ms, above "
                "the pipeline's time)")
    return f"{r} replicas (fewer would keep up too; the workers were spare)"


def _memory(stage: Stage, costs: RangeCosts, memory_bytes: int | None) -> str:
    """The stage's memory per worker, and why it recomputes or is split."""
    limit = "" if memory_bytes is None else f" of {format_bytes(memory_bytes)}"
    text = f"memory {format_bytes(stage.memory_bytes)}{limit}"
    versions = stage.in_flight or 1
    if stage.recompute:
        kept = costs.memory(stage.first, stage.last, versions)
        text += (f"; recomputes: keeping its activations for {versions} minibatch"
                 f"{'es' if versions > 1 else ''} in flight would need {format_bytes(kept)}")
    if stage.tensor_parallel > 1:
        text += f"; {_split(stage, costs, memory_bytes)}"
    return text


def _split(stage: Stage, costs: RangeCosts, memory_bytes: int | None) -> str:
    """Why the stage is split: what its layers would hold and take unsplit on its workers."""
    t, r = stage.tensor_parallel, stage.replicas
    workers = r * t
    versions = -(-(stage.in_flight or 1) * r // workers)
    whole = costs.memory(stage.first, stage.last, versions)
    alone = float(costs.compute_s[stage.first, stage.last]) / workers
    text = (f"split over {t} workers of one server (the split's collectives are in its "
            f"compute): unsplit, each of its {workers} workers would hold {format_bytes(whole)}")
    if memory_bytes is not None and whole > memory_bytes:
        return text + ", above the limit"
    return (text + f" and its compute alone would take {alone * 1e3:.2f} ms per minibatch, "
            "the all-reduce of whole weights on top")


#: The most runs of workers a stage's place lists before it only counts the rest.
_RUNS = 4


def _runs(values: Sequence[int]) -> str:
    """Sorted ``values`` as runs (``0-2, 8-10``), the first :data:`_RUNS` of them."""
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs[:_RUNS])
    return text if len(runs) <= _RUNS else f"{text} and {len(runs) - _RUNS} more runs"


def _place(workers: Sequence[int], per_server: int) -> str:
    """Where a stage's ``workers`` sit on servers of ``per_server``: the same workers of
    each of its servers where they are, else the workers themselves."""
    servers = sorted({w // per_server for w in workers})
    local = {tuple(sorted(w % per_server for w in workers if w // per_server == k))
             for k in servers}
    if len(servers) > 1 and len(local) == 1:
        return f"workers {_runs(next(iter(local)))} of servers {_runs(servers)}"
    return f"worker{'s' if len(workers) > 1 else ''} {_runs(sorted(workers))}"


def stage_reasons(result: Plan, graph: LayerGraph, memory_bytes: int | None,
                  optimizer: OptimizerTerms = STATELESS, per_server: int | None = None
                  ) -> list[str]:
    """One line per stage: where it sits on servers of ``per_server`` workers (None: one
    server), its slowest term, its replicas, split, recomputation and memory (beside what
    ``optimizer`` holds)."""
    costs = RangeCosts.of(graph, optimizer)
    pipeline_s = result.time_per_minibatch_s
    lines = []
    for s, stage in enumerate(result.stages):
        terms = _terms(stage)
        name = max(terms, key=lambda k: terms[k])
        share = terms[name] / pipeline_s if pipeline_s > 0 else 0.0
        where = "" if per_server is None else f"on {_place(result.stage_workers(s), per_server)}; "
        lines.append(
            f"stage {s}: {where}{_replicas(stage, pipeline_s)}; slowest term {name} "
            f"{terms[name] * 1e3:.2f} ms ({share:.0%} of the pipeline's time); "
            f"{_memory(stage, costs, memory_bytes)}"
        )
    return lines
