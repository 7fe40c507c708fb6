"""A model with one Linear too large for ``--memory`` trains split over 2 and 4 workers.

The mlp's middle Linear is 4096 x 4096 (64 MB; 128 MB with its gradient):
neither data parallelism nor any layer pipeline fits the limit, so the
planner splits every layer over the workers (operator partitioning), and
``dreampipe train`` runs that plan with DTensor on gloo. Its weights must
equal one process training the whole model, and each rank's peak memory
must be within a quarter of the plan's prediction.

The one process computes each split Linear on the plan's shards (``split_as``):
summed whole, a 4096-wide dot product's float32 rounding follows the CPU's kernel
set, not the run. Weights and losses must then match to ``rtol=1e-5, atol=4e-5``,
the tolerance of every Pipeline-against-reference comparison (``tests/api/compare.py``
says what it covers).
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dreampipe.api import TrainConfig
from dreampipe.api.checkpoint import load_model_state
from dreampipe.commands.train_config import TrainOptions
from dreampipe.commands.train_plan import PlanSource, TrainRequest
from dreampipe.commands.train_run import Checkpoints, run_train
from dreampipe.errors import PlanError
from dreampipe.models import get_model
from dreampipe.models.datasets import load_dataset
from dreampipe.planning.plan import Plan, Stage
from dreampipe.planning.splits import Split
from dreampipe.runplan.worker_profile import profile_as_worker
from dreampipe.runtime.processes import run_processes
from dreampipe.runtime.tensor_split import SplitStage, check_split_layers, tensor_mesh

from .reference import reference_pipedream, reference_sync, sgd, split_like

__all__: list[str] = []

KWARGS = (("layers", 3), ("width", 4096))
MINIBATCH, STEPS, LR = 32, 4, 0.01
#: Per worker: 2 workers fit only a split over 2 (about 70 MB); 4 only one over 4 (36 MB).
LIMITS = {2: 100 * 10**6, 4: 50 * 10**6}


@pytest.fixture(scope="module")
def big_profile(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The mlp of :data:`KWARGS` profiled once as a worker computes a minibatch, for both
    worker counts (``train --profile``): the sizes the plan and the memory prediction
    come from are the profile's, which train's own profile beside busy twins measures
    alike."""
    path = tmp_path_factory.mktemp("big-profile") / "mlp.json"
    profile_as_worker(get_model("mlp", **dict(KWARGS)), MINIBATCH, repeats=2).save(path)
    return str(path)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("workers", [2, 4])
def test_a_linear_too_big_for_memory_trains_split_like_one_process(workers: int,
                                                                   big_profile: str) -> None:
    run = TrainOptions(model="mlp", model_kwargs=KWARGS, minibatch_size=MINIBATCH, steps=STEPS,
                       lr=LR, config=TrainConfig(schedule="1f1b-flush", timeout_s=120.0,
                                                 measure_memory=True), progress=False)
    request = TrainRequest(run=run, plan=PlanSource(), workers=workers, exact_steps=True,
                           memory_bytes=LIMITS[workers], profile=big_profile)
    said: list[str] = []
    report = run_train(request, say=said.append)
    assert report is not None
    assert report.plan.config == f"1t{workers}", str(report.plan)
    unfit = [line for line in said if "does not fit (" in line]
    assert [line.split(":")[0] for line in unfit] == ["data parallelism", "layer pipeline"], said
    assert all(float(line.split("needs ")[1].split(" MB")[0]) * 1e6 > LIMITS[workers]
               for line in unfit), said

    spec = get_model("mlp", **dict(KWARGS))
    losses, state = reference_sync(spec, load_dataset("synthetic", spec, seed=0), steps=STEPS,
                                   minibatch=MINIBATCH, seed=0, opt=sgd(LR),
                                   split_as=report.plan)
    got = report.result.stage_states[0]
    assert sorted(got) == sorted(state)
    for name, value in state.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=4e-5, msg=name)
    assert report.result.losses == pytest.approx(losses, rel=1e-5, abs=4e-5)

    rows = report.memory_rows()
    print(f"\n{workers} workers, plan {report.plan.config}, limit {LIMITS[workers] / 1e6:.0f} MB: "
          + ", ".join(f"rank {r['rank']} {r['measured_bytes'] / 1e6:.1f} MB measured / "
                      f"{r['predicted_bytes'] / 1e6:.1f} predicted ({r['ratio']:.2f})"
                      for r in rows))
    assert sorted(r["rank"] for r in rows) == list(range(workers)), rows
    for r in rows:
        assert r["predicted_bytes"] <= LIMITS[workers], rows
        assert r["predicted_bytes"] > 20e6, r  # the split weights dominate the noise
        assert 0.75 <= r["ratio"] <= 1.25, rows


#: One stage of the whole mlp split over 2 workers, each way a Linear can be split.
_ALL_WAYS = Plan(stages=(Stage(first=0, last=2, replicas=1, ranks=(0,), tensor_parallel=2,
                               splits=(Split.OUT, Split.IN, Split.BATCH)),), num_layers=3)
_WAYS_KWARGS = {"layers": 3, "width": 301}  # 301: shares of 151 and 150


def _split_stage_step(rank: int, world: int, _arg: None) -> dict[str, Any]:
    """One forward and backward of the mlp as :data:`_ALL_WAYS`'s split stage: its output
    and its parameters' gradients, whole."""
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=30))
    try:
        spec = get_model("mlp", **_WAYS_KWARGS)
        stage = SplitStage(spec.build(seed=0), _ALL_WAYS.stages[0].splits,
                           tensor_mesh(world, world, "cpu"))
        x, y = load_dataset("synthetic", spec, seed=0).batch(0, 30)
        out = stage(x)
        spec.loss_fn(out, y).backward()
        grads = {name: p.grad.full_tensor() for name, p in stage.named_parameters()
                 if p.grad is not None}
        return {"out": out.detach(), "grads": grads}
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(90)
def test_the_reference_splits_a_stage_bit_for_bit_as_dtensor_does() -> None:
    """``split_like`` (what ``split_as`` makes of a reference) computes a split stage's
    output and gradients exactly: over 2 workers the all-reduce adds two partial sums,
    in either order the same float32 sum, and every other reduction is cut where the
    split run cuts it, on shards of the same shapes."""
    ranks = run_processes(_split_stage_step, 2, None, deadline_s=60.0)
    spec = get_model("mlp", **_WAYS_KWARGS)
    x, y = load_dataset("synthetic", spec, seed=0).batch(0, 30)
    model = spec.build(seed=0)
    split_like(model, _ALL_WAYS, spec.layer_names)
    out = model(x)
    spec.loss_fn(out, y).backward()
    for r in ranks:
        assert torch.equal(out, r["out"])
        assert sorted(r["grads"]) == sorted(n for n, _ in model.named_parameters())
        for name, p in model.named_parameters():
            assert torch.equal(p.grad, r["grads"][name]), name


#: Activations as layers of their own, as a user's Sequential has them: the planner
#: splits each ReLU ``out`` (features stay split through it), then the next Linear
#: gathers them back (``out``) or reads them split (``in``).
_SEPARATE = (Split.OUT, Split.OUT, Split.OUT, Split.OUT, Split.IN)


def _separate_relus() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16),
                               torch.nn.ReLU(), torch.nn.Linear(16, 3))


def _elementwise_step(rank: int, world: int, _arg: None) -> dict[str, Any]:
    """One forward and backward of :func:`_separate_relus` split as :data:`_SEPARATE`, and
    the error for a layer without weights that is not elementwise split ``out``."""
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=30))
    try:
        mesh = tensor_mesh(world, world, "cpu")
        stage = SplitStage(_separate_relus(), _SEPARATE, mesh)
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
        out = stage(x)
        out.square().mean().backward()
        grads = {name: p.grad.full_tensor() for name, p in stage.named_parameters()}
        try:
            SplitStage(torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Softmax(-1)),
                       (Split.OUT, Split.OUT), mesh)
            refused = ""
        except PlanError as exc:
            refused = str(exc)
        return {"out": out.detach(), "grads": grads, "refused": refused}
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(90)
def test_an_elementwise_layer_split_out_passes_split_features_through() -> None:
    """A plan from ``dreampipe plan --memory`` splits a separate ReLU ``out``; the stage
    runs it on the features the Linear before it split, as one process computes it.
    A layer without weights that mixes features (softmax) split so is refused."""
    ranks = run_processes(_elementwise_step, 2, None, deadline_s=60.0)
    model = _separate_relus()
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
    out = model(x)
    out.square().mean().backward()
    for r in ranks:
        torch.testing.assert_close(r["out"], out.detach(), rtol=1e-6, atol=1e-7)
        for name, p in model.named_parameters():
            torch.testing.assert_close(r["grads"][name], p.grad, rtol=1e-6, atol=1e-7,
                                       msg=name)
        refused = r["refused"]
        assert "layer '1' (Softmax) of a split stage has 0 Linear modules" in refused, refused


def _profile(tmp_path: Path, kwargs: tuple[tuple[str, int], ...]) -> str:
    """The mlp profiled as a worker computes a minibatch, for ``train --profile``: the runs
    of a plan file check what they train, not the prediction, so they skip train's
    profile beside busy twins."""
    path = tmp_path / "profile.json"
    profile_as_worker(get_model("mlp", **dict(kwargs)), MINIBATCH, repeats=2).save(path)
    return str(path)


def _two_split_stages(tmp_path: Path, kwargs: tuple[tuple[str, int], ...]) -> PlanSource:
    """``1t2-1t2``: layers 0-1 split (out, in) over workers 0-1, the head over 2-3."""
    spec = get_model("mlp", **dict(kwargs))
    plan = Plan(stages=(Stage(first=0, last=1, replicas=1, ranks=(0,), tensor_parallel=2,
                              splits=(Split.OUT, Split.IN)),
                        Stage(first=2, last=2, replicas=1, ranks=(1,), tensor_parallel=2,
                              splits=(Split.REPLICA,))),
                num_layers=3, model="mlp", layer_names=tuple(n for n, _ in spec.layer_factories))
    plan.save(tmp_path / "plan.json")
    return PlanSource(path=str(tmp_path / "plan.json"))


@pytest.mark.timeout(120)
def test_dreampipe_train_checkpoints_split_stages(tmp_path: Path) -> None:
    kwargs = (("layers", 3), ("width", 64))
    run = TrainOptions(model="mlp", model_kwargs=kwargs, minibatch_size=MINIBATCH, steps=4,
                       lr=LR, momentum=0.9, config=TrainConfig(schedule="1f1b-flush",
                                                               timeout_s=60.0),
                       progress=False, evaluate=False)
    report = run_train(TrainRequest(run=run, plan=_two_split_stages(tmp_path, kwargs),
                                    workers=4, exact_steps=True,
                                    profile=_profile(tmp_path, kwargs)),
                       checkpoints=Checkpoints(directory=tmp_path / "ck", every=2))
    assert report is not None and report.plan.config == "1t2-1t2"
    assert [p.name for p in sorted((tmp_path / "ck").iterdir())] == [
        "step-2", "step-4", "train-data.json"]
    saved = load_model_state(tmp_path / "ck")  # step-4: each stage's two shares, whole
    got = {k: v for part in report.result.stage_states for k, v in part.items()}
    assert sorted(saved) == sorted(got)
    for name, value in got.items():
        assert torch.equal(saved[name], value), name


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_split_stages_run_pipedream_with_stashing_like_one_process(tmp_path: Path) -> None:
    """A pipeline x tensor mesh: 2 stages, each split over 2 workers (4 in all).

    Worker ``k`` of stage 0 sends to worker ``k`` of stage 1 (its lane);
    PipeDream's schedule stashes each stage's split weights per minibatch in
    flight. The losses and weights must be PipeDream's single-process ones.
    """
    kwargs, steps = (("layers", 3), ("width", 255)), 6  # uneven shares: 128 and 127
    spec = get_model("mlp", **dict(kwargs))
    run = TrainOptions(model="mlp", model_kwargs=kwargs, minibatch_size=MINIBATCH, steps=steps,
                       lr=LR, config=TrainConfig(schedule="pipedream", timeout_s=60.0),
                       progress=False)
    report = run_train(TrainRequest(run=run, plan=_two_split_stages(tmp_path, kwargs),
                                    workers=4, exact_steps=True,
                                    profile=_profile(tmp_path, kwargs)))
    assert report is not None and report.plan.config == "1t2-1t2"
    losses, state = reference_pipedream(
        spec, load_dataset("synthetic", spec, seed=0), bounds=[0, 2], replicas=[1, 1],
        steps=steps, minibatch=MINIBATCH, seed=0, opt=sgd(LR), compensate=True,
        split_as=report.plan)
    got = {k: v for part in report.result.stage_states for k, v in part.items()}
    assert sorted(got) == sorted(state)
    for name, value in state.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=4e-5, msg=name)
    assert report.result.losses == pytest.approx(losses, rel=1e-5, abs=4e-5)


def test_a_split_stage_refuses_what_it_cannot_hold_before_anything_is_split() -> None:
    """A tie inside the stage (each name would become a tensor of its own: the copies
    come apart under ``out``/``in``, and are stepped twice under ``replica``), a buffer
    (DTensor ops refuse a plain tensor beside split ones), a weight split of no Linear."""
    def named(*mods: nn.Module) -> list[tuple[str, nn.Module]]:
        return [(str(i), m) for i, m in enumerate(mods)]

    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    check_split_layers(named(a, nn.ReLU(), b), [Split.OUT, Split.OUT, Split.IN], 1)
    b.weight = a.weight
    for splits in ([Split.OUT, Split.OUT, Split.IN], [Split.REPLICA] * 3):
        with pytest.raises(PlanError, match=r"parameter '0.weight' is tied to '2.weight' "
                                            r"on split stage 1; .* on a stage with no split"):
            check_split_layers(named(a, nn.ReLU(), b), splits, 1)
    with pytest.raises(PlanError, match=r"layer '1' \(BatchNorm1d\) of split stage 0 holds the "
                                        r"buffer 'running_mean'"):
        check_split_layers(named(nn.Linear(4, 4), nn.BatchNorm1d(4)),
                           [Split.BATCH, Split.BATCH], 0)
    with pytest.raises(PlanError, match=r"layer '0' \(Conv1d\) of a split stage has 0 Linear "
                                        r"modules; split out"):
        check_split_layers(named(nn.Conv1d(4, 4, 1)), [Split.OUT])
