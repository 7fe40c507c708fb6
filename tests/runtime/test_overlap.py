"""Replicas all-reduce gradient buckets during the backward that completes a round.

Two gloo processes on 127.0.0.1 (one thread each, a free port, a hard
deadline; a child's traceback comes back in the error) play the replicas of
one stage. With a tiny bucket cap every parameter is a bucket of its own, so
the tests see the all-reduces start while the backward still runs, and check
that the result is the blocking all-reduce's (sum over all gradients at
once, then scale) bit for bit, on a model with fused Linear layers, a Linear
used twice and plain autograd parameters (LayerNorm).
"""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

from dreampipe.commands.train_config import TrainResult, TrainRun
from dreampipe.commands.train_run import TrainJob, train_local, train_rank
from dreampipe.errors import WorkerError
from dreampipe.planning.plan import Plan
from dreampipe.runtime import buckets as buckets_module
from dreampipe.runtime.buckets import GradientBuckets, round_ends
from dreampipe.runtime.processes import run_processes
from dreampipe.runtime.stage_module import StageModule
from dreampipe.scheduling.actions import Action, ActionKind, ScheduleKind

from .runs import train_run

__all__: list[str] = []

#: Smaller than any parameter: one bucket per parameter.
TINY_CAP_MB = 1e-9
SCALE = 0.5
ACTION = Action(ActionKind.ALLREDUCE, 0, 0)
_EVENTS: list[str] = []


class _ProbeFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        _EVENTS.append("probe")
        return grad


class _Probe(nn.Module):
    """Identity whose backward notes "probe": the backward has the layers before it left."""

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = _ProbeFn.apply(x)  # type: ignore[no-untyped-call]
        return out


class _Twice(nn.Module):
    """One Linear applied twice: its gradient is final after the second contribution only."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(torch.tanh(self.fc(x)))


def _stage() -> StageModule:
    torch.manual_seed(0)
    module = nn.Sequential(
        nn.Linear(6, 8), _Probe(), nn.Tanh(), nn.LayerNorm(8), _Twice(8), nn.Tanh(),
        nn.Linear(8, 3),
    )
    return StageModule(
        module, lambda ps: torch.optim.SGD(ps, lr=0.1), stage=0, input_grad=False,
        loss_fn=nn.functional.mse_loss,
    )


def _blocking(grads: list[Tensor], all_reduce: Any) -> None:
    """The all-reduce as it was before buckets: one flat sum, then the scale."""
    flat = torch.cat([g.reshape(-1) for g in grads])
    all_reduce(flat)
    flat.mul_(SCALE)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def _round(st: StageModule, data: list[tuple[Tensor, Tensor]], microbatch: int, bk: Any) -> None:
    """Forward and backward of ``data`` from ``microbatch`` on; the last backward reports to
    ``bk``."""
    for i, (x, y) in enumerate(data):
        st.forward(microbatch + i, x, target=y, scale=1 / len(data))
        last = bk is not None and i == len(data) - 1
        if last:
            _EVENTS.clear()
        st.backward(microbatch + i, on_ready=bk if last else None)


def _two_rounds(rank: int, world: int, _arg: None) -> dict[str, Any]:
    """Round 1: three microbatches on each replica; round 2: one, on replica 0 only.

    Returns the bucket sizes, and per round the events of the bucketed
    replica's last backward and all-reduce, its gradients, and those of the
    blocking all-reduce on the same data.
    """
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=30))
    real = dist.all_reduce

    def recording(tensor: Tensor, *args: Any, **kw: Any) -> Any:
        _EVENTS.append("launch")
        return real(tensor, *args, **kw)

    dist.all_reduce = recording  # type: ignore[assignment]
    try:
        st, ref = _stage(), _stage()
        bk = GradientBuckets(st.params, None, lambda work, _a: work.wait(), cap_mb=TINY_CAP_MB)

        def on_ready(index: int, grad: Tensor) -> None:
            _EVENTS.append(f"ready {index}")
            bk.ready(index, grad)

        torch.manual_seed(100 + rank)
        rounds = [[(torch.randn(4, 6), torch.randn(4, 3)) for _ in range(3)]]
        rounds.append([(torch.randn(4, 6), torch.randn(4, 3))] if rank == 0 else [])
        out: dict[str, Any] = {"buckets": bk.sizes, "events": [], "got": [], "want": []}
        microbatch = 0
        for data in rounds:
            _round(ref, data, microbatch, None)
            _EVENTS.clear()
            _round(st, data, microbatch, on_ready)
            microbatch += len(data)
            _EVENTS.append("end")
            bk.finish(st.gradients(), ACTION, SCALE)
            _blocking(ref.gradients(), real)
            out["events"].append(list(_EVENTS))
            out["got"].append([g.clone() for g in st.gradients()])
            out["want"].append([g.clone() for g in ref.gradients()])
            st.step()
            ref.step()
        return out
    finally:
        dist.all_reduce = real
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_rounds() -> list[dict[str, Any]]:
    """Both replicas' results of :func:`_two_rounds` (one pair of processes per module)."""
    return run_processes(_two_rounds, 2, None, deadline_s=60.0)


@pytest.mark.timeout(90)
def test_buckets_start_while_the_backward_still_runs(two_rounds: list[dict[str, Any]]) -> None:
    for rank, out in enumerate(two_rounds):
        assert out["buckets"] == [1] * 8, out["buckets"]
        for events in out["events"][: 1 if rank == 1 else 2]:
            assert events.count("launch") == 8, (rank, events)
            assert len([e for e in events if e.startswith("ready")]) == 8, (rank, events)
            # every bucket started inside the backward, the first one before the
            # backward reached the first layer and before the last gradient was final
            assert max(i for i, e in enumerate(events) if e == "launch") < events.index("end")
            first = events.index("launch")
            assert first < events.index("probe"), (rank, events)
            assert first < max(i for i, e in enumerate(events) if e.startswith("ready"))


@pytest.mark.timeout(90)
def test_a_replica_without_a_backward_starts_its_buckets_at_the_allreduce(
    two_rounds: list[dict[str, Any]],
) -> None:
    assert two_rounds[1]["events"][1] == ["end"] + ["launch"] * 8


@pytest.mark.timeout(90)
def test_bucketed_gradients_equal_the_blocking_allreduce_bit_for_bit(
    two_rounds: list[dict[str, Any]],
) -> None:
    for rnd in range(2):
        for out in two_rounds:
            for got, want in zip(out["got"][rnd], out["want"][rnd], strict=True):
                assert got.dtype == want.dtype
                assert torch.equal(got, want), (rnd, (got - want).abs().max())
        for a, b in zip(two_rounds[0]["got"][rnd], two_rounds[1]["got"][rnd], strict=True):
            assert torch.equal(a, b)


def test_round_ends_are_the_last_backward_before_each_allreduce() -> None:
    text = "F0 B0 F2 B2 SEND_B2 ALLREDUCE0 STEP0 F4 B4 ALLREDUCE1 STEP1 ALLREDUCE2 STEP2 F6 B6"
    actions = tuple(Action.parse(t, 0) for t in text.split())
    assert round_ends(actions) == {2, 4}


# ---- whole runs: one Pipeline per rank, as dreampipe train runs them ----------------
MODEL_KW = (("layers", 4), ("width", 16))
RUNS = [
    ("dp-2", ScheduleKind.DP, [0], [2], 2, {0: 8, 1: 8}),
    ("gpipe-2-1", ScheduleKind.GPIPE, [0, 2], [2, 1], 4, {0: 4, 1: 4, 2: 0}),
    ("pipedream-2-1", ScheduleKind.PIPEDREAM, [0, 2], [2, 1], 1, {0: 4, 1: 4, 2: 0}),
]


def _tiny_buckets(rank: int, world: int, cfg: TrainRun) -> tuple[TrainResult | None, int]:
    """One rank of ``cfg`` with a bucket per parameter; its result and all-reduce count."""
    buckets_module.BUCKET_CAP_MB = TINY_CAP_MB
    real = dist.all_reduce
    calls = [0]

    def counting(tensor: Tensor, *args: Any, **kw: Any) -> Any:
        calls[0] += 1
        return real(tensor, *args, **kw)

    dist.all_reduce = counting  # type: ignore[assignment]
    try:
        return train_rank(rank, world, TrainJob(cfg)), calls[0]
    finally:
        dist.all_reduce = real


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("kind", "bounds", "replicas", "micro", "params_per_round"), [r[1:] for r in RUNS],
    ids=[r[0] for r in RUNS],
)
def test_runs_with_a_bucket_per_parameter_equal_runs_with_one_bucket(
    kind: ScheduleKind, bounds: list[int], replicas: list[int], micro: int,
    params_per_round: dict[int, int],
) -> None:
    steps = 3 if kind is not ScheduleKind.PIPEDREAM else 6
    cfg = train_run(
        model="mlp", plan=Plan.from_config(4, bounds, replicas), model_kwargs=MODEL_KW,
        schedule=kind, minibatch_size=16 if kind is not ScheduleKind.PIPEDREAM else 8,
        microbatches=micro, steps=steps, lr=0.2, seed=3, timeout_s=30.0,
    )
    one = train_local(TrainJob(cfg), deadline_s=100.0)
    ranks = run_processes(_tiny_buckets, sum(replicas), cfg, deadline_s=100.0)
    many = ranks[0][0]
    assert isinstance(many, TrainResult)
    rounds = steps // replicas[0] if kind is ScheduleKind.PIPEDREAM else steps
    # one all-reduce per parameter and round, one a round of which parameters the
    # replicas used, and the Pipeline's one of the losses at finish()
    assert {r: n for r, (_, n) in enumerate(ranks)} == {
        r: (n + 1) * rounds + 1 if n else 1 for r, n in params_per_round.items()
    }
    assert many.losses == one.losses
    for a, b in zip(many.stage_states, one.stage_states, strict=True):
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name], b[name]), name


@pytest.mark.timeout(90)
def test_a_replica_lost_during_the_allreduce_is_named_with_the_action() -> None:
    cfg = train_run(
        model="runtime.models_for_tests:crash_replica_mlp", model_kwargs=MODEL_KW,
        plan=Plan.from_config(5, [0], [2]), schedule=ScheduleKind.DP, minibatch_size=8,
        microbatches=1, steps=3, timeout_s=30.0,
    )
    with pytest.raises(WorkerError) as info:
        train_local(TrainJob(cfg), deadline_s=60.0)
    lines = str(info.value).splitlines()
    assert lines[0] == "rank 1 (stage 0) failed: ValueError: crash on rank 1", lines[0]
    assert any(
        re.match(
            r"rank 0 \(stage 0\) also failed: PeerTimeoutError: rank 0 \(stage 0\) lost ranks "
            r"0\.\.1 \(all-reduce\) in ALLREDUCE0 ", ln,
        )
        for ln in lines
    ), lines
