"""The plan's simulated check warns where the simulator parts from the prediction, and why."""

from __future__ import annotations

from dreampipe.cli.links import profile_on
from dreampipe.cli.plan_check import CHECK_TOLERANCE, check_ratio, check_warning, format_check
from dreampipe.cli.plan_command import confirm_by_simulation
from dreampipe.planning.evaluate import evaluate_plan
from dreampipe.planning.options import PlanOptions
from dreampipe.planning.planner import plan_pipeline
from dreampipe.planning.topology import Topology


def _checked(profile: str, cluster: str, memory: bool = False) -> tuple[float, str | None]:
    topo = Topology.parse(cluster)
    graph = profile_on(profile, topo)
    plan = plan_pipeline(graph, topo, PlanOptions(
        memory_bytes=topo.memory_bytes if memory else None, recompute=memory))
    sim = confirm_by_simulation(plan, graph, topo)
    assert f"{check_ratio(plan, sim):.0%} of the prediction" in format_check(plan, sim)
    return check_ratio(plan, sim), check_warning(plan, sim)


def test_a_plan_the_simulator_runs_as_predicted_draws_no_warning() -> None:
    ratio, warning = _checked("pipedream:resnet18", "cluster-b")
    assert abs(ratio - 1) <= CHECK_TOLERANCE and warning is None


def test_a_cut_priced_on_one_link_runs_faster_and_says_so() -> None:
    # VGG-16 on 16x8 in 16 GB as 8r-8 (the range program's plan on its grid of whole
    # servers), one server each side of the cut; each server's link carries one direction,
    # the price both
    topo = Topology.parse("16x8")
    graph = profile_on("pipedream:vgg16", topo)
    plan = evaluate_plan(graph, topo, [0, 11], [8, 8], memory_bytes=topo.memory_bytes,
                         recompute=[True, False])
    sim = confirm_by_simulation(plan, graph, topo)
    ratio, warning = check_ratio(plan, sim), check_warning(plan, sim)
    assert ratio > 1 + CHECK_TOLERANCE
    assert warning is not None and f"{ratio:.0%}" in warning and "one link" in warning


def test_stages_short_of_whole_rounds_in_flight_run_slower_and_say_so() -> None:
    # a GPT's 24 layers on cluster-b (16 GB) as 1-1-6-1-1-5-1: the memory leaves the
    # stages PipeDream's count, short of whole rounds, and replicas wait for each other at
    # each all-reduce (the planner keeps a straight pipeline there instead)
    topo = Topology.parse("cluster-b")
    graph = profile_on("gpt:layers=24,hidden=2048,heads=16,seq=1024,vocab=50257", topo)
    plan = evaluate_plan(graph, topo, [0, 9, 20, 78, 87, 98, 145], [1, 1, 6, 1, 1, 5, 1],
                         memory_bytes=topo.memory_bytes)
    sim = confirm_by_simulation(plan, graph, topo)
    ratio, warning = check_ratio(plan, sim), check_warning(plan, sim)
    assert ratio < 1 - CHECK_TOLERANCE
    assert warning is not None and "rounds whole" in warning
    assert "Stages [0, 1, 2, 3, 4, 5] hold [16, 15, 3, 8, 7, 2]" in warning
