"""``runtime/memory.py``: each stage's predicted bytes, term by term."""

from __future__ import annotations

from typing import Any

from dreampipe.models import get_model
from dreampipe.planning.plan import Plan
from dreampipe.profiling.graph import Layer, LayerGraph
from dreampipe.profiling.profiler import profile_spec
from dreampipe.runtime.memory import TrainingChoices, predict_memory
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
    4 bytes; the blocks' and the head's deferred Linear operands 50 and 20."""
    def layer(name: str, what: str, kept: int, work: int, deferred: int) -> Layer:
        return Layer(name, 1.0, 1.0, 4, 8, what, saved_bytes=kept, backward_bytes=work,
                     deferred_bytes=deferred)

    return LayerGraph((layer("embed", "Embed", 10, 5, 0), layer("b1", "Block", 100, 30, 50),
                       layer("b2", "Block", 100, 30, 50), layer("head", "Head", 40, 60, 20)),
                      ((0, 1), (1, 2), (2, 3)), 4)


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
    # stage 1 plain: walk at b2 = 100 + 20 + max(30, 50) = 170 (b2's own deferred operands
    # outgrow its working set), at head = 140 + 60 = 200 = formula
    # recomputing b2: kept 40 per microbatch; at b2: 0 + 100 again + 20 + 50 = 170
    assert plain[1] - got[1] == (140 * m1 + 60) - (40 * (m1 - 1) + 170)
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
