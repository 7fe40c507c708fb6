"""``runtime/comm.py`` on a wire that matches as NCCL does: in order per pair, tags ignored.

No process group: ``dist.isend``/``irecv`` are replaced by a wire that pairs
each receive with the oldest unmatched send between the same two ranks on
the same group, and records the pairs. Every pair must carry the same tag
and size, or the order of receives differs from that of the sends.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dreampipe.runtime import comm as comm_module
from dreampipe.runtime.comm import Comm
from dreampipe.scheduling.actions import ActionKind, Schedule, ScheduleKind
from dreampipe.scheduling.build import build_schedule

__all__: list[str] = []


@dataclass
class _Work:
    done: bool = False

    def is_completed(self) -> bool:
        return self.done

    def wait(self, timeout: Any = None) -> bool:
        if not self.done:
            raise RuntimeError("never matched")
        return True


@dataclass
class _Wire:
    """FIFO matching per (group, source, destination); ``rank`` is the caller."""

    rank: int = 0
    sends: dict[Any, deque[tuple[torch.Tensor, int, _Work]]] = field(
        default_factory=lambda: defaultdict(deque))
    recvs: dict[Any, deque[tuple[torch.Tensor, int, _Work]]] = field(
        default_factory=lambda: defaultdict(deque))
    pairs: list[tuple[int, int, int, int]] = field(default_factory=list)  # tags, sizes

    def isend(self, t: torch.Tensor, group_dst: int, tag: int, group: Any) -> _Work:
        return self._arrive((group, self.rank, group_dst), self.sends, self.recvs, t, tag)

    def irecv(self, t: torch.Tensor, group_src: int, tag: int, group: Any) -> _Work:
        return self._arrive((group, group_src, self.rank), self.recvs, self.sends, t, tag)

    def _arrive(self, key: Any, mine: dict[Any, deque[Any]], other: dict[Any, deque[Any]],
                t: torch.Tensor, tag: int) -> _Work:
        work = _Work()
        if not other[key]:
            mine[key].append((t.clone() if mine is self.sends else t, tag, work))
            return work
        t2, tag2, work2 = other[key].popleft()
        sent, sent_tag, got, got_tag = (t, tag, t2, tag2) if mine is self.sends \
            else (t2, tag2, t, tag)
        self.pairs.append((sent_tag, got_tag, sent.numel(), got.numel()))
        if sent.numel() == got.numel() and sent.dtype == got.dtype:
            got.copy_(sent.reshape(got.shape))
        work.done = work2.done = True
        return work


@pytest.fixture
def wire(monkeypatch: pytest.MonkeyPatch) -> _Wire:
    w = _Wire()
    monkeypatch.setattr(dist, "isend", w.isend)
    monkeypatch.setattr(dist, "irecv", w.irecv)
    monkeypatch.setattr(dist, "get_backend", lambda *a, **k: "nccl")
    monkeypatch.setattr(comm_module, "_POLL_S", 0.0)
    return w


def _comm(schedule: Schedule, rank: int, vertical_sync: bool, groups: tuple[Any, Any]) -> Comm:
    return Comm(schedule, rank, torch.device("cpu"), 0.05, vertical_sync=vertical_sync,
                groups=groups)


def _of(schedule: Schedule, rank: int, kind: ActionKind) -> list[Any]:
    return [a for a in schedule.actions[rank] if a.kind is kind]


@pytest.mark.parametrize("vertical_sync", [False, True])
def test_receives_posted_before_and_after_the_header_meet_their_own_sends(
        wire: _Wire, vertical_sync: bool) -> None:
    schedule = build_schedule((1, 1), ScheduleKind.PIPEDREAM, 6)
    groups = (object(), object())
    wire.rank = 0
    sender = _comm(schedule, 0, vertical_sync, groups)
    wire.rank = 1
    receiver = _comm(schedule, 1, vertical_sync, groups)
    sends, recvs = _of(schedule, 0, ActionKind.SEND_F), _of(schedule, 1, ActionKind.RECV_F)
    # the receiver posts ahead of the sends (microbatch 1 must wait for microbatch 0's header) ...
    assert receiver.post(recvs[0]) and not receiver.post(recvs[1])
    wire.rank = 0
    for k, a in enumerate(sends[:3]):
        sender.send(a, torch.full((2, 3), float(k)), version=k)
    wire.rank = 1
    got, version = receiver.take(recvs[0])
    assert torch.equal(got, torch.zeros(2, 3)) and version == (0 if vertical_sync else None)
    # ... and, once the link is agreed, posts microbatches 1-3 before their sends come
    assert all(receiver.post(a) for a in recvs[1:4])
    wire.rank = 0
    for k, a in enumerate(sends[3:], start=3):
        sender.send(a, torch.full((2, 3), float(k)), version=k)
    wire.rank = 1
    for k, a in enumerate(recvs[1:], start=1):
        got, version = receiver.take(a)
        assert torch.equal(got, torch.full((2, 3), float(k))), k
        assert version == (k if vertical_sync else None)
    assert wire.pairs, "nothing was matched"
    for sent_tag, got_tag, sent_n, got_n in wire.pairs:
        assert (sent_tag, sent_n) == (got_tag, got_n)


def test_gradients_are_received_in_the_order_the_next_stage_sends_them(wire: _Wire) -> None:
    schedule = build_schedule((1, 1), ScheduleKind.PIPEDREAM, 4)
    groups = (object(), object())
    wire.rank = 0
    first = _comm(schedule, 0, False, groups)
    wire.rank = 1
    last = _comm(schedule, 1, False, groups)
    wire.rank = 0
    for a in _of(schedule, 0, ActionKind.SEND_F):
        first.send(a, torch.ones(4))
    for a in _of(schedule, 0, ActionKind.RECV_B):
        assert first.post(a)
    wire.rank = 1
    for a in _of(schedule, 1, ActionKind.RECV_F):
        last.take(a)
    for a in _of(schedule, 1, ActionKind.SEND_B):
        last.send(a, torch.full((4,), float(a.microbatch)))
    wire.rank = 0
    for a in _of(schedule, 0, ActionKind.RECV_B):
        got, _ = first.take(a)
        assert torch.equal(got, torch.full((4,), float(a.microbatch)))
    assert all(s == g for s, g, _, _ in wire.pairs)


def test_only_gloo_posts_receives_ahead_of_the_runnable_prefix(
        wire: _Wire, monkeypatch: pytest.MonkeyPatch) -> None:
    schedule = build_schedule((1, 1), ScheduleKind.PIPEDREAM, 2)
    assert not _comm(schedule, 1, False, (None, None)).posts_ahead
    monkeypatch.setattr(dist, "get_backend", lambda *a, **k: "gloo")
    assert _comm(schedule, 1, False, (None, None)).posts_ahead
