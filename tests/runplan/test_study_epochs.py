"""epochs_factor: the epochs to target the convergence study predicts for a schedule."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from dreampipe.runplan.study_epochs import ROWS, StudyRow, epochs_factor
from dreampipe.scheduling.actions import ScheduleKind as S

__all__: list[str] = []

_ROWS = (StudyRow("a", 2, "pipedream", 3.0, 2.0, 3), StudyRow("b", 2, "pipedream", 5.0, 4.0, 3),
         StudyRow("a", 4, "pipedream", 4.0, 4.0, 3), StudyRow("b", 4, "pipedream", math.inf,
                                                               4.0, 3),
         StudyRow("a", 8, "pipedream", 6.0, 4.0, 3))


def test_synchronous_schedules_need_data_parallelism_s_epochs() -> None:
    for kind in (S.FLUSH, S.GPIPE, S.ZB_H1, S.ZB_H2, S.INTERLEAVED, S.ZBV, S.DUALPIPEV):
        assert epochs_factor(kind, 7, _ROWS).factor == 1.0


def test_the_worst_workload_at_the_nearest_depth_not_shallower() -> None:
    two = epochs_factor(S.PIPEDREAM, 2, _ROWS)
    assert two.factor == 1.5 and "the study's a at 2 stages" in two.why
    assert math.isinf(epochs_factor(S.PIPEDREAM, 3, _ROWS).factor)  # 4's row: b never
    assert epochs_factor(S.PIPEDREAM, 5, _ROWS).factor == 1.5  # 8's row
    deep = epochs_factor(S.PIPEDREAM, 9, _ROWS)
    assert math.isinf(deep.factor) and "deepest pipedream run had 8 stages, not 9" in deep.why
    assert math.isinf(epochs_factor(S.TWO_BW, 2, _ROWS).factor)  # no 2bw row at all


@given(st.integers(1, 16), st.sampled_from([S.PIPEDREAM, S.TWO_BW]))
def test_the_bundled_rows_give_the_worst_of_the_nearest_depth_or_never(stages: int, kind: S
                                                                      ) -> None:
    """On the bundled study: the largest factor of the rows at the shallowest depth at
    or beyond the plan's, and never when the study went no deeper."""
    got = epochs_factor(kind, stages)
    mine = [r for r in ROWS if r.schedule == kind.value and r.stages >= stages]
    if not mine:
        assert math.isinf(got.factor)
        return
    depth = min(r.stages for r in mine)
    assert got.factor == max(r.factor for r in mine if r.stages == depth)
