"""Plan: construction checks, config strings, derived figures and JSON round-trip."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dreampipe.errors import ConfigError, PlanError
from dreampipe.planning.config_string import config_string, parse_stage_bounds, stages_from_config
from dreampipe.planning.in_flight import in_flight_counts
from dreampipe.planning.plan import Heuristic, Plan, Stage
from dreampipe.planning.planner import evaluate_plan, plan_pipeline
from dreampipe.planning.topology import Topology
from dreampipe.profiling.graph import Layer, LayerGraph


def _plan() -> Plan:
    return Plan.from_config(
        8, [0, 5], [3, 1], model="toy", topology="4", batch_size=32,
        time_per_minibatch_s=0.5, baselines_s={"dp": 1.5, "straight": 1.0},
        layer_names=tuple(f"l{i}" for i in range(8)),
    )


def _st(first: int, last: int, rank: int) -> Stage:
    return Stage(first=first, last=last, replicas=1, ranks=(rank,))


def test_from_config_numbers_ranks_stage_by_stage() -> None:
    plan = _plan()
    assert [(s.first, s.last, s.replicas) for s in plan.stages] == [(0, 4, 3), (5, 7, 1)]
    assert [s.ranks for s in plan.stages] == [(0, 1, 2), (3,)]
    assert plan.workers_used == 4 and plan.num_stages == 2
    assert plan.stage_of_rank(2) == 0 and plan.stage_of_rank(3) == 1
    with pytest.raises(PlanError, match="rank 4"):
        plan.stage_of_rank(4)


@pytest.mark.parametrize(
    ("replicas", "config"),
    [([15, 1], "15-1"), ([1, 1, 1], "straight"), ([16], "16"), ([1], "1"), ([2, 1, 1], "2-1-1")],
)
def test_config_strings(replicas: list[int], config: str) -> None:
    assert config_string(replicas) == config
    assert stages_from_config(config, len(replicas)) == replicas


def test_bad_config_strings() -> None:
    with pytest.raises(PlanError, match="needs the number of stages"):
        stages_from_config("straight")
    with pytest.raises(PlanError, match="'2-x' is not like"):
        stages_from_config("2-x")
    with pytest.raises(PlanError, match="fewer than 1 replica"):
        stages_from_config("2-0")


def test_predictions() -> None:
    plan = _plan()
    assert plan.throughput_minibatches_per_s == pytest.approx(2.0)
    assert plan.speedup_over("dp") == pytest.approx(3.0)
    assert plan.speedup_over("straight") == pytest.approx(2.0)
    with pytest.raises(PlanError, match="'gpipe'"):
        plan.speedup_over("gpipe")


def test_stage_time_is_max_of_its_terms() -> None:
    stage = Stage(first=0, last=3, replicas=4, ranks=(0, 1, 2, 3), compute_s=8.0, comm_s=1.0,
                  allreduce_s=6.0)
    assert stage.time_s == pytest.approx(2.0)
    pair = Stage(first=0, last=0, replicas=2, ranks=(0, 1), compute_s=1.0, comm_s=3.0)
    assert pair.time_s == pytest.approx(3.0)
    assert stage.num_layers == 4


def test_json_round_trip(tmp_path: Path) -> None:
    plan = _plan()
    path = tmp_path / "plan.json"
    plan.save(path)
    again = Plan.load(path)
    assert again == plan
    assert again.baselines_s == plan.baselines_s and again.layer_names == plan.layer_names
    assert again.config == "3-1"
    rough = dataclasses.replace(plan, optimality_gap=0.25,
                                heuristics=(Heuristic.LAYER_BLOCKS, Heuristic.WORKER_GRID))
    assert Plan.from_dict(json.loads(rough.to_json())) == rough


def test_str_lists_stages() -> None:
    text = str(_plan())
    assert ("plan 3-1 for toy on 4 workers: 500.00 ms per profiled batch of 32 samples, "
            "64.0 samples/s by the planner's objective") in text
    unsized = str(dataclasses.replace(_plan(), batch_size=0))
    assert "500.00 ms per profiled batch, 2.00 batches/s by the planner" in unsized
    assert "stage 1: layers 5..7 (l5 .. l7) x1 ranks [3]" in text


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: Plan.from_config(8, [0, 4], [1]), "one entry per stage"),
        (lambda: Plan.from_config(8, [1, 4], [1, 1]), "must start at layer 0"),
        (lambda: Plan.from_config(8, [0, 9], [1, 1]), "empty or negative"),
        (lambda: Plan(stages=(), num_layers=3), "at least one stage"),
        (lambda: Plan(stages=(_st(0, 1, 0),), num_layers=3), "model has 3 layers"),
        (lambda: Plan(stages=(_st(0, 0, 0), _st(2, 2, 1)), num_layers=3), "contiguously"),
        (lambda: Plan(stages=(_st(0, 0, 1),), num_layers=1), "each used once"),
        (lambda: Stage(first=0, last=0, replicas=0, ranks=()), "needs >= 1"),
        (lambda: Stage(first=0, last=0, replicas=2, ranks=(0,)), "but ranks"),
    ],
)
def test_invalid_plans(build: Callable[[], object], message: str) -> None:
    with pytest.raises(PlanError, match=message):
        build()


def test_load_errors(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match="cannot read plan"):
        Plan.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "other"}')
    with pytest.raises(PlanError, match=r"^plan '.*bad\.json': format='other': not a "
                       r"dreampipe plan \(its 'format' is 'dreampipe\.plan'\); give a plan "
                       r"JSON from 'dreampipe plan -o'$"):
        Plan.load(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(PlanError, match="format='list': not a dreampipe plan"):
        Plan.load(bad)
    bad.write_text('{"format": "dreampipe.plan", "version": 1}')
    with pytest.raises(PlanError, match=r"bad\.json': field stages is missing; add it"):
        Plan.load(bad)


def test_load_binary_file(tmp_path: Path) -> None:
    binary = tmp_path / "plan.bin"
    binary.write_bytes(b"\xd0\xff\xfe\x00")
    with pytest.raises(PlanError, match=r"cannot read plan .*plan\.bin"):
        Plan.load(binary)



@pytest.mark.parametrize(
    ("text", "needle"),
    [("1,4", "must start at 0"), ("0,4,4", "increase"), ("0,8", "layer 8"), ("0,a", "e.g. 0,4")],
)
def test_stage_bounds_are_checked(text: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle) as info:
        parse_stage_bounds(text, 8)
    assert info.value.parameters == ("stages",)
    assert f"stages={text!r}" in str(info.value)
    assert parse_stage_bounds("0,3,5", 8) == [0, 3, 5]


# ---- predictions are finite, so plan JSON is strict JSON ----------------------------
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, -1.0])
@pytest.mark.parametrize("field", ["compute_s", "comm_s", "allreduce_s"])
def test_stage_figures_must_be_finite(field: str, value: float) -> None:
    kwargs: dict[str, Any] = {field: value}
    with pytest.raises(PlanError, match=field) as info:
        Stage(first=0, last=1, replicas=1, ranks=(0,), **kwargs)
    assert repr(value) in str(info.value) and "finite" in str(info.value)


@pytest.mark.parametrize("value", [math.inf, math.nan])
def test_plan_figures_must_be_finite(value: float) -> None:
    with pytest.raises(PlanError, match="time_per_minibatch_s"):
        Plan.from_config(4, [0], [1], time_per_minibatch_s=value)
    with pytest.raises(PlanError, match="baselines_s\\['dp'\\]"):
        Plan.from_config(4, [0], [1], baselines_s={"dp": value})


def test_a_plan_file_with_infinity_is_rejected(tmp_path: Path) -> None:
    data = _plan().to_dict()
    data["stages"][0]["comm_s"] = math.inf
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))  # Python writes the invalid token Infinity
    with pytest.raises(PlanError, match="comm_s=inf"):
        Plan.load(path)


def test_a_zero_time_plan_is_strict_json_with_unknown_throughput() -> None:
    plan = Plan.from_config(4, [0], [2], baselines_s={"dp": 0.0})
    assert plan.throughput_minibatches_per_s == 0.0 and plan.speedup_over("dp") == 0.0
    json.dumps(plan.to_dict(), allow_nan=False)
    assert Plan.from_dict(json.loads(plan.to_json())) == plan


def test_a_plan_without_prediction_is_strict_json() -> None:
    plan = Plan.from_config(4, [0, 2], [1, 1])
    assert plan.throughput_minibatches_per_s == 0.0
    json.loads(plan.to_json(), parse_constant=_refuse)


def test_an_all_zero_profile_is_refused_by_the_planner() -> None:
    layers = [Layer(f"l{i}", 0.0, 0.0, 0, 0) for i in range(4)]
    with pytest.raises(PlanError, match="every layer of the profile takes 0 ms"):
        plan_pipeline(LayerGraph.chain(layers), Topology.parse("4"))


def _refuse(token: str) -> float:
    raise AssertionError(f"plan JSON holds {token}")


def test_in_flight_is_the_stages_own_else_the_default(tmp_path: Path) -> None:
    # ceil(4 / 3) = 2 per replica, raised to lead the last stage's 1 by max(lcm(3, 1), 2 x 3):
    # 7, in whole minibatches per replica 9
    assert _plan().in_flight == (3, 1)
    stages = (Stage(first=0, last=4, replicas=3, ranks=(0, 1, 2), in_flight=2),
              Stage(first=5, last=7, replicas=1, ranks=(3,), in_flight=1))
    plan = Plan(stages=stages, num_layers=8)
    assert plan.in_flight == (2, 1)
    plan.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json").in_flight == (2, 1)


def test_in_flight_is_all_or_nothing() -> None:
    stages = (Stage(first=0, last=4, replicas=3, ranks=(0, 1, 2), in_flight=2),
              Stage(first=5, last=7, replicas=1, ranks=(3,)))
    with pytest.raises(PlanError, match=r"hold \[2, 0\] minibatches in flight"):
        Plan(stages=stages, num_layers=8)


def test_a_memory_limit_keeps_the_first_in_flight_choice_that_fits() -> None:
    layers = [Layer(f"l{i}", 1.0, 2.0, 10**6, 10**6) for i in range(4)]
    graph, topo = LayerGraph.chain(layers), Topology.parse("4")
    free = evaluate_plan(graph, topo, [0, 2], [3, 1])
    assert free.in_flight == in_flight_counts([3, 1]) == (3, 1)
    need = max(s.memory_bytes for s in free.stages)
    tight = evaluate_plan(graph, topo, [0, 2], [3, 1], memory_bytes=need - 1)
    # aligned (3, 1) and the unaligned join buffer of 2, (3, 1), do not fit; 1 does
    assert tight.in_flight == in_flight_counts([3, 1], 1, aligned=False) == (2, 1)
    assert all(s.memory_bytes <= need - 1 for s in tight.stages)
    assert tight.time_per_minibatch_s == free.time_per_minibatch_s


def test_a_stage_keeps_its_own_zero_level_through_json() -> None:
    plan = Plan.from_config(4, [0, 2], [2, 1])
    staged = dataclasses.replace(plan, stages=(dataclasses.replace(plan.stages[0], zero=2),
                                               plan.stages[1]))
    again = Plan.from_dict(staged.to_dict())
    assert [st.zero for st in again.stages] == [2, None]
    assert "zero" not in plan.to_dict()["stages"][0]  # the run's level: nothing written
    with pytest.raises(PlanError, match=r"zero=4; give 0, 1, 2 or 3"):
        dataclasses.replace(plan.stages[0], zero=4)


def test_zero_levels_are_each_stage_s_own_else_the_run_s() -> None:
    plan = Plan.from_config(4, [0, 2], [2, 1])
    staged = dataclasses.replace(plan, stages=(dataclasses.replace(plan.stages[0], zero=3),
                                               plan.stages[1]))
    assert plan.zero_levels(1) == (1, 1)
    assert staged.zero_levels(1) == (3, 1) and staged.zero_levels(0) == (3, 0)
