"""``runtime/memory.py``: each stage's predicted bytes, term by term."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from dreampipe.models import get_model
from dreampipe.planning.plan import Plan
from dreampipe.profiling.graph import Layer, LayerGraph
from dreampipe.profiling.profiler import profile_spec
from dreampipe.runtime import memory
from dreampipe.runtime.memory import (
    TrainingChoices,
    counted_twice,
    planner_terms,
    predict_memory,
)
from dreampipe.runtime.optimizer_step import StepBytes
from dreampipe.runtime.precision import Precision
from dreampipe.runtime.runner_options import OptimizerKind
from dreampipe.scheduling.actions import Action, ActionKind, ScheduleKind
from dreampipe.scheduling.microbatch_layout import MicrobatchLayout

__all__: list[str] = []


def _choices(**kw: Any) -> TrainingChoices:
    return TrainingChoices(optimizer=OptimizerKind.ADAM, momentum=0.0, stash=True,
                           vertical_sync=False, compensate=False, **kw)


def _graph() -> LayerGraph:
    """embed, two blocks, head: kept 10, 100, 100, 40; working 5, 30, 30, 60; each output
    4 bytes; the blocks' and the head's deferred Linear operands 50 and 20, of them their
    outputs 40 and 10 (what a split backward's ``B`` records)."""
    def layer(name: str, what: str, kept: int, work: int, deferred: int,
              recorded: int) -> Layer:
        return Layer(name, 1.0, 1.0, 4, 8, what, saved_bytes=kept, backward_bytes=work,
                     deferred_bytes=deferred, recorded_bytes=recorded)

    return LayerGraph((layer("embed", "Embed", 10, 5, 0, 0),
                       layer("b1", "Block", 100, 30, 50, 40),
                       layer("b2", "Block", 100, 30, 50, 40),
                       layer("head", "Head", 40, 60, 20, 10)), ((0, 1), (1, 2), (2, 3)), 4)


def test_a_backward_walked_layer_by_layer_sets_the_peak() -> None:
    """Stage 0 (embed, b1) and stage 1 (b2, head), flush of 4 microbatches. The formula
    holds every kept tensor of each microbatch in flight plus the largest working set; a
    stage recomputing its first block keeps that block's input only (none on stage 1,
    whose first layer it is: the stage input) and holds its tensors again in its backward,
    when the layers after it hold only their deferred Linear operands (not on stage 0),
    and it holds its own where more than its working set."""
    graph = _graph()
    plan = Plan.from_config(4, [0, 2], [1, 1])
    sched = MicrobatchLayout(kind=ScheduleKind.FLUSH, microbatches=4).build([1, 1], 2,
                                                                            plan.in_flight)
    m0, m1 = (_in_flight(sched.actions[s]) for s in (0, 1))
    plain = predict_memory(graph, plan, sched, _choices())
    got = predict_memory(graph, plan, sched, _choices(recompute_blocks=1, block="Block"))
    # stage 0 plain: walk at b1 = 10 + 100 + 30 = 140 = formula's 110 + 30: nothing saved
    # recomputing b1: kept 10 + 4 per microbatch; its backward: 14 + 96 again + 30 = 140
    assert plain[0] - got[0] == (110 * m0 + 30) - (14 * (m0 - 1) + 140)
    # stage 1 plain: walk at b2 = 100 + 20 + max(30, 40) = 160 (b2's deferred output
    # gradients outgrow its working set), at head = 140 + 60 = 200 = formula
    # recomputing b2: kept 40 per microbatch; at b2: 0 + 100 again + 20 + 40 = 160
    assert plain[1] - got[1] == (140 * m1 + 60) - (40 * (m1 - 1) + 160)
    assert m0 > 1 and plain[1] - got[1] > 0


def test_recomputed_blocks_keep_their_inputs_and_their_tensors_again_in_one_backward(
        ) -> None:
    """A measured profile: a stage recomputing its first k blocks holds less, per
    microbatch in flight, than one that does not, by what the blocks keep beyond their
    inputs, less at most one block's tensors again."""
    graph = profile_spec(get_model("transformer", layers=3), batch_size=4, repeats=1)
    plan = Plan.from_config(len(graph.layers), [0, 3], [1, 1])
    sched = MicrobatchLayout(kind=ScheduleKind.FLUSH, microbatches=4).build([1, 1], 2,
                                                                            plan.in_flight)
    plain = predict_memory(graph, plan, sched, _choices())
    for k in (1, 2, 5):
        got = predict_memory(graph, plan, sched, _choices(recompute_blocks=k,
                                                          block="TransformerBlock"))
        for s, st in enumerate(plan.stages):  # each stage: its first k blocks
            chosen = [i for i in range(st.first, st.last + 1)
                      if graph.layers[i].description == "TransformerBlock"][:k]
            kept = [graph.layers[i].stash_bytes for i in chosen]
            inputs = [0 if i == st.first else graph.layers[i - 1].activation_bytes
                      for i in chosen]
            m = _in_flight(sched.actions[s])
            most = (sum(kept) - sum(inputs)) * m
            assert most - max(kept) - max(x.working_bytes for x in graph.layers) \
                <= plain[s] - got[s] <= most, (k, s)
    assert predict_memory(graph, plan, sched, _choices(precision=Precision.BF16)) != plain


def _in_flight(actions: tuple[Action, ...]) -> int:
    now = most = 0
    for a in actions:
        now += {ActionKind.FORWARD: 1, ActionKind.BACKWARD: -1}.get(a.kind, 0)
        most = max(most, now)
    return most


def _until(actions: tuple[Action, ...], end: ActionKind) -> tuple[int, int]:
    """The most microbatches forwarded and not yet at ``end``, and the most past their
    ``B`` but not their ``W``."""
    now = most = waiting = most_waiting = 0
    for a in actions:
        now += (a.kind is ActionKind.FORWARD) - (a.kind is end)
        waiting += (a.kind is ActionKind.BACKWARD) - (a.kind is ActionKind.WEIGHT)
        most, most_waiting = max(most, now), max(most_waiting, waiting)
    return most, most_waiting


def test_a_split_backward_keeps_a_microbatch_until_its_w() -> None:
    """Under zb-h1 a microbatch's kept tensors live until its ``W`` (``B`` keeps the
    graph), and after the first stage each microbatch waiting for its ``W`` also holds
    what ``B`` recorded, its Linear outputs' gradients (the blocks' and the head's 40 and
    10), but for the one in its ``B``, whose working set holds them as it makes them
    (counting both read 0.74 of the measured peak under a large head); the first
    stage's ``B`` records nothing (it leaves the backward to ``W``)."""
    graph = _graph()
    plan = Plan.from_config(4, [0, 2], [1, 1])
    flush, zb = (MicrobatchLayout(kind=kind, microbatches=4).build([1, 1], 2, plan.in_flight)
                 for kind in (ScheduleKind.FLUSH, ScheduleKind.ZB_H1))
    plain, split = (predict_memory(graph, plan, s, _choices()) for s in (flush, zb))
    kept = (10 + 100, 4 + 100 + 40)  # each stage's input and kept tensors a microbatch
    for s in (0, 1):
        before = _in_flight(flush.actions[s])
        after, waiting = _until(zb.actions[s], ActionKind.WEIGHT)
        assert after >= before and (s == 0 or waiting > 0)
        extra = (after - before) * kept[s] + ((waiting - 1) * (40 + 10) if s == 1 else 0)
        assert split[s] - plain[s] == extra, s


def test_a_block_recomputed_by_b_stays_whole_until_its_w() -> None:
    """Under zb-h1 stage 1 (b2, head) recomputing b2 keeps 40 + 4 (the head's tensors
    and its input) a microbatch until its ``B``; the ``B`` computes b2's tensors again,
    and they stay for its ``W``. After ``B1`` two microbatches wait for their ``W`` at
    once, each with all its tensors (100 + 40 + 4) and what ``B`` recorded (40 + 10):
    388 bytes beside the weights' terms, which no recomputation lowers (counting them
    at 44 a microbatch read 0.74 to 0.82 of measured peaks)."""
    graph = _graph()
    plan = Plan.from_config(4, [0, 2], [1, 1])
    zb = MicrobatchLayout(kind=ScheduleKind.ZB_H1, microbatches=4).build([1, 1], 2,
                                                                        plan.in_flight)
    assert _until(zb.actions[1], ActionKind.WEIGHT)[1] == 2
    bare = dataclasses.replace(graph, layers=tuple(
        dataclasses.replace(x, saved_bytes=0, backward_bytes=0, deferred_bytes=0,
                            recorded_bytes=0, activation_bytes=0) for x in graph.layers))
    weights = predict_memory(bare, plan, zb, _choices())[1]
    got = predict_memory(graph, plan, zb, _choices(recompute_blocks=1, block="Block"))[1]
    assert got - weights >= 2 * (144 + 50)
    assert got <= predict_memory(graph, plan, zb, _choices())[1]


def test_a_split_backward_drops_the_loss_with_the_last_stages_output() -> None:
    """``B`` lets go of the last stage's output, and the loss's saved tensors with it
    (cross-entropy's log-probabilities, the size of a large head's logits): a microbatch
    waiting there for its ``W`` holds its kept tensors less the loss's 30 of the head's 40."""
    graph = _graph()
    head = dataclasses.replace(graph.layers[-1], loss_bytes=30)
    lossy = dataclasses.replace(graph, layers=(*graph.layers[:-1], head))
    plan = Plan.from_config(4, [0, 2], [1, 1])
    zb = MicrobatchLayout(kind=ScheduleKind.ZB_H1, microbatches=4).build([1, 1], 2,
                                                                        plan.in_flight)
    waiting = _until(zb.actions[1], ActionKind.WEIGHT)[1]
    kept, dropped = (predict_memory(g, plan, zb, _choices()) for g in (graph, lossy))
    assert kept[0] == dropped[0]
    assert kept[1] - dropped[1] == (waiting - 1) * 30 > 0


def test_an_interleaved_rank_predicts_each_of_its_stages_from_its_own_actions() -> None:
    """Two one-layer stages a rank: a layer keeping ``d`` more bytes a microbatch costs
    its stage ``d`` times that stage's own microbatches in flight, counted along its own
    actions (the rank's, both stages', would be more)."""
    graph, d = _graph(), 1000
    plan = Plan.from_config(4, [0, 1, 2, 3], [1, 1, 1, 1], virtual_stages=2)
    sched = MicrobatchLayout(kind=ScheduleKind.INTERLEAVED, microbatches=4).build(
        [1] * 4, 2, plan.in_flight, virtual_stages=2)
    assert [sorted({a.stage for a in acts}) for acts in sched.actions] == [[0, 2], [1, 3]]
    base = predict_memory(graph, plan, sched, _choices())
    fewer = 0
    for stage in range(4):
        layers = list(graph.layers)
        layers[stage] = dataclasses.replace(layers[stage],
                                            saved_bytes=layers[stage].saved_bytes + d)
        more = predict_memory(dataclasses.replace(graph, layers=tuple(layers)), plan, sched,
                              _choices())
        actions = sched.actions[stage % 2]
        own = tuple(a for a in actions if a.stage == stage)
        fewer += _in_flight(own) < _in_flight(actions)
        assert more[stage] - base[stage] == d * _in_flight(own), stage
    assert fewer >= 2  # the rank's count would be more on half the stages or more


def test_a_rank_of_two_stages_holds_one_working_set_and_their_joint_flight() -> None:
    """What the sum of an interleaved rank's stages counts twice: the smaller of its two
    stages' backward working sets (one backward runs at a time), grown with it, not with
    the larger; and of their microbatches in flight, what they never hold together."""
    graph = _graph()
    plan = Plan.from_config(4, [0, 1, 2, 3], [1, 1, 1, 1], virtual_stages=2)
    sched = MicrobatchLayout(kind=ScheduleKind.INTERLEAVED, microbatches=4).build(
        [1] * 4, 2, plan.in_flight, virtual_stages=2)
    base = counted_twice(graph, plan, sched, _choices())
    # rank 0 runs embed (working 5) and b2 (30); rank 1 b1 (30) and head (60)
    assert base[0] >= 5 and base[1] >= 30

    def grown(layer: int, d: int) -> tuple[int, ...]:
        layers = list(graph.layers)
        layers[layer] = dataclasses.replace(layers[layer],
                                            backward_bytes=layers[layer].backward_bytes + d)
        return counted_twice(dataclasses.replace(graph, layers=tuple(layers)), plan, sched,
                             _choices())

    assert grown(0, 10)[0] - base[0] == 10  # embed's stays the smaller
    assert grown(3, 10)[1] == base[1]  # the head's is the larger
    straight = Plan.from_config(4, [0, 1, 2, 3], [1, 1, 1, 1])
    one = MicrobatchLayout(kind=ScheduleKind.FLUSH, microbatches=4).build([1] * 4, 2)
    assert counted_twice(graph, straight, one, _choices()) == (0, 0, 0, 0)


def test_a_rank_of_two_stages_holds_one_stages_step_temporaries() -> None:
    """Its stages step one after the other: where the step's temporaries set each stage's
    peak, the sum of the stages counts the smaller stage's a second time."""
    layers = tuple(dataclasses.replace(x, parameter_bytes=p) for x, p in zip(
        _graph().layers, (1000, 3000, 2000, 500), strict=True))
    graph = dataclasses.replace(_graph(), layers=layers)
    plan = Plan.from_config(4, [0, 1, 2, 3], [1, 1, 1, 1], virtual_stages=2)
    sched = MicrobatchLayout(kind=ScheduleKind.INTERLEAVED, microbatches=4).build(
        [1] * 4, 2, plan.in_flight, virtual_stages=2)
    plain = _choices()
    stepping = _choices(step_bytes=StepBytes(total=4.0))  # 4 bytes a weight byte
    raised = [a - b for a, b in zip(predict_memory(graph, plan, sched, stepping),
                                    predict_memory(graph, plan, sched, plain), strict=True)]
    assert min(raised) > 0  # the step sets every stage's peak here
    extra = [a - b for a, b in zip(counted_twice(graph, plan, sched, stepping),
                                   counted_twice(graph, plan, sched, plain), strict=True)]
    # rank 0 holds stages 0 and 2, rank 1 stages 1 and 3
    assert extra == [min(raised[0], raised[2]), min(raised[1], raised[3])]


def test_from_zero_2_a_replica_makes_its_gradient_chunks_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The gradients the walk holds on a stage replicated 2 ways: its whole gradients
    up to ZeRO-1, this replica's half from ZeRO-2 on."""
    seen: dict[int, set[int]] = {}
    real = memory.gradients_later

    def spy(actions: tuple[Action, ...], kept: int, gradients: int, *rest: Any) -> int:
        seen.setdefault(level, set()).add(gradients)
        return real(actions, kept, gradients, *rest)

    monkeypatch.setattr(memory, "gradients_later", spy)
    graph = _graph()
    plan = Plan.from_config(4, [0, 2], [2, 1])
    sched = MicrobatchLayout(kind=ScheduleKind.FLUSH, microbatches=4).build(
        [2, 1], 2, plan.in_flight)
    for level in range(4):
        predict_memory(graph, plan, sched, _choices(zero=level))
    weights = [16, 16]  # each stage's two layers of 8 bytes
    assert seen == {0: {weights[0], weights[1]}, 1: {weights[0], weights[1]},
                    2: {weights[0] // 2, weights[1]}, 3: {weights[0] // 2, weights[1]}}


@pytest.mark.parametrize("step", [StepBytes(largest=2.0, second=1.0), StepBytes(total=1.0)],
                         ids=["single-tensor", "foreach"])
@pytest.mark.parametrize("precision", [Precision.FP32, Precision.BF16_MIXED])
def test_a_plan_the_planner_fits_in_a_limit_the_runs_own_check_accepts(
        step: StepBytes, precision: Precision) -> None:
    """Eight 1024x1024 Linears with ReLUs on 2 workers under Adam, at every limit from too
    little to plenty: whatever the planner picks (pipelines, replicas, a split over both
    workers) holds, as the run predicts it under 1f1b-flush, within the limit. Adam's state,
    its step's temporaries (single-tensor: two of the largest parameter and one of the
    second; foreach: one of every parameter) and 16-bit weights' masters are what the
    planner's terms must count (:func:`~dreampipe.runtime.memory.planner_terms`)."""
    from dreampipe.errors import PlanError
    from dreampipe.planning.options import PlanOptions
    from dreampipe.planning.planner import plan_pipeline
    from dreampipe.planning.topology import Level, Topology

    w = 4 << 20
    layers: list[Layer] = []
    for i in range(8):
        layers += [Layer(f"fc{i}", 0.3, 0.6, 64 << 10, w + 4096, "Linear(1024, 1024)",
                         largest_parameter_bytes=w),
                   Layer(f"r{i}", 0.01, 0.02, 64 << 10, 0, "ReLU()")]
    graph = LayerGraph.chain(layers)
    topo = Topology((Level(2, 10e9),))
    choices = _choices(step_bytes=step, precision=precision)
    planned = 0
    for limit in range(30_000_000, 160_000_000, 4_000_000):
        try:
            plan = plan_pipeline(graph, topo, PlanOptions(
                memory_bytes=limit, optimizer=planner_terms(choices), recompute=True))
        except PlanError:
            continue
        planned += 1
        schedule = MicrobatchLayout(kind=ScheduleKind.FLUSH, microbatches=1).build(
            [st.replicas for st in plan.stages], 4, plan.in_flight)
        need = predict_memory(graph, plan, schedule, choices)
        assert max(need) <= limit, (limit, plan.config, need)
    assert planned >= 10


@pytest.mark.parametrize(("kind", "microbatches", "copies"),
                         [(ScheduleKind.PIPEDREAM, 1, (2, 0)), (ScheduleKind.TWO_BW, 2, (2, 2))],
                         ids=["pipedream", "2bw"])
def test_weight_prediction_holds_copies_of_a_delayed_stage_s_weights(
        kind: ScheduleKind, microbatches: int, copies: tuple[int, int]) -> None:
    """Adam's compensation predicts a delayed stage's weights: the last update's change and
    the live weights (2 copies; none on pipedream's last stage, which is not delayed)."""
    graph = _graph()  # each stage's weights: 8 + 8 bytes
    plan = Plan.from_config(4, [0, 2], [1, 1])
    sched = MicrobatchLayout(kind=kind, microbatches=microbatches).build([1, 1], 4,
                                                                        plan.in_flight)
    plain = predict_memory(graph, plan, sched, _choices())
    predicted = predict_memory(graph, plan, sched, dataclasses.replace(_choices(),
                                                                       compensate=True))
    assert [b - a for a, b in zip(plain, predicted, strict=True)] == [16 * c for c in copies]
