"""Losses shared by the sequence models of the zoo."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["token_cross_entropy"]


def token_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every token: logits ``(B, T, V)``, target ``(B, T)``."""
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())
