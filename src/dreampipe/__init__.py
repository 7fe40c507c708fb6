"""dreampipe: PipeDream-style generalized pipeline parallelism for PyTorch.

profile -> LayerGraph -> plan(topology) -> Plan -> schedule -> Schedule ->
simulate() or the runtime. See DESIGN.md for the map.

The functions whose module has the same name are exported under longer
names, so that ``dreampipe.plan``, ``dreampipe.validate`` and
``dreampipe.simulate`` stay the modules:

- ``plan_pipeline`` is :func:`dreampipe.planner.plan`, ``evaluate_plan``
  :func:`dreampipe.planner.evaluate`;
- ``validate_schedule`` is :func:`dreampipe.validate.validate`;
- ``simulate_schedule`` is :func:`dreampipe.simulate.simulate`.

``import dreampipe`` stays light: the names that need NumPy or torch
(the planner, the profiler, the model zoo, the runtime) load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from dreampipe.actions import Action, ActionKind, Schedule, ScheduleKind
from dreampipe.errors import (
    DreampipeError,
    PeerTimeoutError,
    PlanError,
    ProfileError,
    QuantityError,
    ScheduleError,
    StageMismatchError,
    TopologyError,
)
from dreampipe.events import Event
from dreampipe.graph import Layer, LayerGraph, load_graph
from dreampipe.plan import Plan, Stage
from dreampipe.schedule import build_schedule
from dreampipe.simulate import SimCosts, SimResult, costs_from_plan, costs_from_profile
from dreampipe.simulate import simulate as simulate_schedule
from dreampipe.timeline import draw_timeline
from dreampipe.topology import Topology
from dreampipe.trace import write_chrome_trace
from dreampipe.validate import validate as validate_schedule

if TYPE_CHECKING:
    from dreampipe.models import get_model
    from dreampipe.models.spec import ModelSpec
    from dreampipe.planner import evaluate as evaluate_plan
    from dreampipe.planner import plan as plan_pipeline
    from dreampipe.profiler import profile_model, profile_spec
    from dreampipe.runtime import OptimizerKind, RunConfig, RunResult, launch_local, run_from_env

__all__ = [
    "Action",
    "ActionKind",
    "DreampipeError",
    "Event",
    "Layer",
    "LayerGraph",
    "ModelSpec",
    "OptimizerKind",
    "PeerTimeoutError",
    "Plan",
    "PlanError",
    "ProfileError",
    "QuantityError",
    "RunConfig",
    "RunResult",
    "Schedule",
    "ScheduleError",
    "ScheduleKind",
    "SimCosts",
    "SimResult",
    "Stage",
    "StageMismatchError",
    "Topology",
    "TopologyError",
    "build_schedule",
    "costs_from_plan",
    "costs_from_profile",
    "draw_timeline",
    "evaluate_plan",
    "get_model",
    "launch_local",
    "load_graph",
    "plan_pipeline",
    "profile_model",
    "profile_spec",
    "run_from_env",
    "simulate_schedule",
    "validate_schedule",
    "write_chrome_trace",
]

__version__ = "0.1.0"

# name -> (module, attribute), imported on first access
_LAZY = {
    "ModelSpec": ("dreampipe.models.spec", "ModelSpec"),
    "get_model": ("dreampipe.models", "get_model"),
    "evaluate_plan": ("dreampipe.planner", "evaluate"),
    "plan_pipeline": ("dreampipe.planner", "plan"),
    "profile_model": ("dreampipe.profiler", "profile_model"),
    "profile_spec": ("dreampipe.profiler", "profile_spec"),
    "OptimizerKind": ("dreampipe.runtime", "OptimizerKind"),
    "RunConfig": ("dreampipe.runtime", "RunConfig"),
    "RunResult": ("dreampipe.runtime", "RunResult"),
    "launch_local": ("dreampipe.runtime", "launch_local"),
    "run_from_env": ("dreampipe.runtime", "run_from_env"),
}


def __getattr__(name: str) -> Any:
    """Import the NumPy- and torch-backed entry points when first used."""
    if name not in _LAZY:
        raise AttributeError(f"module 'dreampipe' has no attribute {name!r}")
    module, attribute = _LAZY[name]
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
