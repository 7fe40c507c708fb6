"""The dynamic program's inner step: a batched min-max matrix product over candidate splits.

For every context ``k``, first layer ``i`` and range end ``c`` the best split is::

    val[k, i, c] = min over candidates u, cut points t of max(x[k, i, u, t], y[k, c, u, t])

where candidate ``u`` is one (inner slot, units) choice of the first stage,
``x`` the first stage ``i..t`` with the cut after it and ``y`` the rest
``t+1..c``. Invalid ranges hold ``inf``, so they never win; ties keep the
plain loop's choice (the first ``u``, then the first ``t``). The product runs
tile by tile over ``(i, c)``, each tile only over the pairs ``(u, t)`` that
can improve one of its ranges within ``limit[k]``: an entry within the limit
is exact, value and choice (docs/design.md §4.1, §4.3).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt

from dreampipe.planning.costs import FloatArray

__all__ = ["best_splits", "index_dtype"]

IntArray = npt.NDArray[np.signedinteger[Any]]
BoolArray = npt.NDArray[np.bool_]

#: Elements of one temporary tile of the cube (2 MiB of float64), which bounds memory.
_TILE = 1 << 18
#: The widest tile side: narrower tiles skip more of the unused triangle.
_MAX_SIDE = 12


def index_dtype(largest: int) -> type[np.signedinteger[Any]]:
    """The narrowest of int16 and int32 that holds ``0..largest`` and the negative codes:
    a table's index arrays cost 2 bytes an entry instead of 8 below 32,768 layers."""
    return np.int16 if largest < np.iinfo(np.int16).max else np.int32


def _tile(
    x: FloatArray, y: FloatArray, best: FloatArray, val: FloatArray, arg_u: IntArray,
    arg_t: IntArray, u: IntArray, t: IntArray,
) -> None:
    """:func:`best_splits` of one tile over the pairs ``(u, t)`` (in ``(u, t)`` order)."""
    x_p, y_p = x[:, :, u, t], y[:, :, u, t]  # [k, i, pair], [k, c, pair]
    cube = np.maximum(x_p[:, :, None], y_p[:, None, :])  # [k, i, c, pair]
    v = cube.min(axis=3)
    win = v < best
    if win.any():
        p = cube[win].argmin(axis=1)
        val[win] = v[win]
        arg_u[win] = u[p]
        arg_t[win] = t[p]


def _low(a: FloatArray, lo: int, hi: int) -> FloatArray:
    """``[k, u, t]``: the least of ``a[k, lo:hi, u, t]``, a tile's rows (or columns)."""
    return np.asarray(a[:, lo:hi].min(axis=1))


def best_splits(
    x: FloatArray, y: FloatArray, best: FloatArray, limit: FloatArray, first_col: int
) -> tuple[FloatArray, IntArray, IntArray]:
    """``(val, u, t)``: the module doc's ``val[k, i, c]`` where it is below ``best[k, i, c]``
    (``inf`` elsewhere) and the first ``(u, t)`` that reaches it there.

    ``x[k, i, u, t]`` and ``y[k, c, u, t]``; column ``c`` is the range ending
    at layer ``c + first_col``.
    """
    contexts, rows, cands, width = x.shape
    cols = y.shape[1]
    val = np.full((contexts, rows, cols), np.inf)
    index = index_dtype(max(cands, width))
    arg_u = np.zeros((contexts, rows, cols), dtype=index)
    arg_t = np.zeros((contexts, rows, cols), dtype=index)
    side = max(1, min(_MAX_SIDE, math.isqrt(max(1, _TILE // max(1, cands * width)))))
    # one column (the top level's suffixes): as many rows as a square tile's entries
    rows_side = side if cols > 1 else min(_MAX_SIDE, side * side)
    lim = limit[:, None, None]
    y_low = {c0: _low(y, c0, c0 + side) for c0 in range(0, cols, side)}
    for i0 in range(0, min(rows, width), rows_side):
        i1 = min(rows, i0 + rows_side)
        x_low = _low(x, i0, i1)
        for c0 in range(max(0, i0 + 1 - first_col) // side * side, cols, side):
            c1 = min(cols, c0 + side)
            r, c = slice(i0, i1), slice(c0, c1)
            ranges = np.arange(i0, i1)[:, None] < np.arange(c0, c1)[None, :] + first_col
            top = np.where(ranges, best[:, r, c], -np.inf).max(axis=(1, 2))[:, None, None]
            ok = np.maximum(x_low, y_low[c0])
            use = (ok < top) & (ok <= lim)  # [k, u, t]
            live = np.flatnonzero(use.any(axis=(1, 2)))
            if len(live) == 0:
                continue
            pairs = int(use.any(axis=0).sum())
            step = max(1, _TILE // ((i1 - i0) * (c1 - c0) * pairs))
            for k0 in range(int(live[0]), int(live[-1]) + 1, step):
                ks = slice(k0, min(int(live[-1]) + 1, k0 + step))
                u, t = np.nonzero(use[ks].any(axis=0))
                if len(u):
                    _tile(x[ks, r], y[ks, c], best[ks, r, c], val[ks, r, c], arg_u[ks, r, c],
                          arg_t[ks, r, c], u, t)
    return val, arg_u, arg_t
