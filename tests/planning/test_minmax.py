"""The DP's batched, pruned min-max product equals the plain loop, value and choice."""

from __future__ import annotations

import numpy as np
import pytest

from dreampipe.planning.minmax import best_splits


def _plain(x: np.ndarray, y: np.ndarray, best: np.ndarray, first_col: int
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The loop the DP ran before: candidate by candidate, cut by cut, strict improvements."""
    contexts, rows, cands, width = x.shape
    val = best.copy()
    arg_u = np.full(best.shape, -1)
    arg_t = np.full(best.shape, -1)
    for k in range(contexts):
        for i in range(rows):
            for c in range(y.shape[1]):
                for u in range(cands):
                    for t in range(width):
                        v = max(x[k, i, u, t], y[k, c, u, t])
                        if v < val[k, i, c]:
                            val[k, i, c], arg_u[k, i, c], arg_t[k, i, c] = v, u, t
    return val, arg_u, arg_t


def _case(rng: np.random.Generator, n: int, cands: int, contexts: int, first_col: int
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Valid ranges only (``t >= i`` for x, ``t < c + first_col`` for y), coarse values so
    that ties are common; ``best`` finite or ``inf``."""
    cols = n - first_col
    x = rng.integers(1, 6, (contexts, n, cands, n - 1)).astype(float)
    y = rng.integers(1, 6, (contexts, cols, cands, n - 1)).astype(float)
    t = np.arange(n - 1)
    x[np.broadcast_to((t[None, :] < np.arange(n)[:, None])[:, None], x.shape[1:])[None]
      .repeat(contexts, 0)] = np.inf
    y[np.broadcast_to((t[None, :] >= np.arange(cols)[:, None] + first_col)[:, None],
                      y.shape[1:])[None].repeat(contexts, 0)] = np.inf
    best = rng.choice([2.0, 3.0, 4.0, np.inf], (contexts, n, cols))
    return x, y, best


@pytest.mark.parametrize("seed", range(12))
def test_best_splits_equal_the_plain_loop(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n, cands, contexts = int(rng.integers(2, 30)), int(rng.integers(1, 5)), int(rng.integers(1, 4))
    first_col = n - 1 if seed % 3 == 0 else 0
    x, y, best = _case(rng, n, cands, contexts, first_col)
    limit = rng.choice([2.0, 3.0, 4.0, np.inf], contexts)
    expect_val, expect_u, expect_t = _plain(x, y, best, first_col)
    val, arg_u, arg_t = best_splits(x, y, best, limit, first_col)
    improved = expect_val < best
    # exact where the best split is within the limit; never below the plain product
    within = improved & (expect_val <= limit[:, None, None])
    assert np.array_equal(val[within], expect_val[within])
    assert np.array_equal(arg_u[within], expect_u[within])
    assert np.array_equal(arg_t[within], expect_t[within])
    assert np.all(val[val < best] >= expect_val[val < best])
    assert not np.any((val < best) & ~improved)
    if np.all(np.isinf(limit)):
        assert np.array_equal(val < best, improved)
