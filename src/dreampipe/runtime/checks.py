"""Input checks that run before any rank sends anything.

Every rank (and :func:`~dreampipe.runtime.launch.launch_local`, in the
parent) runs them, so a bad run fails the same way everywhere instead of
leaving a peer waiting. The stage-output check builds each stage on the
``meta`` device and runs it on a shape-only sample: no memory, no compute.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from dreampipe.errors import ConfigError, DatasetError, PlanError, ScheduleError
from dreampipe.models.spec import ModelSpec
from dreampipe.runtime.config import RunConfig, RunOptions
from dreampipe.runtime.data import DATASETS
from dreampipe.runtime.nonfinite import check_policy
from dreampipe.runtime.stage import tensor_output
from dreampipe.scheduling.actions import ScheduleKind

__all__ = ["check_config", "check_options", "check_stage_outputs"]

_log = logging.getLogger(__name__)


def check_config(cfg: RunConfig, spec: ModelSpec, world: int | None = None) -> None:
    """Raise a :class:`~dreampipe.errors.DreampipeError` naming what is wrong and the fix."""
    plan = cfg.plan
    if world is not None and world != plan.workers_used:
        raise PlanError(
            f"the plan {plan.config} uses {plan.workers_used} workers but {world} were started; "
            f"start {plan.workers_used} workers or plan for {world}"
        )
    if plan.num_stages > spec.num_layers:
        raise PlanError(
            f"the plan has {plan.num_stages} stages but {spec.name} has only "
            f"{spec.num_layers} layers; use at most {spec.num_layers} stages"
        )
    if plan.num_layers != spec.num_layers:
        raise PlanError(
            f"the plan is for a model of {plan.num_layers} layers but {spec.name} has "
            f"{spec.num_layers}; plan again for this model"
        )
    if plan.layer_names and tuple(plan.layer_names) != tuple(spec.layer_names):
        diff = next(
            i for i, (a, b) in enumerate(zip(plan.layer_names, spec.layer_names, strict=True))
            if a != b
        )
        raise PlanError(
            f"the plan is for another model: its layer {diff} is {plan.layer_names[diff]!r} but "
            f"{spec.name}'s is {spec.layer_names[diff]!r}; plan again for this model"
        )
    check_options(cfg)
    _ = cfg.layout
    _check_schedule(cfg)


def check_options(opts: RunOptions) -> None:
    """The checks that need no plan, so a job can run them before profiling.

    How an update splits into units is :class:`~dreampipe.scheduling.units.UnitLayout`'s
    rule, checked where a layout is made.
    """
    if opts.steps < 1:
        raise ConfigError(f"steps={opts.steps}; use 1 or more", "steps")
    if opts.timeout_s <= 0:
        raise ConfigError(f"timeout_s={opts.timeout_s}; use a positive number of seconds",
                          "timeout_s")
    if opts.lr <= 0:
        raise ConfigError(f"lr={opts.lr}: the learning rate must be positive, such as 0.01",
                          "lr")
    if opts.schedule is not ScheduleKind.PIPEDREAM and (opts.vertical_sync or not opts.stash):
        raise ConfigError(
            f"vertical sync and turning weight stashing off apply to the pipedream schedule "
            f"only; {opts.schedule.value} updates all stages together"
        )
    if opts.vertical_sync and not opts.stash:
        raise ConfigError(
            "vertical sync runs every stage on a stashed weight version; it needs weight "
            "stashing: drop stash=False or vertical_sync=True", "stash", "vertical_sync",
        )
    check_policy(opts.on_nonfinite, opts.schedule)
    if opts.dataset not in DATASETS:
        raise DatasetError(f"unknown dataset {opts.dataset!r}; use one of {', '.join(DATASETS)}")


def _check_schedule(cfg: RunConfig) -> None:
    replicas = {st.replicas for st in cfg.plan.stages}
    if cfg.vertical_sync and len(replicas) > 1:
        raise ConfigError(
            f"vertical sync needs the same replica count in every stage (got "
            f"{cfg.plan.config}): a stage's version counts its own updates, so stages that "
            "update at different rates name different weights by one number (and the faster "
            "one keeps ever more versions); drop vertical_sync=True or replicate stages equally",
            "vertical_sync",
        )
    if cfg.schedule is ScheduleKind.DP and cfg.plan.num_stages != 1:
        raise ScheduleError(
            f"the dp schedule needs a one-stage plan (config like '{cfg.workers}'), "
            f"got {cfg.plan.config}"
        )


def check_stage_outputs(cfg: RunConfig, spec: ModelSpec) -> None:
    """Every stage but the last must return one tensor (checked on the meta device).

    This is the early check, before any process starts. A model that cannot
    run on the meta device (an op without a meta kernel, data-dependent
    shapes) skips it with a debug log line; the same rule is then enforced
    by each stage's first forward (:class:`~dreampipe.runtime.stage.StageModule`),
    which raises the same kind of error naming the stage.
    """
    try:
        with torch.device("meta"):
            x: object = spec.sample_input(max(1, cfg.layout.unit_size))
            for s, st in enumerate(cfg.plan.stages[:-1]):
                module = spec.build(st.first, st.last, cfg.seed)
                assert isinstance(x, Tensor)
                x = tensor_output(module(x), f"stage {s} (layers {st.first}..{st.last}) returns")
    except PlanError:
        raise
    except (RuntimeError, NotImplementedError, TypeError) as exc:
        _log.debug("meta-device dry run of %s not possible: %s", spec.name, exc)
