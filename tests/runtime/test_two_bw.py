"""PipeDream-2BW's versions: which weights each minibatch runs on, and the schedules
two versions can hold."""

from __future__ import annotations

import pytest
import torch

from dreampipe.errors import ScheduleError
from dreampipe.runtime.two_bw import TwoVersions, check_two_versions, fewest_microbatches
from dreampipe.runtime.update_actions import RankUpdates
from dreampipe.scheduling.actions import ScheduleKind
from dreampipe.scheduling.build import build_schedule

__all__: list[str] = []


def test_minibatch_k_runs_on_the_version_of_update_k_minus_one_from_the_segment_start() -> None:
    two = TwoVersions(microbatches_per_update=3)
    # the first forward of a segment fixes its base: the stage had made 5 updates
    assert [two.version(u, 5) for u in range(12)] == [5] * 6 + [6] * 3 + [7] * 3
    two.restart()
    assert two.version(0, 9) == 9
    assert two.version(7, 10) == 10


@pytest.mark.parametrize(("replicas", "fewest"),
                         [((1, 1), 1), ((1, 1, 1, 1), 3), ((2, 1), 2), ((1,) * 8, 7)])
def test_fewest_microbatches_is_the_first_whose_schedule_two_versions_hold(
    replicas: tuple[int, ...], fewest: int
) -> None:
    assert fewest_microbatches(replicas) == fewest
    check_two_versions(build_schedule(replicas, ScheduleKind.TWO_BW, 4 * fewest, fewest))
    below = fewest - max(replicas)
    if below >= 1:
        with pytest.raises(ScheduleError, match=rf"use at least {fewest} microbatches"):
            check_two_versions(build_schedule(replicas, ScheduleKind.TWO_BW, 4 * below, below))


def test_other_schedules_are_not_checked() -> None:
    check_two_versions(build_schedule((1, 1, 1, 1), ScheduleKind.PIPEDREAM, 8))


def test_a_rank_that_agrees_at_each_update_refuses_a_deferred_step() -> None:
    """A schedule built for ranks that do not agree defers 2bw's steps on a replicated
    stage; a run whose ranks agree (clipping, a loss scale, skipping) would meet the next
    minibatch's gradients at a changed loss scale, so its rank refuses that schedule."""
    deferred = build_schedule([1, 2], ScheduleKind.TWO_BW, 16, 4)
    kept = build_schedule([1, 2], ScheduleKind.TWO_BW, 16, 4, steps_agree=True)
    updates = RankUpdates(1, torch.device("cpu"), None,  # type: ignore[arg-type]
                          [], max_grad_norm=None, clip_group=None, after_step=None)
    updates.expect(deferred.actions[1], steps_agree=False)
    updates.expect(kept.actions[1], steps_agree=True)
    with pytest.raises(ScheduleError, match=r"defers a STEP past its ALLREDUCE.*steps_agree"):
        updates.expect(deferred.actions[1], steps_agree=True)


def test_a_pipeline_with_weights_tied_across_stages_keeps_its_steps() -> None:
    """Summing a tie's gradients at each step makes its ranks wait for each other, as
    clipping does: a deferred step on one of them would leave the other waiting for
    traffic sent only after that step (a hang), so such a run builds its steps in place,
    and a rank holding a tie refuses a deferred schedule."""
    from dreampipe.api.config import TrainConfig
    from dreampipe.api.pipeline_segments import Segments
    from dreampipe.planning.plan import Plan
    from dreampipe.scheduling.microbatch_layout import MicrobatchLayout
    from dreampipe.scheduling.stepping import Stepper
    from dreampipe.scheduling.updates import launched_rounds

    plan = Plan.from_config(4, [0, 2], [1, 2])
    layout = MicrobatchLayout(kind=ScheduleKind.TWO_BW, minibatch_size=16, microbatches=4)
    config = TrainConfig(schedule="2bw", microbatches=4)
    for tied in (False, True):
        schedule = Segments(plan, layout, config, 96, tied=tied).build(6)
        assert any(launched_rounds(acts) for acts in schedule.actions) is not tied
        assert (Stepper(schedule, agree_steps=True).run() == []) is tied
    updates = RankUpdates(1, torch.device("cpu"), None,  # type: ignore[arg-type]
                          [], max_grad_norm=None, clip_group=None, after_step=None)
    updates._ties = [object()]  # type: ignore[list-item]  # a rank holding a tie's copy
    deferred = Segments(plan, layout, config, 96).build(6)
    with pytest.raises(ScheduleError, match="weights tied across stages"):
        updates.expect(deferred.actions[1], steps_agree=False)
