"""Hugging Face's reentrant gradient checkpointing, refused before anything runs.

``model.gradient_checkpointing_enable()`` wraps each block's call in
``torch.utils.checkpoint`` with ``use_reentrant=True`` unless told otherwise. A
pipeline stage runs its backward with ``inputs=`` (the values it received), which
reentrant checkpointing does not support: torch raises at the first backward, after the
whole forward ran. The non-reentrant form runs as in one process, and dreampipe's own
recomputation needs no change to the model (docs/design.md §2.1).
"""

from __future__ import annotations

import functools

from torch import nn

from dreampipe.errors import ConfigError

__all__ = ["check_hf_checkpointing"]


def _reentrant(module: nn.Module) -> bool:
    """Whether ``module`` checkpoints its blocks the reentrant way (Hugging Face's
    ``gradient_checkpointing`` flag with its checkpoint function's ``use_reentrant``)."""
    if not getattr(module, "gradient_checkpointing", False):
        return False
    func = getattr(module, "_gradient_checkpointing_func", None)
    if isinstance(func, functools.partial):
        return bool(func.keywords.get("use_reentrant", True))
    return False


def check_hf_checkpointing(model: nn.Module) -> None:
    """Refuse a model whose Hugging Face gradient checkpointing is reentrant (module doc)."""
    for name, module in model.named_modules():
        if _reentrant(module):
            what = f"{type(model).__name__}.{name}" if name else type(model).__name__
            raise ConfigError(
                f"{what} runs Hugging Face's gradient checkpointing with use_reentrant=True, "
                "which cannot run a pipeline stage's backward (it takes the stage's received "
                "values as inputs=); call model.gradient_checkpointing_enable("
                "gradient_checkpointing_kwargs={'use_reentrant': False}), or disable it and "
                "let dreampipe recompute (TrainConfig(recompute_blocks=...) or a plan's "
                "recomputed stages)", "model")
