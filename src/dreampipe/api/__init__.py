"""The library API: train your own model, data, optimizer and loop on a plan.

:class:`Pipeline` runs on every rank of a ``torchrun`` job (or alone in one
process); :func:`load_model_state` reads a checkpoint's weights for a plain
``nn.Module``.
"""

from dreampipe.api.checkpoint import load_model_state
from dreampipe.api.evaluation import EvalResult
from dreampipe.api.pipeline import Pipeline

__all__ = ["EvalResult", "Pipeline", "load_model_state"]
