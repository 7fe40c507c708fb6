"""The dynamic program of the synchronous objective: the best cuts for one schedule's slots.

For a fixed schedule, stage count, chunk count and microbatches (a
:class:`~dreampipe.planning.sync_objective.Slots`), an update takes ``A = max_c g_c``,
``Y = max_c y_c`` and the longest tail ``X = max_c x_c``, each stage's terms read from
the :class:`~dreampipe.planning.sync_tables.StageTables` of its layers, option and slot.
For bounds ``K`` on the ``y`` and ``L`` on the tails the least ``A`` is a min-max of
per-stage terms, so the recursion over the first stage's layers

    H_c(i) = min over j >= i, options o with y < K, x < L of max(g_c(i, j, o), H_{c+1}(j+1))

is exact, ``O(options n w)`` a slot on stages of at most ``w <= n`` layers (the band).
:func:`best_stages` narrows ``L`` to the tail found while ``A`` stays below the best
``A + X``, which finds the least ``A + X`` under ``K``; then ``K`` to that plan's ``Y``
while it stays below the best ``A + X + Y``: the best is the optimum (or, once ``A``
reaches a caller's time to beat, none beats it). :func:`stage_terms` prices given cuts
with the same tables, so a plan's reported time is the program's value.
docs/planner.md, "The synchronous objective".
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from dreampipe.planning.costs import FloatArray
from dreampipe.planning.sync_bands import band
from dreampipe.planning.sync_bands import edge as stage_edge
from dreampipe.planning.sync_objective import Slots
from dreampipe.planning.sync_tables import StageTables

__all__ = ["Chosen", "StageTerms", "best_stages", "stage_terms", "update_time",
           "whole_block_starts"]

IntArray = npt.NDArray[np.int64]
#: One option's ``(x, g, tail, y or None, fits)`` over a slot's stages (:class:`_Slots`).
_Priced = tuple[int, FloatArray, FloatArray, FloatArray | None, npt.NDArray[np.bool_]]
_SlotPrices = tuple[slice, tuple[IntArray, ...] | None, tuple[int, ...], list[_Priced]]


@dataclass(frozen=True)
class Chosen:
    """A stage of layers ``first..last`` run as option ``option`` of the tables."""

    first: int
    last: int
    option: int


@dataclass(frozen=True)
class StageTerms:
    """One stage's terms (seconds per microbatch and per update, bytes per worker) and
    its value, its term ``g`` (inf where it does not fit)."""

    chosen: Chosen
    tau_s: float
    cut_s: float
    tail_s: float
    memory_bytes: float
    held: int
    value_s: float
    lift_s: float = 0.0


def whole_block_starts(blocks: Sequence[int | None], count: int) -> tuple[int, ...] | None:
    """Where ``count`` stages start when each holds the same number of whole blocks, as
    Megatron-LM places them: the layers before the first block (the embedding) on the
    first stage, those after the last (the head) on the last. ``blocks`` is each layer's
    block (None outside blocks); None when the blocks do not divide into ``count``."""
    starts: dict[int, int] = {}
    for i, b in enumerate(blocks):
        if b is not None:
            starts.setdefault(b, i)
    order = sorted(starts.values())
    if not order or len(order) % count:
        return None
    per = len(order) // count
    return (0, *(order[c * per] for c in range(1, count)))


class _Slots:
    """Each slot's best option for every stage of at most ``width`` layers, computed once
    per distinct slot and tail bound. Entry ``[i, k]`` is the stage of layers
    ``i..i + k`` (inf past the last layer): a stage longer than ``width`` is left out,
    which is exact where the caller knows such a stage's value to be at least the time
    to beat (:func:`best_stages`)."""

    def __init__(self, tables: StageTables, slots: Slots, memory_bytes: float | None,
                 width: int | None = None, starts: Sequence[int] | None = None) -> None:
        self.tables, self.slots, self.memory = tables, slots, memory_bytes
        n = tables.n
        self.width = n if width is None else max(1, min(n, width))
        self.rows, self.last = band(n, self.width)
        self.inside = self.rows + np.arange(self.width)[None, :] < n
        if starts is not None:  # stages only from and to these boundaries
            edge = np.zeros(n + 1, dtype=bool)
            edge[[*starts, n]] = True
            self.inside &= edge[self.rows] & edge[np.minimum(self.last + 1, n)]
        self._seen: dict[tuple[object, ...], tuple[int, FloatArray, IntArray]] = {}
        self._options: dict[tuple[object, ...], _SlotPrices] = {}
        self._cuts: dict[int, FloatArray] = {}
        self._span: dict[tuple[object, ...], tuple[int, int]] | None = None
        self._shared: dict[tuple[object, ...],
                           tuple[int, FloatArray, FloatArray, FloatArray | None]] = {}
        #: each stage's next first layer (``n + 1``, past any, where it is left out)
        self.after = np.where(self.inside, self.last + 1, n + 1)

    def _cut(self, c: int) -> FloatArray:
        if c not in self._cuts:
            last = c + 1 == self.slots.count
            self._cuts[c] = np.zeros(self.tables.n) if last else self.tables.cut(
                self.slots.blocks[c], self.slots.blocks[c + 1])
        return self._cuts[c]

    @staticmethod
    def _edge(c: int, count: int) -> bool | None:
        """Which stages slot ``c`` may take: those from layer 0 (False: the first slot,
        which holds the last's where there is one slot), those to the last layer (True:
        the last slot), or the whole band (None)."""
        return False if c == 0 else True if c == count - 1 else None

    def values(self, c: int, tail_below: float = math.inf, lift_below: float = math.inf
               ) -> tuple[int, FloatArray, IntArray]:
        """``[i - lo, k]`` for the first layers ``i`` from ``lo`` on that slot ``c`` may
        start at: its best value over the options whose tail is below ``tail_below`` and
        whose ``y`` is below ``lift_below``, and which option (the first of those with the
        least value); ``lo`` and the two (inf and 0 for the stages it may not take, and
        every stage of the rows not given)."""
        edge = self._edge(c, self.slots.count)
        slot = self._slot(c)  # slots alike price alike: a middle slot's, on all their rows
        key = (*slot, tail_below, lift_below)
        if key not in self._seen:
            if slot not in self._options:
                self._options[slot] = self._priced(c, self._cut(c), edge,
                                                   None if edge is not None else
                                                   self._spans()[slot])
            self._seen[key] = self._values(self._options[slot], tail_below, lift_below)
        lo, best, pick = self._seen[key]
        if edge is not None:
            return lo, best, pick
        first, last = self._window(c)  # the slot's own rows of those
        a, b = first - lo, max(first, last + 1) - lo
        return first, best[a:b], pick[a:b]

    def _slot(self, c: int) -> tuple[object, ...]:
        """What slot ``c``'s prices depend on: its replicas' layout, its cut, what it holds
        and which stages it may take."""
        sl = self.slots
        return (self.tables.groups(sl.blocks[c]), self._cut(c).tobytes(), sl.in_flight[c],
                self._edge(c, sl.count))

    def _spans(self) -> dict[tuple[object, ...], tuple[int, int]]:
        """Each middle slot's first layers (:meth:`_window`) joined over the slots alike,
        and over those alike but for the microbatches they hold (their terms')."""
        if self._span is None:
            self._span = {}
            for c in range(1, self.slots.count - 1):
                lo, hi = self._window(c)
                slot = self._slot(c)
                for key in (slot, slot[:2]):
                    was = self._span.get(key)
                    if was is None or was[0] > was[1]:
                        self._span[key] = (lo, hi)
                    elif lo <= hi:
                        self._span[key] = (min(was[0], lo), max(was[1], hi))
        return self._span

    def _middle_terms(self, c: int, x: int, key: tuple[object, ...]
                      ) -> tuple[int, FloatArray, FloatArray, FloatArray | None]:
        """Option ``x``'s ``g``, tail and ``y`` (None without a credit) on middle slot
        ``c``'s replicas and cut ``key``, made once over the rows of every slot alike but
        for the microbatches it holds, and the first of those rows."""
        if (*key, x) not in self._shared:
            sl = self.slots
            lo, hi = self._spans()[key]
            rows = slice(lo, max(lo, hi + 1))
            tau, tail, wgrad = (a[rows] for a in self.tables.times(x, sl.blocks[c], self.width))
            u = tau + self._cut(c)[self.last[rows]]
            lift = sl.lift(u, wgrad) if sl.credit else None
            self._shared[*key, x] = (lo, sl.value(u, wgrad), tail, lift)
        return self._shared[*key, x]

    def _values(self, prices: _SlotPrices, tail_below: float, lift_below: float
                ) -> tuple[int, FloatArray, IntArray]:
        rows, at, shape, priced = prices
        best = np.full(shape, np.inf)
        pick = np.zeros(shape, dtype=np.int64)
        for x, value, tail, lift, ok in priced:
            better = tail < tail_below
            if lift is not None:
                better &= lift < lift_below
            better &= ok
            better &= value < best  # options in order win ties
            np.copyto(best, value, where=better)
            np.copyto(pick, x, where=better)
        if at is None:  # a middle slot's rows, as priced
            return rows.start, best, pick
        lo = int(at[0].min())  # an edge slot's stages, in the rows they start at
        full = np.full((int(at[0].max()) + 1 - lo, self.width), np.inf)
        chosen = np.zeros(full.shape, np.int64)
        full[at[0] - lo, at[1]], chosen[at[0] - lo, at[1]] = best, pick
        return lo, full, chosen

    def _priced(self, c: int, cut: FloatArray, edge: bool | None,
                span: tuple[int, int] | None) -> _SlotPrices:
        """Slot ``c``'s rows, or edge stages (``at``), their shape, and each option's ``(x,
        g, tail, y, fits)`` over them, made once a slot (:meth:`values`): the bounds on
        tails and ``y`` only filter."""
        sl, tables, block, width = self.slots, self.tables, self.slots.blocks[c], self.width
        # the first slot starts at layer 0 and the last ends at the last layer: each reads
        # only those stages
        last, at, rows = self.last, None, slice(None)
        if edge is not None:
            _, last, at = stage_edge(tables.n, width, edge)
        else:  # a middle slot: only the first layers the slots around it may leave it
            assert span is not None
            lo, hi = span
            rows = slice(lo, max(lo, hi + 1))
            last = last[rows]
            key = self._slot(c)[:2]
        inside = self.inside[rows] if at is None else self.inside[at]
        after = None if at is None else cut[last]  # a middle slot's are shared
        room = None if self.memory is None else self.memory * sl.memory_share
        priced: list[_Priced] = []
        for x in range(len(tables.options)):
            ok = inside
            if room is not None:  # first: an option that fits no stage costs no times
                ok = (tables.capacity(x, room, width)[rows] if edge is None else
                      tables.edge_capacity(x, room, width, edge)) >= sl.in_flight[c]
                ok &= inside
                if not ok.any():
                    continue
            if edge is None:  # the terms the slots alike share, on this slot's rows
                first, value, tail, lift = self._middle_terms(c, x, key)
                a, b = rows.start - first, rows.stop - first
                priced.append((x, value[a:b], tail[a:b], None if lift is None else lift[a:b],
                               ok))
                continue
            tau, tail, wgrad = tables.edge_times(x, block, width, edge)
            assert after is not None
            lift = sl.lift(tau + after, wgrad) if sl.credit else None
            priced.append((x, sl.value(tau + after, wgrad), tail, lift, ok))
        return rows, at, last.shape, priced

    def _window(self, c: int) -> tuple[int, int]:
        """The first layers a middle slot ``c``'s stage may start at: after ``c`` stages of
        one to ``width`` layers, with the slots after it covering the rest (an empty
        window where ``lo > hi``)."""
        n, w, after = self.tables.n, self.width, self.slots.count - c
        return max(c, n - after * w), min(c * w, n - after)

    def terms(self, c: int, chosen: Chosen) -> StageTerms:
        """Slot ``c``'s terms for ``chosen``."""
        sl, i, j, x = self.slots, chosen.first, chosen.last, chosen.option
        if self._edge(c, sl.count) is None and j - i < self.width:  # the band it read
            taus, tails, wgrads = self.tables.times(x, sl.blocks[c], self.width)
            tau, tail, wgrad = (float(a[i, j - i]) for a in (taus, tails, wgrads))
        else:  # an edge's stage, priced as its edge prices it
            tau, tail, wgrad = self.tables.time_at(x, sl.blocks[c], i, j)
        cut = float(self._cut(c)[j])
        memory = self.tables.memory_at(x, sl.in_flight[c], i, j)
        fits = self.memory is None or self.tables.fits(
            x, sl.in_flight[c], self.memory * sl.memory_share, i, j)
        u, w = np.array([tau + cut]), np.array([wgrad])
        lift = float(sl.lift(u, w)[0])
        value = float(sl.value(u, w)[0])
        return StageTerms(chosen, tau, cut, tail, memory,
                          sl.in_flight[c], value if fits else math.inf, lift)


def update_time(terms: Sequence[StageTerms]) -> float:
    """The update's time: the pipeline's largest term, its bubble's largest ``y``, then
    the longest tail."""
    return (max(x.value_s for x in terms) + max(x.lift_s for x in terms)
            + max(x.tail_s for x in terms))


def _least_pipeline(program: _Slots, tail_below: float, lift_below: float
                    ) -> tuple[float, list[StageTerms]] | None:
    """The stages whose largest term ``g`` is least with tails below ``tail_below`` and
    ``y`` below ``lift_below``."""
    slots, n = program.slots, program.tables.n
    rest = np.full(n + 2, np.inf)
    rest[n] = 0.0
    cuts: list[tuple[int, IntArray]] = []
    for c in reversed(range(slots.count)):
        # the rows the slot may start at: no other row has a finite value
        lo, values, _ = program.values(c, tail_below, lift_below)
        hi = lo + len(values)
        cand = np.maximum(values, rest[program.after[lo:hi]])
        k = np.argmin(cand, axis=1)
        rest = np.full(n + 2, np.inf)
        rest[lo:hi] = cand[np.arange(hi - lo), k]
        cuts.append((lo, k))
    cuts.reverse()
    if not math.isfinite(float(rest[0])):
        return None
    out, i = [], 0
    for c in range(slots.count):
        lo, ks = cuts[c]
        k = int(ks[i - lo])
        option = int(program.values(c, tail_below, lift_below)[2][i - lo, k])
        out.append(program.terms(c, Chosen(i, i + k, option)))
        i += k + 1
    return float(rest[0]), out


def best_stages(tables: StageTables, slots: Slots, memory_bytes: float | None = None,
                width: int | None = None, beat: float = math.inf,
                starts: Sequence[int] | None = None
                ) -> tuple[float, list[StageTerms]] | None:
    """The cuts and options of ``slots.count`` stages (at least a layer each) whose update
    (:func:`update_time`) is least, with their terms; None when no choice fits
    ``memory_bytes`` per worker (None: no limit). Ties go to the shorter first stage,
    then the earlier option, then the longer tail found first. For a caller that only
    wants plans faster than ``beat``: stages of more than ``width`` layers are left out
    (no such stage's value may be below ``beat``), and the tails stop narrowing once the
    pipeline alone takes ``beat``; the plan returned is the optimum wherever that is
    below ``beat``, else a plan (or None). ``starts``: the only layers a stage may start
    at (:func:`whole_block_starts`), the other cuts left out."""
    if slots.count > tables.n:
        return None
    program = _Slots(tables, slots, memory_bytes, width, starts)
    best: tuple[float, list[StageTerms]] | None = None
    lift_below = math.inf
    while True:
        least: tuple[float, list[StageTerms]] | None = None  # the least A + X under K
        first: float | None = None
        bound = math.inf
        while True:
            found = _least_pipeline(program, bound, lift_below)
            if found is None:
                break
            pipeline, terms = found
            first = pipeline if first is None else first
            time = update_time(terms)
            if best is None or time < best[0]:
                best = (time, terms)
            rest = pipeline + max(x.tail_s for x in terms)
            if least is None or rest < least[0]:
                least = (rest, terms)
            bound = max(x.tail_s for x in terms)
            if bound <= 0 or pipeline >= min(best[0], beat):
                break
        if least is None or first is None or best is None:
            return best
        lift_below = max(x.lift_s for x in least[1])
        # under a lower K, A + X is at least least[0] and A at least first, so the stage
        # of the largest g = m u - (p - 1) W (W <= u / 2) has u >= first / (m - (p - 1) / 2)
        # and y = (p - 1)(u - W) >= (p - 1) u / 2
        floor = least[0] + slots.credit * first / (2 * slots.scale - slots.credit)
        if lift_below <= 0 or floor >= best[0] or first >= beat:
            return best


def stage_terms(tables: StageTables, slots: Slots, chosen: Sequence[Chosen],
                memory_bytes: float | None = None) -> list[StageTerms]:
    """The terms of given stages (one a slot, covering the layers in order), priced with
    the tables the program reads; the update takes :func:`update_time` of them."""
    if len(chosen) != slots.count or chosen[0].first != 0 or chosen[-1].last != tables.n - 1 \
            or any(b.first != a.last + 1 for a, b in itertools.pairwise(chosen)):
        raise ValueError(f"{len(chosen)} stages for {slots.count} slots over {tables.n} "
                         "layers: give one stage a slot, covering the layers in order")
    program = _Slots(tables, slots, memory_bytes)
    return [program.terms(c, x) for c, x in enumerate(chosen)]
