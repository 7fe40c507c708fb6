"""Staleness compensation: the optimizer settings an asynchronous stage trains with.

Under pipedream and 2bw a stage's update applies a gradient taken ``d``
updates ago (its *delay*), which acts like momentum of its own, about
``d / (d + 1)``. A stage cancels it by the means its optimizer has: SGD's
momentum is lowered to ``max(0, mu - d / (d + 1))``, its learning rate kept;
Adam and AdamW keep their settings and run each stashed microbatch on weights
extrapolated to the update its gradient goes into (:mod:`.versions`). Other
optimizers, and stages of delay 0, keep theirs (docs/design.md §12; the
evidence that chose the rule: docs/convergence.md).

:func:`stage_delays` reads each stage's delay from the schedule, :func:`compensate`
applies the rule to an optimizer's groups, :func:`delay_advice` warns of a delay
too large for the settings; :func:`compensate_stage` does all three for a stage.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from dreampipe.scheduling.actions import ActionKind, Schedule, ScheduleKind

__all__ = ["Applied", "Hyper", "carry_over", "compensate", "compensate_stage", "compensated",
           "compensation_delay", "delay_advice", "hyper_of", "implicit_momentum",
           "predicting", "prediction_delays", "predicts", "recompensated", "stage_delays"]

_log = logging.getLogger(__name__)

#: The most ``lr / (1 - momentum) * delay`` an SGD stage takes without a warning:
#: the digits' 4-stage pipedream trains at lr 0.2 (0.6) and diverges at 0.4 (1.2).
_STEP_DELAY_LIMIT = 1.0


@dataclass(frozen=True)
class Hyper:
    """The settings compensation reads and writes: the learning rate and the momentum
    (SGD's ``momentum``, or Adam's ``beta1``: ``adaptive``)."""

    lr: float
    momentum: float
    adaptive: bool = False


def implicit_momentum(delay: int) -> float:
    """The momentum a delay of ``delay`` updates acts like: ``d / (d + 1)``."""
    return delay / (delay + 1)


def compensated(hyper: Hyper, delay: int) -> Hyper:
    """``hyper`` for a stage whose gradients are ``delay`` updates stale (module doc)."""
    if delay < 0:
        raise ValueError(f"delay={delay}; a delay counts updates, 0 or more")
    if hyper.adaptive:
        return hyper
    return replace(hyper, momentum=max(0.0, hyper.momentum - implicit_momentum(delay)))


def predicts(hyper: Hyper | None, delay: int) -> bool:
    """Whether a stage with settings ``hyper`` (None: an optimizer with neither momentum
    nor ``betas``) and ``delay`` compensates by weight prediction (Adam's way)."""
    return delay > 0 and hyper is not None and hyper.adaptive


def predicting(kind: ScheduleKind, hyper: Hyper | None, *, compensate: bool,
               stash: bool) -> bool:
    """Whether a run's delayed stages run on weights predicted for the update their
    gradient goes into: the one rule the runtime, the memory and the throughput
    predictions read. They do under an asynchronous schedule ``kind`` with compensation
    and stashing on (prediction runs on the stashed versions), with an optimizer that
    compensates by prediction (:func:`predicts`)."""
    return not kind.synchronous and compensate and stash and predicts(hyper, 1)


def prediction_delays(schedule: Schedule, hyper: Hyper | None, *, vertical_sync: bool,
                      compensate: bool, stash: bool) -> tuple[int, ...]:
    """Each stage's delay where it runs on predicted weights (:func:`predicting`), else 0."""
    if not predicting(schedule.kind, hyper, compensate=compensate, stash=stash):
        return (0,) * schedule.num_stages
    return stage_delays(schedule, vertical_sync)


def hyper_of(group: dict[str, object]) -> Hyper | None:
    """A parameter group's :class:`Hyper`, None for an optimizer with neither
    ``momentum`` nor ``betas`` (compensation leaves it as it is). A one-element tensor
    (a capturable optimizer's learning rate or betas) reads as its value."""
    lr = _number(group.get("lr"))
    if lr is None:
        return None
    momentum = _number(group.get("momentum"))
    betas = group.get("betas")
    if momentum is not None:
        return Hyper(lr, momentum)
    beta1 = _number(betas[0]) if isinstance(betas, tuple | list) and betas else None
    return None if beta1 is None else Hyper(lr, beta1, adaptive=True)


def _number(value: object) -> float | None:
    """``value`` as a float if it is a number or a one-element tensor, else None."""
    if isinstance(value, torch.Tensor):
        return float(value.item()) if value.numel() == 1 else None
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


#: What compensation did to each parameter group of one optimizer: ``(given, used)``
#: settings, None for a group it left as it was.
Applied = tuple[tuple[Hyper, Hyper] | None, ...]


def compensate(optimizer: torch.optim.Optimizer, delay: int) -> Applied:
    """Apply :func:`compensated` to every parameter group of ``optimizer``; the
    ``(before, after)`` settings of each group, None where unchanged."""
    applied: list[tuple[Hyper, Hyper] | None] = []
    for group in optimizer.param_groups:
        before = hyper_of(group)
        after = None if before is None else compensated(before, delay)
        if before is None or after is None or after == before:
            applied.append(None)
            continue
        if after.lr != before.lr:  # the rule keeps it: a tensor stays the user's tensor
            group["lr"] = after.lr
        _set_momentum(group, after.momentum)
        applied.append((before, after))
    return tuple(applied)


def _set_momentum(group: dict[str, Any], momentum: float) -> None:
    if "momentum" in group:
        group["momentum"] = momentum
    else:
        group["betas"] = (momentum, *group["betas"][1:])


def _lr_factor(applied: tuple[Hyper, Hyper] | None) -> float:
    if applied is None or applied[0].lr == 0:
        return 1.0
    return applied[1].lr / applied[0].lr


def carry_over(group: dict[str, Any], saved: tuple[Hyper, Hyper] | None,
               now: tuple[Hyper, Hyper] | None, delay: int | None
               ) -> tuple[Hyper, Hyper] | None:
    """Turn ``group``, as a run compensated by ``saved`` left it, into this run's
    settings, in place; its ``(given, used)`` settings now (None where compensation
    leaves it as it is).

    A checkpoint holds the settings a stage trained with; a run resumed on
    another plan or schedule has other delays. The learning rate (and a
    scheduler's ``initial_lr``) keeps what the scheduler or the user did to it,
    with the old compensation's factor replaced by ``now``'s; the momentum is the
    user's as the saving run last had it (a scheduler may cycle it), compensated for
    this run's ``delay`` (None: this run compensates nothing).
    """
    factor = _lr_factor(now) / _lr_factor(saved)
    for key in ("lr", "initial_lr"):
        if isinstance(group.get(key), int | float):
            group[key] *= factor
    if saved is not None:
        _set_momentum(group, saved[0].momentum)
    given = hyper_of(group)
    after = None if given is None or delay is None else compensated(given, delay)
    if given is None or after is None or after == given:
        return None
    _set_momentum(group, after.momentum)
    return given, after


def stage_delays(schedule: Schedule, vertical_sync: bool = False) -> tuple[int, ...]:
    """Each stage's delay: the most updates its stage makes between a microbatch's forward and
    the update that applies that microbatch's gradient (0 in every synchronous schedule).

    With vertical sync every stage runs the input stage's version, so each has the
    input stage's delay. Every 2bw stage has a delay of 1 (:mod:`.two_bw`).
    """
    if schedule.kind is ScheduleKind.TWO_BW:
        return (1,) * schedule.num_stages
    delays = [0] * schedule.num_stages
    for acts in schedule.actions:
        steps: dict[int, int] = {}
        for a in acts:
            if a.kind is ActionKind.STEP:
                steps[a.stage] = steps.get(a.stage, 0) + 1
            elif a.kind is ActionKind.FORWARD:
                applied = a.microbatch // schedule.round_microbatches(a.stage)
                delays[a.stage] = max(delays[a.stage], applied - steps.get(a.stage, 0))
    if vertical_sync:
        return (delays[0],) * len(delays)
    return tuple(delays)


def delay_advice(hyper: Hyper, delay: int, compensating: bool) -> str | None:
    """What to change when a delay of ``delay`` updates is large for ``hyper``; None if not.

    Two limits, from the delayed-update simulation (docs/convergence.md):
    the momentum left plus the delay's implicit momentum must stay below 1,
    and an SGD stage's effective step ``lr / (1 - momentum)`` times the
    delay at most :data:`_STEP_DELAY_LIMIT` (Adam's step does not scale so).
    """
    if compensating and hyper.adaptive:
        return None  # prediction is Adam's compensation; its settings stay the user's
    used = compensated(hyper, delay) if compensating else hyper
    name = "beta1" if hyper.adaptive else "momentum"
    stale = f"gradients {delay} update{'s' if delay != 1 else ''} stale"
    if delay > 0 and used.momentum + implicit_momentum(delay) >= 1.0:
        most = 1.0 - implicit_momentum(delay)
        return (f"{name} {used.momentum:g} with {stale}: the delay adds about "
                f"{implicit_momentum(delay):.2g} momentum of its own and training may "
                f"diverge; keep staleness compensation on (the default: Pipeline's "
                f"compensate=True, train without --no-compensation), or lower {name} below "
                f"{most:.2g}")
    step = used.lr / (1.0 - used.momentum)
    if hyper.adaptive or step * delay <= _STEP_DELAY_LIMIT:
        return None
    most = used.lr * _STEP_DELAY_LIMIT / (step * delay)
    return (f"lr {used.lr:g} with momentum {used.momentum:g} takes an effective step of "
            f"{step:.3g} on {stale}, more than this delay tolerates; lower the learning "
            f"rate to at most {most:.3g}")


def compensation_delay(delays: Sequence[int], stage: int, uniform: bool = False) -> int:
    """The delay ``stage`` is compensated for, of the stages' ``delays``
    (:func:`stage_delays`): its own, or with ``uniform`` (weights tied across stages)
    the deepest stage's."""
    return max(delays) if uniform else delays[stage]


def recompensated(group: dict[str, Any], applied: tuple[Hyper, Hyper] | None, delay: int
                  ) -> tuple[Hyper, Hyper] | None:
    """After a learning-rate scheduler's step: where it set ``group``'s momentum anew over
    what compensation set (OneCycleLR and CyclicLR cycle it at every step), compensate
    that value for ``delay``, in place; the group's ``(given, used)`` settings now
    (``applied`` where nothing moved it). A group compensation left as it was (``applied``
    None: built with momentum 0, say) is compensated once a scheduler gives it momentum."""
    now = hyper_of(group)
    if now is None or now.adaptive or (applied is not None
                                       and now.momentum == applied[1].momentum):
        return applied
    after = compensated(now, delay)
    if applied is None and after == now:
        return None
    _set_momentum(group, after.momentum)
    return now, after


def compensate_stage(optimizer: torch.optim.Optimizer | None, schedule: Schedule | None,
                     stage: int, *,
                     vertical_sync: bool, enabled: bool, advise: bool, uniform: bool = False,
                     delays: Sequence[int] | None = None) -> Applied:
    """Compensate ``stage``'s optimizer for its delay in ``schedule`` (if ``enabled``) and,
    if ``advise``, log :func:`delay_advice` for the deepest delay of any stage as a
    warning, with this optimizer's settings as the user gave them. ``uniform``: every
    stage takes the deepest delay's settings (weights tied across stages must take the
    same updates on each copy). What it changed, group by group. ``schedule`` None: a
    synchronous run, which has no delays (and need not build its schedule to say so).
    ``delays``: :func:`stage_delays` of ``schedule``, where the caller has them."""
    if optimizer is None:
        return ()
    if schedule is None or schedule.kind.synchronous:
        return (None,) * len(optimizer.param_groups)
    if delays is None:
        delays = stage_delays(schedule, vertical_sync)
    given = hyper_of(optimizer.param_groups[0])
    delay = compensation_delay(delays, stage, uniform)
    applied = compensate(optimizer, delay) if enabled else (None,) * len(optimizer.param_groups)
    for pair in applied:
        if pair is not None:
            _log.info("stage %d, %d updates stale: momentum %g -> %g (staleness compensation)",
                      stage, delay, pair[0].momentum, pair[1].momentum)
    advice = None if given is None else delay_advice(given, max(delays), enabled)
    if advise and advice is not None:
        other = "" if schedule.kind is ScheduleKind.TWO_BW else "schedule='2bw' (a delay of 1) or "
        _log.warning("%s: %s, or train with %sa synchronous schedule (1f1b-flush)",
                     schedule.kind.value, advice, other)
    return applied
