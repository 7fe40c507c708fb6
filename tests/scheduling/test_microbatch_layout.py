"""MicrobatchLayout: the one place an update is cut into scheduled microbatches."""

from __future__ import annotations

import re

import pytest

from dreampipe.errors import ConfigError
from dreampipe.scheduling.actions import ScheduleKind
from dreampipe.scheduling.microbatch_layout import MicrobatchLayout

S = ScheduleKind


@pytest.mark.parametrize(
    ("kind", "microbatches", "workers", "per_update", "size"),
    [
        (S.PIPEDREAM, 1, 4, 1, 256),
        (S.FLUSH, 8, 4, 8, 32),
        (S.GPIPE, 8, 4, 8, 32),
        (S.NAIVE, 2, 1, 2, 128),
        (S.DP, 1, 2, 2, 128),
        (S.DP, 2, 4, 8, 32),
    ],
)
def test_microbatches_follow_the_table(
    kind: ScheduleKind, microbatches: int, workers: int, per_update: int, size: int
) -> None:
    layout = MicrobatchLayout(kind=kind, minibatch_size=256, microbatches=microbatches,
                              workers=workers)
    assert layout.microbatches_per_update == per_update
    assert layout.microbatch_size == size
    assert layout.num_microbatches(5) == 5 * per_update
    schedule = layout.build([workers] if kind is S.DP else [1, 1], 3)
    assert schedule.num_microbatches == 3 * per_update
    assert schedule.microbatches_per_update == per_update


def test_pipedream_takes_one_microbatch() -> None:
    with pytest.raises(ConfigError, match="microbatches=3 with schedule=pipedream") as info:
        MicrobatchLayout(kind=S.PIPEDREAM, minibatch_size=32, microbatches=3)
    assert set(info.value.parameters) == {"microbatches", "schedule"}


@pytest.mark.parametrize(
    ("kind", "microbatches", "workers", "needle"),
    [
        (S.FLUSH, 4, 1, "minibatch_size=30 is not divisible by microbatches=4"),
        (S.DP, 1, 4, "4 workers x microbatches=1 = 4 microbatches"),
    ],
)
def test_indivisible_minibatches_are_refused(
    kind: ScheduleKind, microbatches: int, workers: int, needle: str
) -> None:
    with pytest.raises(ConfigError, match=needle) as info:
        MicrobatchLayout(kind=kind, minibatch_size=30, microbatches=microbatches, workers=workers)
    assert "minibatch_size" in info.value.parameters


@pytest.mark.parametrize("name", ["minibatch_size", "microbatches", "workers"])
def test_counts_must_be_positive(name: str) -> None:
    with pytest.raises(ConfigError, match=f"{name}=0") as info:
        MicrobatchLayout(kind=S.FLUSH, **{name: 0})  # type: ignore[arg-type]
    assert info.value.parameters == (name,)


def test_a_layout_without_samples_counts_profiled_minibatches() -> None:
    # the simulator's dp: one whole profiled minibatch per worker per update
    dp = MicrobatchLayout(kind=S.DP, workers=4)
    assert dp.microbatch_fraction == 1.0
    assert dp.updates_covering(10) == 3 and dp.num_microbatches(3) == 12
    assert MicrobatchLayout(kind=S.GPIPE, microbatches=4).microbatch_fraction == 0.25
    with pytest.raises(ConfigError, match="minibatch_size is not set"):
        _ = dp.microbatch_size


def test_pipedream_runs_whole_all_reduce_rounds() -> None:
    assert MicrobatchLayout(kind=S.PIPEDREAM).whole_rounds([2, 3], 7) == 12
    assert MicrobatchLayout(kind=S.FLUSH).whole_rounds([2, 3], 7) == 7


def test_pipedream_builds_any_number_of_steps() -> None:
    layout = MicrobatchLayout(kind=S.PIPEDREAM)
    schedule = layout.build([2, 3], 7)  # 7 is not whole rounds of 2 and 3: the last is partial
    assert schedule.num_microbatches == 7
    assert layout.whole_rounds([2, 3], 7) == 12  # what training runs instead


@pytest.mark.parametrize(("kind", "workers", "microbatches"), [(S.FLUSH, 1, 4), (S.DP, 2, 4),
                                                               (S.DP, 3, 4)])
def test_the_counts_an_indivisible_minibatch_suggests_divide_it(
    kind: ScheduleKind, workers: int, microbatches: int
) -> None:
    """dp's count is per worker: what the message offers must be whole on every worker."""
    with pytest.raises(ConfigError) as info:
        MicrobatchLayout(kind=kind, minibatch_size=10, microbatches=microbatches,
                         workers=workers)
    said = str(info.value).split("per update")[1]
    offered = [int(n) for n in re.findall(r"\d+", said)]
    assert (offered != []) == (10 % workers == 0)
    for n in offered:
        MicrobatchLayout(kind=kind, minibatch_size=10, microbatches=n, workers=workers)
