"""What each chunk of an interleaved worker holds: the schedule's own order, counted."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from dreampipe.planning.interleave_order import chunk_peaks, warmup
from dreampipe.planning.sync_objective import PipelineKind, slots
from dreampipe.scheduling.actions import ActionKind
from dreampipe.scheduling.interleave import interleaved_compute


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(2, 4), st.integers(1, 5))
def test_each_chunk_s_peak_is_what_the_schedule_holds(p: int, v: int, rounds: int) -> None:
    m = p * rounds
    schedule = interleaved_compute(p * v, v, 2 * m, m)  # two minibatches, flushed between
    for rank in range(p):
        held, peak = [0] * v, [0] * v
        for a in schedule.actions[rank]:
            c = a.stage // p
            held[c] += 1 if a.kind is ActionKind.FORWARD else -1
            peak[c] = max(peak[c], held[c])
        assert tuple(peak) == chunk_peaks(p, v, m)[rank]
        # the worker's warm-up is spread over its chunks: none holds all of it
        assert max(peak) <= min(m, warmup(rank, p, v, m) + 1)


def test_the_objective_holds_each_chunk_to_its_own_peak() -> None:
    # worker 0 of 8 with 3 chunks runs 30 forwards before its first backward, but its
    # chunks hold 16, 15 and 8 at most: the objective no longer charges each of them 31
    s = slots(PipelineKind.INTERLEAVED, 8, 64, 3)
    assert [s.in_flight[c] for c in (0, 8, 16)] == [16, 15, 8]
    assert [s.in_flight[c] for c in (7, 15, 23)] == list(chunk_peaks(8, 3, 64)[7])
