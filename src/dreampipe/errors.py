"""The exception hierarchy users see.

Every error a user can cause is a :class:`DreampipeError`; each subclass also
derives from the builtin it refines (``ValueError``, ``TimeoutError``) so that
code catching the builtin keeps working. Messages name the offending value
and the fix.
"""

from __future__ import annotations

__all__ = [
    "TRACEBACK_HEADER",
    "BaselineError",
    "CheckpointError",
    "ConfigError",
    "DatasetError",
    "DreampipeError",
    "NonFiniteError",
    "PeerTimeoutError",
    "PlanError",
    "ProfileError",
    "QuantityError",
    "ScheduleError",
    "StageMismatchError",
    "TopologyError",
    "WorkerError",
]


#: Starts each worker traceback appended to an error raised from worker processes,
#: so that the command line can show the summary above it and hide the rest.
TRACEBACK_HEADER = "--- traceback of rank"


class DreampipeError(Exception):
    """Base class of every error dreampipe raises on purpose."""


class ConfigError(DreampipeError, ValueError):
    """An option is out of range or conflicts with another.

    The message writes each offending option as ``name=value`` (the library's
    parameter names); ``parameters`` lists those names so that a front end
    can say them its own way (the command line writes ``--microbatches 3``).
    """

    def __init__(self, message: str, *parameters: str) -> None:
        super().__init__(message)
        self.parameters = parameters


class DatasetError(DreampipeError, ValueError):
    """A data set is unknown, missing, or does not fit the model."""


class CheckpointError(DreampipeError, ValueError):
    """A checkpoint is missing, uncommitted, damaged, or of another model."""


class WorkerError(DreampipeError, RuntimeError):
    """A worker process failed with an error that is not a DreampipeError, or ran too long."""


class BaselineError(DreampipeError, RuntimeError):
    """A bench baseline's worker process failed or ran past its deadline."""


class ProfileError(DreampipeError, ValueError):
    """A layer profile (ours or PipeDream's graph.txt) is malformed."""


class QuantityError(DreampipeError, ValueError):
    """A size or bandwidth (``16GB``, ``10Gbps``) cannot be read or is out of range."""


class TopologyError(DreampipeError, ValueError):
    """A cluster description makes no sense (zero workers, bad bandwidth...)."""


class PlanError(DreampipeError, ValueError):
    """No valid plan exists, or a plan does not fit the model or cluster."""


class ScheduleError(DreampipeError, ValueError):
    """A schedule is malformed, would deadlock, or does not fit its plan."""


class StageMismatchError(DreampipeError, ValueError):
    """Two stages disagree on the shape or dtype of a tensor between them."""


class PeerTimeoutError(DreampipeError, TimeoutError):
    """A rank waited past its deadline for a peer."""


class NonFiniteError(DreampipeError, FloatingPointError):
    """A forward output or a loss holds NaN or inf (the run stops instead of training on it)."""
