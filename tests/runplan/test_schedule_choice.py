"""choose_schedule: the fastest schedule of the asked semantics that fits memory."""

from __future__ import annotations

import pytest

from dreampipe.errors import ConfigError
from dreampipe.planning.memory_terms import OptimizerTerms
from dreampipe.planning.plan import Plan
from dreampipe.planning.topology import Topology
from dreampipe.profiling.graph import Layer, LayerGraph
from dreampipe.runplan.schedule_choice import (
    CANDIDATES,
    SEVERAL,
    ScheduleChoice,
    Semantics,
    choose_schedule,
)
from dreampipe.runplan.study_epochs import StudyRow
from dreampipe.scheduling.actions import ScheduleKind
from dreampipe.scheduling.microbatch_layout import default_microbatches

S = ScheduleKind


def _chain(backward_ms: float = 20.0, weight_ms: float | None = None) -> LayerGraph:
    return LayerGraph.chain([Layer(f"l{i}", 10.0, backward_ms, 10**6, 10**6,
                                   weight_grad_ms=weight_ms) for i in range(4)])


def _straight() -> Plan:
    return Plan.from_config(4, [0, 1, 2, 3], [1, 1, 1, 1])


def test_sync_keeps_a_zero_bubble_schedule_over_1f1b_flush() -> None:
    choice = choose_schedule(_chain(), _straight(), Topology.parse("1x4"), Semantics.SYNC)
    assert [c.kind for c in choice.candidates] == list(CANDIDATES[Semantics.SYNC])
    assert choice.kind in (S.ZB_H1, S.ZB_H2)
    rate = {c.kind: c.minibatches_per_s for c in choice.candidates}
    assert rate[choice.kind] == max(rate.values()) > rate[S.FLUSH]
    assert len(choice.reasons()) == 4
    assert sum("chosen" in line for line in choice.reasons()) == 1


def test_by_default_every_replica_of_the_widest_stage_gets_microbatches() -> None:
    # one stage on 8 replicas, run synchronously, is data parallelism: 4 microbatches a
    # minibatch would leave half the replicas idle
    graph, topo = _chain(), Topology.parse("1x8")
    plan = Plan.from_config(4, [0], [8])
    choice = choose_schedule(graph, plan, topo, Semantics.SYNC)
    assert choice.microbatches == default_microbatches((8,)) == 8
    rate = {c.kind: c.minibatches_per_s for c in choice.candidates}
    four = choose_schedule(graph, plan, topo, Semantics.SYNC, microbatches=4)
    assert rate[S.FLUSH] > 1.9 * {c.kind: c.minibatches_per_s for c in four.candidates}[S.FLUSH]
    assert default_microbatches((1, 1, 1)) == 12 and default_microbatches((3, 1)) == 9
    # a schedule asked by name is the only one simulated
    asked = choose_schedule(graph, plan, topo, Semantics.SYNC, kinds=(S.GPIPE,),
                            memory_bytes=10**12)
    assert [c.kind for c in asked.candidates] == [S.GPIPE] and asked.kind is S.GPIPE
    assert asked.reasons()[0].endswith("per worker: fits")
    # without a limit, no candidate is said to fit it
    assert not any("fits" in line for line in choice.reasons())


def test_a_memory_limit_drops_the_schedules_that_hold_more() -> None:
    graph, plan, topo = _chain(30.0, 5.0), _straight(), Topology.parse("1x4")
    free = choose_schedule(graph, plan, topo, Semantics.SYNC)
    peak = {c.kind: c.peak_memory_bytes for c in free.candidates}
    assert peak[S.ZB_H2] > peak[S.ZB_H1] >= peak[S.FLUSH]
    assert free.kind is S.ZB_H2  # B costs more than W: the extra warm-up pays
    tight = choose_schedule(graph, plan, topo, Semantics.SYNC, memory_bytes=peak[S.ZB_H1])
    assert tight.kind is S.ZB_H1
    assert any("does not fit" in line for line in tight.reasons())
    with pytest.raises(ConfigError, match="no sync schedule of plan straight fits"):
        choose_schedule(graph, plan, topo, Semantics.SYNC, memory_bytes=1)


def test_async_keeps_2bw_when_pipedream_needs_more_memory() -> None:
    graph, plan, topo = _chain(), _straight(), Topology.parse("1x4")
    free = choose_schedule(graph, plan, topo, Semantics.ASYNC)
    peak = {c.kind: c.peak_memory_bytes for c in free.candidates}
    assert set(peak) == {S.TWO_BW, S.PIPEDREAM}
    limited = choose_schedule(graph, plan, topo, Semantics.ASYNC,
                              memory_bytes=min(peak.values()))
    assert limited.kind is min(peak, key=lambda k: peak[k])


@pytest.mark.parametrize("semantics", list(Semantics))
def test_a_plan_with_a_split_stage_tries_only_what_the_runtime_runs_on_it(
        semantics: Semantics) -> None:
    from dreampipe.planning.plan_stage import Stage
    from dreampipe.planning.splits import Split

    plan = Plan(stages=(Stage(first=0, last=1, replicas=1, ranks=(0,), tensor_parallel=2,
                              splits=(Split.OUT, Split.IN)),
                        Stage(first=2, last=3, replicas=2, ranks=(1, 2))), num_layers=4)
    graph = LayerGraph.chain([Layer(f"l{i}", 10.0, 20.0, 10**6, 10**6,
                                    description="Linear(in_features=64, out_features=64)")
                              for i in range(4)])
    choice = choose_schedule(graph, plan, Topology.parse("1x4"), semantics)
    skipped = {c.kind for c in choice.candidates if c.why_not}
    assert skipped == {S.ZB_H1, S.ZB_H2, S.TWO_BW} & set(CANDIDATES[semantics])
    assert choice.kind in {S.FLUSH, S.GPIPE, S.PIPEDREAM}


def test_the_candidates_are_simulated_with_the_run_s_zero_level() -> None:
    """A replicated stage's ZeRO level changes the simulated rates on a slow link (level
    1's all-gather after the step, level 3's per-use gathers in each forward and
    backward); an asynchronous schedule
    cannot run level 3 and says why."""
    graph, topo = _chain(), Topology.parse("1x3", bandwidths=[1e7, 1e7])
    plan = Plan.from_config(4, [0, 2], [2, 1])
    rates = {level: {c.kind: c.minibatches_per_s for c in choose_schedule(
        graph, plan, topo, Semantics.SYNC, microbatches=4, zero=level).candidates}
        for level in (0, 1, 3)}
    assert all(rates[1][k] < rates[0][k] for k in rates[0])  # the all-gather after STEP
    assert all(rates[3][k] < rates[0][k] for k in rates[0])
    refused = choose_schedule(graph, plan, topo, Semantics.SYNC, zero=3)
    assert refused.kind.synchronous
    with pytest.raises(ConfigError, match=r"no async schedule can run plan 2-1: 2bw: "
                       r"zero=3: .* a weight version each"):
        choose_schedule(graph, plan, topo, Semantics.ASYNC, zero=3)


def test_a_plan_of_two_stages_per_worker_weighs_interleaving_and_both_vs() -> None:
    """8 one-layer stages on 4 workers, F = B = W: zbv and dualpipev (the plan re-placed in
    a V for them) leave less bubble than interleaved 1F1B; async semantics run none."""
    graph = LayerGraph.chain([Layer(f"l{i}", 10.0, 20.0, 0, 0) for i in range(8)])
    plan = Plan.from_config(8, list(range(8)), [1] * 8, virtual_stages=2)
    topo = Topology.parse("1x4")
    choice = choose_schedule(graph, plan, topo, Semantics.SYNC, microbatches=8)
    rate = {c.kind: c.minibatches_per_s for c in choice.candidates}
    assert list(rate) == list(SEVERAL) and all(rate.values())
    assert choice.kind in (S.ZBV, S.DUALPIPEV)
    assert rate[S.ZBV] > 1.1 * rate[S.INTERLEAVED] and rate[S.DUALPIPEV] > rate[S.INTERLEAVED]
    thrice = Plan.from_config(12, list(range(12)), [1] * 12, virtual_stages=3)
    graph12 = LayerGraph.chain([Layer(f"l{i}", 10.0, 20.0, 0, 0) for i in range(12)])
    three = choose_schedule(graph12, thrice, topo, Semantics.SYNC)
    assert three.kind is S.INTERLEAVED
    assert {c.kind for c in three.candidates if c.why_not} == {S.ZBV, S.DUALPIPEV}
    with pytest.raises(ConfigError, match=r"semantics=async with a plan of 2 stages per "
                                          r"worker; .* are synchronous"):
        choose_schedule(graph, plan, topo, Semantics.ASYNC)


def test_any_weighs_each_rate_by_the_study_s_epochs_to_target() -> None:
    """4 straight stages, 4 microbatches: the asynchronous schedules, without a flush, are
    the fastest, so one is kept where the study says they need data parallelism's epochs,
    and a synchronous schedule where the study says they need enough more, or never get
    there (the bundled study: pipedream never reached the characters' target at 4
    stages), or has no row as deep."""
    graph, plan, topo = _chain(), _straight(), Topology.parse("1x4")

    def chosen(epochs: float, *, depth: int = 4) -> ScheduleChoice:
        rows = [StudyRow(w, depth, k, e, 3.0, 3, "sgd") for k in ("pipedream", "2bw")
                for w, e in (("x", 3.0), ("y", epochs))]
        return choose_schedule(graph, plan, topo, Semantics.ANY, microbatches=4, study=rows)

    equal = chosen(3.0)
    rate = {c.kind: c.minibatches_per_s for c in equal.candidates}
    assert [c.kind for c in equal.candidates] == list(CANDIDATES[Semantics.ANY])
    sync = max(rate[k] for k in rate if k.synchronous)
    assert not equal.kind.synchronous and rate[equal.kind] > 1.1 * sync
    gain = rate[equal.kind] / sync
    assert not chosen(3.0 * gain * 0.95).kind.synchronous
    more = chosen(3.0 * gain * 1.05)
    assert more.kind.synchronous
    lines = "\n".join(more.reasons())
    assert f"{gain * 1.05:.2f}x dp's epochs (the study's y at 4 stages, its worst" in lines
    shallow = chosen(3.0, depth=2)
    assert shallow.kind.synchronous
    assert "the study's deepest 2bw run had 2 stages, not 4" in "\n".join(shallow.reasons())
    bundled = choose_schedule(graph, plan, topo, Semantics.ANY, microbatches=4)
    assert bundled.kind.synchronous
    last = bundled.reasons()[-1]
    assert last.startswith("pipedream") and "never reaches the target" in last
    by_throughput = choose_schedule(graph, plan, topo, Semantics.ASYNC, microbatches=4)
    assert all(c.epochs is None for c in by_throughput.candidates)


def test_a_run_that_agrees_before_each_update_prices_the_asynchronous_schedules_so() -> None:
    """Clipping by the global norm holds each pipedream stage to the others' backwards: on
    4 equal stages the asynchronous schedules lose their edge and the choice under
    ``any`` (the study's epochs equal to dp's) moves to a synchronous schedule."""
    graph, plan, topo = _chain(), _straight(), Topology.parse("1x4")
    rows = [StudyRow("x", 4, k, 3.0, 3.0, 3, "sgd") for k in ("pipedream", "2bw")]
    alone, agreed = (choose_schedule(graph, plan, topo, Semantics.ANY, microbatches=4,
                                     study=rows, steps_agree=a) for a in (False, True))
    rate = [{c.kind: c.minibatches_per_s for c in x.candidates} for x in (alone, agreed)]
    for kind in (S.PIPEDREAM, S.TWO_BW):
        assert rate[1][kind] < 0.8 * rate[0][kind]
    for kind in (S.FLUSH, S.GPIPE):
        assert rate[1][kind] == pytest.approx(rate[0][kind])
    assert not alone.kind.synchronous and agreed.kind.synchronous


def test_pipedream_on_unequal_replicas_is_not_tried_where_the_ranks_must_agree() -> None:
    """Its stages update at different rates, so no update is common to agree on: the
    candidate says so instead of the simulation waiting forever; 2bw still runs."""
    plan = Plan.from_config(4, [0, 1, 2], [1, 1, 2])
    choice = choose_schedule(_chain(), plan, Topology.parse("1x4"), Semantics.ASYNC,
                             steps_agree=True)
    by = {c.kind: c for c in choice.candidates}
    assert "cannot agree on each update" in by[S.PIPEDREAM].why_not
    assert choice.kind is S.TWO_BW and by[S.TWO_BW].minibatches_per_s > 0
    alone = choose_schedule(_chain(), plan, Topology.parse("1x4"), Semantics.ASYNC)
    assert {c.kind: c for c in alone.candidates}[S.PIPEDREAM].why_not == ""


def test_where_no_schedule_of_the_semantics_runs_the_error_names_each_way_out() -> None:
    plan = Plan.from_config(2048, [0], [2048])  # one stage on 2048 replicas: 2048 microbatches
    with pytest.raises(ConfigError, match=r"no sync schedule can run plan 2048") as info:
        choose_schedule(_chain(), plan, Topology.parse("256x8"), Semantics.SYNC)
    for way in ("semantics=async", "schedule=pipedream", "fewer microbatches", "--global-batch"):
        assert way in str(info.value)


def _scaled_chain(batch: int, share: float) -> LayerGraph:
    """Four layers profiled at ``batch`` samples, ``share`` of a 32-sample minibatch:
    times and kept tensors in proportion, the same weights."""
    return LayerGraph(tuple(Layer(f"l{i}", 10.0 * share, 20.0 * share, round(4e6 * share),
                                  10**6) for i in range(4)),
                      tuple((i, i + 1) for i in range(3)), batch, "toy")


@pytest.mark.parametrize("semantics", [Semantics.SYNC, Semantics.ANY])
def test_a_profile_of_a_microbatch_prices_each_candidate_at_its_own_size(
        semantics: Semantics) -> None:
    # a run with microbatches=4 profiles a quarter of its minibatch: its candidates must be
    # what the whole minibatch's profile gives, not a quarter of it in memory and 4x in rate
    whole, quarter = _scaled_chain(32, 1.0), _scaled_chain(8, 0.25)
    plan, topo = _straight(), Topology.parse("1x4")
    want = choose_schedule(whole, plan, topo, semantics, microbatches=4)
    got = choose_schedule(quarter, plan, topo, semantics, microbatches=4, profile_share=0.25)
    unscaled = choose_schedule(quarter, plan, topo, semantics, microbatches=4)
    assert got.kind is want.kind
    for g, w, u in zip(got.candidates, want.candidates, unscaled.candidates, strict=True):
        assert g.minibatches_per_s == pytest.approx(w.minibatches_per_s, rel=1e-9)
        assert g.peak_memory_bytes == pytest.approx(w.peak_memory_bytes, rel=1e-9)
        if not g.why_not:  # the comparison can fail: unscaled, the figures differ
            assert u.peak_memory_bytes < 0.5 * w.peak_memory_bytes
            assert u.minibatches_per_s > 2 * w.minibatches_per_s


def test_each_candidate_holds_the_optimizers_state_a_replica_its_share_from_zero_1() -> None:
    """Adam's two moments a weight: each worker's peak grows by twice its stage's
    weights, or, sharded at ZeRO level 1 over 2 replicas, by its half of that."""
    graph, topo = _chain(), Topology.parse("1x4")
    straight = choose_schedule(graph, _straight(), topo, Semantics.SYNC, microbatches=4)
    adam = choose_schedule(graph, _straight(), topo, Semantics.SYNC, microbatches=4,
                           optimizer=OptimizerTerms(state_copies=2))
    for plain, with_state in zip(straight.candidates, adam.candidates, strict=True):
        assert with_state.peak_memory_bytes == plain.peak_memory_bytes + 2 * 10**6
    replicated = Plan.from_config(4, [0, 2], [2, 2])
    base = choose_schedule(graph, replicated, topo, Semantics.SYNC, microbatches=4, zero=1)
    sharded = choose_schedule(graph, replicated, topo, Semantics.SYNC, microbatches=4, zero=1,
                              optimizer=OptimizerTerms(state_copies=2))
    for plain, with_state in zip(base.candidates, sharded.candidates, strict=True):
        assert with_state.peak_memory_bytes == plain.peak_memory_bytes + 2 * 2 * 10**6 / 2


def test_the_default_microbatches_divide_the_minibatch() -> None:
    """Four stages' 16 microbatches do not divide a minibatch of 24: the nearest count
    below that does (12) is tried; one stage on 3 replicas takes whole rounds of 3, which
    no count dividing 16 is, so a candidate whose count does not divide it is not tried,
    and the refusal says so."""
    graph, topo = _chain(), Topology.parse("1x4")
    choice = choose_schedule(graph, _straight(), topo, Semantics.SYNC, minibatch_size=24)
    assert choice.microbatches == 12 and default_microbatches((1, 1, 1, 1)) == 16
    assert choose_schedule(graph, _straight(), topo, Semantics.SYNC,
                           minibatch_size=5).microbatches == 5  # one sample each
    dp = Plan.from_config(4, [0], [3])
    with pytest.raises(ConfigError, match=r"1f1b-flush: its 6 microbatches do not divide a "
                                          r"minibatch of 16"):
        choose_schedule(graph, dp, Topology.parse("1x3"), Semantics.SYNC, minibatch_size=16,
                        kinds=(S.FLUSH,))


def test_each_candidate_holds_the_optimizers_step_temporaries() -> None:
    """Adam's step makes temporaries beside its state (two of the largest layer's size, a
    single-tensor step): a candidate's peak holds the planner's bound on them, as the run's
    own check counts the step, so a schedule said to fit is not refused by the run."""
    graph, topo = _chain(), Topology.parse("1x4")
    two = Plan.from_config(4, [0, 2], [1, 1])
    plain = choose_schedule(graph, two, topo, Semantics.SYNC, microbatches=4,
                            optimizer=OptimizerTerms(state_copies=2))
    stepped = choose_schedule(graph, two, topo, Semantics.SYNC, microbatches=4,
                              optimizer=OptimizerTerms(state_copies=2, per_largest=2.0,
                                                       per_byte=0.5))
    for without, with_step in zip(plain.candidates, stepped.candidates, strict=True):
        # each stage: 2 layers of 1 MB, the largest 1 MB
        assert with_step.peak_memory_bytes == without.peak_memory_bytes + 2 * 10**6 + 10**6
    limit = max(c.peak_memory_bytes for c in plain.candidates)
    with pytest.raises(ConfigError, match="no sync schedule"):
        choose_schedule(graph, two, topo, Semantics.SYNC, limit, microbatches=4,
                        optimizer=OptimizerTerms(state_copies=2, per_largest=2.0,
                                                 per_byte=0.5))
