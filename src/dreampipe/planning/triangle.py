"""The upper triangle of a table of layer ranges, made once per size.

A range table's entry ``[i, j]`` is a range only where ``i <= j``; the tables mask the
rest with :func:`upper`, which they read many times over one profile (each split's
sums), so the mask is made once per size and shared, read-only.
"""

from __future__ import annotations

import functools

import numpy as np
import numpy.typing as npt

__all__ = ["upper"]


@functools.lru_cache(maxsize=16)
def upper(n: int, k: int = 0) -> npt.NDArray[np.bool_]:
    """``[i, j]``: whether ``j - i >= k`` (with ``k = 0``, whether ``i..j`` is a range), for
    ``n`` layers; read-only."""
    mask = np.triu(np.ones((n, n), dtype=bool), k)
    mask.flags.writeable = False
    return mask
