"""A rank's copies of a weight tied across stages, single process: where they are, their
start, their summed gradient, and which copy the global norm counts."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dreampipe.api.ties import TiePlace, tie_place
from dreampipe.planning.plan import Plan
from dreampipe.runtime.precision import Precision
from dreampipe.runtime.stage_module import StageModule
from dreampipe.runtime.stage_ties import RankTie, TiedCopy, left_out_of_norm, start_values, sum_ties
from dreampipe.splitter.chain import Tie, hold_apart

__all__: list[str] = []


def test_an_interleaved_rank_holds_two_copies_and_the_first_stage_is_normed() -> None:
    plan = Plan.from_config(7, [0, 3, 4, 5], [1, 1, 1, 1], virtual_stages=2)  # 0, 2 on rank 0
    tie = Tie((0, 2, 3), ("wte.weight", "proj.weight", "head.weight"))
    assert tie_place(tie, plan, 0) == TiePlace(
        (0, 1), 0, ((0, "wte.weight", True, True), (2, "proj.weight", True, False)))
    assert tie_place(tie, plan, 1) == TiePlace((0, 1), 0, ((3, "head.weight", True, False),))
    local = Tie((1, 3), ("a.weight", "b.weight"))  # both on rank 1: no group to sum over
    assert tie_place(local, plan, 1).ranks == (1,)
    assert tie_place(local, plan, 0).copies == ()


def test_a_replicated_stage_adds_its_sum_from_its_first_replica_only() -> None:
    plan = Plan.from_config(3, [0, 2], [1, 2])  # stage 1 on ranks 1 and 2
    tie = Tie((0, 1), ("embed.weight", "head.weight"))
    assert tie_place(tie, plan, 1) == TiePlace((0, 1, 2), 0, ((1, "head.weight", True, False),))
    assert tie_place(tie, plan, 2) == TiePlace((0, 1, 2), 0, ((1, "head.weight", False, False),))


def test_on_copies_of_a_pipeline_each_stages_first_replica_adds_its_sum() -> None:
    """2 copies of a 2-rank pipeline, stages 0 and 2 on ranks 0 and 1, 1 and 3 on ranks 2
    and 3: the tie's group is every rank; ranks 0 and 2 add their stages' sums (the update
    pass all-reduces a rank's stages before its first step, tests/scheduling)."""
    plan = Plan.from_config(4, [0, 1, 2, 3], [2, 2, 2, 2], virtual_stages=2)
    tie = Tie((0, 3), ("wte.weight", "head.weight"))
    assert [tie_place(tie, plan, rank) for rank in range(4)] == [
        TiePlace((0, 1, 2, 3), 0, ((stage, name, counts, stage == 0),))
        for stage, name, counts in [(0, "wte.weight", True), (0, "wte.weight", False),
                                    (3, "head.weight", True), (3, "head.weight", False)]]


def test_two_stages_of_one_rank_hold_a_shared_module_and_weight_apart() -> None:
    embed, shared = nn.Embedding(5, 3), nn.Linear(3, 3)
    head, again = nn.Linear(3, 5, bias=False), nn.Linear(3, 5, bias=False)
    head.weight = again.weight = embed.weight
    first, later = nn.Sequential(embed, shared), nn.Sequential(shared, head, again)
    tied = embed.weight
    hold_apart([first, later])
    assert first[0] is embed and first[1] is shared and embed.weight is tied  # kept
    assert head.weight is not tied  # the later stage's module holds a copy in its place
    assert later[0] is not shared and torch.equal(later[0].weight, shared.weight)
    assert later[1].weight is later[2].weight  # one tensor within a stage stays one
    torch.testing.assert_close(later[1].weight, embed.weight, rtol=0, atol=0)
    assert not {id(p) for p in first.parameters()} & {id(p) for p in later.parameters()}


@pytest.fixture
def world() -> Iterator[None]:
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        if owns:
            dist.destroy_process_group()


def _built(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def _stage(stage: int, built: nn.Module, precision: Precision = Precision.FP32
           ) -> StageModule:
    return StageModule(built, lambda ps: torch.optim.SGD(ps, lr=0.5), stage=stage,
                       input_grad=False, precision=precision)


def _gradient(st: StageModule, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    st.forward(0, torch.randn(5, 3))
    st.backward(0, torch.randn(5, 2))
    return st.gradients()[0].clone()


@pytest.mark.usefixtures("world")
def test_two_copies_on_one_rank_start_equal_and_take_one_sum_each() -> None:
    first, later = _built(1), _built(2)
    assert not torch.equal(first[0].weight, later[0].weight)
    start_values([((first[0].weight, later[0].weight), None, 0)])
    a, b = _stage(0, first), _stage(2, later)
    tie = RankTie((TiedCopy(a, 0, True, True), TiedCopy(b, 0, True, False)), None, 0)
    torch.testing.assert_close(b.params[0], a.params[0], rtol=0, atol=0)
    total = _gradient(a, 3) + _gradient(b, 4)
    waited: list[object] = []
    sum_ties([tie], waited.append)
    assert waited == []  # all on this rank: nothing to all-reduce
    ga, gb = a.gradients()[0], b.gradients()[0]
    torch.testing.assert_close(ga, total, rtol=0, atol=0)
    torch.testing.assert_close(gb, total, rtol=0, atol=0)
    assert ga.data_ptr() != gb.data_ptr()  # clipping scales each copy's once
    assert left_out_of_norm([tie]) == {(2, 0)}
    a.step()
    b.step()
    torch.testing.assert_close(b.params[0], a.params[0], rtol=0, atol=0)
    assert not torch.equal(a.params[1], b.params[1])  # the untied weights stay their own


@pytest.mark.usefixtures("world")
def test_a_copy_that_does_not_count_adds_zeros_through_the_runners_wait() -> None:
    st = _stage(1, _built(1))
    _gradient(st, 3)
    tie = RankTie((TiedCopy(st, 0, False, False),), dist.new_group([0]), 0)
    waited: list[object] = []

    def wait(work: object) -> None:
        waited.append(work)
        work.wait()  # type: ignore[attr-defined]

    sum_ties([tie], wait)
    assert len(waited) == 2  # the tie's sum and flag of use, through the runner's wait
    torch.testing.assert_close(st.gradients()[0], torch.zeros(4, 3), rtol=0, atol=0)


@pytest.mark.usefixtures("world")
def test_under_bf16_the_tied_copies_masters_start_from_the_32_bit_value() -> None:
    """The copies start before the stages cast to 16 bits: each 32-bit master weight is
    the first copy's value itself, not its bf16 rounding (which a start after the cast
    would give every copy, losing updates smaller than the rounding)."""
    first, later = _built(1), _built(2)
    value = first[0].weight.detach().clone()
    assert not torch.equal(value.bfloat16().float(), value)  # the rounding would show
    start_values([((first[0].weight, later[0].weight), None, 0)])
    a, b = _stage(0, first, Precision.BF16), _stage(2, later, Precision.BF16)
    for st in (a, b):
        assert st.params[0].dtype == torch.bfloat16
        torch.testing.assert_close(st.optimized[0], value, rtol=0, atol=0)


class _Spare(nn.Module):
    """A layer whose forward uses ``used`` only: ``spare``'s weight gets no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.used, self.spare = nn.Linear(3, 2), nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def _decaying(stage: int, built: nn.Module) -> StageModule:
    return StageModule(built, lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.9,
                                                         weight_decay=0.1),
                       stage=stage, input_grad=False)


@pytest.mark.usefixtures("world")
@pytest.mark.parametrize("grouped", [False, True])
def test_a_tied_weight_no_copy_used_takes_no_gradient_so_decay_leaves_it(grouped: bool) -> None:
    """One process gives a weight its update never used no gradient, and SGD's weight
    decay and momentum skip it; the copies' sum must say so too, not hand them zeros."""
    torch.manual_seed(0)
    a, b = _decaying(0, _Spare()), _decaying(2, _Spare())
    index = [n for n, _ in a.module.named_parameters()].index("spare.weight")
    start_values([((a.params[index], b.params[index]), None, 0)])
    before = a.params[index].detach().clone()
    for st, seed in ((a, 3), (b, 4)):
        torch.manual_seed(seed)
        st.forward(0, torch.randn(5, 3))
        st.backward(0, torch.randn(5, 2))
    group = dist.new_group([0]) if grouped else None
    waited: list[object] = []

    def wait(work: object) -> None:
        waited.append(work)
        work.wait()  # type: ignore[attr-defined]

    tie = RankTie((TiedCopy(a, index, True, True), TiedCopy(b, index, True, False)), group, 0)
    sum_ties([tie], wait)
    assert len(waited) == (2 if grouped else 0)  # the sum and the flag of use
    assert not a.tied_used(index) and not b.tied_used(index)
    used = [n for n, _ in a.module.named_parameters()].index("used.weight")
    moved = a.params[used].detach().clone()
    a.step()
    b.step()
    for st in (a, b):
        torch.testing.assert_close(st.params[index], before, rtol=0, atol=0)
    assert not torch.equal(a.params[used], moved)  # the used weight decays and steps


@pytest.mark.usefixtures("world")
def test_a_tied_weight_one_copy_used_gives_every_copy_that_gradient() -> None:
    torch.manual_seed(0)
    a, b = _decaying(0, _Spare()), _decaying(2, _Spare())
    index = [n for n, _ in a.module.named_parameters()].index("used.weight")
    start_values([((a.params[index], b.params[index]), None, 0)])
    torch.manual_seed(3)
    a.forward(0, torch.randn(5, 3))
    a.backward(0, torch.randn(5, 2))  # b runs nothing this update
    assert not b.tied_used(index)
    tie = RankTie((TiedCopy(a, index, True, True), TiedCopy(b, index, True, False)), None, 0)
    sum_ties([tie], lambda work: None)
    assert b.tied_used(index)
    before = b.params[index].detach().clone()
    a.step()
    b.step()
    torch.testing.assert_close(b.params[index], a.params[index], rtol=0, atol=0)
    assert not torch.equal(b.params[index], before)
