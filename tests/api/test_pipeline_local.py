"""The Pipeline in this process, one worker: options against plain PyTorch loops."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import dreampipe
from dreampipe.api import pipeline as pipeline_module
from dreampipe.planning.plan import Plan
from dreampipe.scheduling.actions import ActionKind, Schedule
from dreampipe.scheduling.microbatch_layout import MicrobatchLayout
from dreampipe.splitter.chain import split_layers

__all__: list[str] = []

RTOL, ATOL = 1e-5, 4e-5


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 3))


def _data(n: int = 8) -> list[tuple[Tensor, Tensor]]:
    gen = torch.Generator().manual_seed(2)
    return [(torch.randn(8, 6, generator=gen), torch.randint(0, 3, (8,), generator=gen))
            for _ in range(n)]


def _warmup(step: int) -> float:
    return min(1.0, (step + 1) / 3)


def _reference(model: nn.Module, data: list[tuple[Tensor, Tensor]], micro: int,
               clip: float | None = None) -> tuple[list[float], dict[str, Tensor]]:
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _warmup)
    losses = []
    for x, y in data:
        opt.zero_grad()
        total = 0.0
        for xm, ym in zip(x.chunk(micro), y.chunk(micro), strict=True):
            loss = F.cross_entropy(model(xm), ym)
            (loss / micro).backward()
            total += float(loss.detach())
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        sched.step()
        losses.append(total / micro)
    return losses, model.state_dict()


def _pipe(model: nn.Module, data: list[tuple[Tensor, Tensor]], plan: Any = "auto",
          **config: Any) -> dreampipe.Pipeline:
    return dreampipe.Pipeline(
        model, example=data[0], loss_fn=F.cross_entropy,
        optimizer=lambda p: torch.optim.AdamW(p, lr=0.05),
        lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, _warmup),
        plan=plan, config=dreampipe.TrainConfig(**config),
    )


def _assert_trained_like(pipe: dreampipe.Pipeline, losses: list[float],
                         reference: tuple[list[float], dict[str, Tensor]]) -> None:
    """The pipeline's losses and weights are the reference loop's."""
    want_losses, want = reference
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses),
                               rtol=RTOL, atol=ATOL)
    got = pipe.full_state_dict()
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=RTOL, atol=ATOL, msg=k)


@pytest.mark.parametrize("clip", [None, 0.5], ids=["plain", "clipped"])
def test_one_worker_flush_equals_accumulation_with_scheduler_and_clipping(
    clip: float | None,
) -> None:
    data = _data()
    want_losses, want = _reference(_model(), data, micro=2, clip=clip)
    pipe = _pipe(_model(), data, schedule="1f1b-flush", microbatches=2, max_grad_norm=clip)
    for x, y in data[:5]:  # two segments: the pipeline fills again after finish()
        pipe.step(x, y)
    losses = pipe.finish()
    for x, y in data[5:]:
        pipe.step(x, y)
    losses += pipe.finish()
    _assert_trained_like(pipe, losses, (want_losses, want))
    assert pipe.scheduler is not None and pipe.scheduler.last_epoch == len(data)
    pipe.close()


def test_reserved_steps_never_stop_to_extend_the_schedule_and_train_alike(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``reserve`` builds the schedule once; the steps train as if it had grown as they came."""
    data = _data(40)  # past the first horizon (32): an unreserved loop extends it
    want_losses, want = _reference(_model(), data, micro=2)
    pipe = _pipe(_model(), data, schedule="1f1b-flush", microbatches=2)
    with pytest.raises(dreampipe.ConfigError, match=r"reserve\(0\): reserve at least 1"):
        pipe.reserve(0)
    switches = 0
    switch = pipe.runner.switch

    def counted(schedule: object) -> None:
        nonlocal switches
        switches += 1
        switch(schedule)  # type: ignore[arg-type]

    monkeypatch.setattr(pipe.runner, "switch", counted)
    pipe.reserve(5)
    assert switches == 0  # 2 x 5 fits the first horizon
    for x, y in data[:5]:
        pipe.step(x, y)
    losses = pipe.finish()  # one switch: to the exact schedule, to drain
    assert switches == 1
    pipe.reserve(len(data) - 5)  # a new segment, on its reserved schedule from the start
    for x, y in data[5:]:
        pipe.step(x, y)
    assert switches == 1, "a reserved step stopped to extend the schedule"
    losses += pipe.finish()
    _assert_trained_like(pipe, losses, (want_losses, want))
    pipe.close()



def test_a_long_stream_drains_full_segments_on_reserved_schedules_and_trains_alike(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past ``SEGMENT_MICROBATCHES`` a step drains, as ``finish()`` would; nothing else changes.

    A cap of 96 microbatches is 48 minibatches of 2 microbatches: 115 reserved steps
    run as segments of 48, 48 and 19. ``reserve`` builds every schedule they
    run on (48 minibatches, and 38 for the last segment's horizon), so no step
    builds one; no schedule holds more than the cap; the losses of all 115
    steps come back from the one ``finish()``; and the events number microbatches
    and updates over the whole run, not from 0 in each segment.
    """
    monkeypatch.setattr(pipeline_module, "SEGMENT_MICROBATCHES", 96)
    built: list[int] = []
    build = MicrobatchLayout.build

    def counted(layout: MicrobatchLayout, replicas: list[int], steps: int,
                in_flight: list[int] | None = None, virtual_stages: int = 1,
                zero: list[int] | None = None, steps_agree: bool = False) -> Schedule:
        built.append(steps)
        return build(layout, replicas, steps, in_flight, virtual_stages, zero, steps_agree)

    monkeypatch.setattr(MicrobatchLayout, "build", counted)
    data = _data(115)
    want_losses, want = _reference(_model(), data, micro=2)
    pipe = _pipe(_model(), data, schedule="1f1b-flush", microbatches=2, record_events=True)
    pipe.reserve(len(data))
    assert built == [32, 48, 38]
    longest = 0
    for x, y in data:
        pipe.step(x, y)
        longest = max(longest, pipe.runner.schedule.num_microbatches)
    assert built == [32, 48, 38], "a reserved step built a schedule"
    losses = pipe.finish()
    assert longest == 96
    assert built[3:] == [19]  # the drain of the last, short segment
    forwards = [e.microbatch for e in pipe.events if e.kind is ActionKind.FORWARD]
    assert forwards == list(range(2 * len(data)))
    steps = [e.microbatch for e in pipe.events if e.kind is ActionKind.STEP]
    assert steps == list(range(len(data)))
    _assert_trained_like(pipe, losses, (want_losses, want))
    pipe.close()


def test_evaluate_gives_the_mean_loss_and_accuracy_of_the_current_weights() -> None:
    data = _data(3)
    model = _model()
    pipe = _pipe(copy.deepcopy(model), data, schedule="pipedream")
    batches = [data[0], (data[1][0][:5], data[1][1][:5])]  # a short last batch
    result = pipe.evaluate(batches)
    with torch.no_grad():
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        out = model(x)
    assert result.loss == pytest.approx(float(F.cross_entropy(out, y)), rel=1e-5)
    assert result.accuracy == pytest.approx(float((out.argmax(1) == y).float().mean()))
    with pytest.raises(dreampipe.ConfigError, match="no batches"):  # not a loss of 0
        pipe.evaluate([])
    pipe.close()


def test_a_batchnorm_left_in_eval_mode_stays_frozen_through_training_and_evaluate() -> None:
    """Fine-tuning with frozen BatchNorm statistics: the module keeps the mode the user
    gave it, in training and after an evaluation, as in one process."""
    def frozen() -> nn.Sequential:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.GELU(), nn.Linear(16, 3))
        with torch.no_grad():
            model[1].running_mean.fill_(0.5)
        model[1].eval()
        return model

    data = _data()
    want_losses, want = _reference(frozen(), data, micro=1)
    pipe = _pipe(frozen(), data, plan=Plan.from_config(4, [0], [1]), schedule="1f1b-flush")
    for x, y in data[:4]:
        pipe.step(x, y)
    losses = pipe.finish()
    pipe.evaluate(data[:1])
    for x, y in data[4:]:
        pipe.step(x, y)
    losses += pipe.finish()
    _assert_trained_like(pipe, losses, (want_losses, want))
    assert torch.equal(pipe.full_state_dict()["1.running_mean"], torch.full((16,), 0.5))
    pipe.close()


def test_a_model_wholly_in_eval_mode_draws_a_warning_naming_model_train() -> None:
    from dreampipe.api.checks import mode_warning

    model = _model()
    assert mode_warning(model) is None
    model[1].eval()  # a part frozen on purpose: nothing to say
    assert mode_warning(model) is None
    said = mode_warning(model.eval())
    assert said is not None and "Sequential is in eval mode" in said
    assert "model.train()" in said


def test_autocast_trains_in_bfloat16() -> None:
    data = _data()
    pipe = _pipe(_model(), data, schedule="pipedream", precision="bf16-mixed")
    for x, y in data * 3:
        pipe.step(x, y)
    losses = pipe.finish()
    assert sum(losses[-4:]) < sum(losses[:4])
    pipe.close()


class _Net(nn.Module):
    """An fx-traceable module whose forward is a chain of submodule calls."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 8)
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.head = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.blocks[1](self.blocks[0](self.embed(x))))


def test_a_meta_model_is_materialised_by_per_layer_seeds_under_its_own_names() -> None:
    with torch.device("meta"):
        net = _Net()
    assert [n for n, _ in split_layers(net)] == ["embed", "blocks.0", "blocks.1", "head"]
    data = _data(1)
    pipe = _pipe(net, data, schedule="1f1b-flush", seed=5)
    got = pipe.full_state_dict()
    plain = _Net()
    for i, (_, layer) in enumerate(split_layers(plain)):
        torch.manual_seed(5 + i)
        for sub in layer.modules():
            if isinstance(sub, nn.Linear):
                sub.reset_parameters()
    assert sorted(got) == sorted(plain.state_dict())
    for k, v in plain.state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=0, msg=k)
    pipe.close()


@pytest.mark.parametrize("given", ["file", "object"])
def test_a_plan_of_two_stages_per_worker_runs_them_so_without_being_told(
    given: str, tmp_path: Path,
) -> None:
    data = _data(3)
    want = _reference(_model(), data, micro=2)
    plan = Plan.from_config(4, [0, 2], [1, 1], virtual_stages=2)
    plan.save(tmp_path / "p.json")
    pipe = _pipe(_model(), data, schedule="interleaved-1f1b", microbatches=2,
                 plan=tmp_path / "p.json" if given == "file" else plan)
    assert pipe.plan.virtual_stages == 2 and pipe.runner.schedule.virtual_stages == 2
    assert pipe.runner.schedule.stages_of_rank(0) == (0, 1)
    for x, y in data:
        pipe.step(x, y)
    _assert_trained_like(pipe, pipe.finish(), want)
    pipe.close()


class _Aliased(nn.Module):
    """A layer holding one Linear under two names."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = self.a

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.b(torch.tanh(self.a(x))))


def _shared() -> dict[str, nn.Sequential]:
    torch.manual_seed(0)
    act, block = nn.Tanh(), nn.Sequential(nn.Linear(16, 16), nn.Tanh())
    return {"aliased": nn.Sequential(nn.Linear(6, 16), _Aliased(), nn.Linear(16, 3)),
            "act-twice": nn.Sequential(nn.Linear(6, 16), act, nn.Linear(16, 16), act,
                                       nn.Linear(16, 3)),
            "block-twice": nn.Sequential(nn.Linear(6, 16), block, block, nn.Linear(16, 3))}


@pytest.mark.parametrize("name", ["aliased", "act-twice", "block-twice"])
@pytest.mark.parametrize("cut", [None, 2])
def test_a_module_used_twice_trains_as_one_process_on_one_stage_or_two(
        name: str, cut: int | None) -> None:
    """A module under two names in a layer (the checks' meta run put it back whole, not
    its meta stand-ins, which would have had the stage drawn anew and that module frozen);
    a Sequential listing one module twice (its second call kept, not dropped); split
    between the two uses, the module's weights are a tie."""
    data = _data(3)
    want = _reference(_shared()[name], data, micro=2)
    model = _shared()[name]
    layers = len(model._modules)
    plan = (Plan.from_config(layers, [0], [1]) if cut is None else
            Plan.from_config(layers, [0, cut], [1, 1], virtual_stages=2))
    pipe = _pipe(model, data, plan=plan, microbatches=2,
                 schedule="1f1b-flush" if cut is None else "interleaved-1f1b")
    assert all(p.requires_grad for p in pipe.module.module.parameters())
    for x, y in data:
        pipe.step(x, y)
    _assert_trained_like(pipe, pipe.finish(), want)
    pipe.close()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_adagrad_whose_state_is_made_with_it_trains_as_one_process(precision: str) -> None:
    """Adagrad makes its sums as it is built, for the parameters it is given: the stage's
    optimizer is made again for the tensors it steps (32-bit masters under bf16)."""
    def adagrad(params: Any) -> torch.optim.Optimizer:
        return torch.optim.Adagrad(params, lr=0.05, initial_accumulator_value=0.1)

    data = _data(3)
    model = _model()
    opt = adagrad(model.parameters())
    want = []
    for x, y in data:
        opt.zero_grad()
        loss = sum(F.cross_entropy(model(xm), ym) / 2
                   for xm, ym in zip(x.chunk(2), y.chunk(2), strict=True))
        loss.backward()
        opt.step()
        want.append(float(loss.detach()))
    pipe = dreampipe.Pipeline(_model(), example=data[0], loss_fn=F.cross_entropy,
                              optimizer=adagrad, plan=Plan.from_config(4, [0], [1]),
                              config=dreampipe.TrainConfig(schedule="1f1b-flush",
                                                           microbatches=2, precision=precision))
    for x, y in data:
        pipe.step(x, y)
    losses = pipe.finish()
    tol = {"rtol": RTOL, "atol": ATOL} if precision == "fp32" else {"rtol": 0.02, "atol": 0.02}
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), **tol)
    got = pipe.full_state_dict()
    for k, v in model.state_dict().items():
        torch.testing.assert_close(got[k].float(), v, **tol, msg=k)
    pipe.close()


def test_copies_of_a_tied_weight_in_groups_that_differ_are_refused_naming_both() -> None:
    """A factory that picks groups by name (no weight decay on the embedding) finds the
    head's copy under the head's name: stepped with other settings, the copies would
    drift apart, where one process steps the one tensor in its first name's group."""
    torch.manual_seed(0)
    embed, head = nn.Embedding(10, 8), nn.Linear(8, 10, bias=False)
    head.weight = embed.weight
    model = nn.Sequential(embed, nn.Linear(8, 8), nn.GELU(), head)

    def by_name(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        plain = [p for p in params if names.get(id(p)) == "0.weight"]
        decayed = [p for p in params if names.get(id(p)) != "0.weight"]
        return torch.optim.AdamW([{"params": decayed, "weight_decay": 0.5},
                                  {"params": plain, "weight_decay": 0.0}], lr=0.01)

    x, y = torch.randint(0, 10, (8,)), torch.randint(0, 10, (8,))
    with pytest.raises(dreampipe.ConfigError, match=r"parameter '0\.weight' is tied to "
                                                    r"'3\.weight'.*weight_decay=0\.0 against 0\.5"):
        dreampipe.Pipeline(model, example=(x, y), loss_fn=F.cross_entropy, optimizer=by_name,
                           plan=Plan.from_config(4, [0, 2], [1, 1], virtual_stages=2),
                           config=dreampipe.TrainConfig(schedule="interleaved-1f1b",
                                                        microbatches=2))
