"""Point-to-point latency and bandwidth between two ranks: a ping-pong at a few sizes.

Rank ``a`` sends a message of ``n`` bytes, rank ``b`` sends it back; half
the round trip is one way. Over the sizes the one-way times fit
``latency + n / bandwidth`` (least squares). The sizes grow until a round
trip takes longer than the probe allows (such a trip is timed once), so a
slow link is measured in seconds too, not minutes. Before each message ``a`` tells ``b`` its size
and whether to echo it, so ``b`` needs no schedule of its own::

    a   ctl(n, echo) | send n | recv n | ctl(n, 0) | isend n (its post timed) | ... | ctl(0)
    b   ctl          | recv n | send n | ctl       | recv n                   | ... | ctl -> done

Posting a send without waiting for it gives the host time a send costs the
sender (``isend`` timed by the wall clock), fitted the same way: the
runtime's send overhead and copy bandwidth.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from dreampipe.machine.timers import Timer, WallTimer

__all__ = ["LineFit", "PingPong", "ping_pong"]

#: Timed rounds per size at the least and at the most.
_MIN_ROUNDS, _MAX_ROUNDS = 3, 50
#: The largest bandwidth a fit reports, bytes/s: a flat line (every size as fast).
_FASTEST = 1e13


@dataclass(frozen=True)
class LineFit:
    """``fixed_s + nbytes / bandwidth``, fitted to median seconds per size."""

    fixed_s: float
    bandwidth: float

    @classmethod
    def of(cls, sizes: Sequence[int], seconds: Sequence[float]) -> LineFit:
        """The slope by least squares over ``(sizes, seconds)`` (at least one byte per
        :data:`_FASTEST`), the fixed part what the smallest size took beyond its bytes at
        that slope (at least 0). The large sizes set the slope and would swamp an
        intercept of microseconds with their noise; the smallest is nearly all fixed part.
        One size: all of it is the fixed part."""
        if len(sizes) < 2:
            return cls(max(0.0, seconds[0]) if seconds else 0.0, _FASTEST)
        mx, my = statistics.fmean(sizes), statistics.fmean(seconds)
        var = sum((x - mx) ** 2 for x in sizes)
        slope = sum((x - mx) * (y - my) for x, y in zip(sizes, seconds, strict=True)) / var
        slope = max(slope, 1 / _FASTEST)
        smallest = min(range(len(sizes)), key=lambda i: sizes[i])
        return cls(max(0.0, seconds[smallest] - slope * sizes[smallest]), 1 / slope)


@dataclass(frozen=True)
class PingPong:
    """Median one-way and send-post seconds at each size measured (bytes)."""

    sizes: tuple[int, ...]
    one_way_s: tuple[float, ...]
    post_s: tuple[float, ...]

    @property
    def link(self) -> LineFit:
        """Latency and bandwidth of the link."""
        return LineFit.of(self.sizes, self.one_way_s)

    @property
    def send(self) -> LineFit:
        """Host time to post a send: overhead and copy bandwidth."""
        return LineFit.of(self.sizes, self.post_s)


def ping_pong(
    pair: tuple[int, int], sizes: Sequence[int], *, budget_s: float, min_time_s: float,
    device: torch.device, timer: Timer,
) -> PingPong | None:
    """Ping-pong between global ranks ``pair`` of the default group (both call it; other
    ranks must not): ``pair[0]`` gets the result, ``pair[1]`` None.

    Each size is timed at least :data:`_MIN_ROUNDS` times and for ``min_time_s``,
    but no round after one whose round trip took over ``budget_s``, and no size
    after one whose median did.
    """
    me = dist.get_rank()
    largest = max(sizes)
    buf = torch.zeros(largest // 4 + 1, device=device)
    control = torch.zeros(2, dtype=torch.int64, device=device)
    if me == pair[1]:
        _echo(pair[0], buf, control)
        return None
    assert me == pair[0], f"rank {me} is not in the pair {pair}"
    peer = pair[1]
    measured: list[int] = []
    one_way: list[float] = []
    post: list[float] = []
    wall = WallTimer()
    for size in sorted(sizes):
        msg = buf[: max(1, size // 4)]
        trip, send = partial(_round_trip, msg, peer, control, timer), partial(
            _post, msg, peer, control, wall)
        if not measured:  # warm up: the pair's first messages set up its connection
            trip()
            send()
        trips = _rounds(trip, min_time_s, budget_s, _MAX_ROUNDS)
        posts = _rounds(send, min_time_s, budget_s, len(trips))
        measured.append(msg.numel() * 4)
        one_way.append(statistics.median(trips) / 2)
        post.append(statistics.median(posts))
        if 2 * one_way[-1] > budget_s:
            break
    control.fill_(0)
    dist.send(control, peer)
    return PingPong(tuple(measured), tuple(one_way), tuple(post))


def _rounds(one: Callable[[], float], min_time_s: float, budget_s: float, most: int
            ) -> list[float]:
    """At least :data:`_MIN_ROUNDS` of ``one`` (at most ``most``) filling ``min_time_s``;
    none after one that took over ``budget_s`` (a slow link: its first round says enough)."""
    took: list[float] = []
    start = time.perf_counter()
    while not took or (took[-1] <= budget_s and len(took) < most and (
            len(took) < _MIN_ROUNDS or time.perf_counter() - start < min_time_s)):
        took.append(one())
    return took


def _round_trip(msg: torch.Tensor, peer: int, control: torch.Tensor, timer: Timer) -> float:
    control[0], control[1] = msg.numel(), 1
    dist.send(control, peer)
    return timer(lambda: (dist.send(msg, peer), dist.recv(msg, peer)))


def _post(msg: torch.Tensor, peer: int, control: torch.Tensor, wall: Timer) -> float:
    control[0], control[1] = msg.numel(), 0
    dist.send(control, peer)
    work: list[dist.Work | None] = []
    took = wall(lambda: work.append(dist.isend(msg, peer)))
    if work[0] is not None:
        work[0].wait()
    dist.recv(control, peer)  # the peer has it: the next round starts on an idle link
    return took


def _echo(peer: int, buf: torch.Tensor, control: torch.Tensor) -> None:
    while True:
        dist.recv(control, peer)
        n, echo = (int(v) for v in control.tolist())
        if n == 0:
            return
        dist.recv(buf[:n], peer)
        if echo:
            dist.send(buf[:n], peer)
        else:
            dist.send(control, peer)
