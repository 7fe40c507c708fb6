"""Routes between schedule ranks of different split widths: every receiving worker gets
each tensor exactly once, from a worker of the sending replica that holds it."""

from __future__ import annotations

import dataclasses

import pytest

from dreampipe.planning.plan import Plan, Stage
from dreampipe.planning.splits import Split
from dreampipe.runtime.lanes import Routes

__all__: list[str] = []


def _plan(*stages: tuple[int, int], reverse: bool = False) -> Plan:
    """One layer per stage, ``(replicas, t)`` each, ranks numbered stage by stage; with
    ``reverse``, the stages laid on the workers from the last stage's first."""
    out, rank = [], 0
    for s, (replicas, t) in enumerate(stages):
        ranks = tuple(range(rank, rank + replicas))
        out.append(Stage(first=s, last=s, replicas=replicas, ranks=ranks, tensor_parallel=t,
                         splits=(Split.REPLICA,) if t > 1 else ()))
        rank += replicas
    if reverse:
        first, laid = 0, []
        for st in reversed(out):
            laid.append(dataclasses.replace(st, workers=tuple(
                first + k * st.tensor_parallel for k in range(st.replicas))))
            first += st.replicas * st.tensor_parallel
        out = laid[::-1]
    return Plan(stages=tuple(out), num_layers=len(stages))


def test_a_worker_knows_its_schedule_rank_and_place() -> None:
    plan = _plan((1, 2), (2, 1), (1, 4))  # 1t2-2-1t4: workers 0-1, 2, 3, 4-7
    places = [(Routes.of(plan, w).rank, Routes.of(plan, w).member) for w in range(8)]
    assert places == [(0, 0), (0, 1), (1, 0), (2, 0), (3, 0), (3, 1), (3, 2), (3, 3)]
    with pytest.raises(ValueError, match="worker 8 is not in plan 1t2-2-1t4"):
        Routes.of(plan, 8)
    laid = _plan((1, 2), (2, 1), (1, 4), reverse=True)  # workers 6-7, 4, 5, 0-3
    places = [(Routes.of(laid, w).rank, Routes.of(laid, w).member) for w in range(8)]
    assert places == [(3, 0), (3, 1), (3, 2), (3, 3), (1, 0), (2, 0), (0, 0), (0, 1)]


@pytest.mark.parametrize("stages", [((1, 2), (2, 1)), ((2, 1), (1, 2)), ((1, 2), (1, 4)),
                                    ((1, 4), (1, 2)), ((1, 2), (1, 2)), ((1, 3), (1, 2))])
@pytest.mark.parametrize("reverse", [False, True])
def test_each_worker_of_the_receiving_rank_gets_the_tensor_once_from_its_source(
        stages: tuple[tuple[int, int], ...], reverse: bool) -> None:
    plan = _plan(*stages, reverse=reverse)
    workers = plan.workers_used
    routes = [Routes.of(plan, w) for w in range(workers)]
    for a in range(len(routes[0].widths)):
        for b in range(len(routes[0].widths)):
            if a == b:
                continue
            sent = [(w, dst) for w in range(workers) if routes[w].rank == a
                    for dst in routes[w].targets(b)]
            receivers = [w for w in range(workers) if routes[w].rank == b]
            assert sorted(dst for _, dst in sent) == receivers, (a, b, sent)
            assert sorted(sent) == sorted((routes[w].source(a), w) for w in receivers)
    if not plan.mixes_splits:  # lanes: worker k to worker k
        assert all(r.member == (dst - r.first(1 - r.rank)) for r in routes
                   for dst in r.targets(1 - r.rank))
