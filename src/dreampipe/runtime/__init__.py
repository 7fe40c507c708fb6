"""The runtime: train a :class:`~dreampipe.planning.plan.Plan` for real on torch.distributed.

``launch_local(cfg)`` on one machine, ``run_from_env(cfg)`` under torchrun;
both return a :class:`RunResult` (``run_from_env`` on rank 0 only).
"""

from dreampipe.runtime.config import OptimizerKind, RunConfig, RunOptions, RunResult
from dreampipe.runtime.launch import launch_local, run_from_env, run_rank

__all__ = [
    "OptimizerKind",
    "RunConfig",
    "RunOptions",
    "RunResult",
    "launch_local",
    "run_from_env",
    "run_rank",
]
