"""ZeRO's levels in the simulator's costs (:mod:`dreampipe.simulation.zero_costs`)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dreampipe.errors import ScheduleError
from dreampipe.scheduling.actions import ScheduleKind
from dreampipe.scheduling.build import build_schedule
from dreampipe.simulation.action_costs import SimCosts
from dreampipe.simulation.simulator import simulate_schedule
from dreampipe.simulation.zero_costs import with_zero

S = ScheduleKind


def _costs(allreduce: float, delay: float = 0.0) -> SimCosts:
    return SimCosts(forward_s=(1.0, 1.0), backward_s=(2.0, 2.0), allreduce_s=(allreduce, 0.0),
                    allreduce_delay_s=(delay, 0.0), weight_grad_s=(0.8, 0.8))


@settings(max_examples=40, deadline=None)
@given(kind=st.sampled_from([S.FLUSH, S.GPIPE, S.ZB_H1, S.ZB_H2]), per=st.integers(1, 6),
       level=st.integers(0, 3), allreduce=st.floats(0.0, 6.0), delay=st.floats(0.0, 2.0))
def test_levels_add_the_reduce_scatters_and_gathers_a_run_makes(
    kind: ScheduleKind, per: int, level: int, allreduce: float, delay: float
) -> None:
    sched = build_schedule([2, 1], kind, 2 * per, per, zero=[level, level])
    base = _costs(allreduce, delay)
    got = with_zero(base, sched, [level, level])
    assert got.forward_s[1] == base.forward_s[1] and got.backward_s[1] == base.backward_s[1]
    assert got.step_s[0] == base.step_s[0] + (base.gather_s[0] if level in (1, 2) else 0.0)
    if level < 2:
        assert got == base if level == 0 else got.backward_s == base.backward_s
        return
    assert got.allreduce_s[0] == 0.0  # the round's ALLREDUCE has nothing left to send
    finishes = got.weight_grad_s[0] if kind.splits_backward else got.backward_s[0] - delay
    assert finishes >= allreduce / 2 - 1e-12  # the last reduce-scatter is waited for
    per_use = level == 3 and per % 2 == 0
    assert got.forward_s[0] == base.forward_s[0] + (base.gather_s[0] if per_use else 0.0)
    assert got.gather_s[0] == (0.0 if per_use else base.gather_s[0])
    simulate_schedule(sched, got, record_events=False)  # the simulator takes them


def test_free_communication_costs_nothing_at_any_level() -> None:
    sched = build_schedule([2, 1], S.FLUSH, 8, 4, zero=[3, 3])
    base = _costs(0.0)
    plain = simulate_schedule(build_schedule([2, 1], S.FLUSH, 8, 4), base,
                              record_events=False).makespan_s
    for level in (2, 3):
        sharded = build_schedule([2, 1], S.FLUSH, 8, 4, zero=[level, level])
        assert simulate_schedule(sharded, with_zero(base, sharded, [level, level]),
                                 record_events=False).makespan_s == pytest.approx(plain)
    with pytest.raises(ScheduleError, match=r"1 ZeRO levels for 2 stages"):
        with_zero(base, sched, [3])


def test_a_slow_link_makes_every_level_2_backward_wait_for_its_reduce_scatter() -> None:
    """4 microbatches on 2 replicas: each backward ends with its microbatch's reduce-scatter
    (half the all-reduce, from its first bucket on), and the round's end waits for none."""
    slow = _costs(8.0, delay=0.5)
    sharded = build_schedule([2, 1], S.FLUSH, 4, 4, zero=[2, 2])
    got = with_zero(slow, sharded, [2, 2])
    assert got.backward_s[0] == 0.5 + 4.0 and got.allreduce_s[0] == 0.0
    result = simulate_schedule(sharded, got, record_events=True)
    backwards = [e for e in result.events if e.rank == 0 and e.kind.value == "B"]
    assert [round(e.end_s - e.start_s, 9) for e in backwards] == [4.5, 4.5]
