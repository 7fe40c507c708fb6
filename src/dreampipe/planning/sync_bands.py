"""Bands of layer ranges, and the array helpers the synchronous tables read.

A band holds, for each first layer ``i``, the stages ``i..i + k`` for ``k`` below a
width, so that a table of stages no longer than that costs ``n x width``, not ``n^2``
(:mod:`dreampipe.planning.sync_tables`, docs/planner.md, "The synchronous objective").
"""

from __future__ import annotations

import functools
from typing import cast

import numpy as np
import numpy.typing as npt

from dreampipe.planning.costs import FloatArray
from dreampipe.planning.triangle import upper

__all__ = ["band", "band_allreduce_ends", "capacity_of", "edge", "edge_size", "pick", "row_sums"]

IntArray = npt.NDArray[np.int64]


def capacity_of(fixed: FloatArray, per: FloatArray, room: float) -> FloatArray:
    """:meth:`~dreampipe.planning.sync_tables.StageTables.capacity` of memory terms
    ``fixed + held * per``: ``floor((room - fixed) / per)``, inf where ``per`` is not
    positive, -1 where ``fixed`` is over ``room`` (made in place: a masked copy over a
    band's runs of stages is faster than a select)."""
    most = np.subtract(room, fixed)
    with np.errstate(divide="ignore", invalid="ignore"):
        np.divide(most, per, out=most)
    np.floor(most, out=most)
    np.copyto(most, np.inf, where=~(per > 0))
    np.copyto(most, -1.0, where=fixed > room)
    return most


@functools.lru_cache(maxsize=256)
def band(n: int, width: int | None, start: int = 0) -> tuple[IntArray, IntArray]:
    """Index arrays ``(first, last)`` of stages over ``n`` layers: every ``[i, j]`` (None),
    or ``[i, k]`` the stage of layers ``i..i + k`` for ``k < width``, past the last layer
    clipped to it; with ``start``, only the columns ``k >= start`` (what widening a band
    from ``start`` layers adds: each entry depends on its stage alone)."""
    rows = np.arange(n)[:, None]
    if width is None:
        return np.broadcast_to(rows, (n, n)), np.broadcast_to(np.arange(n)[None, :], (n, n))
    last = np.minimum(rows + np.arange(start, width)[None, :], n - 1)
    first = np.ascontiguousarray(np.broadcast_to(rows, last.shape))  # gathers by it run fast
    first.flags.writeable = last.flags.writeable = False
    return first, last


def band_allreduce_ends(pb: FloatArray, pw: FloatArray, lat: float, per: float,
                        overlap: bool, rows: IntArray, last: IntArray, is_column: bool = False,
                        start: int = 0) -> FloatArray:
    """:func:`~dreampipe.planning.costs.allreduce_end` of the stages ``rows..last`` only,
    so that a band of stages costs its own size, not the square: index arrays whose
    ``last`` grows by one along the second axis from ``rows`` (a band; with ``start``,
    its columns from ``start`` on, :func:`band`), or, with ``is_column``, stages that all
    end at the profile's last layer (:func:`edge`); ``pb`` and ``pw`` sum the backward
    and the weights over the first layers."""
    later = last >= rows
    after, before = last + 1, pw[rows]
    if overlap:
        h = np.where(pw[1:] > pw[:-1], per * pw[1:] - pb[:-1], -np.inf)
        if is_column:  # the maximum from the last layer back
            end = np.maximum.accumulate(h[::-1])[::-1][rows]
        else:
            end = h[last]
            if not later.all():
                np.copyto(end, -np.inf, where=~later)
            np.maximum.accumulate(end, axis=1, out=end)
            if start:  # the maximum over the band's first ``start`` columns too
                np.maximum(end, _window_max(h, start)[rows[:, :1]], out=end)
        end += lat  # in place, in the order end + lat + pb[last + 1] - per * pw[rows]
        end += pb[after]
        end -= per * before
    else:
        end = lat + (pb[after] - pb[rows]) + per * (pw[after] - before)
    later &= pw[after] - before > 0
    np.copyto(end, 0.0, where=~later)
    return np.asarray(end)


def _window_max(h: FloatArray, k: int) -> FloatArray:
    """``[i]``: the largest of ``h[i..i + k - 1]`` (to the last entry)."""
    padded = np.concatenate([h, np.full(k - 1, -np.inf)])
    return np.asarray(np.lib.stride_tricks.sliding_window_view(padded, k).max(axis=1))


@functools.lru_cache(maxsize=256)
def edge(n: int, width: int, last_slot: bool, start: int = 0
         ) -> tuple[IntArray, IntArray, tuple[IntArray, ...]]:
    """The stages of at most ``width`` layers over ``n`` that a pipeline's first slot may
    take (they start at layer 0: the band's first row) or, with ``last_slot``, its last
    (they end at layer ``n - 1``: a column, one stage a row): index arrays ``(first,
    last)`` and where each stage sits in the band (:func:`band`); with ``start``, only
    those of more than ``start`` layers (what widening the edge from ``start`` adds: the
    first slot's later columns, the last slot's earlier rows)."""
    if not last_slot:
        k = np.arange(start, width)[None, :]
        first, last, at = np.zeros_like(k), np.minimum(k, n - 1), (np.zeros_like(k), k)
    else:
        first = np.arange(max(0, n - width), max(0, n - start))[:, None]
        last = np.full_like(first, n - 1)
        at = (first, last - first)
    for a in (first, last, *at):  # cached: read-only, as pick may keep their flat index
        a.flags.writeable = False
    return first, last, at


def edge_size(n: int, width: int, last_slot: bool) -> int:
    """How many stages :func:`edge` gives: a column holds at most the ``n`` layers."""
    return min(width, n) if last_slot else width


def pick(table: FloatArray, rows: IntArray | int, last: IntArray | int) -> FloatArray:
    """``table[rows, last]`` for index arrays of one shape (or one entry): read through one
    flat index, which NumPy gathers many times faster than a pair of (broadcast) index
    arrays, the same entries. ``rows`` and ``last`` must lie in the table (no negative
    indices)."""
    if isinstance(rows, int) or isinstance(last, int):  # one entry, as NumPy reads it
        return cast(FloatArray, table[rows, last])
    if not table.flags.c_contiguous:  # a broadcast table: flattening it would copy it
        return np.asarray(table[rows, last])
    return np.asarray(table.reshape(-1)[_flat(rows, last, table.shape[1])])


#: The flat indices of the last index arrays :func:`pick` read (each with them): a
#: table's terms read several tables through one band's.
_FLATS: list[tuple[IntArray, IntArray, int, IntArray]] = []


def _flat(rows: IntArray, last: IntArray, cols: int) -> IntArray:
    """``rows * cols + last``, kept for read-only index arrays (:func:`band`'s and
    :func:`edge`'s), which no one changes while it keeps them."""
    if rows.flags.writeable or last.flags.writeable:
        return rows * cols + last
    for r, k, c, flat in _FLATS:
        if r is rows and k is last and c == cols:
            return flat
    flat = rows * cols + last
    _FLATS.insert(0, (rows, last, cols, flat))
    del _FLATS[4:]
    return flat


def row_sums(masked: FloatArray) -> FloatArray:
    """``[i, j]``: row ``i``'s entries ``i..j`` summed (entries left of ``i`` must be 0)."""
    n = masked.shape[0]
    return np.asarray(np.where(upper(n), np.cumsum(masked, axis=1), 0.0))
