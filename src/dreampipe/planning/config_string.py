"""Config strings: the paper's ``"15-1"`` for replicas per stage, and first layers ``"0,4"``.

``"straight"`` is every stage on one worker; ``"1t4"`` one replica split over
4 workers and ``"3r"`` a stage on 3 workers that recomputes its activations
(:mod:`dreampipe.planning.plan`). Parsed from the command line
and printed for every plan.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from dreampipe.errors import ConfigError, PlanError

__all__ = ["config_string", "parse_stage_bounds", "stages_from_config"]


def config_string(replicas: Sequence[int], tensor_parallel: int | Sequence[int] = 1,
                  recompute: Sequence[bool] = ()) -> str:
    """The paper's config string for per-stage replica counts (``"1t4"``: split over 4,
    ``tensor_parallel`` one width for all stages or one per stage; ``"3r"``: the stage
    recomputes)."""
    marks = ["r" if rc else "" for rc in recompute] or [""] * len(replicas)
    widths = ([tensor_parallel] * len(replicas) if isinstance(tensor_parallel, int)
              else list(tensor_parallel))
    if any(t > 1 for t in widths):
        return "-".join(f"{r}t{t}{m}" if t > 1 else f"{r}{m}"
                        for r, t, m in zip(replicas, widths, marks, strict=True))
    if len(replicas) > 1 and all(r == 1 for r in replicas) and not any(recompute):
        return "straight"
    return "-".join(f"{r}{m}" for r, m in zip(replicas, marks, strict=True))


def stages_from_config(config: str, num_stages: int | None = None) -> list[int]:
    """Parse ``"2-1-1"`` into ``[2, 1, 1]``; ``"straight"`` needs ``num_stages``."""
    if config == "straight":
        if not num_stages or num_stages < 2:
            raise PlanError("config 'straight' needs the number of stages (at least 2)")
        return [1] * num_stages
    if "t" in config or "r" in config:
        raise PlanError(
            f"config {config!r} splits stages over workers or recomputes them; such a plan "
            "comes from 'dreampipe plan --memory ... -o plan.json' (its splits per layer), "
            "given as --plan"
        )
    try:
        reps = [int(x) for x in config.split("-")]
    except ValueError:
        raise PlanError(
            f"config {config!r} is not like '2-1-1', '16' or 'straight'"
        ) from None
    if any(r < 1 for r in reps):
        raise PlanError(f"config {config!r} has a stage with fewer than 1 replica")
    return reps


def parse_stage_bounds(text: str, num_layers: int) -> list[int]:
    """``"0,4"`` (the first layer of each stage) into ``[0, 4]``, checked against the model."""
    try:
        bounds = [int(x) for x in text.split(",")]
    except ValueError:
        raise ConfigError(
            f"stages={text!r}: list the first layer of each stage, e.g. 0,4", "stages"
        ) from None
    if bounds[0] != 0 or any(b <= a for a, b in itertools.pairwise(bounds)):
        raise ConfigError(f"stages={text!r} must start at 0 and increase, e.g. 0,4", "stages")
    if bounds[-1] >= num_layers:
        raise ConfigError(
            f"stages={text!r} starts a stage at layer {bounds[-1]} but the model has "
            f"{num_layers} layers (0..{num_layers - 1})", "stages",
        )
    return bounds
