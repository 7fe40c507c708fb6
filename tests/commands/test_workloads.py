"""``commands.workloads``: the bench's two models, their cuts into stages and chunks, and the
update's sizes, as the module's docstring states them."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from dreampipe.commands.workloads import Workload, WorkloadKind
from dreampipe.errors import ConfigError, DreampipeError

__all__: list[str] = []

KINDS = [k for k in WorkloadKind if not Workload.of(k).hf]  # the zoo models


@settings(max_examples=80, deadline=None)
@given(batch=st.integers(1, 600), microbatches=st.integers(1, 40))
def test_a_workload_is_made_exactly_when_its_update_cuts_evenly(batch: int,
                                                               microbatches: int) -> None:
    """Into microbatches and into the 2 workers' shares, with whole sizes that add up."""
    fits = batch % microbatches == 0 and batch % 2 == 0
    if not fits:
        with pytest.raises(DreampipeError, match=f"bench batch {batch} is not divisible by "
                                                 f"{microbatches} microbatches and 2 workers"):
            Workload(batch=batch, microbatches=microbatches)
        return
    work = Workload(batch=batch, microbatches=microbatches)
    assert work.microbatch * microbatches == batch
    assert work.per_worker * 2 == batch
    assert f"{batch} samples/update as {microbatches} microbatches of {work.microbatch}" in (
        work.describe())


@pytest.mark.parametrize(("steps", "warmup"), [(0, 3), (-1, 0), (5, -1)])
def test_a_workload_needs_a_timed_step_and_no_negative_warm_up(steps: int, warmup: int) -> None:
    with pytest.raises(ConfigError) as info:
        Workload(steps=steps, warmup=warmup)
    assert set(info.value.parameters) == {"steps", "warmup"}
    assert f"steps={steps}, warmup={warmup}" in str(info.value)


def test_the_mlp_is_8_linear_layers_of_1024_cut_4_and_4_with_256_samples_per_update() -> None:
    work = Workload.of(WorkloadKind.MLP, steps=4, warmup=0)
    assert (work.steps, work.warmup) == (4, 0)
    assert (work.batch, work.microbatches, work.microbatch, work.per_worker) == (256, 8, 32, 128)
    spec = work.spec()
    assert spec.num_layers == 8
    assert [work.stage_range(s) for s in (0, 1)] == [(0, 3), (4, 7)]
    model = spec.build(seed=0)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert {m.out_features for m in linears[:-1]} == {1024}, "hidden layers of 1024"
    in_linear = {id(p) for m in linears for p in m.parameters()}
    assert all(id(p) in in_linear for p in model.parameters()), "every parameter in a Linear"


def test_the_transformer_is_embed_and_2_blocks_then_2_blocks_and_head() -> None:
    work = Workload.of(WorkloadKind.TRANSFORMER)
    assert (work.batch, work.microbatches, work.microbatch, work.per_worker) == (16, 8, 2, 8)
    names = work.spec().layer_names
    stages = [names[a:b + 1] for a, b in (work.stage_range(s) for s in (0, 1))]
    assert stages == [["embed", "block0", "block1"], ["block2", "block3", "head"]]
    x, y = work.data(4)
    assert x.shape == (4, 32) and y.shape == (4, 32), "sequences of 32 tokens"
    assert int(x.max()) < 256 and int(y.max()) < 256, "a vocabulary of 256 tokens"


@pytest.mark.parametrize("kind", KINDS, ids=[k.value for k in KINDS])
def test_the_stages_and_the_chunks_each_cover_the_model_once(kind: WorkloadKind) -> None:
    work = Workload.of(kind)
    layers = work.spec().num_layers
    for v in (1, 2):
        ranges = [work.stage_range(s, v) for s in range(2 * v)]
        covered = [layer for first, last in ranges for layer in range(first, last + 1)]
        assert covered == list(range(layers)), (v, ranges)
    halves = [work.stage_range(s, 2) for s in range(4)]
    for s, (first, last) in enumerate(work.stage_range(t) for t in (0, 1)):
        mine = halves[2 * s: 2 * s + 2]
        assert mine[0][0] == first and mine[1][1] == last, "two chunks of each stage"


@pytest.mark.parametrize("kind", KINDS, ids=[k.value for k in KINDS])
def test_the_plans_run_the_cuts_on_two_workers(kind: WorkloadKind) -> None:
    work = Workload.of(kind)
    spec = work.spec()
    for v in (1, 2):
        plan = work.plan(v)
        assert [st.first for st in plan.stages] == list(work.bounds(v))
        assert (plan.workers_used, plan.virtual_stages, plan.num_layers) == (2, v,
                                                                            spec.num_layers)
        assert plan.layer_names == tuple(spec.layer_names) and plan.model == kind.value
    with pytest.raises(ConfigError) as info:
        work.bounds(3)
    assert info.value.parameters == ("virtual_stages",)


def test_the_data_is_one_fixed_batch_that_leaves_the_random_stream_alone() -> None:
    work = Workload()
    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    x, y = work.data(8)
    assert torch.equal(torch.random.get_rng_state(), state)
    x2, y2 = work.data(8)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert x.shape[0] == y.shape[0] == 8
    other, _ = Workload(seed=1).data(8)
    assert not torch.equal(x, other), "the seed picks the batch"


def test_the_llama_is_hugging_faces_cut_as_dreampipe_cuts_it_at_its_split_points() -> None:
    """The layer names are dreampipe's of the model itself; the split points begin its 2
    stages (embed and 2 layers | 2 layers, norm and head) and its 4 chunks; the data are
    next-token pairs of 64 tokens; the loss reads a Hugging Face output or bare logits."""
    from dreampipe.splitter.chain import split_layers

    work = Workload.of(WorkloadKind.LLAMA)
    assert work.hf and (work.batch, work.microbatch, work.workers) == (16, 2, 2)
    model = work.model()
    assert type(model).__name__ == "LlamaForCausalLM"
    x, y = work.data(2)
    assert [name for name, _ in split_layers(model, x)] == list(work.layer_names)
    assert work.split_points() == ["model.layers.2"]
    assert work.split_points(2) == ["model.layers.1", "model.layers.2", "model.layers.3"]
    assert x["input_ids"].shape == y.shape == (2, 64)
    assert torch.equal(x["input_ids"][:, 1:], y[:, :-1]), "the target is the next token"
    with torch.no_grad():
        out = model(**x)
    loss = work.loss_fn(out, y)
    assert loss == work.loss_fn((out.logits,), y) == work.loss_fn(out.logits, y)
    assert float(loss) == pytest.approx(
        float(nn.functional.cross_entropy(out.logits.reshape(-1, 256), y.reshape(-1))))
    assert torch.equal(next(work.model().parameters()), next(model.parameters())), "seeded"
    with pytest.raises(ConfigError, match="Hugging Face model"):
        work.spec()
