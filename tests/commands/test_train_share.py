"""``commands.train_share``: rank 0's plan and chosen schedule reach the other ranks exactly,
through a store that stands in for torchrun's agent store; rank 0's failure reaches them as a
timeout that points at rank 0."""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from dreampipe.commands.train_share import share_plan, torchrun_world
from dreampipe.errors import PlanError
from dreampipe.planning.plan import Heuristic, Plan, Stage
from dreampipe.runtime.processes import run_processes
from dreampipe.scheduling.actions import ScheduleKind

__all__: list[str] = []

_DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def agent_store() -> Iterator[Any]:
    """A master TCP store on 127.0.0.1 and a free port, as torchrun's agent holds one."""
    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    yield store
    del store  # the server stops with its last reference


def _agent_env(port: int, run_id: str, restart: int = 0) -> dict[str, str]:
    return {"TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": run_id,
            "TORCHELASTIC_RESTART_COUNT": str(restart)}


def _rich_plan(compute: float = 0.125, gap: float = 0.1) -> Plan:
    """A plan whose every field is set, so a field lost on the way shows."""
    stages = (
        Stage(first=0, last=1, replicas=2, ranks=(0, 1), compute_s=compute, comm_s=0.01,
              allreduce_s=0.02, memory_bytes=123_456, forward_s=compute / 3, workers=(4, 6),
              allreduce_delay_s=0.005, in_flight=3),
        Stage(first=2, last=3, replicas=1, ranks=(2,), compute_s=0.2, comm_s=0.01,
              memory_bytes=7, forward_s=0.05, workers=(9,), in_flight=1, recompute=True),
    )
    return Plan(stages=stages, num_layers=4, batch_size=32, model="mlp", topology="2x8",
                time_per_minibatch_s=0.1 + 1 / 3, baselines_s={"dp": 0.5, "straight": 0.4},
                layer_names=("fc0", "fc1", "fc2", "fc3"), optimality_gap=gap,
                heuristics=(Heuristic.LAYER_BLOCKS,))


# ---- in this process: the rules of the exchange ------------------------------------------

def test_torchrun_world_reads_rank_and_world_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert torchrun_world() is None
    monkeypatch.setenv("RANK", "3")
    assert torchrun_world() == (3, 4)


def test_sharing_without_an_agent_store_says_what_to_give_instead(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    with pytest.raises(PlanError, match=r"no torchrun agent store.*a plan file, or stages"):
        share_plan(_rich_plan(), 1.0)


#: Seconds a read in this process may wait: above 5 s, as torch's client may spend 5 s on one
#: connection in a few dozen (the stores here never make a rank wait that long).
_IN_PROCESS_S = 30.0


@pytest.mark.parametrize(("compute", "gap", "chosen"), [
    (0.125, 0.1, None),
    (1 / 3, 0.0, (ScheduleKind.ZB_H1, 4)),
    (2.0**-40, 7.5, (ScheduleKind.PIPEDREAM, 1)),
], ids=["no-choice", "zb-h1", "tiny-time"])
def test_the_plan_and_choice_read_back_are_exactly_those_published(
    agent_store: Any, monkeypatch: pytest.MonkeyPatch, compute: float, gap: float,
    chosen: tuple[ScheduleKind, int] | None,
) -> None:
    plan = _rich_plan(compute, gap)
    for key, value in _agent_env(agent_store.port, f"exact-{compute!r}-{gap!r}").items():
        monkeypatch.setenv(key, value)
    assert share_plan(plan, _IN_PROCESS_S, chosen) == (plan, chosen), "rank 0 keeps its own"
    got, pick = share_plan(None, _IN_PROCESS_S)
    assert got.to_dict() == plan.to_dict() and got.baselines_s == plan.baselines_s
    assert pick == chosen


def test_each_attempt_of_a_restarted_job_reads_its_own_plan(
    agent_store: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    first, second = _rich_plan(0.125), _rich_plan(0.5)
    for key, value in _agent_env(agent_store.port, "restarts", 0).items():
        monkeypatch.setenv(key, value)
    share_plan(first, _IN_PROCESS_S, (ScheduleKind.GPIPE, 2))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    share_plan(second, _IN_PROCESS_S)
    got, pick = share_plan(None, _IN_PROCESS_S)
    assert got.to_dict() == second.to_dict() and pick is None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    got, pick = share_plan(None, _IN_PROCESS_S)
    assert got.to_dict() == first.to_dict() and pick == (ScheduleKind.GPIPE, 2), (
        "the restart did not overwrite the first attempt's plan: each attempt has its own")


# ---- two processes, as torchrun starts them ------------------------------------------------

def _client(port: int) -> Any:
    return dist.TCPStore("127.0.0.1", port, is_master=False,  # type: ignore[attr-defined]
                         timeout=timedelta(seconds=30))


def _share(rank: int, world: int, arg: tuple[int, str, Plan, Any]) -> Any:
    """Rank 0 publishes ``plan`` and its ``chosen`` schedule; the other ranks read them."""
    port, run_id, plan, chosen = arg
    os.environ.update(_agent_env(port, run_id))
    return share_plan(plan, 20.0, chosen) if rank == 0 else share_plan(None, 20.0)


def _rank_0_fails(rank: int, world: int, arg: tuple[int, str]) -> Any:
    """Rank 0 fails planning (once its peer has given up, so both failures are reported);
    the other ranks wait 0.5 s for its plan."""
    port, run_id = arg
    os.environ.update(_agent_env(port, run_id))
    if rank == 0:
        _client(port).wait([f"{run_id}/gave-up"])
        raise PlanError("rank 0 found no plan for these workers")
    try:
        return share_plan(None, 0.5)
    finally:
        _client(port).set(f"{run_id}/gave-up", "1")


def test_rank_0s_plan_and_schedule_reach_rank_1_exactly(agent_store: Any) -> None:
    plan = _rich_plan()
    results = run_processes(_share, 2, (agent_store.port, "two-ranks", plan,
                                        (ScheduleKind.ZB_H1, 4)), deadline_s=_DEADLINE_S)
    (plan0, chosen0), (plan1, chosen1) = results
    assert plan0.to_dict() == plan1.to_dict() == plan.to_dict()
    assert chosen0 == chosen1 == (ScheduleKind.ZB_H1, 4)


def test_rank_0s_failure_reaches_rank_1_as_a_timeout_naming_rank_0(agent_store: Any) -> None:
    start = time.monotonic()
    with pytest.raises(PlanError) as info:
        run_processes(_rank_0_fails, 2, (agent_store.port, "rank-0-fails"),
                      deadline_s=_DEADLINE_S)
    text = str(info.value)
    assert text.startswith("rank 0 failed: PlanError: rank 0 found no plan"), text
    assert "rank 1 also failed: PeerTimeoutError: rank 1 waited 0.5 s for rank 0's plan" in text
    assert "check rank 0's output, or raise timeout_s" in text
    assert "--- traceback of rank 1 ---" in text
    assert time.monotonic() - start < _DEADLINE_S / 2, "rank 1 gave up at its timeout"
    assert multiprocessing.active_children() == [], "no rank is left behind"
