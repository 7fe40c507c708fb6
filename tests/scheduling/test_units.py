"""UnitLayout: the one place an update is cut into scheduled units."""

from __future__ import annotations

import pytest

from dreampipe.errors import ConfigError
from dreampipe.scheduling.actions import ScheduleKind
from dreampipe.scheduling.units import UnitLayout

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
def test_units_follow_the_table(
    kind: ScheduleKind, microbatches: int, workers: int, per_update: int, size: int
) -> None:
    layout = UnitLayout(kind=kind, minibatch_size=256, microbatches=microbatches,
                        workers=workers)
    assert layout.units_per_update == per_update
    assert layout.unit_size == size
    assert layout.num_units(5) == 5 * per_update
    schedule = layout.build([workers] if kind is S.DP else [1, 1], 3)
    assert schedule.num_units == 3 * per_update
    assert schedule.units_per_update == per_update


def test_pipedream_takes_one_microbatch() -> None:
    with pytest.raises(ConfigError, match="microbatches=3 with schedule=pipedream") as info:
        UnitLayout(kind=S.PIPEDREAM, minibatch_size=32, microbatches=3)
    assert set(info.value.parameters) == {"microbatches", "schedule"}


@pytest.mark.parametrize(
    ("kind", "microbatches", "workers", "needle"),
    [
        (S.FLUSH, 4, 1, "minibatch_size=30 is not divisible by microbatches=4"),
        (S.DP, 1, 4, "4 workers x microbatches=1 = 4 units"),
    ],
)
def test_indivisible_minibatches_are_refused(
    kind: ScheduleKind, microbatches: int, workers: int, needle: str
) -> None:
    with pytest.raises(ConfigError, match=needle) as info:
        UnitLayout(kind=kind, minibatch_size=30, microbatches=microbatches, workers=workers)
    assert "minibatch_size" in info.value.parameters


@pytest.mark.parametrize("name", ["minibatch_size", "microbatches", "workers"])
def test_counts_must_be_positive(name: str) -> None:
    with pytest.raises(ConfigError, match=f"{name}=0") as info:
        UnitLayout(kind=S.FLUSH, **{name: 0})  # type: ignore[arg-type]
    assert info.value.parameters == (name,)


def test_a_layout_without_samples_counts_profiled_minibatches() -> None:
    # the simulator's dp: one whole profiled minibatch per worker per update
    dp = UnitLayout(kind=S.DP, workers=4)
    assert dp.unit_fraction == 1.0
    assert dp.updates_covering(10) == 3 and dp.num_units(3) == 12
    assert UnitLayout(kind=S.GPIPE, microbatches=4).unit_fraction == 0.25
    with pytest.raises(ConfigError, match="minibatch_size is not set"):
        _ = dp.unit_size


def test_pipedream_runs_whole_all_reduce_rounds() -> None:
    assert UnitLayout(kind=S.PIPEDREAM).whole_rounds([2, 3], 7) == 12
    assert UnitLayout(kind=S.FLUSH).whole_rounds([2, 3], 7) == 7


def test_pipedream_builds_any_number_of_steps() -> None:
    layout = UnitLayout(kind=S.PIPEDREAM)
    schedule = layout.build([2, 3], 7)  # 7 is not whole rounds of 2 and 3: the last is partial
    assert schedule.num_units == 7
    assert layout.whole_rounds([2, 3], 7) == 12  # what training runs instead
