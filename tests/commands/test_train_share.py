"""Rank 0's plan shared through torchrun's store (:mod:`dreampipe.commands.train_share`)."""

from __future__ import annotations

import socket
from datetime import timedelta

import pytest
import torch.distributed as dist

from dreampipe.commands.train_share import share_plan, torchrun_world
from dreampipe.errors import PeerTimeoutError, PlanError
from dreampipe.planning.plan import Plan
from dreampipe.scheduling.actions import ScheduleKind

__all__: list[str] = []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def agent_store(monkeypatch: pytest.MonkeyPatch) -> object:
    """A TCP store standing in for torchrun's agent, and the environment it sets."""
    port = _free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True,  # type: ignore[attr-defined]
                          timeout=timedelta(seconds=10))
    for name, value in (("TORCHELASTIC_USE_AGENT_STORE", "True"), ("MASTER_ADDR", "127.0.0.1"),
                        ("MASTER_PORT", str(port)), ("TORCHELASTIC_RUN_ID", "t"),
                        ("TORCHELASTIC_RESTART_COUNT", "0")):
        monkeypatch.setenv(name, value)
    return store


def test_every_rank_gets_rank_0s_plan_and_schedule(agent_store: object) -> None:
    plan = Plan.from_config(6, [0, 2, 4], [2, 1, 1], model="mlp")
    assert share_plan(plan, 5.0, (ScheduleKind.ZB_H1, 6)) == (plan, (ScheduleKind.ZB_H1, 6))
    got, chosen = share_plan(None, 5.0)
    assert got.to_dict() == plan.to_dict() and chosen == (ScheduleKind.ZB_H1, 6)


def test_a_plan_without_a_chosen_schedule_is_shared_as_such(agent_store: object) -> None:
    plan = Plan.from_config(4, [0], [3], model="mlp")
    share_plan(plan, 5.0)
    assert share_plan(None, 5.0)[1] is None


def test_a_restart_waits_for_its_own_plan_and_times_out_naming_the_fix(
    agent_store: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    share_plan(Plan.from_config(4, [0, 2], [1, 1]), 5.0)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # a restart re-plans: a new key
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(PeerTimeoutError, match=r"rank 1 waited 0\.5 s for rank 0's plan"):
        share_plan(None, 0.5)


def test_without_an_agent_store_the_plan_must_be_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    with pytest.raises(PlanError, match="give every rank the same plan"):
        share_plan(None, 1.0)


def test_the_world_comes_from_the_launchers_environment(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RANK", raising=False)
    assert torchrun_world() is None
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert torchrun_world() == (2, 4)
