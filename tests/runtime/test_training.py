"""A real run: the cnn learns the digits with PipeDream on 2 ranks, one Pipeline each."""

from __future__ import annotations

import pytest

from dreampipe.commands.train_run import TrainJob, train_local
from dreampipe.planning.plan import Plan
from dreampipe.scheduling.actions import ActionKind, ScheduleKind

from .runs import train_run

__all__: list[str] = []


@pytest.mark.timeout(120)
def test_pipedream_learns_digits_and_records_every_action() -> None:
    steps = 150
    cfg = train_run(
        model="cnn", model_kwargs=(("image_size", 8),), plan=Plan.from_config(5, [0, 2], [1, 1]),
        schedule=ScheduleKind.PIPEDREAM, minibatch_size=64, steps=steps, lr=0.05, momentum=0.9,
        dataset="digits", record_events=True, progress=True, timeout_s=30.0,
    )
    result = train_local(TrainJob(cfg), deadline_s=100.0)
    assert result.accuracy is not None and result.accuracy > 0.85
    assert len(result.losses) == steps
    assert sum(result.losses[-5:]) < sum(result.losses[:5])
    assert result.samples_per_s > 0
    for rank in (0, 1):
        done = [e for e in result.events if e.rank == rank and e.kind is ActionKind.BACKWARD]
        assert sorted(e.microbatch for e in done) == list(range(steps))
        steps_done = [e for e in result.events if e.rank == rank and e.kind is ActionKind.STEP]
        assert len(steps_done) == steps
