"""``runtime/comm.py`` on a wire that matches as NCCL does: in order per pair, tags ignored.

No process group: ``dist.isend``/``irecv`` are replaced by a wire that pairs
each receive with the oldest unmatched send between the same two ranks on
the same group (or, as gloo does, with the oldest of the same tag), and records
the pairs. Every pair must carry the same tag and size, or the order of receives
differs from that of the sends.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dreampipe.errors import PeerTimeoutError, StageMismatchError
from dreampipe.runtime import comm as comm_module
from dreampipe.runtime.comm import Comm
from dreampipe.scheduling.actions import Action, ActionKind, Schedule, ScheduleKind
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
    by_tag: bool = False  # gloo's matching: the oldest unmatched message of the same tag
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
        waiting = [m for m in other[key] if m[1] == tag or not self.by_tag]
        if not waiting:
            mine[key].append((t.clone() if mine is self.sends else t, tag, work))
            return work
        other[key].remove(waiting[0])
        t2, tag2, work2 = waiting[0]
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


def _comm(schedule: Schedule, rank: int, vertical_sync: bool, groups: tuple[Any, Any],
          varying: bool = False) -> Comm:
    return Comm(schedule, rank, torch.device("cpu"), 0.05, vertical_sync=vertical_sync,
                groups=groups, varying=varying)


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


def _shape(k: int) -> tuple[int, ...]:
    """Microbatch ``k``'s activation: its sequence length and, every third, its samples change."""
    return (2 - (k % 3 == 2), 3 + k % 4, 5)


@pytest.mark.parametrize(("backend", "vertical_sync"),
                         [("nccl", False), ("nccl", True), ("gloo", False)])
def test_microbatches_of_changing_shapes_carry_them_forward_and_back(
        wire: _Wire, monkeypatch: pytest.MonkeyPatch, backend: str, vertical_sync: bool) -> None:
    monkeypatch.setattr(dist, "get_backend", lambda *a, **k: backend)
    wire.by_tag = backend == "gloo"
    schedule = build_schedule((1, 1), ScheduleKind.PIPEDREAM, 6)
    groups = (object(), object())
    wire.rank = 0
    first = _comm(schedule, 0, vertical_sync, groups, varying=True)
    wire.rank = 1
    last = _comm(schedule, 1, vertical_sync, groups, varying=True)
    recvs = _of(schedule, 1, ActionKind.RECV_F)
    # each receive waits for its own header; only gloo, which matches tags, posts several
    posted = [last.post(a) for a in recvs[:3]]
    assert posted == ([True, True, True] if backend == "gloo" else [True, False, False])
    for k, (send, a) in enumerate(zip(_of(schedule, 0, ActionKind.SEND_F), recvs, strict=True)):
        wire.rank = 0
        first.send(send, torch.full(_shape(k), float(k)), version=k)
        wire.rank = 1
        assert last.post(a)
        got, version = last.take(a)
        assert torch.equal(got, torch.full(_shape(k), float(k))), k
        assert version == (k if vertical_sync else None)
    for a in _of(schedule, 1, ActionKind.SEND_B):
        last.send(a, torch.full(_shape(a.microbatch), -float(a.microbatch)))
    wire.rank = 0
    for a in _of(schedule, 0, ActionKind.RECV_B):  # sized as the activation it answers
        assert torch.equal(first.take(a)[0], torch.full(_shape(a.microbatch),
                                                        -float(a.microbatch)))
    assert len(wire.pairs) == 6 * (3 + vertical_sync)  # a header with every activation
    for sent_tag, got_tag, sent_n, got_n in wire.pairs:
        assert (sent_tag, sent_n) == (got_tag, got_n)


def test_a_link_of_fixed_shapes_refuses_a_microbatch_of_another(wire: _Wire) -> None:
    schedule = build_schedule((1, 1), ScheduleKind.PIPEDREAM, 2)
    sender = _comm(schedule, 0, False, (object(), object()))
    sends = _of(schedule, 0, ActionKind.SEND_F)
    sender.send(sends[0], torch.zeros(2, 3))
    with pytest.raises(StageMismatchError, match=r"stage 0 \(rank 0\) produced torch.float32 "
                                                 r"tensors of shape \[2, 4\] .* every microbatch "
                                                 "must have the same shape"):
        sender.send(sends[1], torch.zeros(2, 4))


class _Failed:
    """A transfer whose peer is gone (``lost``) or never answers."""

    def __init__(self, lost: bool) -> None:
        self.lost = lost

    def is_completed(self) -> bool:
        return self.lost

    def wait(self, timeout: Any = None) -> None:
        raise RuntimeError("Connection closed by peer")


@pytest.mark.parametrize("lost", [True, False])
def test_a_later_segments_failure_names_the_runs_microbatch(wire: _Wire, lost: bool) -> None:
    """After a checkpoint the schedule counts from 0 again; the error counts as the run
    does, so microbatch 68 of a segment that began at 300 is the run's 368."""
    comm = _comm(build_schedule((1, 1), ScheduleKind.FLUSH, 4, 4), 0, False,
                 (object(), object()))
    comm.first_microbatch = 300
    action = Action(ActionKind.RECV_B, 0, 68)
    with pytest.raises(PeerTimeoutError) as caught:
        comm._wait(_Failed(lost), action, "rank 1 (stage 1)")
    said = str(caught.value)
    assert "in RECV_B368 (microbatch 368)" in said, said
    assert ("lost rank 1" if lost else "waited more than") in said
