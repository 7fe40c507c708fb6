"""What a stage holds besides its weights and its microbatches' tensors, for every layer
range: the largest backward's working set and the compute library's kernel memory.

``held[i, j] = max over k in i..j of working[k] + sum over the kinds in i..j of library``.
A backward runs one layer at a time, so only the largest layer's working set is
there at once; a process keeps its library's kernels for good, once per kind of layer
(:attr:`~dreampipe.profiling.graph.Layer.kernel_kind`: a stage of three like blocks
keeps one block's), docs/design.md §5.4.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np
import numpy.typing as npt

from dreampipe.planning.triangle import upper
from dreampipe.profiling.graph import LayerGraph

__all__ = ["held_bytes", "held_table", "kinds_sum", "range_max"]

FloatArray = npt.NDArray[np.float64]


def range_max(values: Sequence[float]) -> FloatArray:
    """``[i, j]``: the largest of ``values[i..j]`` (0 where ``i > j``)."""
    v = np.asarray(values, dtype=np.float64)
    n = len(v)
    table = np.where(upper(n), v[None, :], 0.0)
    return np.asarray(np.maximum.accumulate(table, axis=1))


def kinds_sum(values: Sequence[float], kinds: Sequence[Hashable]) -> FloatArray:
    """``[i, j]``: the sum of ``values`` over the distinct ``kinds`` in ``i..j`` (each kind's
    value counted once, the largest of its members'; 0 where ``i > j``)."""
    n = len(values)
    members: dict[Hashable, list[int]] = {}
    for k, kind in enumerate(kinds):
        members.setdefault(kind, []).append(k)
    table = np.zeros((n, n), dtype=np.float64)
    cols = np.arange(n)
    for at in members.values():
        value = max(float(values[k]) for k in at)
        mine = set(at)
        if value == 0.0:
            continue
        nxt = np.full(n, n)  # nxt[i]: the first member at or after i
        for k in reversed(range(n)):
            nxt[k] = k if k in mine else (nxt[k + 1] if k + 1 < n else n)
        table += np.where(cols[None, :] >= nxt[:, None], value, 0.0)
    return np.asarray(np.where(upper(n), table, 0.0))


def held_bytes(working: Sequence[float], library: Sequence[float],
               kinds: Sequence[Hashable]) -> FloatArray:
    """The module docstring's ``held`` table."""
    return np.asarray(range_max(working) + kinds_sum(library, kinds))


def held_table(graph: LayerGraph) -> FloatArray:
    """:func:`held_bytes` of ``graph``'s layers."""
    layers = graph.layers
    return held_bytes([float(x.working_bytes) for x in layers],
                      [float(x.library_bytes or 0) for x in layers],
                      [x.kernel_kind for x in layers])
