"""What a stage's minibatches in flight ask of the lower bound's relaxed program.

A stage of ``r`` replicas of ``t`` workers holds at least ``ceil((r + A) / r)``
minibatches in flight, ``A`` the workers of the stages after it (PipeDream's
count, :mod:`dreampipe.planning.in_flight`; a join buffer or whole rounds only add). Its
layers hold at most ``R`` of them in memory (``RangeCosts.max_versions``), so it
fits only with ``r >= A / (R - 1)``: at least ``t A / (R - 1)`` workers, or none
after it where ``R < 2``. The relaxed program (:mod:`dreampipe.planning.bounds`)
knows a lower bound on ``A``, the fewest workers any plan of the layers after
the stage needs; as fewer workers after a stage never ask more of it, the
fewest a stage needs at that bound is at most what it needs in any plan
(docs/design.md §4.7). Each stage term is the least over the ways to run the
stage (unsplit or a split, as it is or recomputing): recomputing adds its
forward, ``t F``, to the work and raises ``R``. :class:`Ways` takes each split
width's work and in-flight terms together: a stage runs one way, which must
both reach the time and hold its minibatches, so the least over the ways of
the larger need is at least the larger of the two leasts taken apart.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dreampipe.planning.costs import FloatArray, RangeCosts

__all__ = ["InFlight", "Ways", "in_flight_terms"]


@dataclass(frozen=True)
class InFlight:
    """``[i, j]`` terms of a stage of layers ``i..j``, run as it is (``rate``, ``alone``)
    and, where stages may recompute, recomputing (``*_again``, ``extra``).

    ``rate``: the fewest of its workers per worker after it (0: any number fit), a hair
    low so that a count it reaches exactly stays; ``alone``: 0 where it fits as the last
    stage, else ``inf``; ``extra``: the least ``t F`` recomputing adds to its work."""

    rate: FloatArray
    alone: FloatArray
    rate_again: FloatArray | None = None
    alone_again: FloatArray | None = None
    extra: FloatArray | None = None

    def fewest(self, i: int, x: FloatArray, work: FloatArray, after: FloatArray,
               first: np.ndarray, scale: float) -> FloatArray:
        """``[j, q]``: the fewest workers of a stage ``i..j`` in state ``q`` (``first``: its
        fewest) that takes at most ``1 / scale`` on ``x`` workers (its ``work[i, j, q]``
        over them) and holds its minibatches in flight with ``after[j, q]`` after it
        (finite, at least 1 but none after the last layer), as it is or recomputing."""
        out = np.maximum(x, _need(self.rate, self.alone, i, after))
        if self.extra is None:
            return out
        again = work[i, i:] + self.extra[i, i:, None]
        again *= scale
        np.ceil(again, out=again)
        np.maximum(again, first[None, :], out=again)
        assert self.rate_again is not None and self.alone_again is not None
        np.maximum(again, _need(self.rate_again, self.alone_again, i, after), out=again)
        return np.minimum(out, again, out=out)


@dataclass(frozen=True)
class Ways:
    """Per split width ``t``, the work table of its ways (``[i, j, q]``, as
    :meth:`~dreampipe.planning.bound_states.BoundStates.work`) and their
    :class:`InFlight` terms: :meth:`fewest` couples each width's work to its own
    minibatches in flight, where :class:`InFlight` alone pairs the least work of any
    way with the least memory of any (module doc)."""

    ways: tuple[tuple[FloatArray, InFlight], ...]

    def fewest(self, i: int, x: FloatArray, work: FloatArray, after: FloatArray,
               first: np.ndarray, scale: float) -> FloatArray:
        """:meth:`InFlight.fewest` of the stages ``i..j``, the least over the widths of
        each width's own (``x`` and ``work``, the least of every way's, are read only
        as a floor)."""
        out = np.full_like(x, np.inf)
        for table, terms in self.ways:
            own = table[i, i:] * scale
            np.ceil(own, out=own)
            np.maximum(own, first[None, :], out=own)
            if not np.any(own < out):  # its needs are at least its work: none is lower
                continue
            np.minimum(out, terms.fewest(i, own, table, after, first, scale), out=out)
        return np.maximum(out, x, out=out)


def _need(rate: FloatArray, alone: FloatArray, i: int, after: FloatArray) -> FloatArray:
    """``[j, q]``: the workers a stage ``i..j`` needs with ``after[j, q]`` after it."""
    with np.errstate(invalid="ignore"):  # the last row (none after it) is set apart
        need = after * rate[i, i:, None]
    np.ceil(need, out=need)
    need[-1] = alone[i, -1]
    return need


def _terms(options: Sequence[tuple[RangeCosts, int]], memory_bytes: int, again: bool
           ) -> tuple[FloatArray, FloatArray]:
    n = options[0][0].n
    rate, fits = np.full((n, n), np.inf), np.zeros((n, n), dtype=bool)
    for costs, t in options:
        room = costs.max_versions(memory_bytes, recompute=again)
        with np.errstate(divide="ignore"):
            own = np.where(room >= 2, t / np.maximum(room - 1, 1), np.inf)
        np.minimum(rate, np.where(np.isinf(room), 0.0, own), out=rate)
        fits |= room >= 1
    return np.where(fits, rate * (1 - 1e-12), np.inf), np.where(fits, 0.0, np.inf)


def in_flight_terms(options: Sequence[tuple[RangeCosts, int]], memory_bytes: int,
                    recompute: bool) -> InFlight:
    """:class:`InFlight` of the ways ``options`` (each a profile and its split width ``t``)
    to run a stage in ``memory_bytes`` per worker, recomputing where ``recompute``."""
    rate, alone = _terms(options, memory_bytes, False)
    if not recompute:
        return InFlight(rate, alone)
    rate_again, alone_again = _terms(options, memory_bytes, True)
    extra = np.full_like(rate, np.inf)
    for costs, t in options:
        f = np.minimum(costs.forward, np.where(np.isfinite(costs.compute_s), costs.compute_s,
                                               0.0))
        fits = costs.max_versions(memory_bytes, recompute=True) >= 1
        np.minimum(extra, np.where(fits, t * f, np.inf), out=extra)
    return InFlight(rate, alone, rate_again, alone_again, extra)
