"""This machine's costs: what local_costs adds to the profile, and shared cores."""

from __future__ import annotations

import dataclasses

import pytest

from dreampipe.machine.calibration import (
    corun_crowd,
    local_costs,
    local_topology,
    split_layer_seconds,
)
from dreampipe.planning.plan import Plan, Stage
from dreampipe.planning.splits import Split
from dreampipe.profiling.graph import Layer, LayerGraph
from machine.fixtures import DEV_MACHINE

_GRAPH = LayerGraph(
    tuple(Layer(f"l{i}", 2.0, 4.0, 32 * 1024, 4 * 1024 * 1024) for i in range(4)),
    tuple((i, i + 1) for i in range(3)), 32, "toy",
)


def test_each_update_costs_its_parameters_at_the_step_bandwidth() -> None:
    plan = Plan.from_config(4, [0, 2], [1, 1])
    costs = local_costs(_GRAPH, plan, 1.0, dataclasses.replace(DEV_MACHINE, cores=2))
    step = 2 * 4 * 1024 * 1024 / DEV_MACHINE.step_bandwidth
    assert costs.step_s == pytest.approx((step * DEV_MACHINE.corun_slowdown,) * 2)


def test_workers_side_by_side_compute_slower_than_the_profile() -> None:
    plan = Plan.from_config(4, [0, 2], [1, 1])
    quiet = dataclasses.replace(DEV_MACHINE, cores=2, corun_slowdown=1.0)
    busy = dataclasses.replace(DEV_MACHINE, cores=2, corun_slowdown=1.25)
    alone, beside = local_costs(_GRAPH, plan, 1.0, quiet), local_costs(_GRAPH, plan, 1.0, busy)
    assert beside.backward_s == pytest.approx(tuple(1.25 * b for b in alone.backward_s))
    assert beside.forward_s == pytest.approx(tuple(1.25 * f for f in alone.forward_s))
    one = Plan.from_config(4, [0], [1])  # one worker has no busy peer
    assert local_costs(_GRAPH, one, 1.0, busy).backward_s == local_costs(
        _GRAPH, one, 1.0, quiet).backward_s


def test_a_profile_taken_beside_busy_twins_already_holds_the_slowdown() -> None:
    plan = Plan.from_config(4, [0, 2], [1, 1])
    quiet = dataclasses.replace(DEV_MACHINE, cores=2, corun_slowdown=1.0)
    busy = dataclasses.replace(DEV_MACHINE, cores=2, corun_slowdown=1.25)
    beside = dataclasses.replace(_GRAPH, meta={"twins": 1})
    assert local_costs(beside, plan, 1.0, busy) == local_costs(_GRAPH, plan, 1.0, quiet)
    # one twin is not enough where three workers compute at once on four cores
    wide = dataclasses.replace(busy, cores=4)
    three = Plan.from_config(4, [0, 1, 2], [1, 1, 1])
    assert local_costs(beside, three, 1.0, wide).forward_s == pytest.approx(
        tuple(1.25 * f for f in local_costs(_GRAPH, three, 1.0, dataclasses.replace(
            quiet, cores=4)).forward_s))


def test_more_workers_than_cores_share_them() -> None:
    # 2-1 on 3 workers: on 2 cores every host-side cost is 3/2 of its cost on 3
    plan = Plan.from_config(4, [0, 2], [2, 1])
    roomy = local_costs(_GRAPH, plan, 1.0, dataclasses.replace(DEV_MACHINE, cores=3))
    tight = local_costs(_GRAPH, plan, 1.0, dataclasses.replace(DEV_MACHINE, cores=2))
    for name in ("forward_s", "backward_s", "step_s", "allreduce_s"):
        assert getattr(tight, name) == pytest.approx(
            tuple(1.5 * x for x in getattr(roomy, name))), name
    assert roomy.allreduce_s[0] > 0
    assert tight.send_overhead_s == pytest.approx(1.5 * roomy.send_overhead_s)


def test_the_pace_measured_for_as_many_workers_replaces_the_even_share() -> None:
    plan = Plan.from_config(4, [0, 2], [2, 1])
    tight = dataclasses.replace(DEV_MACHINE, cores=2)
    roomy = local_costs(_GRAPH, plan, 1.0, dataclasses.replace(tight, cores=3))
    measured = {"share": 1.8, "shared_by": 3, "share_cores": 2}
    paced = dataclasses.replace(_GRAPH, meta=measured)
    costs = local_costs(paced, plan, 1.0, tight)
    assert costs.backward_s == pytest.approx(tuple(1.8 * b for b in roomy.backward_s))
    assert costs.send_overhead_s == pytest.approx(1.8 * roomy.send_overhead_s)
    even = local_costs(_GRAPH, plan, 1.0, tight)
    # a pace measured for 4 workers, or on 4 cores, says nothing of 3 on 2
    for wrong in ({"shared_by": 4}, {"share_cores": 4}):
        other = dataclasses.replace(_GRAPH, meta=measured | wrong)
        assert local_costs(other, plan, 1.0, tight) == even
    # sharing cores never makes a worker faster than its profile, however noisy the pace
    quick = dataclasses.replace(_GRAPH, meta=measured | {"share": 0.7})
    assert local_costs(quick, plan, 1.0, tight).backward_s == roomy.backward_s
    assert [corun_crowd(w, tight) for w in (1, 2, 3, 5)] == [0, 0, 1, 3]


def test_local_workers_do_not_overlap_communication() -> None:
    assert not local_topology(2, DEV_MACHINE).overlap
    assert DEV_MACHINE.cores >= 1


def test_an_all_reduce_without_overlap_starts_when_the_slowed_backward_ends() -> None:
    # local workers do not overlap: the all-reduce waits for the whole backward,
    # which runs corun_slowdown slower beside a busy worker
    plan = Plan.from_config(4, [0], [2])
    busy = dataclasses.replace(DEV_MACHINE, cores=2, corun_slowdown=1.25)
    costs = local_costs(_GRAPH, plan, 1.0, busy)
    assert costs.allreduce_s[0] > 0
    assert costs.allreduce_delay_s == pytest.approx(costs.backward_s)


def test_the_runtimes_measured_overhead_scales_the_layers_instead_of_the_fixed_figure() -> None:
    plan = Plan.from_config(4, [0, 2], [1, 1])
    quiet = dataclasses.replace(DEV_MACHINE, cores=2, corun_slowdown=1.0)
    plain = local_costs(_GRAPH, plan, 1.0, quiet)
    measured = dataclasses.replace(_GRAPH, meta={"runtime_forward": 1.2,
                                                 "runtime_backward": 1.1})
    costs = local_costs(measured, plan, 1.0, quiet)
    layers = 2 * 2.0e-3  # two layers of 2 ms forward and 4 ms backward per stage
    extra = (quiet.batch_load_s, quiet.batch_load_s + quiet.loss_s)
    assert costs.forward_s == pytest.approx(tuple(1.2 * layers + e for e in extra))
    assert plain.forward_s == pytest.approx(
        tuple(layers + quiet.stage_forward_s + e for e in extra))
    assert costs.backward_s == pytest.approx(tuple(1.1 * b for b in plain.backward_s))


@pytest.mark.parametrize("factor", [0.6, 1.3])
def test_the_weight_gradient_scales_with_the_backward_it_is_part_of(factor: float) -> None:
    plan = Plan.from_config(4, [0, 2], [1, 1])
    busy = dataclasses.replace(DEV_MACHINE, cores=2, corun_slowdown=1.25)
    timed = dataclasses.replace(_GRAPH, layers=tuple(
        dataclasses.replace(x, weight_grad_ms=3.5) for x in _GRAPH.layers))
    plain = local_costs(timed, plan, 1.0, busy)
    costs = local_costs(dataclasses.replace(timed, meta={"runtime_backward": factor}),
                        plan, 1.0, busy)
    assert costs.weight_grad_s == pytest.approx(tuple(factor * w for w in plain.weight_grad_s))
    assert all(w <= b for w, b in zip(costs.weight_grad_s, costs.backward_s, strict=True))
    assert plain.weight_grad_s == pytest.approx(tuple(
        b * 3.5 / 4.0 for b in local_costs(_GRAPH, plan, 1.0, busy).backward_s))


def test_the_profiles_passes_around_their_median_are_the_simulators_jitter() -> None:
    plan = Plan.from_config(4, [0, 2], [1, 1])
    assert local_costs(_GRAPH, plan, 1.0, DEV_MACHINE).jitter == ()
    timed = dataclasses.replace(_GRAPH, meta={"pass_ms": [10.0, 8.0, 12.0, 0.0, 30.0, 10.0]})
    assert local_costs(timed, plan, 1.0, DEV_MACHINE).jitter == pytest.approx(
        (1.0, 0.8, 1.2, 3.0, 1.0))


def test_the_loss_measured_with_the_profile_replaces_the_fixed_figure() -> None:
    plan = Plan.from_config(4, [0, 2], [1, 1])
    quiet = dataclasses.replace(DEV_MACHINE, cores=2, corun_slowdown=1.0)
    fixed = local_costs(_GRAPH, plan, 0.5, quiet)
    timed = dataclasses.replace(_GRAPH, meta={"loss_forward_ms": 3.0, "loss_backward_ms": 5.0})
    costs = local_costs(timed, plan, 0.5, quiet)
    assert costs.forward_s[0] == fixed.forward_s[0]
    assert costs.backward_s[0] == fixed.backward_s[0]
    assert costs.forward_s[1] == pytest.approx(fixed.forward_s[1] - quiet.loss_s + 1.5e-3)
    assert costs.backward_s[1] == pytest.approx(fixed.backward_s[1] + 2.5e-3)


def _split_plan(recompute: bool = False) -> Plan:
    """A tensor-split stage of layers 0-1 over 2 workers, then a plain stage of 2-3."""
    split = Stage(first=0, last=1, replicas=1, ranks=(0,), compute_s=0.012, forward_s=0.004,
                  tensor_parallel=2, splits=(Split.BATCH, Split.BATCH), recompute=recompute)
    plain = Stage(first=2, last=3, replicas=1, ranks=(1,), compute_s=0.012)
    return Plan(stages=(split, plain), num_layers=4)


def test_each_layer_of_a_split_stage_pays_the_machines_split_layer_cost() -> None:
    quiet = dataclasses.replace(DEV_MACHINE, cores=4, corun_slowdown=1.0)
    measured = dataclasses.replace(quiet, split_layer_forward_s=1e-3,
                                   split_layer_backward_s=2e-3)
    assert split_layer_seconds(_GRAPH, _split_plan(), measured) == [(2e-3, 4e-3), (0.0, 0.0)]
    without, priced = (local_costs(_GRAPH, _split_plan(), 0.5, m) for m in (quiet, measured))
    # whatever the microbatch: the fixed part of each operator DTensor runs
    assert priced.forward_s[0] - without.forward_s[0] == pytest.approx(2e-3)
    assert priced.backward_s[0] - without.backward_s[0] == pytest.approx(4e-3)
    assert priced.forward_s[1:] == without.forward_s[1:]
    assert priced.backward_s[1:] == without.backward_s[1:]
    # a recomputing split stage runs its split forward again in its backward
    assert split_layer_seconds(_GRAPH, _split_plan(recompute=True), measured)[0] == (
        pytest.approx(2e-3), pytest.approx(6e-3))
