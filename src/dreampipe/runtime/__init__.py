"""The runtime: train a :class:`~dreampipe.planning.plan.Plan` for real on torch.distributed.

``launch_local(cfg)`` on one machine, ``run_from_env(cfg)`` under torchrun;
both return a :class:`RunResult` (``run_from_env`` on rank 0 only).
"""

from dreampipe.runtime.config import OptimizerKind, RunConfig, RunResult, resolve_model
from dreampipe.runtime.launch import WorkerError, launch_local, run_from_env, run_rank

__all__ = [
    "OptimizerKind",
    "RunConfig",
    "RunResult",
    "WorkerError",
    "launch_local",
    "resolve_model",
    "run_from_env",
    "run_rank",
]
