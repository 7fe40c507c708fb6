"""What a model does outside its blocks: buffers its top-level forward writes, tensors
its forward never reads, and names it gives one tensor twice.

:class:`~.model_zoo.CounterNet` counts its calls and keeps an EMA of its input (which
it subtracts) in its own ``forward``, before its blocks, and holds an unused buffer
and module. Under every schedule, trained for 2 minibatches, saved, resumed and
trained for 2 more, its buffers move as one process moves them and every key of its
``state_dict`` comes back; the synchronous schedules equal one process in full.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from runtime.reference import reference_sync, sgd
from torch import Tensor, nn

from dreampipe.api.checkpoint import load_model_state
from dreampipe.api.checks import check_stages_on_meta
from dreampipe.errors import ConfigError
from dreampipe.planning.plan import Plan
from dreampipe.runtime.processes import run_processes
from dreampipe.splitter.chain import split_layers
from dreampipe.splitter.state_keys import check_written_buffers

from .compare import assert_matches
from .model_workers import train_cases
from .model_zoo import CASES, CaseData, CaseSpec, CounterNet, find_case

__all__: list[str] = []

_SEED, _MINIBATCH, _MICRO, _LR = 5, 8, 2, 0.1
_SCHEDULES: list[tuple[str, dict[str, Any]]] = [
    ("1f1b-flush", {}), ("gpipe", {}), ("zb-h1", {}), ("zb-h2", {}), ("naive", {}),
    ("interleaved-1f1b", {"virtual_stages": 2, "split_points": ["blocks.1", "blocks.2",
                                                                 "blocks.3"]}),
    ("pipedream", {"microbatches": 1}), ("2bw", {"microbatches": 1}),
]
_SYNC = {"1f1b-flush", "gpipe", "zb-h1", "zb-h2", "naive", "interleaved-1f1b"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, Any]]:
    """Each schedule: (the run saved after 2 minibatches, the run resumed for 2 more)."""
    root = tmp_path_factory.mktemp("buffers")
    jobs = []
    for schedule, extra in _SCHEDULES:
        job = {"case": "counter", "schedule": schedule, "seed": _SEED, "steps": 2,
               "minibatch": _MINIBATCH, "microbatches": _MICRO, "lr": _LR, **extra}
        jobs += [{**job, "save": str(root / schedule)}, {**job, "resume": str(root / schedule)}]
    out = run_processes(train_cases, 2, jobs, deadline_s=240.0)[0]
    assert out is not None
    return {s: (out[2 * i], out[2 * i + 1]) for i, (s, _) in enumerate(_SCHEDULES)}


def _reference(microbatches: int) -> tuple[list[float], dict[str, Tensor]]:
    return reference_sync(CaseSpec(CASES["counter"], _SEED), CaseData(CASES["counter"]),  # type: ignore[arg-type]
                          steps=4, minibatch=_MINIBATCH, seed=_SEED, opt=sgd(_LR),
                          microbatches=microbatches)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", [s for s, _ in _SCHEDULES])
def test_buffers_the_forward_writes_move_as_in_one_process_through_a_resume(
        runs: dict[str, tuple[Any, Any]], schedule: str) -> None:
    saved, resumed = runs[schedule]
    sync = schedule in _SYNC
    losses, state = _reference(_MICRO if sync else 1)
    assert int(saved["state"]["calls"]) == 2 * (_MICRO if sync else 1)
    assert sorted(resumed["state"]) == sorted(state)  # every key, the unused ones too
    if sync:
        assert_matches({**resumed, "losses": saved["losses"] + resumed["losses"]}, losses, state)
    for key in ("calls", "in_mean", "unused", "spare.weight", "spare.bias"):
        torch.testing.assert_close(resumed["state"][key], state[key], msg=key)
    model = CounterNet()
    model.load_state_dict(load_model_state(saved["saved"]), strict=True)
    model.load_state_dict(resumed["state"], strict=True)


def test_tracing_leaves_the_models_buffers_alone() -> None:
    model = CounterNet()
    split_layers(model, torch.zeros(2, 6))
    assert int(model.calls) == 0 and bool((model.in_mean == 0).all())


class _LateRead(CounterNet):
    """Writes its EMA before the blocks and reads it after them."""

    def forward(self, x: Tensor) -> Tensor:
        self.in_mean.mul_(0.9).add_(x.mean(0), alpha=0.1)
        for block in self.blocks:
            x = block(x)
        return self.head(x - self.in_mean)


def test_a_buffer_written_on_one_stage_and_read_on_another_is_refused() -> None:
    layers = split_layers(_LateRead(), torch.zeros(2, 6))
    names = [n for n, _ in layers]
    check_written_buffers(layers, [0])  # one stage holds every use
    with pytest.raises(ConfigError, match=r"buffer 'in_mean' is written .* stages 0, 1"):
        check_written_buffers(layers, [0, names.index("blocks.2.0")])


class _Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros(()))
        self.register_buffer("scale", torch.ones(8))

    def forward(self, x: Tensor) -> Tensor:
        self.count += 1
        return x * self.scale


class _CalledTwice(nn.Module):
    """A normalisation and a counter called before the middle blocks and again after."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.stem, self.norm, self.cnt = nn.Linear(6, 8), norm, _Counter()
        self.mid = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 4)

    def forward(self, x: Tensor) -> Tensor:
        x = self.mid(self.cnt(self.norm(self.stem(x))))
        return self.head(self.cnt(self.norm(x)))


@pytest.mark.parametrize(("norm", "needle"), [
    (nn.BatchNorm1d(8), r"buffer 'norm.num_batches_tracked' on stage 0, .* on stage 1"),
    (nn.LayerNorm(8), r"buffer 'cnt.count' on stage 0, .* on stage 1 is written"),
])
def test_a_module_with_buffers_its_forward_writes_called_on_two_stages_is_refused(
        norm: nn.Module, needle: str) -> None:
    """Each stage would step its own copy of the buffers: one process's running statistics
    and counts are lost (and evaluate() reads one stage's). Kept on one stage, it runs."""
    layers = split_layers(_CalledTwice(norm), torch.zeros(4, 6))
    names = [n for n, _ in layers]
    x, y = torch.zeros(4, 6), torch.zeros(4, dtype=torch.long)
    whole = Plan.from_config(len(layers), [0], [1])
    check_stages_on_meta(layers, whole, (x, y), nn.functional.cross_entropy, 4)
    cut = Plan.from_config(len(layers), [0, names.index("mid.2")], [1, 1])
    with pytest.raises(ConfigError, match=needle):
        check_stages_on_meta(layers, cut, (x, y), nn.functional.cross_entropy, 4)


class _Aliased(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.b = self.a = nn.Linear(3, 3)
        self.register_buffer("scale", torch.ones(3))
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(3, 3), nn.ReLU()) for _ in range(2))

    def forward(self, x: Tensor) -> Tensor:
        x = self.a(x) * self.scale
        for block in self.blocks:
            x = block(x)
        return x


def test_every_key_of_the_state_dict_has_a_holder_or_an_alias() -> None:
    from dreampipe.splitter.chain import held_keys
    from dreampipe.splitter.state_keys import state_keys

    model = _Aliased()
    layers = split_layers(model, torch.zeros(2, 3))
    keys = state_keys(model, held_keys(layers))
    assert keys.order == tuple(model.state_dict())
    held = {k: torch.full((1,), float(i)) for i, k in enumerate(sorted(held_keys(layers)))}
    done = keys.complete(held)
    assert list(done) == list(model.state_dict())
    assert done["a.weight"] is done["b.weight"]
    assert type(keys).from_dict(keys.to_dict()) == keys


class _Unused(nn.Module):
    """Blocks each holding a Linear their forward never calls."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.ModuleDict({"lin": nn.Linear(6, 6),
                                                   "idle": nn.Linear(6, 6)}) for _ in range(4))
        self.head = nn.Linear(6, 4)

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = torch.tanh(block["lin"](x))
        return self.head(x)


_X = torch.randn(48, 6, generator=torch.Generator().manual_seed(2))
_Y = torch.randint(0, 4, (48,), generator=torch.Generator().manual_seed(3))


def _adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def _train_unused(rank: int, world: int, schedule: str) -> dict[str, Tensor] | None:
    from dreampipe.api import Pipeline, TrainConfig

    torch.manual_seed(0)
    pipe = Pipeline(_Unused(), example=(_X[:8], _Y[:8]), loss_fn=torch.nn.functional.cross_entropy,
                    optimizer=_adamw, plan=["blocks.2"],
                    config=TrainConfig(schedule=schedule, microbatches=2, max_grad_norm=1.0,
                                       timeout_s=30.0))
    for k in range(3):
        pipe.step(_X[8 * k : 8 * k + 8], _Y[8 * k : 8 * k + 8])
    pipe.finish()
    state = pipe.full_state_dict()
    pipe.close()
    return state if rank == 0 else None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["1f1b-flush", "zb-h1"])
def test_a_parameter_no_microbatch_uses_takes_no_step_under_clipping_and_decay(
        schedule: str) -> None:
    """One process leaves an unused parameter's gradient None, so clipping and AdamW's
    weight decay pass it by; the pipeline's clipping must not give it zeros to decay."""
    got = run_processes(_train_unused, 2, schedule, deadline_s=90.0)[0]
    torch.manual_seed(0)
    model = _Unused()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = _adamw(list(model.parameters()))
    for k in range(3):
        for m in range(2):
            rows = slice(8 * k + 4 * m, 8 * k + 4 * m + 4)
            (torch.nn.functional.cross_entropy(model(_X[rows]), _Y[rows]) / 2).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    assert_matches({"losses": [], "state": got}, [], model.state_dict())
    torch.testing.assert_close(got["blocks.0.idle.weight"], start["blocks.0.idle.weight"],
                               rtol=0, atol=0)


@pytest.mark.timeout(240)
def test_a_replicated_stage_gives_a_module_it_never_calls_no_gradient() -> None:
    """One process gives an uncalled module's weights no gradient, so AdamW's weight decay
    leaves them be; on a replicated stage, at every ZeRO level, the replicas' all-reduce
    agrees on which parameters any replica used, and the others stay as they were."""
    case = find_case("spare")
    jobs = [{"case": "spare", "config": "2-1", "schedule": "1f1b-flush", "seed": _SEED,
             "steps": 3, "minibatch": _MINIBATCH, "microbatches": _MICRO, "lr": 0.05,
             "optimizer": "adamw", "zero": zero} for zero in range(4)]
    out = run_processes(train_cases, 3, jobs, deadline_s=200.0)[0]
    assert out is not None
    losses, state = reference_sync(
        CaseSpec(case, _SEED), CaseData(case), steps=3, minibatch=_MINIBATCH,  # type: ignore[arg-type]
        seed=_SEED, opt=lambda p: torch.optim.AdamW(p, lr=0.05, weight_decay=0.1),
        microbatches=_MICRO)
    start = CaseSpec(case, _SEED).model().state_dict()
    for zero, got in enumerate(out):
        assert got["replicas"] == [2, 1] and got["sharded"][0] == (zero > 0), zero
        for key in ("0.spare.weight", "0.spare.bias", "1.spare.weight"):
            assert torch.equal(got["state"][key], start[key]), (zero, key)
        assert_matches(got, losses, state)


@pytest.mark.timeout(240)
def test_zero_shards_by_process_where_a_plan_lays_replicas_out_of_order() -> None:
    """Stage 0's first replica on worker 2 and its second on worker 0: its replica group
    numbers them by process, and so do its ZeRO shards, so every level trains as the
    plan in rank order does, bit for bit."""
    case = find_case("spare")
    names = [n for n, _ in split_layers(case.build(), case.example(0, 1)[0])]
    plan = Plan.from_config(len(names), [0, names.index(case.split_points[0])], [2, 1])
    laid = dataclasses.replace(plan, stages=(
        dataclasses.replace(plan.stages[0], workers=(2, 0)),
        dataclasses.replace(plan.stages[1], workers=(1,))))
    jobs = [{"case": "spare", "plan": p, "schedule": schedule, "seed": _SEED, "steps": 3,
             "minibatch": _MINIBATCH, "microbatches": 1 if schedule == "pipedream" else _MICRO,
             "lr": 0.05, "optimizer": "adamw", "zero": zero}
            for zero, schedule in ((1, "1f1b-flush"), (2, "pipedream"), (3, "1f1b-flush"))
            for p in (plan, laid)]
    out = run_processes(train_cases, 3, jobs, deadline_s=200.0)[0]
    assert out is not None
    for k in range(0, len(jobs), 2):
        want, got = out[k], out[k + 1]
        assert got["sharded"][2] and got["losses"] == want["losses"], jobs[k]
        for key, value in want["state"].items():
            assert torch.equal(got["state"][key], value), (jobs[k]["zero"], key)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("laid", [None, ((2, 0), (1,))])
def test_evaluate_on_replicas_uses_the_first_replicas_statistics(
        laid: tuple[tuple[int, ...], ...] | None, tmp_path: Path) -> None:
    """BatchNorm's running statistics differ between a stage's replicas; evaluate() runs
    them all with the first replica's, the model full_state_dict() builds, and training
    goes on with each replica's own (the state after it is the first replica's still).
    A checkpoint holds the same, also where the plan lays the first replica on a later
    worker than the second (``laid``: each stage's workers)."""
    case = find_case("resnet")
    names = [n for n, _ in split_layers(case.build(), case.example(0, 1)[0])]
    cut = next(i for i, n in enumerate(names) if n.startswith("layer2"))
    plan = Plan.from_config(len(names), [0, cut], [2, 1])
    if laid is not None:
        plan = dataclasses.replace(plan, stages=tuple(
            dataclasses.replace(st, workers=w) for st, w in zip(plan.stages, laid, strict=True)))
    job = {"case": "resnet", "plan": plan, "schedule": "1f1b-flush", "seed": _SEED,
           "steps": 2, "minibatch": _MINIBATCH, "microbatches": _MICRO, "lr": _LR,
           "evaluate": 2, "save": str(tmp_path)}
    got = run_processes(train_cases, 3, [job], deadline_s=200.0)[0]
    assert got is not None
    saved = load_model_state(tmp_path)
    assert sorted(saved) == sorted(got[0]["state"])
    for name, value in got[0]["state"].items():
        assert torch.equal(saved[name], value), name
    model = CaseSpec(case, _SEED).model()
    model.load_state_dict(got[0]["state"])
    model.eval()
    with torch.no_grad():
        losses = [float(case.loss_fn(model(x), y))
                  for x, y in (case.example(100 + j, _MINIBATCH) for j in range(2))]
    assert got[0]["replicas"] == [2, 1]
    assert got[0]["evaluated"] == pytest.approx(sum(losses) / 2, rel=1e-5, abs=1e-6)
