"""dreampipe: PipeDream-style generalized pipeline parallelism for PyTorch.

profile -> LayerGraph -> plan(topology) -> Plan -> schedule -> Schedule ->
simulate() or the runtime. See DESIGN.md for the map.
"""

from dreampipe.actions import Action, ActionKind, Schedule, ScheduleKind
from dreampipe.errors import (
    DreampipeError,
    PeerTimeoutError,
    PlanError,
    ProfileError,
    ScheduleError,
    StageMismatchError,
    TopologyError,
)
from dreampipe.events import Event
from dreampipe.graph import Layer, LayerGraph, load_graph
from dreampipe.plan import Plan, Stage

__all__ = [
    "Action",
    "ActionKind",
    "DreampipeError",
    "Event",
    "Layer",
    "LayerGraph",
    "PeerTimeoutError",
    "Plan",
    "PlanError",
    "ProfileError",
    "Schedule",
    "ScheduleError",
    "ScheduleKind",
    "Stage",
    "StageMismatchError",
    "TopologyError",
    "load_graph",
]

__version__ = "0.1.0"
