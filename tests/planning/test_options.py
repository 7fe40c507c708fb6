"""``PlanOptions``: the planner's options as one frozen record, checked when made."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

import dreampipe
from dreampipe.errors import ConfigError
from dreampipe.planning.costs import CostModel
from dreampipe.planning.level import Options
from dreampipe.planning.memory_terms import OptimizerTerms
from dreampipe.planning.options import PlanOptions
from dreampipe.planning.planner import plan_pipeline
from dreampipe.planning.sync import DEFAULT_SYNC, Sync, SyncKind
from dreampipe.planning.topology import Topology
from dreampipe.profiling.graph import Layer, LayerGraph

__all__: list[str] = []


def test_plan_pipeline_takes_the_graph_the_topology_and_one_options_record() -> None:
    params = inspect.signature(plan_pipeline).parameters
    assert list(params) == ["graph", "topology", "options"]
    assert params["options"].default == PlanOptions()
    assert dreampipe.PlanOptions is PlanOptions
    with pytest.raises(dataclasses.FrozenInstanceError):
        PlanOptions().straight = True  # type: ignore[misc]


def test_the_dynamic_programs_options_follow_from_it() -> None:
    assert PlanOptions().search(5) == Options(None, False, True, 1, False, CostModel.DREAMPIPE,
                                              DEFAULT_SYNC)
    ring = Sync(SyncKind.RING)
    got = PlanOptions(memory_bytes=10**9, straight=True, max_stages=3, sync=ring).search(5)
    assert got == Options(10**9, True, True, 3, True, CostModel.DREAMPIPE, ring)
    # PipeDream's optimizer uses every worker, whatever allow_fewer_workers says
    assert not PlanOptions(cost_model=CostModel.PIPEDREAM).search(5).allow_fewer


def test_bad_options_fail_when_made_or_against_the_model() -> None:
    # option errors name the option, so the command line writes them as its flags
    with pytest.raises(ConfigError, match=r"memory_bytes=0 must be positive") as e:
        PlanOptions(memory_bytes=0)
    assert e.value.parameters == ("memory_bytes",)
    with pytest.raises(ConfigError, match=r"memory_bytes=1000: the pipedream cost model"):
        PlanOptions(memory_bytes=1000, cost_model=CostModel.PIPEDREAM)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match=r"state_copies=.* must be 0 or more"):
            PlanOptions(optimizer=OptimizerTerms(state_copies=bad))
        with pytest.raises(ConfigError, match=r"per_largest=.* must be 0 or more"):
            OptimizerTerms(per_largest=bad)
    graph = LayerGraph.chain([Layer(f"l{i}", 1.0, 2.0, 10**6, 10**6) for i in range(3)])
    with pytest.raises(ConfigError, match=r"max_stages=4 is impossible for a model of 3 "
                       "layers") as e:
        plan_pipeline(graph, Topology.parse("4"), PlanOptions(max_stages=4))
    assert e.value.parameters == ("max_stages",)
    assert plan_pipeline(graph, Topology.parse("2"), PlanOptions(max_stages=1)).num_stages == 1
