"""Checkpoints: resume bit for bit, across plans and world sizes, into a plain nn.Module."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from runtime.reference import adamw, reference_sync, sgd
from torch import Tensor, nn
from torch.distributed.checkpoint.filesystem import FileSystemReader

import dreampipe
from dreampipe.api.checkpoint import restore_rng, rng_state
from dreampipe.models import get_model
from dreampipe.models.datasets import load_dataset
from dreampipe.planning.plan import Plan, Stage
from dreampipe.planning.splits import Split
from dreampipe.runtime.processes import run_processes
from dreampipe.runtime.staleness import Hyper, compensated

from .workers import train_zoo

__all__: list[str] = []

SEED = 3


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.GELU(), nn.Dropout(0.1),
                         nn.Linear(16, 3))


def _data() -> list[tuple[Tensor, Tensor]]:
    gen = torch.Generator().manual_seed(2)
    return [(torch.randn(8, 6, generator=gen), torch.randint(0, 3, (8,), generator=gen))
            for _ in range(8)]


def _pipe(resume: Path | None = None, precision: str = "fp32") -> dreampipe.Pipeline:
    # fp16-mixed: a scale so large that the first updates overflow and are skipped, and
    # a window so short that it doubles again within the run: the checkpoint must keep it
    scaling = ({"loss_scale": 2.0**18, "loss_scale_window": 2} if precision == "fp16-mixed"
               else {})
    return dreampipe.Pipeline(
        _model(), example=_data()[0], loss_fn=F.cross_entropy,
        optimizer=lambda p: torch.optim.AdamW(p, lr=0.05),
        lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1 / (s + 1)),
        config=dreampipe.TrainConfig(schedule="1f1b-flush", microbatches=2, resume=resume,
                                     precision=precision, **scaling),
    )


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16-mixed"])
def test_a_resumed_synchronous_run_continues_bit_for_bit(tmp_path: Path,
                                                         precision: str) -> None:
    """bf16 too: the checkpoint holds the 32-bit master weights, not their rounding."""
    data = _data()
    torch.manual_seed(7)  # dropout draws from the RNG the checkpoint saves
    straight = _pipe(precision=precision)
    for x, y in data:
        straight.step(x, y)
    want, skipped = straight.full_state_dict(), straight.skipped
    straight.close()
    assert all(v.dtype == torch.float32 for v in want.values())  # bf16: the masters
    assert (len(skipped) > 0) == (precision == "fp16-mixed"), skipped

    torch.manual_seed(7)
    first = _pipe(precision=precision)
    for x, y in data[:4]:
        first.step(x, y)
    saved = first.save(tmp_path)
    first.close()
    assert saved == tmp_path / "step-4" and (saved / "COMMITTED").is_file()
    assert "rng.0" in FileSystemReader(str(saved)).read_metadata().state_dict_metadata
    torch.manual_seed(99)  # the checkpoint's RNG state replaces this
    second = _pipe(resume=tmp_path, precision=precision)
    assert second.minibatches == 4
    for x, y in data[4:]:
        second.step(x, y)
    got = second.full_state_dict()
    assert second.scheduler is not None
    assert second.scheduler.last_epoch == 8 - len(skipped)  # a skipped update steps none
    assert [u for u in skipped if u >= 4] == second.skipped
    second.close()
    for k, v in want.items():
        assert torch.equal(got[k], v), k


class _Average(nn.Module):
    """Subtracts an average of its inputs that it keeps in a buffer a state dict leaves
    out (``persistent=False``) and updates in training."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("avg", torch.zeros(16), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        if self.training:
            self.avg.mul_(0.5).add_(x.detach().mean(0), alpha=0.5)
        return x - self.avg


def test_a_buffer_the_state_dict_leaves_out_resumes_as_the_run_left_it(
        tmp_path: Path) -> None:
    def pipe(resume: Path | None = None) -> dreampipe.Pipeline:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), _Average(), nn.GELU(), nn.Linear(16, 3))
        return dreampipe.Pipeline(model, example=_data()[0], loss_fn=F.cross_entropy,
                                  optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                                  plan=Plan.from_config(4, [0, 2], [1, 1], virtual_stages=2),
                                  config=dreampipe.TrainConfig(schedule="interleaved-1f1b",
                                                               microbatches=2, resume=resume))

    data = _data()
    straight = pipe()
    for x, y in data:
        straight.step(x, y)
    want = straight.full_state_dict()
    straight.close()
    first = pipe()
    for x, y in data[:4]:
        first.step(x, y)
    first.save(tmp_path)
    first.close()
    second = pipe(resume=tmp_path)
    for x, y in data[4:]:
        second.step(x, y)
    got = second.full_state_dict()
    second.close()
    assert "1.avg" not in want  # not in a state dict: the checkpoint's buffer.1.avg
    for k, v in want.items():
        assert torch.equal(got[k], v), k


@pytest.mark.parametrize(("saved", "resumed"), [("bf16", "fp32"), ("fp32", "bf16")])
def test_a_checkpoint_moves_between_precisions(tmp_path: Path, saved: str,
                                               resumed: str) -> None:
    """The weights resume at the saved 32-bit values (bf16's masters), and train on."""
    first = _pipe(precision=saved)
    for x, y in _data()[:3]:
        first.step(x, y)
    first.save(tmp_path)
    want = first.full_state_dict()
    first.close()
    second = _pipe(resume=tmp_path, precision=resumed)
    got = second.full_state_dict()
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    for x, y in _data()[3:5]:
        second.step(x, y)
    assert all(torch.isfinite(torch.tensor(second.finish())))
    second.close()


def test_a_rank_resumes_its_own_generators_or_else_a_stream_of_rank_0s_state() -> None:
    cpu = torch.device("cpu")
    torch.manual_seed(1)
    own = rng_state(cpu)
    assert own["cuda"] is None  # no CUDA generator is read for a CPU rank
    want = torch.rand(4)
    torch.manual_seed(2)
    rank0 = torch.get_rng_state()
    other = torch.rand(4)
    progress = {"minibatches": 4, "rng": rank0}
    # a GPU-saved state resumed on a CPU rank: the CUDA part is not applied
    restore_rng({"progress": progress, "rng.1": {**own, "cuda": rank0}}, 1, cpu)
    assert torch.equal(torch.rand(4), want)
    draws = []
    for rank in (1, 2, 1):  # not saved: a stream from rank 0's state, each rank its own
        restore_rng({"progress": progress, "rng.0": own}, rank, cpu)
        draws.append(torch.rand(4))
    assert torch.equal(draws[0], draws[2]) and not torch.equal(draws[0], draws[1])
    assert not torch.equal(draws[0], other) and not torch.equal(draws[0], want)


def _batchnorm_replicas(rank: int, world: int, path: str) -> dict[str, Any] | None:
    """A BatchNorm on stage 0's two replicas, whose statistics differ (each sees its own
    samples): rank 0 reports what the Pipeline calls the model's state, and what it saved."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    pipe = dreampipe.Pipeline(model, example=_data()[0], loss_fn=F.cross_entropy,
                              optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                              plan=Plan.from_config(4, [0, 3], [2, 1]),
                              config=dreampipe.TrainConfig(schedule="1f1b-flush",
                                                           microbatches=2, timeout_s=30.0))
    for x, y in _data()[:3]:
        pipe.step(x, y)
    pipe.finish()
    saved, state = pipe.save(path), pipe.full_state_dict()
    pipe.close()
    return {"saved": str(saved), "state": state} if rank == 0 else None


@pytest.mark.timeout(120)
def test_a_replicated_stage_saves_its_first_replicas_buffers(tmp_path: Path) -> None:
    """As full_state_dict() and evaluate() take them, whichever rank DCP would balance
    the write of a key every replica holds onto."""
    got = run_processes(_batchnorm_replicas, 3, str(tmp_path), deadline_s=90.0)[0]
    saved = dreampipe.load_model_state(got["saved"])
    for k, v in got["state"].items():
        assert torch.equal(saved[k], v), k


def test_a_two_stage_checkpoint_resumes_on_three_workers_and_loads_into_a_plain_module(
    tmp_path: Path,
) -> None:
    job: dict[str, Any] = {"seed": SEED, "schedule": "1f1b-flush", "minibatch": 16,
                           "microbatches": 2, "lr": 0.2, "momentum": 0.9}
    first = run_processes(train_zoo, 2, {**job, "bounds": [0, 2], "replicas": [1, 1],
                                         "steps": 3, "save": str(tmp_path)}, deadline_s=90.0)[0]
    plain = get_model("mlp", layers=4, width=16).build(seed=0)
    plain.load_state_dict(dreampipe.load_model_state(first["saved"]))
    for k, v in first["state"].items():
        assert torch.equal(plain.state_dict()[k], v), k
    second = run_processes(train_zoo, 3, {**job, "bounds": [0, 1], "replicas": [2, 1],
                                          "steps": 2, "resume": str(tmp_path)},
                           deadline_s=90.0)[0]
    for k, v in first["state"].items():  # loaded on plan 2-1, 3 workers: the same weights
        assert torch.equal(second["loaded"][k], v), k
    # momentum buffers and the data position moved too: 3 + 2 updates are 5 straight ones
    spec = get_model("mlp", layers=4, width=16)
    losses, state = reference_sync(spec, load_dataset("synthetic", spec, seed=SEED), steps=5,
                                   minibatch=16, seed=SEED, opt=sgd(0.2, 0.9), microbatches=2)
    torch.testing.assert_close(torch.tensor(second["losses"]), torch.tensor(losses[3:]),
                               rtol=1e-5, atol=4e-5)
    for k, v in state.items():
        torch.testing.assert_close(second["state"][k], v, rtol=1e-5, atol=4e-5, msg=k)


def _zoo_reference(steps: int, job: dict[str, Any]) -> tuple[list[float], dict[str, Tensor]]:
    """The zoo mlp of :func:`train_zoo` trained ``steps`` updates by one process."""
    spec = get_model("mlp", layers=4, width=16)
    opt = adamw(job["lr"]) if job.get("optimizer") == "adamw" else sgd(job["lr"],
                                                                     job.get("momentum", 0.0))
    gamma = job.get("gamma")
    return reference_sync(
        spec, load_dataset("synthetic", spec, seed=SEED), steps=steps, minibatch=job["minibatch"],
        seed=SEED, opt=opt, microbatches=job["microbatches"],
        scheduler=None if gamma is None else (
            lambda o: torch.optim.lr_scheduler.ExponentialLR(o, gamma)))


def _assert_continues(got: dict[str, Any], job: dict[str, Any], done: int) -> None:
    """A run resumed at update ``done`` trains on as one process does from the start."""
    losses, state = _zoo_reference(done + len(got["losses"]), job)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(losses[done:]),
                               rtol=1e-5, atol=4e-5)
    for k, v in state.items():
        torch.testing.assert_close(got["state"][k], v, rtol=1e-5, atol=4e-5, msg=k)


def test_interleaved_stages_resume_on_one_or_two_stages_per_worker_and_evaluate(
    tmp_path: Path,
) -> None:
    job: dict[str, Any] = {"seed": SEED, "minibatch": 16, "microbatches": 2, "lr": 0.2,
                           "momentum": 0.9, "gamma": 0.8}
    four = {**job, "schedule": "interleaved-1f1b", "bounds": [0, 1, 2, 3],
            "replicas": [1, 1, 1, 1], "virtual_stages": 2}  # stages 0, 2 on rank 0; 1, 3 on 1
    two = {**job, "schedule": "1f1b-flush", "bounds": [0, 2], "replicas": [1, 1]}
    first = run_processes(train_zoo, 2, {**four, "steps": 3, "save": str(tmp_path / "v2"),
                                         "finish_every": 3, "evaluate": 2}, deadline_s=90.0)[0]
    saved = dreampipe.load_model_state(first["saved"])
    assert sorted(saved) == sorted(first["state"])
    for k, v in first["state"].items():
        assert torch.equal(saved[k], v), k
    spec = get_model("mlp", layers=4, width=16)
    plain = spec.build(seed=0)
    plain.load_state_dict(saved)
    data = load_dataset("synthetic", spec, seed=SEED)
    with torch.no_grad():
        want = [float(spec.loss_fn(plain(x), y)) for x, y in
                (data.batch(10_000 + j, 16) for j in range(2))]
    assert first["evals"] == pytest.approx([sum(want) / 2], rel=1e-5)

    again = run_processes(train_zoo, 2, {**four, "steps": 2, "resume": str(tmp_path / "v2")},
                          deadline_s=90.0)[0]
    _assert_continues(again, job, 3)  # each stage's momentum and scheduler came back
    flat = run_processes(train_zoo, 2, {**two, "steps": 2, "resume": str(tmp_path / "v2"),
                                        "save": str(tmp_path / "v1")}, deadline_s=90.0)[0]
    _assert_continues(flat, job, 3)
    back = run_processes(train_zoo, 2, {**four, "steps": 1, "resume": str(tmp_path / "v1")},
                         deadline_s=90.0)[0]
    _assert_continues(back, job, 5)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_a_run_resumed_on_other_delays_compensates_for_its_own(tmp_path: Path,
                                                               optimizer: str) -> None:
    job: dict[str, Any] = {"seed": SEED, "minibatch": 16, "lr": 0.01, "momentum": 0.9,
                           "optimizer": optimizer, "steps": 3}
    stages2 = {"bounds": [0, 2], "replicas": [1, 1]}
    first = run_processes(train_zoo, 2, {**job, **stages2, "schedule": "pipedream",
                                         "save": str(tmp_path)}, deadline_s=90.0)[0]
    flush = run_processes(train_zoo, 2, {**job, **stages2, "schedule": "1f1b-flush",
                                         "microbatches": 2, "steps": 1, "resume": str(tmp_path)},
                          deadline_s=90.0)[0]
    deeper = run_processes(train_zoo, 3, {**job, "bounds": [0, 1, 2], "replicas": [1, 1, 1],
                                          "schedule": "pipedream", "steps": 1,
                                          "resume": str(tmp_path)}, deadline_s=90.0)[0]
    adamw = optimizer == "adamw"

    def settings(h: Hyper) -> dict[str, Any]:
        key, value = ("betas", (h.momentum, 0.999)) if adamw else ("momentum", h.momentum)
        return {"lr": pytest.approx(h.lr), key: pytest.approx(value)}

    given = Hyper(0.01, 0.9, adaptive=adamw)
    assert first["hyper"] == [settings(compensated(given, 1))]  # stage 0: 1 update stale
    assert flush["hyper"] == [settings(given)]
    assert deeper["hyper"] == [settings(compensated(given, 2))]  # now 2 updates stale


def test_a_momentum_a_scheduler_cycles_resumes_compensated_as_it_went_on(tmp_path: Path
                                                                         ) -> None:
    """SGD built without momentum, to which OneCycleLR gives 0.95 falling as its rate
    rises: stage 0 of a pipedream pipeline (1 update stale) trains with what it sets less
    1/2, and a run resumed halfway makes the updates of one that went on."""
    job: dict[str, Any] = {"seed": SEED, "minibatch": 16, "lr": 0.05, "momentum": 0.0,
                           "one_cycle": 8, "schedule": "pipedream", "bounds": [0, 2],
                           "replicas": [1, 1]}
    straight = run_processes(train_zoo, 2, {**job, "steps": 6, "finish_every": 3},
                             deadline_s=90.0)[0]
    assert straight["hyper"][0]["momentum"] == pytest.approx(0.95 - 0.5)
    run_processes(train_zoo, 2, {**job, "steps": 3, "save": str(tmp_path)}, deadline_s=90.0)
    resumed = run_processes(train_zoo, 2, {**job, "steps": 3, "resume": str(tmp_path)},
                            deadline_s=90.0)[0]
    assert resumed["hyper"][0]["momentum"] < 0.95 - 0.5  # what it had fallen to, less 1/2
    assert resumed["losses"] == straight["losses"][3:]
    for k, v in straight["state"].items():
        assert torch.equal(resumed["state"][k], v), k


def test_each_parameter_group_resumes_its_own_settings(tmp_path: Path) -> None:
    def two_groups(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.AdamW([{"params": [p for p in params if p.dim() > 1]},
                                  {"params": [p for p in params if p.dim() <= 1],
                                   "weight_decay": 0.0, "lr": 0.02}], lr=0.05)

    def pipe(resume: Path | None = None) -> dreampipe.Pipeline:
        return dreampipe.Pipeline(_model(), example=_data()[0], loss_fn=F.cross_entropy,
                                  optimizer=two_groups, config=dreampipe.TrainConfig(
                                      schedule="1f1b-flush", resume=resume))

    first = pipe()
    first.step(*_data()[0])
    first.save(tmp_path)
    first.close()
    second = pipe(resume=tmp_path)
    assert second.module.optimizer is not None
    groups = second.module.optimizer.param_groups
    second.close()
    assert [(g["lr"], g["weight_decay"]) for g in groups] == [(0.05, 0.01), (0.02, 0.0)]


def _split_plan() -> Plan:
    """``1t2-1``: layers 0-1 split over workers 0-1 (rows, then columns), 2-3 on worker 2."""
    spec = get_model("mlp", layers=4, width=16)
    return Plan(stages=(Stage(first=0, last=1, replicas=1, ranks=(0,), tensor_parallel=2,
                              splits=(Split.OUT, Split.IN)),
                        Stage(first=2, last=3, replicas=1, ranks=(1,))),
                num_layers=4, model="mlp", layer_names=tuple(n for n, _ in spec.layer_factories))


_SPLIT_JOB: dict[str, Any] = {"seed": SEED, "schedule": "1f1b-flush", "minibatch": 16,
                              "microbatches": 2, "lr": 0.01, "optimizer": "adamw"}


def test_a_split_stage_saves_its_shares_and_resumes_on_its_plan(tmp_path: Path) -> None:
    first = run_processes(train_zoo, 3, {**_SPLIT_JOB, "plan": _split_plan(), "steps": 3,
                                         "save": str(tmp_path)}, deadline_s=90.0)[0]
    saved = dreampipe.load_model_state(first["saved"])  # whole tensors from the two shares
    assert sorted(saved) == sorted(first["state"])
    for k, v in first["state"].items():
        assert torch.equal(saved[k], v), k
    meta = FileSystemReader(first["saved"]).read_metadata().state_dict_metadata
    assert len(meta["model.fc0.0.weight"].chunks) == 2  # rows of workers 0 and 1
    assert len(meta["optim.fc1.0.weight.exp_avg"].chunks) == 2  # columns
    again = run_processes(train_zoo, 3, {**_SPLIT_JOB, "plan": _split_plan(), "steps": 2,
                                         "resume": str(tmp_path)}, deadline_s=90.0)[0]
    _assert_continues(again, _SPLIT_JOB, 3)  # AdamW's moments came back in shares too


def test_checkpoints_move_between_split_and_unsplit_stages(tmp_path: Path) -> None:
    two = {**_SPLIT_JOB, "bounds": [0, 2], "replicas": [1, 1]}
    run_processes(train_zoo, 2, {**two, "steps": 3, "save": str(tmp_path)}, deadline_s=90.0)
    split = run_processes(train_zoo, 3, {**_SPLIT_JOB, "plan": _split_plan(), "steps": 2,
                                         "resume": str(tmp_path), "save": str(tmp_path)},
                          deadline_s=90.0)[0]
    _assert_continues(split, _SPLIT_JOB, 3)
    flat = run_processes(train_zoo, 2, {**two, "steps": 1, "resume": str(tmp_path)},
                         deadline_s=90.0)[0]
    _assert_continues(flat, _SPLIT_JOB, 5)


def test_a_stage_of_other_groups_resumes_each_groups_rate_and_the_schedule(
        tmp_path: Path) -> None:
    """Saved on one stage of two groups (weights, and the rest with no decay), resumed on
    three stages, one holding the LayerNorm alone and so one group: each group goes on
    from its own rate and the scheduler from the steps it took."""
    def groups(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        found = [{"params": [p for p in params if p.dim() > 1]},
                 {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0,
                  "lr": 0.02}]
        return torch.optim.AdamW([g for g in found if g["params"]], lr=0.05)

    def pipe(resume: Path | None = None, **config: Any) -> dreampipe.Pipeline:
        return dreampipe.Pipeline(
            _model(), example=_data()[0], loss_fn=F.cross_entropy, optimizer=groups,
            lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1 / (s + 1)),
            plan=config.pop("plan", "auto"), config=dreampipe.TrainConfig(
                **{"schedule": "1f1b-flush", **config}, microbatches=2, resume=resume))

    first = pipe()
    for x, y in _data()[:3]:
        first.step(x, y)
    first.finish()
    first.save(tmp_path)
    first.close()
    second = pipe(tmp_path, schedule="interleaved-1f1b", virtual_stages=3, plan=["1", "2"])
    schedulers = [second.schedulers[s] for s in sorted(second.schedulers)]
    rates = [[(g["lr"], g["weight_decay"]) for g in s.optimizer.param_groups]
             for s in schedulers]
    steps = [s.last_epoch for s in schedulers]
    second.close()
    assert rates == [[(0.05 / 4, 0.01), (0.02 / 4, 0.0)], [(0.02 / 4, 0.0)],
                     [(0.05 / 4, 0.01), (0.02 / 4, 0.0)]]
    assert steps == [3, 3, 3]


def test_a_checkpoint_of_another_optimizer_is_refused_naming_both(tmp_path: Path) -> None:
    first = _pipe()
    first.step(*_data()[0])
    first.save(tmp_path)
    first.close()
    with pytest.raises(dreampipe.CheckpointError, match=r"trained with AdamW, and this run's "
                                                        r"optimizer factory makes SGD"):
        dreampipe.Pipeline(_model(), example=_data()[0], loss_fn=F.cross_entropy,
                           optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                           config=dreampipe.TrainConfig(schedule="1f1b-flush",
                                                        microbatches=2, resume=tmp_path))


def test_a_parameter_the_saving_run_froze_is_named_with_the_fix(tmp_path: Path) -> None:
    def pipe(frozen: bool, resume: Path | None = None) -> dreampipe.Pipeline:
        model = _model()
        model[0].weight.requires_grad_(not frozen)
        return dreampipe.Pipeline(model, example=_data()[0], loss_fn=F.cross_entropy,
                                  optimizer=lambda p: torch.optim.AdamW(p, lr=0.01),
                                  config=dreampipe.TrainConfig(schedule="1f1b-flush",
                                                               microbatches=2, resume=resume))

    first = pipe(True)
    for x, y in _data()[:2]:
        first.step(x, y)
    first.save(tmp_path)
    first.close()
    with pytest.raises(dreampipe.CheckpointError, match=r"no optimizer entry for parameter "
                                                        r"'0\.weight'.*load_model_state"):
        pipe(False, resume=tmp_path)


def _tied_run(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any] | None:
    """An embedding tied to the head, on ``job["bounds"]``: one stage holds the weight
    under its first name, two stages each a copy under its own."""
    torch.manual_seed(0)
    embed, head = nn.Embedding(10, 8), nn.Linear(8, 10, bias=False)
    head.weight = embed.weight
    model = nn.Sequential(embed, nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8), nn.GELU(), head)
    gen = torch.Generator().manual_seed(2)
    data = [(torch.randint(0, 10, (8,), generator=gen), torch.randint(0, 10, (8,), generator=gen))
            for _ in range(5)]
    pipe = dreampipe.Pipeline(
        model, example=data[0], loss_fn=F.cross_entropy,
        optimizer=lambda p: torch.optim.AdamW(p, lr=0.05),
        plan=Plan.from_config(6, job["bounds"], [1] * len(job["bounds"])),
        config=dreampipe.TrainConfig(schedule="1f1b-flush", microbatches=2, timeout_s=30.0,
                                     resume=job.get("resume")))
    start = pipe.minibatches
    for x, y in data[start:start + job["steps"]]:
        pipe.step(x, y)
    losses = pipe.finish()
    if "save" in job:
        pipe.save(job["save"])
    state = pipe.full_state_dict()
    pipe.close()
    return {"losses": losses, "state": state} if rank == 0 else None


@pytest.mark.timeout(150)
def test_a_weight_tied_on_one_stage_resumes_tied_across_two(tmp_path: Path) -> None:
    """The saving run held the tie on one stage, under the embedding's name: each copy of
    the two-stage run takes that weight's optimizer state, so the copies stay equal and
    train on as the one-stage run does."""
    one, two = {"bounds": [0]}, {"bounds": [0, 3]}
    run_processes(_tied_run, 1, {**one, "steps": 3, "save": str(tmp_path)}, deadline_s=60.0)
    got = run_processes(_tied_run, 2, {**two, "steps": 2, "resume": str(tmp_path)},
                        deadline_s=90.0)[0]
    again = run_processes(_tied_run, 1, {**one, "steps": 2, "resume": str(tmp_path)},
                          deadline_s=60.0)[0]
    assert got is not None and again is not None
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(again["losses"]),
                               rtol=1e-6, atol=1e-6)
    for k, v in again["state"].items():
        torch.testing.assert_close(got["state"][k], v, rtol=1e-5, atol=1e-6, msg=k)
    assert torch.equal(got["state"]["0.weight"], got["state"]["5.weight"])


def test_a_save_below_a_newer_committed_step_warns_that_a_resume_takes_the_newer(
    tmp_path: Path,
) -> None:
    """A folder holding another run's later step: a resume from it would take that one."""
    from dreampipe.api.checkpoint import MARKER, _warn_newer

    for n in (4, 8):
        (tmp_path / f"step-{n}").mkdir()
        (tmp_path / f"step-{n}" / MARKER).write_text("{}")
    (tmp_path / "step-12").mkdir()  # never committed: not a checkpoint
    with pytest.warns(UserWarning, match=r"saving step-6 into .* holds step-8 from another"):
        _warn_newer(tmp_path, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _warn_newer(tmp_path, 8)  # the run's own step again, or a later one: nothing to say
        _warn_newer(tmp_path, 10)
