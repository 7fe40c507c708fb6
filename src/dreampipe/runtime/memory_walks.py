"""Walks along one rank's actions, and along a stage's backward: what the schedule's
order and the layers' order add to, or take from, the peak that
:func:`~dreampipe.runtime.memory.predict_memory`'s formula counts (the most microbatches
in flight, gradients made and freed at each step, microbatches waiting for their ``W``,
one backward's tensors layer by layer; docs/design.md §5.4)."""

from __future__ import annotations

from dreampipe.planning.memory_terms import input_copies
from dreampipe.planning.plan import Stage
from dreampipe.profiling.graph import LayerGraph
from dreampipe.runtime.buckets import round_ends
from dreampipe.scheduling.actions import Action, ActionKind, Schedule
from dreampipe.scheduling.updates import launched_rounds
from dreampipe.scheduling.weight_versions import peak_in_flight, release_kind

__all__ = ["by_stage", "gradients_later", "most_in_flight", "waiting_bytes", "walk_saved"]


def by_stage(schedule: Schedule) -> list[tuple[int, tuple[Action, ...]]]:
    """Each rank's actions of each of its stages (interleaved ranks run several)."""
    out = []
    for actions in schedule.actions:
        mine: dict[int, list[Action]] = {}
        for a in actions:
            mine.setdefault(a.stage, []).append(a)
        out += [(stage, tuple(acts)) for stage, acts in mine.items()]
    return out


def gradients_later(actions: tuple[Action, ...], kept: int, gradients: int,
                    buckets: int = 0, stage: int = 0) -> int:
    """What the formula counts beyond one rank's peak by holding the stage's
    ``gradients`` beside its most microbatches in flight (``kept`` bytes each): a rank
    frees its gradients at each ``STEP`` and makes them again in the update's first
    backward (its ``W`` under a split backward), which frees that microbatch's tensors
    as it makes them, but for a ``W`` after the first stage, which holds the graph ``B``
    kept until it ends (:mod:`~dreampipe.runtime.split_backward`). Along the actions:
    after a forward, the microbatches in flight and the gradients if made; in a
    backward, the others in flight and that microbatch's tensors beside the gradients,
    or the larger of the two in the update's first; after a backward that ends an
    all-reduce round, the others and the gradients beside ``buckets`` bytes more (their
    flat copies, made as the last gradients are, once that microbatch's tensors are
    freed, less what the formula's peak holds besides; :mod:`~dreampipe.runtime.buckets`);
    from an all-reduce a deferred ``STEP`` leaves in flight to that step, its gradients
    and buckets beside all of that, the next update's gradients made anew.
    Negative where the buckets raise the peak beyond the formula's."""
    release = release_kind(actions)
    holds = release is ActionKind.WEIGHT and stage > 0
    ends = round_ends(actions) if buckets else frozenset()
    launched = launched_rounds(actions)
    flight = most_flight = peak = away = 0
    made = False
    for a in actions:
        if a.kind is ActionKind.FORWARD:
            flight += 1
            most_flight = max(most_flight, flight)
            peak = max(peak, away + kept * flight + (gradients if made else 0))
        elif a.kind is release:
            others = away + kept * (flight - 1)
            both = made or holds
            peak = max(peak, others + (kept + gradients if both else max(kept, gradients)))
            if a.microbatch in ends:
                peak = max(peak, others + gradients + buckets)
            flight -= 1
            made = True
        elif a.kind is ActionKind.ALLREDUCE and (a.stage, a.microbatch) in launched:
            away, made = gradients + buckets, False
        elif a.kind is ActionKind.STEP:
            if (a.stage, a.microbatch) in launched:
                away = 0
            else:
                made = False
    return kept * most_flight + gradients - peak


def waiting_bytes(actions: tuple[Action, ...], graph: LayerGraph, st: Stage,
                  working: int = 0, own: int | None = None) -> int:
    """What microbatches waiting for their ``W`` hold beyond the formula's peak: the
    stage's kept tensors of its most microbatches in flight and one backward's
    ``working`` set. Along one rank's actions, the kept tensors (and input) of those in
    flight and what ``B`` recorded for those waiting
    (:attr:`~dreampipe.profiling.graph.Layer.recorded_bytes`), and in a ``B`` its working
    set beside the others waiting: it makes its recorded gradients, which the working
    set holds until it ends. ``B`` drops the stage's output, and on the last stage the
    loss with it: one waiting there no longer holds what the loss saved
    (:attr:`~dreampipe.profiling.graph.Layer.loss_bytes`). ``own``: what a microbatch
    keeps until its ``B`` where blocks are recomputed (their inputs only), the stage's
    input aside; its ``B`` computes them again, and they stay, for its ``W``, until then."""
    if release_kind(actions) is not ActionKind.WEIGHT:
        return 0
    layers = graph.layers[st.first : st.last + 1]
    received = graph.cut_bytes()[st.first] + input_copies(graph)[st.first]  # and its copy
    kept = sum(x.stash_bytes for x in layers) + received
    recorded = sum(x.recorded_bytes or 0 for x in layers)
    if st.last == len(graph.layers) - 1:
        recorded -= graph.layers[-1].loss_bytes or 0
    before = kept if own is None else own + received  # until its B

    def held(flight: int, waiting: int) -> int:
        return before * (flight - waiting) + (kept + recorded) * waiting

    flight = waiting = most = top = 0
    for a in actions:
        if a.kind is ActionKind.BACKWARD:
            most = max(most, held(flight, waiting) + working)
        flight += (a.kind is ActionKind.FORWARD) - (a.kind is ActionKind.WEIGHT)
        waiting += (a.kind is ActionKind.BACKWARD) - (a.kind is ActionKind.WEIGHT)
        most, top = max(most, held(flight, waiting)), max(top, flight)
    return max(0, most - before * top - working)


def walk_saved(graph: LayerGraph, st: Stage, stage: int, recomputed: list[int],
               in_flight: int) -> tuple[int, int]:
    """What :meth:`~dreampipe.planning.costs.RangeCosts.memory` counts beyond the stage's
    backward walked layer by layer, last first (docs/design.md §5.4).

    The formula holds every layer's kept tensors of each microbatch in flight and the
    largest layer's working set. A recomputed block keeps its input only (none of its own
    when it is the stage's first layer: the stage's input), and its backward holds its
    tensors again. Walking one backward, at layer ``l`` the layers up to ``l`` still keep
    theirs, ``l`` holds its working set, and each later layer has freed its tensors but,
    after the first stage, what its deferred Linear weight gradients hold until the
    stage's backward ends (:attr:`~dreampipe.profiling.graph.Layer.deferred_bytes`);
    ``l`` itself holds its working set or, where more, the output gradients its Linears'
    deferred weight gradients keep (:attr:`~dreampipe.profiling.graph.Layer.recorded_bytes`:
    its backward makes them; their inputs are its kept tensors). The
    peak of that walk replaces the formula's one backward. Returns the difference and
    what one microbatch in flight keeps."""
    span = range(st.first, st.last + 1)
    layers = [graph.layers[i] for i in span]
    kept = [float(x.stash_bytes) for x in layers]
    cuts = graph.cut_bytes()
    own = [(0.0 if i == st.first else float(cuts[i])) if i in recomputed else k
           for i, k in zip(span, kept, strict=True)]
    after = [float(x.deferred_bytes or 0) if stage > 0 else 0.0 for x in layers]
    outputs = [float(x.recorded_bytes or 0) if stage > 0 else 0.0 for x in layers]
    work = [float(x.working_bytes) for x in layers]
    walk = max(sum(own[: n + 1]) + (kept[n] - own[n]) + sum(after[n + 1:])
               + max(work[n], outputs[n]) for n in range(len(layers)))
    formula = sum(kept) * in_flight + max(work)
    return round(formula - (sum(own) * (in_flight - 1) + walk)), round(sum(own))


def most_in_flight(schedule: Schedule, stages: int) -> list[int]:
    """Each stage's most microbatches in flight on any of its ranks."""
    flight = [0] * stages
    for stage, actions in by_stage(schedule):
        flight[stage] = max(flight[stage], peak_in_flight(actions))
    return flight
