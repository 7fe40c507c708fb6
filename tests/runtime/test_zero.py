"""ZeRO on a replicated stage trains as one process does, and keeps what it predicts.

Three local gloo ranks run the zoo's mlp on plan ``2-1`` (stage 0 replicated twice) with
the stage's optimizer state (level 1), its gradients too (level 2), and its weights between
updates too (level 3, :mod:`dreampipe.runtime.zero_params`), sharded over its replicas
(:mod:`dreampipe.runtime.zero`); the runs are compared with the single-process
references of :mod:`runtime.reference` (fp32: rtol 1e-5) and, in 16 bits, with the same
pipeline without ZeRO (bit for bit: an elementwise optimizer steps each chunk as it steps
the whole; level 3 against level 0 bit for bit in fp32 too) and with one bf16 process under
``test_pipeline_precision``'s rule. The mlp of
width 15 has parameters that do not split evenly (padded chunks); that of width 16 does,
so the bytes each rank holds equal :func:`~dreampipe.planning.state_bytes.zero_bytes`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from dreampipe.api.checks import check_schedule
from dreampipe.api.config import TrainConfig
from dreampipe.commands.train_config import TrainResult
from dreampipe.commands.train_run import TrainJob
from dreampipe.errors import ConfigError, ScheduleError
from dreampipe.models import get_model
from dreampipe.models.datasets import load_dataset
from dreampipe.planning.plan import Plan
from dreampipe.planning.state_bytes import zero_bytes
from dreampipe.runtime.precision import Precision
from dreampipe.runtime.processes import run_processes
from dreampipe.runtime.runner_options import OptimizerKind
from dreampipe.runtime.stage_module import StageModule
from dreampipe.runtime.zero import ZeroPlace, _Layout
from dreampipe.runtime.zero_params import ZeroParams, check_gathers, sharded_weights, writable
from dreampipe.scheduling.actions import Action, ActionKind, ScheduleKind
from dreampipe.scheduling.build import build_schedule

from .reference import adam, adamw, reference_pipedream, reference_sync, reference_two_bw, sgd
from .reference_formats import reference_formats
from .runs import train_run
from .zero_workers import (
    branch_rank,
    child_weight_rank,
    mixed_dtype_rank,
    per_use_rank,
    scatter_rank,
    zero_rank,
    zero_zoo,
)

__all__: list[str] = []

RTOL, ATOL = 1e-5, 4e-5
SEED = 3
BOUNDS, REPLICAS = [0, 2], [2, 1]


def _run(level: int, width: int = 16, **kw: Any
         ) -> tuple[TrainResult, list[list[tuple[int, dict[str, int]]]]]:
    """The run of ``kw`` on plan 2-1 at ZeRO ``level``: rank 0's result, every rank's bytes."""
    run = train_run(model="mlp", plan=Plan.from_config(4, BOUNDS, REPLICAS),
                    model_kwargs=(("layers", 4), ("width", width)), seed=SEED,
                    timeout_s=30.0, evaluate=False, **kw)
    ranks = run_processes(zero_rank, 3, (level, TrainJob(run)), deadline_s=100.0)
    result = ranks[0][0]
    assert isinstance(result, TrainResult)
    return result, [records for _, records in ranks]


def _state(result: TrainResult) -> dict[str, Tensor]:
    return {k: v for s in result.stage_states for k, v in s.items()}


def _assert_matches(result: TrainResult, losses: list[float], state: dict[str, Tensor]) -> None:
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(losses),
                               rtol=RTOL, atol=ATOL)
    got = _state(result)
    assert sorted(got) == sorted(state)
    for name, value in state.items():
        torch.testing.assert_close(got[name], value, rtol=RTOL, atol=ATOL, msg=name)


def _assert_equal(a: TrainResult, b: TrainResult) -> None:
    assert a.losses == b.losses
    sa, sb = _state(a), _state(b)
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), (name, (sa[name] - sb[name]).abs().max())


def _spec(width: int) -> Any:
    return get_model("mlp", layers=4, width=width)


# ---- fp32: every level against one process, and the bytes it keeps -------------------
@pytest.fixture(scope="module")
def flush_adam() -> dict[int, tuple[TrainResult, list[list[tuple[int, dict[str, int]]]]]]:
    """1f1b-flush with Adam at each level (width 16: every parameter splits evenly)."""
    return {level: _run(level, schedule=ScheduleKind.FLUSH, minibatch_size=16, microbatches=4,
                        steps=3, optimizer=OptimizerKind.ADAM, lr=0.01)
            for level in (0, 1, 2, 3)}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("level", [0, 1, 2, 3])
def test_flush_with_sharded_replicas_equals_one_process(
    flush_adam: dict[int, Any], level: int
) -> None:
    result, _ = flush_adam[level]
    spec = _spec(16)
    losses, state = reference_sync(spec, load_dataset("synthetic", spec, seed=SEED), steps=3,
                                   minibatch=16, seed=SEED, opt=adam(0.01), microbatches=4)
    _assert_matches(result, losses, state)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("level", [1, 2, 3])
def test_each_replica_keeps_the_bytes_predicted(flush_adam: dict[int, Any], level: int) -> None:
    """At each STEP (level 3: between its RESHARD and the next UNSHARD) a replica of stage
    0 holds what :func:`zero_bytes` says; at level 3 its weights are its chunks, tensors of
    their own (the optimizer's parameters), the full weights' storage freed."""
    spec = _spec(16)
    stage0 = spec.build(0, 1, SEED)
    param_bytes = sum(p.numel() * p.element_size() for p in stage0.parameters())
    for rank, records in enumerate(flush_adam[level][1]):
        later = [held for _, held in records[1:]]  # the optimizer's state exists from step 2
        assert len(later) == 2, records
        base = [held for _, held in flush_adam[0][1][rank][1:]]
        for held, before in zip(later, base, strict=True):
            if rank == 2:  # the last stage is not replicated: ZeRO leaves it alone
                assert held == before
                continue
            want = zero_bytes(level, 2, param_bytes, optimizer_copies=2)
            assert before == {"weights": param_bytes, "masters": 0, "gradients": param_bytes,
                              "optimizer": 2 * param_bytes}
            chunks = {"weights": 0, "masters": want.weights} if level == 3 else {
                "weights": want.weights, "masters": 0}
            assert held == {**chunks, "gradients": want.gradients, "optimizer": want.optimizer}
            assert sum(held.values()) == want.total
            assert sum(held.values()) == {1: 12, 2: 10, 3: 8}[level] / 16 * sum(before.values())


@pytest.mark.timeout(300)
def test_level_3_equals_level_2_bit_for_bit(flush_adam: dict[int, Any]) -> None:
    """fp32, Adam, 1f1b-flush: gathering the chunks rebuilds the weights exactly (level 2
    sums its microbatches' reduce-scatters in another order than level 0's all-reduce)."""
    _assert_equal(flush_adam[3][0], flush_adam[2][0])


@pytest.mark.timeout(300)
def test_level_3_under_zb_h1_equals_level_2_and_one_process() -> None:
    """zb-h1 (``W`` apart: each microbatch's gradient reduce-scattered after its ``W``)."""
    kw: dict[str, Any] = dict(schedule=ScheduleKind.ZB_H1, minibatch_size=16, microbatches=4,
                              steps=3, optimizer=OptimizerKind.ADAM, lr=0.01)
    zero, records = _run(3, **kw)
    two, _ = _run(2, **kw)
    _assert_equal(zero, two)
    assert all(held["weights"] == 0 for _, held in records[0])  # freed at every STEP
    spec = _spec(16)
    losses, state = reference_sync(spec, load_dataset("synthetic", spec, seed=SEED), steps=3,
                                   minibatch=16, seed=SEED, opt=adam(0.01), microbatches=4)
    _assert_matches(zero, losses, state)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("level", [1, 2])
def test_uneven_chunks_and_clipping_train_as_without_zero(level: int) -> None:
    """Width 15 (chunks padded, the last shorter) with SGD's momentum and clipping by the
    global norm, which must count every shard once: as without ZeRO, bit for bit but for
    the norm's sum of squares, added up in another order."""
    kw: dict[str, Any] = dict(width=15, schedule=ScheduleKind.FLUSH, minibatch_size=16,
                              microbatches=4, steps=3, lr=0.2, momentum=0.9, max_grad_norm=0.05)
    zero, _ = _run(level, **kw)
    plain, _ = _run(0, **kw)
    _assert_matches(zero, plain.losses, _state(plain))
    unclipped, _ = _run(0, **{**kw, "max_grad_norm": None})
    assert max(float((_state(unclipped)[k] - v).abs().max())
               for k, v in _state(plain).items()) > 1e-3  # the clip did something


@pytest.mark.timeout(200)
def test_replicas_with_unequal_microbatches_join_each_others_reduce_scatters() -> None:
    """3 microbatches an update on 2 replicas: one runs 2 of them, the other 1 (which one
    alternates by update), and joins the second reduce-scatter with zeros; level 2 and 3."""
    kw: dict[str, Any] = dict(schedule=ScheduleKind.FLUSH, minibatch_size=12, microbatches=3,
                              steps=3, optimizer=OptimizerKind.ADAM, lr=0.01)
    spec = _spec(16)
    losses, state = reference_sync(spec, load_dataset("synthetic", spec, seed=SEED), steps=3,
                                   minibatch=12, seed=SEED, opt=adam(0.01), microbatches=3)
    for level in (2, 3):
        _assert_matches(_run(level, **kw)[0], losses, state)


# ---- 16 bits ------------------------------------------------------------------------
def _sixteen_bit_rule(result: TrainResult, schedule: ScheduleKind, steps: int, width: int,
                      microbatches: int, lr: float) -> None:
    """No further from one bf16 process than 3 times that process is from fp32, plus fp32's
    tolerance; each tensor moved in training by 5 times that bound (test_pipeline_precision)."""
    spec = _spec(width)
    data = load_dataset("synthetic", spec, seed=SEED)
    common: dict[str, Any] = dict(steps=steps, minibatch=16, seed=SEED, opt=sgd(lr, 0.9),
                                  microbatches=microbatches)
    bf16 = reference_formats(spec, data, precision="bf16", **common)
    fp32 = reference_formats(spec, data, precision="fp32", **common)
    start = spec.build(0, spec.num_layers - 1, SEED).state_dict()
    got = _state(result)
    for name, want in bf16.state.items():
        bound = 3 * float((want - fp32.state[name]).abs().max()) + ATOL + RTOL * float(
            want.abs().max())
        assert float((got[name].float() - want).abs().max()) <= bound, name
        assert float((want - start[name]).abs().max()) >= 5 * bound, name
    dl = max(abs(a - b) for a, b in zip(bf16.losses, fp32.losses, strict=True))
    for a, b in zip(result.losses, bf16.losses, strict=True):
        assert abs(a - b) <= 3 * dl + ATOL + RTOL * abs(b)


BF16_CASES = [(ScheduleKind.FLUSH, 1), (ScheduleKind.FLUSH, 2), (ScheduleKind.ZB_H1, 1),
              (ScheduleKind.ZB_H2, 2), (ScheduleKind.GPIPE, 2), (ScheduleKind.FLUSH, 3),
              (ScheduleKind.ZB_H1, 3)]


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("schedule", "level"), BF16_CASES,
                         ids=[f"{s.value}-zero{lv}" for s, lv in BF16_CASES])
def test_bf16_with_sharded_masters_equals_the_plain_pipeline_and_one_process(
    schedule: ScheduleKind, level: int
) -> None:
    kw: dict[str, Any] = dict(width=15, schedule=schedule, minibatch_size=16, microbatches=4,
                              steps=3, lr=0.2, momentum=0.9, precision=Precision.BF16.value)
    zero, records = _run(level, **kw)
    plain, base = _run(0, **kw)
    if level == 1:  # the same all-reduce, each chunk stepped as the whole
        _assert_equal(zero, plain)
    elif level == 3:  # level 2's sums (its microbatches' reduce-scatters), gathered exactly
        _assert_equal(zero, _run(2, **kw)[0])
    _sixteen_bit_rule(zero, schedule, 3, 15, 4, 0.2)
    held, before = records[0][-1][1], base[0][-1][1]  # replica 0 of stage 0, last update
    assert held["masters"] < 0.51 * before["masters"]  # 32-bit masters: this replica's half
    assert held["optimizer"] < 0.51 * before["optimizer"]
    if level >= 2:  # the gradient's half, in bf16 (the 32-bit masters take it at the step)
        assert held["gradients"] < 0.51 * before["gradients"]
    else:
        assert held["gradients"] == before["gradients"]
    # level 3: no 16-bit weights between uses, the 32-bit master chunks gather their rounding
    assert held["weights"] == (0 if level == 3 else before["weights"])


def test_fp16_loss_scaling_unscales_the_shards() -> None:
    kw: dict[str, Any] = dict(width=15, schedule=ScheduleKind.FLUSH, minibatch_size=16,
                              microbatches=4, steps=3, lr=0.2, momentum=0.9,
                              precision=Precision.FP16_MIXED.value, max_grad_norm=0.05)
    zero, _ = _run(2, **kw)
    plain, _ = _run(0, **kw)
    _assert_matches(zero, plain.losses, _state(plain))


# ---- asynchronous schedules -----------------------------------------------------
@pytest.mark.timeout(200)
@pytest.mark.parametrize("level", [1, 2])
def test_pipedream_follows_the_delayed_update_rule(level: int) -> None:
    result, _ = _run(level, width=15, schedule=ScheduleKind.PIPEDREAM, minibatch_size=8, steps=6,
                     lr=0.3, momentum=0.9)
    spec = _spec(15)
    losses, state = reference_pipedream(
        spec, load_dataset("synthetic", spec, seed=SEED), bounds=BOUNDS, replicas=REPLICAS,
        steps=6, minibatch=8, seed=SEED, opt=sgd(0.3, 0.9), compensate=True)
    _assert_matches(result, losses, state)


@pytest.mark.timeout(200)
def test_2bw_at_level_1_follows_its_update_rule() -> None:
    result, _ = _run(1, width=15, schedule=ScheduleKind.TWO_BW, minibatch_size=16,
                     microbatches=2, steps=6, optimizer=OptimizerKind.ADAM, lr=0.01,
                     compensate=False)
    spec = _spec(15)
    losses, state = reference_two_bw(spec, load_dataset("synthetic", spec, seed=SEED), steps=6,
                                     minibatch=16, seed=SEED, opt=adam(0.01), microbatches=2)
    _assert_matches(result, losses, state)


# ---- checkpoints move between levels and plans --------------------------------------
CKPT = {"seed": SEED, "schedule": "1f1b-flush", "minibatch": 16, "microbatches": 2,
        "lr": 0.01, "optimizer": "adamw"}


def _continues(got: dict[str, Any], done: int) -> None:
    spec = _spec(16)
    losses, state = reference_sync(spec, load_dataset("synthetic", spec, seed=SEED),
                                   steps=done + len(got["losses"]), minibatch=16, seed=SEED,
                                   opt=adamw(0.01), microbatches=2)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(losses[done:]),
                               rtol=RTOL, atol=ATOL)
    for k, v in state.items():
        torch.testing.assert_close(got["state"][k], v, rtol=RTOL, atol=ATOL, msg=k)


MOVES = [((2, [2, 1]), (0, [1, 1])), ((0, [1, 1]), (1, [2, 1])), ((1, [2, 1]), (2, [2, 1])),
         ((3, [2, 1]), (0, [1, 1])), ((0, [1, 1]), (3, [2, 1]))]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("saved", "loaded"), MOVES,
                         ids=["zero2-2-1-to-zero0-1-1", "zero0-1-1-to-zero1-2-1",
                              "zero1-to-zero2", "zero3-2-1-to-zero0-1-1",
                              "zero0-1-1-to-zero3-2-1"])
def test_a_checkpoint_moves_between_zero_levels_and_training_continues(
    tmp_path: Path, saved: tuple[int, list[int]], loaded: tuple[int, list[int]]
) -> None:
    (z0, r0), (z1, r1) = saved, loaded
    first = run_processes(zero_zoo, sum(r0), {**CKPT, "zero": z0, "bounds": BOUNDS,
                                              "replicas": r0, "steps": 3,
                                              "save": str(tmp_path)}, deadline_s=100.0)[0]
    _continues(first, 0)
    second = run_processes(zero_zoo, sum(r1), {**CKPT, "zero": z1, "bounds": BOUNDS,
                                               "replicas": r1, "steps": 2,
                                               "resume": str(tmp_path)}, deadline_s=100.0)[0]
    for k, v in first["state"].items():
        assert torch.equal(second["loaded"][k], v), k
    _continues(second, 3)  # Adam's moments came back whole: 3 + 2 updates are 5 straight


@pytest.mark.timeout(300)
def test_level_3_evaluates_and_trains_on_across_finishes_and_segments() -> None:
    """Evaluation gathers the weights whole for the while; training goes on over segments
    (a schedule extended, then restarted): the same losses, evaluations and weights as
    level 0, bit for bit."""
    job = {**CKPT, "bounds": BOUNDS, "replicas": [2, 1], "steps": 5, "finish_every": 2,
           "evaluate": 2, "segment_microbatches": 4}
    three = run_processes(zero_zoo, 3, {**job, "zero": 3}, deadline_s=100.0)[0]
    zero = run_processes(zero_zoo, 3, {**job, "zero": 0}, deadline_s=100.0)[0]
    assert len(three["evals"]) == 2 and three["evals"] == zero["evals"]
    assert three["losses"] == zero["losses"]
    for k, v in zero["state"].items():
        assert torch.equal(three["state"][k], v), k


# ---- single-process rules -----------------------------------------------------------
@pytest.mark.parametrize("schedule", ["pipedream", "2bw"])
def test_level_3_with_an_asynchronous_schedule_is_refused_by_name(schedule: str) -> None:
    with pytest.raises(ConfigError, match=rf"zero=3 with schedule={schedule}: its "
                       r"microbatches in flight run on a weight version each.*use zero=2") as e:
        TrainConfig(schedule=schedule, zero=3, microbatches=1 if schedule == "pipedream" else 2)
    assert e.value.parameters == ("zero", "schedule")
    with pytest.raises(ConfigError, match=r"semantics=async .* none of them can run this"):
        TrainConfig(schedule="auto", semantics="async", zero=3)
    TrainConfig(schedule="1f1b-flush", zero=3)  # a synchronous one runs it
    plan = Plan.from_config(4, BOUNDS, REPLICAS)
    staged = dataclasses.replace(plan, stages=(dataclasses.replace(plan.stages[0], zero=3),
                                               plan.stages[1]))
    config = TrainConfig(schedule=schedule, microbatches=1 if schedule == "pipedream" else 2)
    with pytest.raises(ConfigError, match=rf"zero=3 on stage 0 with schedule={schedule}: its "
                       r"microbatches in flight .* give the stage zero=2"):  # a plan's stage
        check_schedule(config, staged)
    alone = dataclasses.replace(plan, stages=(plan.stages[0],
                                              dataclasses.replace(plan.stages[1], zero=3)))
    check_schedule(config, alone)  # one replica: nothing to shard, nothing refused


def test_levels_beyond_three_are_refused_by_name() -> None:
    with pytest.raises(ConfigError, match=r"zero=4; give 0, 1, 2 or 3") as e:
        ZeroPlace(4, 0, 2)
    assert e.value.parameters == ("zero",)
    with pytest.raises(ConfigError, match=r"zero=4; give 0 \(no sharding\).* or 3"):
        TrainConfig(schedule="1f1b-flush", zero=4)
    one = StageModule(nn.Linear(3, 3), lambda ps: torch.optim.SGD(ps, lr=0.1), stage=0,
                      input_grad=False, zero=ZeroPlace(2, 0, 1))
    assert one.zero is None  # one replica: nothing to shard


@pytest.mark.timeout(120)
def test_level_2_never_holds_the_whole_gradient() -> None:
    """Each microbatch's gradient goes to its reduce-scatter as the backward finishes each
    parameter: at most a few parameters' gradients are alive at once, never the stage's,
    and the chunks sum every replica's microbatches."""
    for got in run_processes(scatter_rank, 2, None, deadline_s=60.0):
        assert got["sums_equal"], got
        assert 0 < got["most"] <= 4 * got["largest"] < got["total"], got


@pytest.mark.timeout(120)
def test_level_3_per_use_holds_one_module_s_weights_whole_at_a_time() -> None:
    """Each Linear's forward starts with only its own two weights whole (the gathers),
    none are whole after the forward though its graph is alive (the saved weights are
    references), nor after the backward, whose gradients are the whole model's."""
    for got in run_processes(per_use_rank, 2, 3, deadline_s=60.0):
        assert got["during"] == [2, 0, 2, 0, 2], got  # a Tanh holds none
        assert got["after_forward"] == 0 and got["after_backward"] == 0, got
        assert got["gradients_equal"], got


@pytest.mark.timeout(120)
def test_level_3_per_use_gathers_a_module_s_weights_each_in_its_own_dtype() -> None:
    """A module's bf16 weight and fp32 bias arrive whole in their own dtypes: one gather
    of both in the first's would round the bias to bf16."""
    for got in run_processes(mixed_dtype_rank, 2, None, deadline_s=60.0):
        assert got == {"weight": True, "bias": True}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("apart", [True, False])
def test_replicas_whose_data_picks_other_weights_stop_before_the_update(apart: bool) -> None:
    """Gathers per use pair up by their order: where replica 0's microbatch runs one
    expert and replica 1's another of the same shape, each would run on rows of both.
    The gathers carry their first weight's index, and ``RESHARD`` (before the update's
    reduce-scatter and step) stops every replica, naming the fix; the same expert on
    both passes."""
    for got in run_processes(branch_rank, 2, apart, deadline_s=60.0):
        if apart:
            assert "gathered different weights for one use" in got and "zero=2" in got
        else:
            assert got == ""


@pytest.mark.timeout(120)
def test_a_weight_read_without_calling_its_module_is_refused_with_the_fix() -> None:
    """Per use, a module's weights are gathered as it runs: a parent's F.linear of its
    child's weight reads the shard's empty storage, which stops with the fix named, not
    torch's message about a storage of size 0."""
    for got in run_processes(child_weight_rank, 2, None, deadline_s=60.0):
        assert "zero=3 on stage 0: its forward read a weight whose module it did not call" \
            in got and "call the module (self.fc(x)), or shard this stage at zero=2" in got


def _decay_matrices(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """The usual factory: weight decay on the matrices only, chosen by shape."""
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2]},
                              {"params": [p for p in params if p.dim() < 2],
                               "weight_decay": 0.0}], lr=0.1, weight_decay=0.1)


@pytest.mark.parametrize("level", [1, 2, 3])
@pytest.mark.parametrize("precision", [Precision.FP32, Precision.BF16])
def test_the_factory_s_groups_hold_the_chunks_of_the_parameters_it_chose(
        level: int, precision: Precision) -> None:
    # the factory sees the model's parameters, not their flat chunks (all 1-D), so a
    # group chosen by shape keeps the weight's chunk, and the bias's stays undecayed
    st = StageModule(nn.Linear(3, 4), _decay_matrices, stage=0, input_grad=False,
                     zero=ZeroPlace(level, 0, 2), precision=precision)
    assert st.zero is not None and st.zero.optimizer is not None
    decayed, plain = st.zero.optimizer.param_groups
    assert (decayed["weight_decay"], plain["weight_decay"]) == (0.1, 0.0)
    assert [p.numel() for p in decayed["params"]] == [6]  # half of the 4x3 weight
    assert [p.numel() for p in plain["params"]] == [2]  # half of the bias
    assert {id(p) for g in (decayed, plain) for p in g["params"]} == {
        id(p) for p in st.optimized}
    # a factory that builds from tensors it was not given is refused by name
    with pytest.raises(ConfigError, match="tensors it was not given"):
        StageModule(nn.Linear(3, 4), lambda ps: torch.optim.SGD([nn.Parameter(
            torch.zeros(2))], lr=0.1), stage=0, input_grad=False, zero=ZeroPlace(level, 0, 2))


def test_level_3_frees_the_weights_at_once_and_refuses_a_schedule_without_gathers() -> None:
    st = StageModule(nn.Linear(3, 4), lambda ps: torch.optim.SGD(ps, lr=0.1), stage=0,
                     input_grad=False, zero=ZeroPlace(3, 1, 2))
    assert isinstance(st.zero, ZeroParams) and not st.zero.whole
    assert all(p.untyped_storage().nbytes() == 0 for p in st.params)  # only the chunks
    assert [m.numel() for m in st.optimized] == [6, 2]  # this replica's halves, 4x3 and 4
    with pytest.raises(ScheduleError, match=r"stage 0 shards its weights .* \(no UNSHARD\)"):
        check_gathers(st.zero, build_schedule([2], ScheduleKind.DP, 2, 2).actions[1], 0)
    check_gathers(st.zero, build_schedule([2], ScheduleKind.DP, 2, 2, zero=[3]).actions[1], 0)
    gather = Action(ActionKind.UNSHARD, 0, 0)
    with pytest.raises(ScheduleError, match=r"runs UNSHARD0 on stage 0, which does not shard"):
        sharded_weights(None, gather)
    with writable(st.zero):  # a load writes the whole weights, then they are freed again
        st.module.load_state_dict({"weight": torch.ones(4, 3), "bias": torch.ones(4)})
    assert not st.zero.whole and st.params[0].untyped_storage().nbytes() == 0


def test_chunks_cover_each_parameter_once_and_scatter_rank_major() -> None:
    """Each replica's chunks tile a parameter; a reduce-scatter's input holds replica
    ``k``'s chunk of each gradient in row ``k``, zero-padded; gathered, they are whole."""
    params = [torch.arange(7.0), torch.arange(4.0).view(2, 2) + 10, torch.tensor([99.0])]
    layouts = [_Layout(params, ZeroPlace(1, k, 3), cap_mb=1.0) for k in range(3)]
    for i, p in enumerate(params):
        parts = [lay.shard(i, p.view(-1)) for lay in layouts]
        assert torch.equal(torch.cat(parts), p.view(-1))
    lay = layouts[0]
    (bucket,) = lay.buckets
    buf = torch.zeros(3, bucket.size)
    for k, i in enumerate(bucket.indices):
        lay.put(buf, bucket, k, params[i])
    for k, other in enumerate(layouts):  # replica k's stretch: its chunk of each, padded
        for i, off in zip(bucket.indices, bucket.offsets, strict=True):
            n = other.hi[i] - other.lo[i]
            assert torch.equal(buf[k, off:off + n], other.shard(i, params[i].view(-1)))
    for k, i in enumerate(bucket.indices):
        assert torch.equal(lay.whole(i, buf.reshape(-1), bucket, k), params[i].view(-1))
        dest = torch.full((params[i].numel(),), -1.0)  # written in place, row by row
        lay.copy_whole(i, buf.reshape(-1), bucket, k, dest)
        assert torch.equal(dest, params[i].view(-1))


def test_the_memory_model_keeps_what_the_paper_says() -> None:
    p = 4.0  # one fp32 parameter with Adam on 2 replicas
    assert [zero_bytes(level, 2, p, optimizer_copies=2).total for level in range(4)] == [
        16, 12, 10, 8]
    bf16 = zero_bytes(1, 4, 2.0, optimizer_copies=2, master_weights=True)
    assert (bf16.weights, bf16.gradients, bf16.optimizer) == (2, 2, 3)  # 12 bytes / 4
    assert zero_bytes(2, 1, p, optimizer_copies=2).total == 16  # one replica: no saving
    three = zero_bytes(3, 2, 2.0, optimizer_copies=2, master_weights=True)
    assert (three.weights, three.gradients, three.optimizer) == (0, 1, 6)  # masters gather
    assert zero_bytes(3, 1, 2.0, optimizer_copies=2, master_weights=True).weights == 2


@pytest.mark.parametrize("replica", [0, 1])
def test_a_0_dim_parameter_s_saved_adam_state_resumes_as_its_chunk(replica: int) -> None:
    """A learnable scalar's Adam moments are 0-dim in a checkpoint, as its step count is:
    the moments are cut to the replica's chunk (one value, or none), the count kept, and
    the optimizer steps on."""
    from dreampipe.runtime.zero_params import stage_optimizer

    module = nn.Module()
    module.scale = nn.Parameter(torch.tensor(0.5))
    shards = stage_optimizer(module, [module.scale], lambda ps: torch.optim.Adam(ps, lr=0.1),
                             Precision.FP32, ZeroPlace(1, replica, 2), 0)
    chunk = shards.masters[0]
    whole = {"step": torch.tensor(3.0), "exp_avg": torch.tensor(0.25),
             "exp_avg_sq": torch.tensor(0.5)}
    state = shards.sharded_state(0, whole)
    assert state["step"].shape == () and state["exp_avg"].shape == chunk.shape
    shards.optimizer.state[chunk] = state
    chunk.grad = torch.ones_like(chunk)
    shards.optimizer.step()
    assert float(state["step"]) == 4.0


@pytest.mark.parametrize(("make", "warns"), [
    (lambda ps: torch.optim.Adafactor(ps, lr=0.01), True),
    (lambda ps: torch.optim.AdamW(ps, lr=0.01), False),
])
def test_an_optimizer_not_known_to_step_each_value_alone_is_warned_of_under_zero(
        make: Any, warns: bool, caplog: pytest.LogCaptureFixture) -> None:
    """Adafactor's factored moments of a chunk are not those of the whole weight: the
    update differs from one without ZeRO, which the run says, naming the fix."""
    from dreampipe.runtime.zero_params import stage_optimizer

    with caplog.at_level("WARNING"):
        stage_optimizer(nn.Linear(4, 4), list(nn.Linear(4, 4).parameters()), make,
                        Precision.FP32, ZeroPlace(1, 0, 2), 0)
    assert ("Adafactor steps each replica's 1-D chunk" in caplog.text) is warns
    assert ("use zero=0 for it" in caplog.text) is warns
