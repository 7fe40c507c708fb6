"""Checks of a Pipeline's inputs that every rank runs before anything is sent.

Each rank sees the same model, example, loss, optimizer factory and batch
stream, so each raises the same error at the same point and no peer is
left waiting. The model check runs the whole model on the ``meta`` device
(shapes only, no memory, no compute), stage by stage.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from enum import Enum
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from dreampipe.api.split import Chain, Layers
from dreampipe.api.tracer import call_on_meta, on_meta
from dreampipe.errors import ConfigError, DatasetError, PlanError, ScheduleError
from dreampipe.planning.plan import Plan
from dreampipe.runtime.stage import tensor_output
from dreampipe.scheduling.actions import ScheduleKind
from dreampipe.simulation.choose import STAND_IN, Semantics

__all__ = [
    "Batch", "Inputs", "check_batch", "check_loss", "check_optimizer", "check_plan",
    "check_schedule", "check_split", "check_stages_on_meta", "check_stages_per_rank",
    "check_virtual", "choice", "map_inputs", "schedule_to_start",
]

_log = logging.getLogger(__name__)

#: A model's input: a tensor, a tuple of tensors, or a dict of keyword arguments.
Inputs = Tensor | tuple[Tensor, ...] | dict[str, Tensor]
#: A minibatch: the input and the target.
Batch = tuple[Inputs, Tensor]


def _describe(t: Tensor) -> str:
    return f"{t.dtype} {list(t.shape)}"


def _signature(x: Inputs) -> list[str]:
    if isinstance(x, dict):
        return [f"{k}={_describe(t)}" for k, t in x.items()]
    return [_describe(t) for t in (x if isinstance(x, tuple) else (x,))]


def map_inputs(x: Inputs, fn: Callable[[Tensor], Tensor]) -> Inputs:
    """``fn`` applied to each tensor of the input, keeping its tuple or dict."""
    if isinstance(x, dict):
        return {k: fn(t) for k, t in x.items()}
    return tuple(fn(t) for t in x) if isinstance(x, tuple) else fn(x)


def check_batch(index: int, batch: Batch, example: Batch) -> None:
    """Minibatch ``index`` must have the example's shapes and dtypes (input and target)."""
    for what, got, want in (("input", batch[0], example[0]), ("target", batch[1], example[1])):
        if _signature(got) != _signature(want):
            raise DatasetError(
                f"minibatch {index}'s {what} is {', '.join(_signature(got))} but example's is "
                f"{', '.join(_signature(want))}; give every step a minibatch shaped like "
                "example (a DataLoader with drop_last=True drops a short last batch)"
            )


def check_optimizer(factory: Callable[[list[nn.Parameter]], Any]) -> None:
    """The factory must return a ``torch.optim.Optimizer`` (tried on a one-element parameter)."""
    got = factory([nn.Parameter(torch.zeros(1))])
    if not isinstance(got, torch.optim.Optimizer):
        raise ConfigError(
            f"optimizer returned a {type(got).__name__}, not a torch.optim.Optimizer; pass a "
            "function of the parameters, e.g. optimizer=lambda params: "
            "torch.optim.AdamW(params, lr=3e-4)", "optimizer",
        )


def check_plan(plan: Plan, names: Sequence[str], world: int) -> None:
    """The plan must cover exactly the model's layers and use every rank."""
    if plan.num_layers != len(names):
        raise PlanError(
            f"the plan covers {plan.num_layers} layers but the model has {len(names)}; plan "
            "this model (plan='auto')"
        )
    if plan.layer_names and tuple(plan.layer_names) != tuple(names):
        i = next(i for i, (a, b) in enumerate(zip(plan.layer_names, names, strict=True)) if a != b)
        raise PlanError(
            f"the plan is for another model: its layer {i} is {plan.layer_names[i]!r}, the "
            f"model's is {names[i]!r}; plan this model (plan='auto')"
        )
    if plan.workers_used != world:
        raise PlanError(
            f"the plan {plan.config} uses {plan.workers_used} workers but {world} were started; "
            f"start {plan.workers_used} or plan for {world} (plan='auto')"
        )


def check_stages_on_meta(
    layers: Layers, plan: Plan, example: Batch, loss_fn: Callable[..., Any], unit_size: int
) -> None:
    """Every stage but the last returns one tensor, and the loss of the last one's
    output (whatever the model returns) is a scalar.

    Runs on the meta device with the example's first ``unit_size`` samples. A
    model or loss that cannot run on meta (an op without a meta kernel, a
    data-dependent shape) skips the check with a debug log line; the runtime
    then raises the same errors at the first forward.
    """
    first = map_inputs(example[0], lambda t: on_meta(t[:unit_size]))
    x: Any = first if isinstance(first, tuple) else (first,)
    try:
        for s, st in enumerate(plan.stages):
            stage = Chain(layers[st.first : st.last + 1])
            where = f"stage {s} (layers {st.first}..{st.last}, {layers[st.last][0]!r} last) returns"
            out = call_on_meta(stage, x)
            x = (tensor_output(out, where) if s < len(plan.stages) - 1 else out,)
        loss = loss_fn(x[0], on_meta(example[1][:unit_size]))
    except PlanError:
        raise
    except (RuntimeError, NotImplementedError, TypeError, ValueError) as exc:
        _log.debug("meta-device dry run not possible: %s", exc)
        return
    check_loss(loss)


def check_loss(loss: Any) -> None:
    """``loss_fn`` must return a scalar tensor (the mean over the batch, say)."""
    if not isinstance(loss, Tensor) or loss.dim() != 0:
        what = f"a tensor of shape {list(loss.shape)}" if isinstance(loss, Tensor) else (
            f"a {type(loss).__name__}")
        raise ConfigError(
            f"loss_fn returned {what}, not a scalar; return one number per minibatch, e.g. "
            "the mean (reduction='mean')", "loss_fn",
        )


def check_split(plan: Plan, kind: ScheduleKind, max_grad_norm: float | None) -> None:
    """What a plan of tensor-split stages cannot run with yet, each a ConfigError (a plan
    may mix split and unsplit stages, replicate the unsplit ones, recompute any)."""
    t = max(st.tensor_parallel for st in plan.stages)
    if any(st.replicas > 1 and st.tensor_parallel > 1 for st in plan.stages):
        raise ConfigError(
            f"plan {plan.config} replicates stages split over {t} workers; a split stage runs "
            "one replica for now: use one replica per split stage, or no split", "plan")
    if kind is ScheduleKind.DP:
        raise ConfigError(
            f"schedule dp with plan {plan.config}: data parallelism over split groups is not "
            "supported yet; use pipedream, 1f1b-flush or gpipe", "schedule")
    if kind is ScheduleKind.TWO_BW:
        raise ConfigError(
            f"schedule 2bw with plan {plan.config}: the two weight versions of stages split "
            "over workers are not supported yet; use pipedream or 1f1b-flush", "schedule")
    if kind.splits_backward:
        raise ConfigError(
            f"schedule {kind.value} with plan {plan.config}: the zero-bubble split backward of "
            "stages split over workers is not supported yet; use 1f1b-flush", "schedule")
    if max_grad_norm is not None:
        raise ConfigError(
            f"max_grad_norm={max_grad_norm} with stages split over {t} workers: clipping by the "
            "norm of split gradients is not supported yet; drop max_grad_norm", "max_grad_norm")


def check_virtual(kind: ScheduleKind, asked: int | None, plan: object,
                  split_points: object) -> None:
    """``virtual_stages`` (None: the plan's) fits the schedule, and what a Pipeline of
    several stages per rank cannot do yet (plan them itself) is refused, each a ConfigError."""
    virtual_stages = 1 if asked is None else asked
    if virtual_stages < 1 or (virtual_stages > 1 and kind is not ScheduleKind.INTERLEAVED):
        raise ConfigError(f"virtual_stages={virtual_stages} with schedule={kind.value}; use 1, "
                          "or schedule='interleaved-1f1b' with 2 or more", "virtual_stages")
    if virtual_stages > 1 and plan == "auto" and split_points is None:
        raise ConfigError(f"virtual_stages={virtual_stages} with plan='auto'; give split_points "
                          f"or a plan of world x {virtual_stages} stages", "virtual_stages", "plan")


def check_stages_per_rank(stages: int, virtual_stages: int, world: int) -> None:
    """``virtual_stages`` to a rank on ``world`` ranks needs ``world * v`` stages."""
    if virtual_stages > 1 and stages != world * virtual_stages:
        raise ConfigError(f"virtual_stages={virtual_stages} on {world} workers needs "
                          f"{world * virtual_stages} stages, not the plan's {stages}",
                          "virtual_stages", "plan")


def check_schedule(kind: ScheduleKind, replicas: list[int], vsync: bool,
                    max_grad_norm: float | None, stash: bool) -> None:
    """The schedule's options must fit it and the plan's replicas."""
    if kind is ScheduleKind.DP and len(replicas) != 1:
        raise ScheduleError(f"the dp schedule runs one stage on every worker, not a plan of "
                            f"{len(replicas)} stages; use plan='auto'")
    if kind is not ScheduleKind.PIPEDREAM and (vsync or not stash):
        raise ConfigError(f"vertical_sync=True and stash=False apply to schedule='pipedream' "
                          f"only, not {kind.value}", "vertical_sync", "stash")
    if vsync and not stash:
        raise ConfigError("vertical sync runs every stage on a stashed weight version; drop "
                          "stash=False or vertical_sync=True", "stash", "vertical_sync")
    if kind is ScheduleKind.PIPEDREAM and len(set(replicas)) > 1 and (
            vsync or max_grad_norm is not None):
        what = "vertical_sync=True" if vsync else f"max_grad_norm={max_grad_norm}"
        raise ConfigError(
            f"{what} with pipedream needs every stage replicated equally (got "
            f"{'-'.join(map(str, replicas))}): stages that update at different rates have no "
            "common update to share; use a plan with equal replica counts", "plan",
        )


_E = TypeVar("_E", bound=Enum)


def choice(value: str | _E, kind: type[_E], name: str) -> _E:
    """``value`` as a member of the enum ``kind``; a ConfigError naming ``name`` if none."""
    if isinstance(value, kind):
        return value
    try:
        return kind(value)
    except ValueError:
        names = ", ".join(k.value for k in kind)
        raise ConfigError(f"{name}={value!r}; use one of {names}", name) from None


def schedule_to_start(schedule: str | ScheduleKind, semantics: str | Semantics,
                      virtual_stages: int | None) -> tuple[ScheduleKind, Semantics | None]:
    """The schedule a Pipeline starts with, and the semantics ``schedule="auto"`` chooses
    in (None: the schedule is the user's); until it has chosen, one schedule of the
    semantics stands in."""
    wanted = choice(semantics, Semantics, "semantics")
    if schedule != "auto":
        return choice(schedule, ScheduleKind, "schedule"), None
    if virtual_stages not in (None, 1):
        raise ConfigError(f"virtual_stages={virtual_stages} with schedule='auto': the "
                          "interleaved schedule needs a plan cut for it; give "
                          "schedule='interleaved-1f1b'", "virtual_stages", "schedule")
    return STAND_IN[wanted], wanted
