"""The library API: train your own model, data, optimizer and loop on a plan.

:class:`Pipeline` runs on every rank of a ``torchrun`` job (or alone in one
process), as its :class:`TrainConfig` says; :func:`load_model_state` reads a
checkpoint's weights for a plain ``nn.Module``; :func:`initialise` gives a model
built on a device the weights a Pipeline gives it built on ``meta``.
"""

from dreampipe.api.checkpoint import load_model_state
from dreampipe.api.config import TrainConfig
from dreampipe.api.evaluation import EvalResult
from dreampipe.api.pipeline import Pipeline
from dreampipe.splitter.chain import initialise

__all__ = ["EvalResult", "Pipeline", "TrainConfig", "initialise", "load_model_state"]
