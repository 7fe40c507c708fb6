"""Placement: a plan says how many stages each rank runs, its JSON keeps it, and a run
that asks for another count, or a topology too small for its ranks, is an error."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from dreampipe.api.checks import check_stages_per_rank
from dreampipe.errors import ConfigError, PlanError
from dreampipe.planning.placement import (
    Placement,
    check_fits,
    check_schedule,
    moved_stages,
    rank_workers,
    stage_ranks,
    virtual_stages_of,
)
from dreampipe.planning.plan import Plan, Stage
from dreampipe.planning.topology import Topology


def _interleaved(v: int = 2, workers: int = 4) -> Plan:
    n = v * workers
    return Plan.from_config(n, list(range(n)), [1] * n, model="chain8", topology=str(workers),
                            virtual_stages=v)


def test_from_config_puts_stage_s_on_rank_s_mod_workers() -> None:
    plan = _interleaved()
    assert [st.ranks for st in plan.stages] == [(s % 4,) for s in range(8)]
    assert [plan.stage_workers(s) for s in range(8)] == [(s % 4,) for s in range(8)]
    assert plan.workers_used == 4 and plan.num_stages == 8
    assert [plan.stage_of_rank(r) for r in range(4)] == [0, 1, 2, 3]
    with pytest.raises(PlanError, match="rank 4 is not in this plan of 4 workers"):
        plan.stage_of_rank(4)
    assert stage_ranks(6, 3) == (0, 1, 0, 1, 0, 1) and stage_ranks(3, 2) == (0, 1, 2)
    assert "4 workers, 2 stages per worker" in str(plan)


@pytest.mark.parametrize("placement", list(Placement))
def test_copies_put_a_positions_replicas_side_by_side(placement: Placement) -> None:
    """Every stage on 2 replicas, 2 stages a rank: 2 copies of a 2-rank pipeline, position
    ``q``'s replicas ranks ``2q`` and ``2q + 1``, as a replicated stage's are."""
    plan = Plan.from_config(8, [0, 2, 4, 6], [2] * 4, virtual_stages=2, placement=placement)
    home = stage_ranks(4, 2, placement)
    assert [st.ranks for st in plan.stages] == [(2 * q, 2 * q + 1) for q in home]
    assert plan.workers_used == 4 and plan.config == "2-2-2-2"
    assert [plan.stages_of_rank(r) for r in range(4)] == [
        tuple(s for s in range(4) if home[s] == r // 2) for r in range(4)]
    assert plan.placed(Placement.LOOP if placement is Placement.V else Placement.V
                       ).placed(placement) == plan
    assert Plan.from_dict(json.loads(plan.to_json())) == plan
    check_stages_per_rank(4, 2, 4, replicas=2)
    with pytest.raises(ConfigError, match="needs 2 stages each on 2 replicas, not the plan's 4"):
        check_stages_per_rank(4, 2, 2, replicas=2)


@pytest.mark.parametrize("placement", list(Placement))
def test_a_replicated_position_numbers_the_ranks_position_by_position(
        placement: Placement) -> None:
    """Positions of 2 and 1 replicas, 2 stages each: position 0's two ranks run both its
    stages, position 1's rank the others'; the ranks follow the positions."""
    replicas = [2, 1, 2, 1] if placement is Placement.LOOP else [2, 1, 1, 2]
    plan = Plan.from_config(8, [0, 2, 4, 6], replicas, virtual_stages=2, placement=placement)
    home = stage_ranks(4, 2, placement)
    assert [st.ranks for st in plan.stages] == [((0, 1), (2,))[q] for q in home]
    assert plan.workers_used == 3
    assert [plan.stages_of_rank(r) for r in range(3)] == [
        tuple(s for s in range(4) if home[s] == (0, 0, 1)[r]) for r in range(3)]
    assert [plan.layers_of_rank(r) for r in range(3)] == [
        tuple(i for s in plan.stages_of_rank(r) for i in (2 * s, 2 * s + 1)) for r in range(3)]
    assert Plan.from_dict(json.loads(plan.to_json())) == plan
    check_stages_per_rank(4, 2, 3, replicas=replicas)
    with pytest.raises(ConfigError, match=r"needs stages whose replicas add up to 8, not the "
                                          r"plan's 4 \(of 6 replicas\)"):
        check_stages_per_rank(4, 2, 4, replicas=replicas)
    stray = 2 if placement is Placement.LOOP else 3  # on position 0, with 1 replica
    with pytest.raises(PlanError, match=f"stage {stray} shares position 0's ranks with stage "
                                        "0: give it 2 replicas"):
        Plan.from_config(8, [0, 2, 4, 6], [2, 1, 1, 1], virtual_stages=2, placement=placement)


def test_json_round_trip_keeps_the_stages_per_rank(tmp_path: Path) -> None:
    plan = _interleaved(v=2)
    data = json.loads(plan.to_json())
    assert data["virtual_stages"] == 2
    assert [st["ranks"] for st in data["stages"]] == [[s % 4] for s in range(8)]
    path = tmp_path / "p.json"
    plan.save(path)
    again = Plan.load(path)
    assert again == plan and again.virtual_stages == 2 and again.workers_used == 4
    one = Plan.from_config(4, [0, 2], [1, 1])
    assert Plan.from_dict(json.loads(one.to_json())) == one


def test_a_plan_file_without_the_field_runs_one_stage_per_rank() -> None:
    data = Plan.from_config(8, list(range(8)), [1] * 8, topology="4").to_dict()
    del data["virtual_stages"]  # as plan files were written before it
    old = Plan.from_dict(data)
    assert old.virtual_stages == 1 and old.workers_used == 8


@pytest.mark.parametrize(("build", "needle"), [
    (lambda: Plan.from_config(6, list(range(6)), [1] * 6, virtual_stages=4),
     "virtual_stages=4 for a plan of 6 stages; give a divisor of 6"),
    (lambda: Plan.from_config(4, [0, 1, 2, 3], [2, 1, 1, 1], virtual_stages=2),
     r"virtual_stages=2 with replicas \[2, 1, 1, 1\]"),
    (lambda: Plan(stages=(Stage(first=0, last=0, replicas=2, ranks=(0, 1)),
                          Stage(first=1, last=1, replicas=1, ranks=(0,))),
                  num_layers=2, virtual_stages=2),
     "virtual_stages=2 with stage 1 on 1 replicas split over 1 workers; the stages of one "
     r"position \(rank\) run on its ranks, each stage on one worker a replica: give stage 1 "
     "the 2 replicas of stage 0"),
    (lambda: Plan(stages=tuple(Stage(first=s, last=s, replicas=2, ranks=(2 * s, 2 * s + 1))
                               for s in range(4)), num_layers=4, virtual_stages=2),
     r"ranks \[0, 1, 2, 3, 0, 1, 2, 3\], but the stages have ranks \[0, 1, 2, 3, 4, 5, 6, 7\]"),
    (lambda: Plan(stages=tuple(Stage(first=s, last=s, replicas=1, ranks=(s,))
                               for s in range(4)), num_layers=4, virtual_stages=2),
     r"runs stage s on rank s mod 2, ranks \[0, 1, 0, 1\], but the stages have ranks "
     r"\[0, 1, 2, 3\]"),
    (lambda: Plan(stages=tuple(Stage(first=s, last=s, replicas=1, ranks=(s % 2,),
                                     workers=(s,)) for s in range(4)),
                  num_layers=4, virtual_stages=2),
     r"stage 2 sits on workers \[2\] but shares rank 0 with stage 0 on \[0\]"),
    (lambda: Plan.from_config(2, [0, 1], [1, 1], virtual_stages=0),
     "virtual_stages=0 for a plan of 2 stages"),
])
def test_placements_that_cannot_run_name_the_fix(build: object, needle: str) -> None:
    with pytest.raises(PlanError, match=needle):
        build()  # type: ignore[operator]


def test_a_count_asked_for_must_be_the_plans() -> None:
    plan = _interleaved(v=2)
    assert virtual_stages_of(plan, None) == 2 and virtual_stages_of(plan, 2) == 2
    with pytest.raises(ConfigError, match=r"virtual_stages=1 but plan 'p.json' runs 2 stages "
                                          r"per worker \(its virtual_stages is 2\); drop "
                                          r"virtual_stages=1") as caught:
        virtual_stages_of(plan, 1, "plan 'p.json'")
    assert caught.value.parameters == ("virtual_stages",)
    with pytest.raises(ConfigError, match="runs one stage per worker.*with 3 stages per worker "
                                          r"\(dreampipe plan --virtual-stages 3\)"):
        virtual_stages_of(Plan.from_config(2, [0, 1], [1, 1]), 3)


def test_several_stages_per_rank_need_the_interleaved_schedule() -> None:
    check_schedule(_interleaved(), "interleaved-1f1b")
    check_schedule(Plan.from_config(2, [0, 1], [1, 1]), "pipedream")
    with pytest.raises(ConfigError, match=r"schedule=1f1b-flush for the plan, which runs 2 "
                                          r"stages per worker.*use schedule=interleaved-1f1b"):
        check_schedule(_interleaved(), "1f1b-flush")


def test_ranks_beyond_the_topology_are_an_error_that_names_the_fix() -> None:
    check_fits(_interleaved(), Topology.parse("4"))
    old = Plan.from_config(8, list(range(8)), [1] * 8, topology="4")  # 8 ranks, no placement
    with pytest.raises(PlanError, match=r"needs 8 workers \(a rank at position 7\) but "
                                        r"topology 4 has 4; pick a larger --topology, of 8 "
                                        r"workers or more, or, for 2 stages per worker, make "
                                        r"the plan with dreampipe plan --virtual-stages 2"):
        check_fits(old, Topology.parse("4"))
    with pytest.raises(PlanError, match=r"needs 3 workers .* has 2; pick a larger "
                                        r"--topology, of 3 workers or more$"):
        check_fits(Plan.from_config(4, [0, 2], [2, 1]), Topology.parse("2"))


def _v(workers: int = 4) -> Plan:
    n = 2 * workers
    return Plan.from_config(n, list(range(n)), [1] * n, model="chain8", topology=str(workers),
                            virtual_stages=2, placement=Placement.V)


def test_the_v_placement_puts_stage_s_with_2p_minus_1_minus_s_and_keeps_it(
    tmp_path: Path
) -> None:
    plan = _v()
    assert [st.ranks for st in plan.stages] == [(r,) for r in (0, 1, 2, 3, 3, 2, 1, 0)]
    assert [plan.stages_of_rank(r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert plan.workers_used == 4 and "2 stages per worker in a V" in str(plan)
    assert json.loads(plan.to_json())["placement"] == "v"
    assert "placement" not in json.loads(_interleaved().to_json())  # older files unchanged
    plan.save(tmp_path / "v.json")
    assert Plan.load(tmp_path / "v.json") == plan
    loop = plan.placed(Placement.LOOP)
    assert loop == _interleaved() and loop.placed(Placement.V) == plan
    assert _interleaved().stages_of_rank(1) == (1, 5)


def test_a_v_plan_runs_only_the_v_schedules_and_they_only_it() -> None:
    check_schedule(_v(), "zbv")
    check_schedule(_v(), "dualpipev")
    with pytest.raises(ConfigError, match=r"schedule=interleaved-1f1b for the plan, which runs "
                       r"2 stages per worker in a V \(its virtual_stages is 2\); only zbv and "
                       r"dualpipev run that: use schedule=zbv or schedule=dualpipev"):
        check_schedule(_v(), "interleaved-1f1b")
    with pytest.raises(ConfigError, match=r"schedule=zbv for the plan, which runs 2 stages per "
                       r"worker in the loop placement; zbv runs 2 stages a rank in the V "
                       r"placement: give 2 x workers split points, or make the plan with "
                       r"dreampipe plan --schedule zbv"):
        check_schedule(_interleaved(), "zbv")
    with pytest.raises(ConfigError, match=r"schedule=dualpipev .* runs one stage per worker"):
        check_schedule(Plan.from_config(2, [0, 1], [1, 1]), "dualpipev")


@pytest.mark.parametrize(("build", "needle"), [
    (lambda: Plan.from_config(6, list(range(6)), [1] * 6, virtual_stages=3,
                              placement=Placement.V),
     "the V placement with virtual_stages=3; it puts exactly 2 stages on each rank"),
    (lambda: Plan(stages=tuple(Stage(first=s, last=s, replicas=1, ranks=(s % 2,))
                               for s in range(4)), num_layers=4, virtual_stages=2,
                  placement=Placement.V),
     r"runs stage s and 3-s on rank min\(s, 3-s\), ranks \[0, 1, 1, 0\], but the stages "
     r"have ranks \[0, 1, 0, 1\]; number them so \(Plan.from_config\(..., virtual_stages=2, "
     r"placement=Placement.V\)\)"),
])
def test_a_v_that_cannot_run_names_the_fix(build: object, needle: str) -> None:
    with pytest.raises(PlanError, match=needle):
        build()  # type: ignore[operator]


def test_stages_copied_onto_other_servers_are_moved_from_rank_order() -> None:
    """A plan whose inner pipeline is copied on both servers (stage 0 on workers 0 and 2)
    lays its ranks out of rank order, and its ranks start there (``rank_workers``, a
    stage's replicas on its workers in the order it lists them); plans in rank order, or
    given by their config, are not moved. The workers a plan lays are numbered by their
    place among them all, one process each, so a plan that leaves workers idle runs on
    as many processes."""
    from dreampipe.planning.evaluate import evaluate_plan
    from dreampipe.planning.topology import Level
    from dreampipe.profiling.graph import Layer, LayerGraph

    graph = LayerGraph.chain([Layer("a", 16.0, 24.0, 30 * 10**6, 10**8),
                              Layer("b", 16.0, 24.0, 1, 10**8)])
    topo = Topology((Level(2, 1e9), Level(2, 1e12)))
    copied = evaluate_plan(graph, topo, [0, 1], [2, 2], workers=[[0, 2], [1, 3]])
    assert moved_stages(copied) == (0, 1)
    half = evaluate_plan(graph, topo, [0, 1], [2, 2], workers=[[0, 1], [2, 3]])
    assert moved_stages(half) == ()
    swapped = dataclasses.replace(half, stages=(
        half.stages[0], dataclasses.replace(half.stages[1], workers=(3, 2))))
    assert moved_stages(swapped) == (1,)  # minibatch 0 goes to worker 3
    assert rank_workers(swapped) == ((0, 1), (1, 1), (3, 1), (2, 1))
    assert moved_stages(evaluate_plan(graph, topo, [0, 1], [1, 3])) == ()
    assert moved_stages(Plan.from_config(2, [0, 1], [2, 2])) == ()
    assert rank_workers(copied) == ((0, 1), (2, 1), (1, 1), (3, 1))
    assert [copied.stage_of_rank(w) for w in range(4)] == [0, 1, 0, 1]
    assert "x2 ranks [0, 1] on workers [0, 2]" in str(copied)
    assert "on workers" not in str(Plan.from_config(2, [0, 1], [2, 2]))
    assert rank_workers(half) == ((0, 1), (1, 1), (2, 1), (3, 1))
    assert rank_workers(Plan.from_config(2, [0, 1], [2, 2])) == rank_workers(half)
    far = dataclasses.replace(copied, stages=(
        copied.stages[0], dataclasses.replace(copied.stages[1], workers=(1, 5))))
    assert rank_workers(far) == rank_workers(copied)  # worker 5 is the fourth: process 3
    gaps = dataclasses.replace(half, stages=(
        half.stages[0], dataclasses.replace(half.stages[1], workers=(4, 5))))
    assert moved_stages(gaps) == () and rank_workers(gaps) == rank_workers(half)
    assert [gaps.stage_of_rank(p) for p in range(4)] == [0, 0, 1, 1]
