"""epochs_factor: the epochs to target the convergence study predicts for a schedule."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dreampipe.runplan.study_epochs import ROWS, StudyRow, epochs_factor, study_advice
from dreampipe.scheduling.actions import ScheduleKind as S

__all__: list[str] = []

_ROWS = (StudyRow("a", 2, "pipedream", 3.0, 2.0, 3, "sgd"),
         StudyRow("b", 2, "pipedream", 5.0, 4.0, 3, "adam"),
         StudyRow("a", 4, "pipedream", 4.0, 4.0, 3, "sgd"),
         StudyRow("b", 4, "pipedream", math.inf, 4.0, 3, "adam"),
         StudyRow("a", 8, "pipedream", 6.0, 4.0, 3, "sgd"))


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
    or beyond the plan's, and never when the study went no deeper; pipedream on one stage
    is data parallelism."""
    got = epochs_factor(kind, stages)
    if kind is S.PIPEDREAM and stages == 1:
        assert got.factor == 1.0 and study_advice(kind, stages, "sgd") is None
        return
    mine = [r for r in ROWS if r.schedule == kind.value and r.stages >= stages]
    if not mine:
        assert math.isinf(got.factor)
        return
    depth = min(r.stages for r in mine)
    assert got.factor == max(r.factor for r in mine if r.stages == depth)


def test_an_optimizer_family_reads_its_own_workloads_where_the_study_has_them() -> None:
    assert epochs_factor(S.PIPEDREAM, 4, _ROWS, "sgd").factor == 1.0
    assert math.isinf(epochs_factor(S.PIPEDREAM, 4, _ROWS, "adam").factor)
    assert math.isinf(epochs_factor(S.PIPEDREAM, 4, _ROWS, "lion").factor)  # none: all rows
    deep = epochs_factor(S.PIPEDREAM, 8, _ROWS, "adam")  # no Adam run so deep: never
    assert math.isinf(deep.factor) and "deepest pipedream run had 4 stages, not 8" in deep.why


@pytest.mark.parametrize(("kind", "stages", "family", "warns"), [
    (S.PIPEDREAM, 4, "adam", "never reached data parallelism's target"),  # chars at 4
    (S.TWO_BW, 4, "adam", "never reached data parallelism's target (the study's gpt2 at 4"),
    (S.PIPEDREAM, 3, "adam", "never reached"),  # the 4-stage rows stand for 3
    (S.PIPEDREAM, 2, "sgd", "needed 1.50x"),  # digits at 2
    (S.PIPEDREAM, 4, "sgd", None),  # digits at 4: dp's epochs
    (S.PIPEDREAM, 2, "adam", None),  # chars at 2: 1.25x, at the bound
    (S.PIPEDREAM, 6, "sgd", "needed 2.00x"),  # the digits at 8 stand for 6
    (S.TWO_BW, 8, "sgd", "needed 1.33x"),  # digits at 8
    (S.PIPEDREAM, 9, "sgd", "the study's deepest pipedream run had 8 stages, not 9"),
    (S.PIPEDREAM, 4, "adam", "never reached"),  # chars and gpt2 at 4
    (S.FLUSH, 8, "adam", None),
    (S.PIPEDREAM, 1, "sgd", None),  # one stage: nothing stale
    (S.TWO_BW, 1, "sgd", "needed 2.00x"),  # one update behind at any depth: 2 stages' row
])
def test_the_warning_follows_the_bundled_study_s_rows(kind: S, stages: int, family: str,
                                                      warns: str | None) -> None:
    """The study's failing rows warn, its passing ones do not, and each warning names
    the fix."""
    said = study_advice(kind, stages, family)
    if warns is None:
        assert said is None
        return
    assert said is not None and warns in said
    assert said.startswith(f"{kind.value} on {stages} stages: ")
    assert "schedule='1f1b-flush'" in said and "semantics='any'" in said


@pytest.mark.parametrize(("kind", "stages", "family"), [
    (S.PIPEDREAM, 4, "adam"), (S.TWO_BW, 8, "sgd"), (S.PIPEDREAM, 9, "sgd")])
def test_a_schedule_auto_chose_with_the_study_is_told_not_to_choose_auto(
        kind: S, stages: int, family: str) -> None:
    """Where schedule="auto" weighed the study's epochs and chose the schedule, the finding
    stands and the advice to let "auto" weigh them is not given again."""
    plain = study_advice(kind, stages, family)
    said = study_advice(kind, stages, family, weighed=True)
    assert plain is not None and said is not None
    assert said.split("; ")[0] == plain.split("; ")[0]
    assert "chose it with those epochs counted" in said and "to weigh both" not in said
    assert study_advice(S.FLUSH, stages, family, weighed=True) is None
