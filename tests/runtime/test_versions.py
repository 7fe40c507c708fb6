"""WeightVersions alone: holding and freeing, copy-on-write, vertical sync's floor."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from dreampipe.errors import ScheduleError
from dreampipe.runtime.versions import Version, WeightVersions

__all__: list[str] = []


class _Recorded:
    """WeightVersions over two parameters, with the versions it drops and the hooks run."""

    def __init__(self) -> None:
        self.params = [nn.Parameter(torch.arange(4.0)), nn.Parameter(torch.ones(2, 2))]
        self.dropped: list[int] = []
        self.leaves: list[int] = []
        self.versions = WeightVersions(self.params, stage=2, on_leaf=self._leaf,
                                       on_drop=self._drop)

    def _leaf(self, index: int, _leaf: Tensor) -> None:
        self.leaves.append(index)

    def _drop(self, v: Version) -> None:
        self.dropped.append(v.number)

    def update(self) -> None:
        """What a stage's step does to its versions around the optimizer's change."""
        self.versions.retire()
        with torch.no_grad():
            for p in self.params:
                p.add_(1.0)
        self.versions.advance()


def test_microbatches_on_the_live_weights_share_one_version_until_released() -> None:
    r = _Recorded()
    a, b = r.versions.acquire(None), r.versions.acquire(None)
    assert a is b and a.refs == 2 and a.live and len(r.versions) == 1
    assert a.tensors[0].data_ptr() == r.params[0].data_ptr()
    r.versions.release(a)
    r.versions.release(b)
    assert len(r.versions) == 1  # the live version stays until an update retires it
    r.update()
    assert len(r.versions) == 0 and r.dropped == [] and r.versions.version == 1
    assert r.versions.peak == 1


def test_an_update_copies_the_live_weights_only_while_a_microbatch_holds_them() -> None:
    r = _Recorded()
    free = r.versions.acquire(None)
    r.versions.release(free)
    before = r.params[0].data_ptr()
    r.update()
    assert r.params[0].data_ptr() == before  # nobody held version 0: no copy
    held = r.versions.acquire(None)
    assert held.number == 1
    r.update()
    assert r.params[0].data_ptr() != held.tensors[0].data_ptr()  # the live weights moved
    assert not held.live and torch.equal(held.tensors[0], torch.arange(4.0) + 1)
    assert torch.equal(r.params[0].detach(), torch.arange(4.0) + 2)
    assert sorted(r.versions) == [1] and r.versions[1] is held
    r.versions.release(held)
    assert r.dropped == [1] and len(r.versions) == 0


def test_vertical_sync_keeps_versions_from_the_floor_on() -> None:
    r = _Recorded()
    for number in range(3):
        r.versions.note(0)
        r.versions.release(r.versions.acquire(0 if number == 0 else None))
        r.update()
    assert sorted(r.versions) == [0, 1, 2] and r.dropped == []
    assert r.versions.peak == 3
    r.versions.note(2)
    assert sorted(r.versions) == [2] and r.dropped == [0, 1]
    with pytest.raises(ScheduleError, match="stage 2 has no weight version 1"):
        r.versions.acquire(1)


def test_a_new_segment_drops_the_versions_vertical_sync_kept() -> None:
    r = _Recorded()
    r.versions.note(0)
    r.versions.release(r.versions.acquire(0))
    r.update()
    r.versions.note(1)
    r.versions.release(r.versions.acquire(1))
    r.update()
    assert sorted(r.versions) == [1]  # kept from the floor on, for microbatches to come
    r.versions.restart()  # drained: none will come
    assert len(r.versions) == 0 and r.dropped == [0, 1]
    assert r.versions.acquire(None).number == 2


def test_a_version_held_by_a_microbatch_outlives_the_floor() -> None:
    r = _Recorded()
    r.versions.note(0)
    held = r.versions.acquire(0)
    r.update()
    r.versions.note(1)
    assert sorted(r.versions) == [0]  # microbatch still running on version 0
    r.versions.release(held)
    assert r.dropped == [0] and len(r.versions) == 0


def test_resumed_numbers_and_the_leaf_hooks() -> None:
    r = _Recorded()
    r.versions.resume_at(7)
    v = r.versions.acquire(None)
    assert v.number == 7 and sorted(r.versions) == [7]
    (v.tensors[0].sum() + v.tensors[1].sum()).backward()
    assert sorted(r.leaves) == [0, 1]


def _predicting() -> _Recorded:
    r = _Recorded()
    r.versions.predict = True
    return r


def test_prediction_extrapolates_a_version_by_the_update_that_made_it() -> None:
    r = _predicting()
    first = r.versions.acquire(None, update=1)  # version 0: made before the segment
    assert first.ahead == 0 and first.live
    r.versions.release(first)
    r.update()  # +1 on every weight
    with torch.no_grad():
        r.params[0].mul_(2.0)  # version 1 is then 2 * (w0 + 1) on the first parameter
    w1 = [p.detach().clone() for p in r.params]
    two = r.versions.acquire(None, update=3)  # runs on version 1, its gradient updates 3
    assert two.ahead == 2 and not two.live and two.key == (1, 2)
    torch.testing.assert_close(two.tensors[1], w1[1] + 2 * 1.0, rtol=0, atol=0)
    # the change is taken after the update: ``advance`` sees the live weights as they are
    assert two.tensors[0].data_ptr() != r.params[0].data_ptr()
    same = r.versions.acquire(None, update=3)
    assert same is two and two.refs == 2  # microbatches on one (version, ahead) share it
    exact = r.versions.acquire(None, update=1)  # its gradient updates version 1 itself
    assert exact.key == (1, 0) and exact.live
    assert r.versions.peak == 2


def test_a_prediction_is_freed_with_its_gradients_harvested_when_released() -> None:
    r = _predicting()
    r.update()
    v = r.versions.acquire(None, update=2)
    (v.tensors[0].sum() * 3).backward()
    assert r.leaves == [0]
    r.versions.release(v)
    assert r.dropped == [1] and len(r.versions) == 0


def test_prediction_starts_afresh_with_each_segment() -> None:
    r = _predicting()
    r.update()
    r.versions.restart()  # a new segment from version 1: its change is not used
    v = r.versions.acquire(None, update=1)
    assert v.ahead == 0 and v.live


def _stash_a_dtensor(rank: int, world: int, _arg: None) -> tuple[float, float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from dreampipe.api.group import init_process_group

    init_process_group(30.0)
    mesh = init_device_mesh("cpu", (world,))
    p = nn.Parameter(distribute_tensor(torch.ones(2, 4), mesh, [Shard(1)]))
    versions = WeightVersions([p], stage=0, on_leaf=lambda *_: None, on_drop=lambda _: None)
    held = versions.acquire(None)
    versions.retire()  # a microbatch still runs on version 0: the live weights move to a copy
    with torch.no_grad():
        p.add_(1.0)
    versions.advance()
    out = float(held.tensors[0].to_local()[0, 0]), float(p.to_local()[0, 0])
    torch.distributed.destroy_process_group()
    return out


def test_a_split_stages_version_keeps_its_values_when_the_live_dtensor_steps() -> None:
    from dreampipe.runtime.processes import run_processes

    stashed, live = run_processes(_stash_a_dtensor, 1, None, deadline_s=60.0)[0]
    assert (stashed, live) == (1.0, 2.0)
