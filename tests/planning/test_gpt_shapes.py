"""A GPT-style profile from layer shapes, and a memory-bound one on 4x8: the plan mixes
split, replicated and recomputing stages, and the simulator confirms its prediction."""

from __future__ import annotations

import pytest

from dreampipe.cli.plan_command import confirm_by_simulation
from dreampipe.planning.options import PlanOptions
from dreampipe.planning.plan import Plan
from dreampipe.planning.planner import evaluate_plan, plan_pipeline
from dreampipe.planning.topology import Level, Topology
from dreampipe.profiling.gpt_shapes import (
    ATTENTION_BYTES,
    GELU_BYTES,
    GPT3_1_3B,
    MEGATRON_8_3B,
    OPERAND_BYTES,
    SCORE_BYTES,
    GptShape,
    gpt_profile,
)


@pytest.mark.parametrize("shape", [GPT3_1_3B, MEGATRON_8_3B])
def test_the_profile_holds_the_models_parameters_and_megatrons_activations(
    shape: GptShape,
) -> None:
    graph = gpt_profile(shape, 100e12)
    assert len(graph) == 6 * shape.layers + 3
    assert sum(x.parameter_bytes for x in graph.layers) == 4 * shape.parameters
    # the published sizes, within the untied head and the position embedding
    published = {"gpt3-1.3b": 1.3e9, "megatron-8.3b": 8.3e9}[shape.name]
    assert shape.parameters == pytest.approx(published, rel=0.12)
    s, b, h, a = shape.seq, shape.batch, shape.hidden, shape.heads
    block = graph.layers[1:7]
    assert sum(x.stash_bytes for x in block) == 34 * s * b * h + 5 * a * s * s * b
    # a matrix product of 2 m n k flops: fc1's is four times attn_out's; its bias-GELU and
    # the softmax over the a s^2 b scores move bytes on top, at the memory bandwidth
    ms_per_byte = 1e3 / 900e9
    assert block[4].weight_grad_ms == pytest.approx(4 * block[2].weight_grad_ms)
    assert block[4].forward_ms - block[4].weight_grad_ms == pytest.approx(
        GELU_BYTES[0] * s * b * h * ms_per_byte)
    # attention's batched products take the longer of their work and their bytes
    scores, sbh = a * s * s * b, s * b * h
    core = max(8 * s * sbh / 100e12 * 1e3,
               (ATTENTION_BYTES[1] * scores + 8 * OPERAND_BYTES * sbh) * ms_per_byte)
    assert block[1].backward_ms - 2 * block[1].weight_grad_ms == pytest.approx(
        SCORE_BYTES[1] * scores * ms_per_byte + core)
    assert block[2].forward_ms == pytest.approx(2 * s * b * h * h / 100e12 * 1e3)


@pytest.mark.parametrize(("head_width", "bound_by_bytes"), [(64, True), (512, False)])
def test_attentions_products_are_priced_by_the_roofline(head_width: int,
                                                         bound_by_bytes: bool) -> None:
    # 2 s^2 d flops a head against 2 s^2 bytes of scores written (and read): below the
    # device's flops per byte (here 100e12 / 0.5e12 = 200) narrow heads wait on memory
    s, b, a = 1024, 2, 8
    h = a * head_width
    graph = gpt_profile(GptShape("g", 1, h, a, s, 64, b), 100e12, memory_bandwidth=0.5e12)
    attn_in = graph.layers[2]
    work = 4 * s * s * b * h / 100e12 * 1e3
    moved = (ATTENTION_BYTES[0] * a * s * s * b + 4 * OPERAND_BYTES * s * b * h) / 0.5e9
    assert (moved > work) is bound_by_bytes
    assert attn_in.forward_ms - attn_in.weight_grad_ms == pytest.approx(
        max(work, moved) + SCORE_BYTES[0] * a * s * s * b / 0.5e9)
    # the weights' products are bound by their work at these sizes, their gradient too
    assert attn_in.weight_grad_ms == pytest.approx(2 * s * b * h * 3 * h / 100e12 * 1e3)


def test_a_memory_bound_transformer_on_4x8_mixes_split_replicated_and_recomputing_stages(
) -> None:
    shape = GptShape("gpt-4x4096", 4, 4096, 16, 1024, 50257, 8)
    graph = gpt_profile(shape, 100e12)
    # a split stage that recomputes runs its forward's all-reduces again: with 8 GB the
    # best plan keeps every activation, with 6.8 GB split and unsplit stages recompute
    memory = 68 * 10**8
    topo = Topology((Level(8, 150e9, 5e-6), Level(4, 12.5e9, 2e-5)), memory_bytes=memory)
    got = plan_pipeline(graph, topo, PlanOptions(memory_bytes=memory, recompute=True,
                                                 mixed_splits=True))
    stages = got.stages
    assert any(s.tensor_parallel > 1 for s in stages)
    assert any(s.tensor_parallel == 1 and s.replicas > 1 for s in stages)
    assert any(s.recompute for s in stages)
    assert all(s.memory_bytes <= memory for s in stages)
    assert got.workers_used <= 32
    # faster than the best plan without splits, which the library gives by default
    plain = plan_pipeline(graph, topo, PlanOptions(memory_bytes=memory, recompute=True))
    assert not any(s.tensor_parallel > 1 for s in plain.stages)
    assert got.time_per_minibatch_s < 0.95 * plain.time_per_minibatch_s
    # evaluate_plan prices its layout the same; the JSON round-trips
    again = evaluate_plan(graph, topo, [s.first for s in stages], [s.replicas for s in stages],
                          memory_bytes=memory, recompute=[s.recompute for s in stages],
                          tensor_parallel=[s.tensor_parallel for s in stages],
                          workers=[s.workers for s in stages], splits=[s.splits for s in stages])
    assert again.stages == stages
    assert again.time_per_minibatch_s == pytest.approx(got.time_per_minibatch_s)
    assert Plan.from_dict(got.to_dict()) == got
    # the simulator runs its stages' PipeDream schedule at the predicted rate when they
    # hold the join buffer of replicated stages (dreampipe.planning.in_flight: the memory
    # limit leaves PipeDream's count, which may fall short of it)
    buffered = evaluate_plan(graph, topo, [s.first for s in stages],
                             [s.replicas for s in stages], recompute=[s.recompute for s in stages],
                             tensor_parallel=[s.tensor_parallel for s in stages],
                             workers=[s.workers for s in stages],
                             splits=[s.splits for s in stages])
    assert buffered.time_per_minibatch_s == pytest.approx(got.time_per_minibatch_s)
    sim = confirm_by_simulation(buffered, graph, topo, 2000)
    assert sim.steady_throughput_minibatches_per_s == pytest.approx(
        got.throughput_minibatches_per_s, rel=0.02)
