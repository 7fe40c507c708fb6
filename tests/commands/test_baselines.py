"""``commands.baselines``: what each PyTorch baseline runs on, how it is started, and a real
run of the two baselines nothing else in the fast suite starts."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dreampipe.commands.baselines as baselines
from dreampipe.commands.baselines import Baseline, baseline_microbatch_size, run_baseline
from dreampipe.commands.workloads import Workload, WorkloadKind
from dreampipe.errors import BaselineError
from dreampipe.runtime.processes import HeapPolicy

__all__: list[str] = []

_WORKS = [Workload.of(k) for k in WorkloadKind]
_SHARE = {Baseline.TORCH_1F1B_BIG, Baseline.DDP, Baseline.DDP_NO_ALLREDUCE}
_SINGLE = {Baseline.SINGLE_1THREAD, Baseline.SINGLE_2THREADS}
_DDP = {Baseline.DDP, Baseline.DDP_NO_ALLREDUCE}
_TORCH_PIPELINES = [b for b in Baseline if b not in _SINGLE | _DDP]
_V = {Baseline.TORCH_ZBV, Baseline.TORCH_DUALPIPEV}
_TWO_A_RANK = {Baseline.TORCH_INTERLEAVED} | _V


@pytest.mark.parametrize("work", _WORKS, ids=[w.kind.value for w in _WORKS])
def test_a_baselines_microbatch_is_a_microbatch_a_workers_share_or_the_whole_update(
    work: Workload,
) -> None:
    for which in Baseline:
        want = (work.batch if which in _SINGLE else work.batch // 2 if which in _SHARE
                else work.batch // work.microbatches)
        assert baseline_microbatch_size(which, work) == want, which


def _launched(monkeypatch: pytest.MonkeyPatch, which: Baseline, work: Workload
              ) -> dict[str, Any]:
    """What ``run_baseline`` hands the launcher for ``which``."""
    seen: dict[str, Any] = {}

    def launch(fn: Any, world: int, arg: Any, **kw: Any) -> float:
        seen.update(fn=fn, world=world, arg=arg, **kw)
        return 42.0

    monkeypatch.setattr(baselines, "run_ranks", launch)
    assert run_baseline(which, work, timeout_s=17.0) == 42.0
    return seen


@pytest.mark.parametrize("which", list(Baseline), ids=[b.value for b in Baseline])
def test_each_baseline_starts_as_the_bench_says(monkeypatch: pytest.MonkeyPatch,
                                                which: Baseline) -> None:
    work = Workload(steps=3, warmup=1)
    call = _launched(monkeypatch, which, work)
    assert call["world"] == (1 if which in _SINGLE else 2)
    assert call["threads"] == (2 if which is Baseline.SINGLE_2THREADS else 1)
    stock = which is Baseline.TORCH_1F1B_STOCK
    assert call["heap"] is (HeapPolicy.STOCK if stock else HeapPolicy.KEEP_FREED)
    assert (call["error"], call["timeout_s"]) == (BaselineError, 17.0)
    arg = call["arg"]
    if which in _SINGLE:
        assert arg is work
    elif which in _DDP:
        assert arg == (work, which is Baseline.DDP), "only ddp all-reduces"
    else:
        assert (arg.work, arg.which, arg.microbatch) == (work, which,
                                                          baseline_microbatch_size(which, work))
        v = 2 if which in _TWO_A_RANK else 1
        assert arg.virtual_stages == v
        assert [arg.stages(r, 2) for r in (0, 1)] == (
            [(0, 3), (1, 2)] if which in _V else [(0, 2), (1, 3)] if v == 2 else [(0,), (1,)]
        ), "the V: chunks r and 3 - r on rank r; the loop: r and r + 2"


@settings(max_examples=40, deadline=None)
@given(which=st.sampled_from(_TORCH_PIPELINES), kind=st.sampled_from(list(WorkloadKind)),
       n=st.integers(0, 500))
def test_a_torch_pipeline_times_the_fewest_updates_that_train_the_workloads_samples(
    which: Baseline, kind: WorkloadKind, n: int,
) -> None:
    work = Workload.of(kind)
    with pytest.MonkeyPatch.context() as patch:
        run = _launched(patch, which, work)["arg"]
    assert run.update == run.microbatch * work.microbatches
    updates = run.updates(n)
    assert updates * run.update >= n * work.batch
    assert updates == 0 or (updates - 1) * run.update < n * work.batch


def test_the_zero_bubble_interleaved_and_v_shaped_baselines_train() -> None:
    """Each a real step of ``torch.distributed.pipelining`` on 2 processes, on the fewest
    samples that fill the schedules (a microbatch of 2)."""
    work = Workload(batch=16, steps=1, warmup=0)
    for which in (Baseline.TORCH_ZB, Baseline.TORCH_INTERLEAVED, Baseline.TORCH_ZBV,
                  Baseline.TORCH_DUALPIPEV):
        assert run_baseline(which, work, timeout_s=60.0) > 0, which
