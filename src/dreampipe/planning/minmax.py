"""The dynamic program's inner step: a batched min-max matrix product over candidate splits.

For every context ``k``, first layer ``i`` and range end ``c`` the best split is::

    val[k, i, c] = min over candidates u, cut points t of max(x[k, i, u, t], y[k, c, u, t])

where candidate ``u`` is one (inner slot, units) choice of the first stage,
``x`` the first stage ``i..t`` with the cut after it and ``y`` the rest
``t+1..c``. Invalid ranges hold ``inf`` on either side, so they never win.
On ties the plain loop's choice is kept: the first ``u``, then the first ``t``.

The product runs tile by tile over ``(i, c)``, each tile only over the cut
points ``t`` that some row and some column of it can use: finite (so about a
sixth of the whole cube is computed) and within ``limit[k]``, an upper bound
on the time of any part of an optimal plan. An entry whose best split is
within the limit is exact, value and choice; one above it may come out larger
than the plain product (or ``inf``), which no plan within the limit reads.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from dreampipe.planning.costs import FloatArray

__all__ = ["best_splits"]

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]

#: Elements of one temporary tile of the cube (2 MiB of float64), which bounds memory.
_TILE = 1 << 18
#: The widest tile side: narrower tiles skip more of the unused triangle.
_MAX_SIDE = 24


def _usable(a: FloatArray, limit: FloatArray) -> BoolArray:
    """``[k, row, t]``: some candidate's part ``a[k, row, u, t]`` is finite and within the limit."""
    lim = limit[:, None, None, None]
    return np.asarray(((a <= lim) & (a < np.inf)).any(axis=2))


def _tile(
    x: FloatArray, y: FloatArray, best: FloatArray, val: FloatArray, arg_u: IntArray,
    arg_t: IntArray, t0: int,
) -> None:
    """:func:`best_splits` of one tile, cut points from ``t0``, into its outputs."""
    cube = np.maximum(x[:, :, None], y[:, None, :])  # [k, i, c, u, t]
    flat = cube.reshape(*cube.shape[:3], -1)
    v = flat.min(axis=3)
    win = v < best
    if win.any():
        u, t = np.divmod(flat[win].argmin(axis=1), x.shape[3])
        val[win] = v[win]
        arg_u[win] = u
        arg_t[win] = t + t0


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
    arg_u = np.zeros((contexts, rows, cols), dtype=np.int64)
    arg_t = np.zeros((contexts, rows, cols), dtype=np.int64)
    x_use, y_use = _usable(x, limit), _usable(y, limit)
    side = max(1, min(_MAX_SIDE, math.isqrt(max(1, _TILE // max(1, cands * width)))))
    for i0 in range(0, min(rows, width), side):
        i1 = min(rows, i0 + side)
        x_t = np.asarray(x_use[:, i0:i1].any(axis=1))  # [k, t]
        for c0 in range(max(0, i0 + 1 - first_col), cols, side):
            c1 = min(cols, c0 + side)
            use: BoolArray = np.asarray(x_t & y_use[:, c0:c1].any(axis=1))  # [k, t]
            live = np.flatnonzero(use.any(axis=1))
            if len(live) == 0:
                continue
            r, c = slice(i0, i1), slice(c0, c1)
            ts = np.flatnonzero(use.any(axis=0))
            step = max(1, _TILE // ((i1 - i0) * (c1 - c0) * cands * (int(ts[-1]) + 1 - int(ts[0]))))
            for k0 in range(int(live[0]), int(live[-1]) + 1, step):
                ks = slice(k0, min(int(live[-1]) + 1, k0 + step))
                ts = np.flatnonzero(use[ks].any(axis=0))
                if len(ts):
                    t0, t1 = int(ts[0]), int(ts[-1]) + 1
                    _tile(x[ks, r, :, t0:t1], y[ks, c, :, t0:t1], best[ks, r, c],
                          val[ks, r, c], arg_u[ks, r, c], arg_t[ks, r, c], t0)
    return val, arg_u, arg_t
