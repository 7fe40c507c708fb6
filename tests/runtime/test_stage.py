"""Weight versions of one stage, single process: sharing, copy-on-write, freeing."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dreampipe.errors import PlanError, ScheduleError
from dreampipe.runtime.stage_module import StageModule

__all__: list[str] = []


def _module() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def _stage(*, stage: int = 0, vertical_sync: bool = False, stash: bool = True) -> StageModule:
    return StageModule(
        _module(), lambda ps: torch.optim.SGD(ps, lr=0.5), stage=stage, input_grad=stage > 0,
        stash=stash, vertical_sync=vertical_sync,
    )


def _run_1f1b(st: StageModule, in_flight: int, microbatches: int) -> list[int]:
    """Drive one stage through PipeDream's 1F1B order; returns versions held after each step."""
    held = []
    torch.manual_seed(1)
    for u in range(microbatches + in_flight):
        if u < microbatches:
            st.forward(u, torch.randn(5, 3))
        if u >= in_flight - 1 and u - in_flight + 1 < microbatches:
            st.backward(u - in_flight + 1, torch.ones(5, 2))
            st.step()
            held.append(st.versions_held)
    return held


@pytest.mark.parametrize("in_flight", [1, 2, 4])
def test_a_stage_holds_one_version_per_microbatch_in_flight(in_flight: int) -> None:
    st = _stage()
    held = _run_1f1b(st, in_flight, microbatches=8)
    assert st.peak_versions == in_flight
    assert max(held) <= in_flight
    assert st.versions_held == 0
    assert st.version == 8


def test_forwards_share_the_live_weights_until_a_step() -> None:
    st = _stage()
    live = next(st.module.parameters())
    st.forward(0, torch.randn(5, 3))
    st.forward(1, torch.randn(5, 3))
    assert st.versions_held == 1
    version = st._versions[0].tensors[0]  # 0.weight, the first parameter
    assert version.data_ptr() == live.data_ptr()
    before = live.detach().clone()
    st.backward(0, torch.ones(5, 2))
    st.step()
    assert version.data_ptr() != live.data_ptr()
    assert torch.equal(version, before)
    assert not torch.equal(live.detach(), before)


def _second_microbatch_gradients(st: StageModule) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """F0 F1 B0 STEP B1: microbatch 1's input and the weight gradients its backward left."""
    x0, x1 = torch.randn(5, 3), torch.randn(5, 3)
    st.forward(0, x0)
    st.forward(1, x1)
    st.backward(0, torch.ones(5, 2))
    st.step()
    st.backward(1, torch.ones(5, 2))
    return x1, [g.clone() for g in st.gradients()]


def test_backward_uses_the_forward_version() -> None:
    x1, grads = _second_microbatch_gradients(_stage())
    plain = _module()
    plain(x1).backward(torch.ones(5, 2))
    for g, p in zip(grads, plain.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad)


def test_without_stashing_the_backward_uses_the_newest_weights() -> None:
    st = _stage(stash=False)
    x1, grads = _second_microbatch_gradients(st)
    newest = _module()
    newest.load_state_dict(st.module.state_dict())
    newest(x1).backward(torch.ones(5, 2))
    for g, p in zip(grads, newest.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad)


@pytest.mark.parametrize("stash", [True, False])
def test_a_backward_draws_the_forwards_dropout_and_moves_batchnorm_once(stash: bool) -> None:
    """Without stashing the backward runs the forward again: with the forward's random
    draws and buffers, so its gradient is the stashed one's and BatchNorm's running
    statistics move once a microbatch."""
    def build() -> StageModule:
        torch.manual_seed(0)
        module = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5),
                               nn.Linear(8, 2))
        return StageModule(module, lambda ps: torch.optim.SGD(ps, lr=0.1), stage=1,
                           input_grad=True, stash=stash)

    st = build()
    torch.manual_seed(5)
    x = torch.randn(6, 4)
    st.forward(0, x.clone())
    torch.manual_seed(99)  # the backward must not draw anew
    dx = st.backward(0, torch.ones(6, 2))
    bn = st.module[1]
    assert isinstance(bn, nn.BatchNorm1d) and int(bn.num_batches_tracked) == 1
    # one process: the same draws, one forward, its own backward
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 2))
    torch.manual_seed(5)
    xr = torch.randn(6, 4).requires_grad_(True)
    ref(xr).backward(torch.ones(6, 2))
    assert dx is not None and xr.grad is not None
    torch.testing.assert_close(dx, xr.grad)
    for g, p in zip(st.gradients(), ref.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad)
    torch.testing.assert_close(bn.running_mean, ref[1].running_mean)


def test_vertical_sync_keeps_versions_later_microbatches_name() -> None:
    st = _stage(stage=1, vertical_sync=True)
    for u in range(3):
        st.note_version(0)
        st.forward(u, torch.randn(5, 3), version=0)
        st.backward(u, torch.ones(5, 2))
        st.step()
    assert st.version == 3
    assert sorted(st._versions) == [0, 1, 2]
    st.note_version(2)
    st.forward(3, torch.randn(5, 3), version=2)
    assert sorted(st._versions) == [2]
    with pytest.raises(ScheduleError, match="no weight version 1"):
        st.forward(4, torch.randn(5, 3), version=1)


def test_a_non_tensor_stage_output_is_an_error() -> None:
    class Pair(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x, x

    st = StageModule(
        nn.Sequential(nn.Linear(3, 3), Pair()), lambda ps: torch.optim.SGD(ps, lr=0.1),
        stage=0, input_grad=False,
    )
    with pytest.raises(PlanError, match="stage 0 returned a tuple, not a tensor"):
        st.forward(0, torch.randn(2, 3))
