"""Ranks of runs whose stages shard over their replicas (:mod:`dreampipe.runtime.zero`).

A job's ``TrainConfig.zero`` sets the level. The stages a rank builds count, at the start
of every ``STEP``, the bytes of the tensors they hold: weights (and masters), the
update's gradients, and the optimizer's state (:func:`count_bytes` wraps the
``StageModule`` that :mod:`dreampipe.api.stage_build` constructs).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from api.workers import train_zoo
from torch import Tensor

from dreampipe.api import stage_build
from dreampipe.commands.train_config import TrainResult
from dreampipe.commands.train_run import TrainJob, train_rank
from dreampipe.runtime.stage_module import StageModule

__all__ = ["branch_rank", "count_bytes", "held_bytes", "mixed_dtype_rank", "per_use_rank",
           "scatter_rank", "zero_rank", "zero_zoo"]

#: Each STEP's bytes of the stages this process built: (stage, held_bytes()).
RECORDS: list[tuple[int, dict[str, int]]] = []


def _storage_bytes(tensors: list[Tensor], seen: set[int]) -> int:
    """Bytes of the storages under ``tensors`` not in ``seen`` (a view counts its storage)."""
    total = 0
    for t in tensors:
        s = t.untyped_storage()
        if t.dim() == 0 or s.data_ptr() in seen or s.nbytes() == 0:
            continue
        seen.add(s.data_ptr())
        total += s.nbytes()
    return total


def held_bytes(m: StageModule) -> dict[str, int]:
    """What stage ``m`` holds now: weights (the module's parameters and any master copies
    of their own), the update's gradients (full sums and ZeRO's shards) and the optimizer's
    state (its tensors of one dimension or more: a step count is no state worth counting)."""
    seen: set[int] = set()
    weights = _storage_bytes([p.detach() for p in m.params], seen)
    weights_and_masters = weights + _storage_bytes([p.detach() for p in m.optimized], seen)
    sums = [s for s in m._grads._sums if s is not None]
    grads = _storage_bytes(sums + (m.zero.gradients() if m.zero is not None else []), seen)
    opt = m.optimizer
    state = [v for per in (opt.state.values() if opt is not None else [])
             for v in per.values() if isinstance(v, Tensor)]
    return {"weights": weights, "masters": weights_and_masters - weights, "gradients": grads,
            "optimizer": _storage_bytes(state, seen)}


def count_bytes() -> None:
    """Count the bytes of every stage this process builds at each of its steps."""
    real = stage_build.StageModule

    def make(*args: Any, stage: int, **kw: Any) -> StageModule:
        m = real(*args, stage=stage, **kw)
        step = m.step

        def counted(**kw: Any) -> None:
            RECORDS.append((stage, held_bytes(m)))
            step(**kw)

        m.step = counted  # type: ignore[method-assign]
        return m

    stage_build.StageModule = make  # type: ignore[misc,assignment]


def zero_rank(rank: int, world: int, arg: tuple[int, TrainJob]
              ) -> tuple[TrainResult | None, list[tuple[int, dict[str, int]]]]:
    """One rank of the job in ``arg`` at the ZeRO level in ``arg`` (``evaluate`` off: the
    report follows ``finish``): its result and records."""
    level, job = arg
    count_bytes()
    config = dataclasses.replace(job.run.config, zero=level)
    torch.manual_seed(0)
    return train_rank(rank, world, dataclasses.replace(
        job, run=dataclasses.replace(job.run, config=config))), RECORDS


def zero_zoo(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any] | None:
    """:func:`api.workers.train_zoo` with the job's ``zero`` level, counting bytes."""
    count_bytes()
    return train_zoo(rank, world, job)


def _per_use_stage(model: torch.nn.Module, rank: int, world: int, level: int = 3
                   ) -> tuple[StageModule, Any]:
    """``model`` as a stage at ZeRO ``level`` (3) on ``world`` replicas, its weights
    gathered per use (the process group already up): the stage and its shards."""
    import torch.distributed as dist

    from dreampipe.runtime.zero import ZeroPlace
    from dreampipe.runtime.zero_params import ZeroParams

    st = StageModule(model, lambda ps: torch.optim.SGD(ps, lr=0.1), stage=0,
                     input_grad=False, zero=ZeroPlace(level, rank, world),
                     loss_fn=torch.nn.functional.mse_loss)
    zero = st.zero
    assert isinstance(zero, ZeroParams)
    zero.bind(dist.group.WORLD, lambda work, _a: work.wait())
    zero.per_use = True
    return st, zero


def per_use_rank(rank: int, world: int, level: int) -> dict[str, Any]:
    """A stage of three Linears at ZeRO ``level`` on ``world`` replicas (per use at 3),
    one microbatch forward and backward: the weights whole during each Linear's forward,
    after the forward, and after the backward, and its gradients beside those of the
    same model kept whole (every replica runs the same microbatch)."""
    import copy

    import torch.distributed as dist
    from torch import nn

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                          nn.Linear(8, 3))
    whole = copy.deepcopy(model)
    st, _ = _per_use_stage(model, rank, world, level)

    def live() -> int:
        return sum(p.untyped_storage().nbytes() > 0 for p in st.params)

    during: list[int] = []
    for layer in model:
        layer.register_forward_pre_hook(lambda *_: during.append(live()))
    x, y = torch.randn(5, 6), torch.randn(5, 3)
    st.forward(0, x, target=y)
    after_forward = live()
    with st.backward_scope():
        st.backward(0)
    after_backward = live()
    torch.nn.functional.mse_loss(whole(x), y).backward()
    got = st.gradients()
    want = [p.grad for p in whole.parameters()]
    ok = all(torch.allclose(g, w, rtol=1e-6, atol=1e-7) for g, w in zip(got, want,
                                                                         strict=True))
    dist.destroy_process_group()
    return {"during": during, "after_forward": after_forward,
            "after_backward": after_backward, "gradients_equal": ok}


class _MixedLinear(torch.nn.Module):
    """A 16-bit weight registered before a 32-bit bias that bf16 cannot hold exactly."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(3, 4).bfloat16())
        self.bias = torch.nn.Parameter(torch.randn(3) / 3)

    def forward(self, x: Tensor) -> Tensor:
        return x.bfloat16() @ self.weight.t() + self.bias


def mixed_dtype_rank(rank: int, world: int, _: None) -> dict[str, Any]:
    """One module holding weights of two dtypes at ZeRO level 3 per use, on ``world``
    replicas: whether its forward ran on each weight exactly as it was given."""
    import copy

    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = _MixedLinear()
    given = copy.deepcopy(model)
    st, _ = _per_use_stage(model, rank, world)
    seen: dict[str, Tensor] = {}

    def grab(module: torch.nn.Module, *_: Any) -> None:
        seen.update({k: v.detach().clone() for k, v in module.named_parameters()})

    model.register_forward_hook(grab, prepend=True)  # before the weights are freed
    st.forward(0, torch.randn(2, 4), target=torch.randn(2, 3))
    dist.destroy_process_group()
    return {k: torch.equal(seen[k], v.detach()) and seen[k].dtype == v.dtype
            for k, v in given.named_parameters()}


class _TwoExperts(torch.nn.Module):
    """Two Linears of one shape, of which the data picks one (as a router would)."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))
        self.pick = 0

    def forward(self, x: Tensor) -> Tensor:
        return self.experts[self.pick](x)


def branch_rank(rank: int, world: int, apart: bool) -> str:
    """A stage of :class:`_TwoExperts` at ZeRO level 3 per use on ``world`` replicas, whose
    microbatch picks expert ``rank`` (``apart``) or 0 on every replica, one forward and
    backward, then ``RESHARD``: what it raised, "" for nothing."""
    import torch.distributed as dist

    from dreampipe.errors import ScheduleError

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = _TwoExperts()
    model.pick = rank if apart else 0
    st, zero = _per_use_stage(model, rank, world)
    st.forward(0, torch.randn(2, 4), target=torch.randn(2, 4))
    with st.backward_scope():
        st.backward(0)
    try:
        zero.reshard()
    except ScheduleError as exc:
        return str(exc)
    finally:
        dist.destroy_process_group()
    return ""


class _ReadsChildWeight(torch.nn.Module):
    """A block that reads its child's weight with ``F.linear`` without calling the child."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return torch.nn.functional.linear(x, self.fc.weight, self.fc.bias)


def child_weight_rank(rank: int, world: int, _: None) -> str:
    """A stage of :class:`_ReadsChildWeight` at ZeRO level 3 per use on ``world``
    replicas, one forward: what it raised, "" for nothing."""
    import torch.distributed as dist

    from dreampipe.errors import ConfigError

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    st, _zero = _per_use_stage(_ReadsChildWeight(), rank, world)
    try:
        st.forward(0, torch.randn(2, 4), target=torch.randn(2, 4))
    except ConfigError as exc:
        return str(exc)
    finally:
        dist.destroy_process_group()
    return ""


def scatter_rank(rank: int, world: int, _: None) -> dict[str, Any]:
    """A stage of five Linears at ZeRO level 2 on ``world`` replicas, a bucket per
    parameter, two microbatches a round: the most gradient bytes alive at once in the
    backwards (the stage's sums and the buckets' inputs), the stage's gradient bytes, and
    whether this replica's chunk sums equal its chunks of the whole model's gradient
    (replica ``k`` runs microbatches ``k`` and ``k + world``: the summed gradient is that
    of all ``2 * world``)."""
    import copy

    import torch.distributed as dist
    from torch import nn

    from dreampipe.runtime import buckets
    from dreampipe.runtime.zero import ZeroPlace
    from dreampipe.runtime.zero_buckets import ShardBuckets
    from dreampipe.scheduling.actions import Action, ActionKind

    dist.init_process_group("gloo")
    buckets.BUCKET_CAP_MB = 1e-9  # every parameter its own bucket
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(16, 16) for _ in range(5)))
    whole = copy.deepcopy(model)
    st = StageModule(model, lambda ps: torch.optim.SGD(ps, lr=0.1), stage=0,
                     input_grad=False, zero=ZeroPlace(2, rank, world),
                     loss_fn=torch.nn.functional.mse_loss)
    zero = st.zero
    assert zero is not None
    zero.bind(dist.group.WORLD, lambda work, _a: work.wait())
    shard = ShardBuckets(zero, lambda work, _a: work.wait(), [2])
    most = [0]

    def ready(index: int, grad: Tensor) -> None:
        shard.ready(index, grad)
        alive = {id(t.untyped_storage()): t.untyped_storage().nbytes()
                 for t in [*(s for s in st._grads._sums if s is not None), grad,
                           *(b for b in shard._bufs if b is not None),
                           *(f[2][1] for f in shard._flying)]}
        most[0] = max(most[0], sum(alive.values()))

    data = [(torch.randn(4, 16, generator=torch.Generator().manual_seed(u)),
             torch.randn(4, 16, generator=torch.Generator().manual_seed(100 + u)))
            for u in range(2 * world)]
    for u in (rank, rank + world):
        st.forward(u, data[u][0], target=data[u][1])
        st.backward(u, on_ready=ready)
        shard.settle(Action(ActionKind.BACKWARD, 0, u))
    shard.finish(Action(ActionKind.ALLREDUCE, 0, 0), 1.0)
    for x, y in data:
        torch.nn.functional.mse_loss(whole(x), y).backward()
    lay = zero.layout
    ok = all(torch.allclose(g, lay.shard(i, p.grad.view(-1)), rtol=1e-5, atol=1e-6)
             for i, (g, p) in enumerate(zip(zero.gradients(), whole.parameters(),
                                            strict=True)) if p.grad is not None)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    dist.destroy_process_group()
    return {"most": most[0], "total": total, "largest": 16 * 16 * 4, "sums_equal": ok}
