"""dreampipe: PipeDream-style generalized pipeline parallelism for PyTorch.

The package's folders follow the flow (docs/architecture.md)::

    profiling -> LayerGraph -> planning -> Plan -> scheduling -> Schedule
                                                      |-> simulation (predicted events)
                                                      '-> runtime    (measured events)

with ``machine`` (this machine's calibration), ``runplan`` (the run's plan), ``api`` (the
Pipeline), ``commands`` (train, demo, bench) and ``cli`` on top and ``models`` beside.

``dreampipe.Pipeline`` trains your own model, data, optimizer and loop on a
plan (``api/``), as a ``dreampipe.TrainConfig`` says. ``import dreampipe``
stays light: the names that need NumPy or torch (the Pipeline, the planner,
the profiler, the model zoo) load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from dreampipe.errors import (
    CheckpointError,
    ConfigError,
    DreampipeError,
    PeerTimeoutError,
    PlanError,
    ProfileError,
    QuantityError,
    ScheduleError,
    StageMismatchError,
    TopologyError,
)
from dreampipe.planning.plan import Plan, Stage
from dreampipe.planning.topology import Topology
from dreampipe.profiling.graph import Layer, LayerGraph
from dreampipe.profiling.load import load_graph
from dreampipe.scheduling.actions import Action, ActionKind, Schedule, ScheduleKind
from dreampipe.scheduling.build import build_schedule
from dreampipe.scheduling.events import Event
from dreampipe.scheduling.torch_csv import read_torch_csv
from dreampipe.scheduling.torch_csv_write import write_torch_csv
from dreampipe.scheduling.validator import validate_schedule
from dreampipe.simulation.chrome_trace import write_chrome_trace
from dreampipe.simulation.simulator import (
    SimCosts,
    SimResult,
    costs_from_plan,
    costs_from_profile,
    simulate_schedule,
)
from dreampipe.simulation.timeline import draw_timeline

if TYPE_CHECKING:
    from dreampipe.api import EvalResult, Pipeline, TrainConfig, initialise, load_model_state
    from dreampipe.models import get_model
    from dreampipe.models.spec import ModelSpec
    from dreampipe.planning.options import PlanOptions
    from dreampipe.planning.planner import evaluate_plan, plan_pipeline
    from dreampipe.profiling.profiler import profile_model, profile_spec

__all__ = [
    "Action",
    "ActionKind",
    "CheckpointError",
    "ConfigError",
    "DreampipeError",
    "EvalResult",
    "Event",
    "Layer",
    "LayerGraph",
    "ModelSpec",
    "PeerTimeoutError",
    "Pipeline",
    "Plan",
    "PlanError",
    "PlanOptions",
    "ProfileError",
    "QuantityError",
    "Schedule",
    "ScheduleError",
    "ScheduleKind",
    "SimCosts",
    "SimResult",
    "Stage",
    "StageMismatchError",
    "Topology",
    "TopologyError",
    "TrainConfig",
    "build_schedule",
    "costs_from_plan",
    "costs_from_profile",
    "draw_timeline",
    "evaluate_plan",
    "get_model",
    "initialise",
    "load_graph",
    "load_model_state",
    "plan_pipeline",
    "profile_model",
    "profile_spec",
    "read_torch_csv",
    "simulate_schedule",
    "validate_schedule",
    "write_chrome_trace",
    "write_torch_csv",
]

__version__ = "0.1.0"

# name -> (module, attribute), imported on first access
_LAZY = {
    "Pipeline": ("dreampipe.api", "Pipeline"),
    "TrainConfig": ("dreampipe.api", "TrainConfig"),
    "PlanOptions": ("dreampipe.planning.options", "PlanOptions"),
    "EvalResult": ("dreampipe.api", "EvalResult"),
    "load_model_state": ("dreampipe.api", "load_model_state"),
    "initialise": ("dreampipe.api", "initialise"),
    "ModelSpec": ("dreampipe.models.spec", "ModelSpec"),
    "get_model": ("dreampipe.models", "get_model"),
    "evaluate_plan": ("dreampipe.planning.planner", "evaluate_plan"),
    "plan_pipeline": ("dreampipe.planning.planner", "plan_pipeline"),
    "profile_model": ("dreampipe.profiling.profiler", "profile_model"),
    "profile_spec": ("dreampipe.profiling.profiler", "profile_spec"),
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
