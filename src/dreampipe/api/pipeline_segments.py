"""A Pipeline rank's segments: the schedules they run on, the feed they read, their losses.

A segment is the minibatches between two drains (docs/design.md §8.5). It starts
on the schedule of :data:`HORIZON` minibatches, or of twice those reserved from
its start, and moves to one 4 times as long whenever a step passes half of it, up
to the segment's cap: every rank pauses to build it, ever more rarely. The drain
runs the exact schedule of the minibatches given. Every full segment grows through
the same horizons and drains on the same schedule, so the last few built are kept;
a ``schedule_file`` gives one minibatch's schedule, repeated. Each segment reads
its minibatches from a feed of its own, numbered from its start, and its drain
gives each minibatch's loss: its microbatches' by their shares, summed over the
world (only the last stage's reporting workers count theirs).
"""

from __future__ import annotations

import functools
import math

import torch

from dreampipe.api.config import TrainConfig
from dreampipe.api.evaluation import all_reduced
from dreampipe.api.feed import Feed, ignoring
from dreampipe.planning.plan import Plan
from dreampipe.runtime.engine import RankRunner
from dreampipe.scheduling.actions import Schedule
from dreampipe.scheduling.build import repeat_schedule
from dreampipe.scheduling.microbatch_layout import MicrobatchLayout
from dreampipe.scheduling.torch_csv import check_file_fits, read_torch_csv

__all__ = ["HORIZON", "Segments"]

#: The minibatches of a segment's first schedule, unless more are reserved.
HORIZON = 32
#: Schedules kept for reuse: the horizons a segment grows through, and its drain.
_KEPT_SCHEDULES = 6


class Segments:
    """The segments of ``plan`` run as ``config`` says, each of at most
    ``segment_microbatches`` microbatches; see the module docstring."""

    def __init__(self, plan: Plan, layout: MicrobatchLayout, config: TrainConfig,
                 segment_microbatches: int, *, tied: bool = False) -> None:
        self.plan, self.layout = plan, layout
        #: What each microbatch's loss averages over (:class:`~dreampipe.api.feed.Feed`).
        self.loss_weight = ignoring(config.ignore_index)
        self.replicas = [st.replicas for st in plan.stages]
        #: A PyTorch schedule file's minibatch, run every minibatch (None: build the kind's).
        self.period = None if config.schedule_file is None else self._file_schedule(
            str(config.schedule_file))
        self.zero = list(plan.zero_levels(config.zero))
        # ranks that sum tied weights' gradients at each step wait for each other there
        self.steps_agree = config.runner_options().steps_agree or tied
        per_round = math.lcm(*self.replicas)
        #: The most minibatches a segment holds: whole rounds of every stage's replicas.
        self.cap = max(per_round, segment_microbatches // layout.microbatches_per_update
                       // per_round * per_round)
        #: The minibatches reserved so far (:meth:`reserve`), counted from the run's start.
        self.reserved_to = 0
        #: The minibatches of the schedule the current segment runs on.
        self.horizon = min(HORIZON, self.cap)
        #: :meth:`build`, keeping the last few built.
        self.schedule = functools.lru_cache(maxsize=_KEPT_SCHEDULES)(self.build)

    def _file_schedule(self, path: str) -> Schedule:
        """``schedule_file``'s one minibatch, checked against the plan and the microbatches."""
        period = read_torch_csv(path, self.layout.kind)
        check_file_fits(period, self.replicas, self.plan.virtual_stages,
                        self.layout.microbatches_per_update, f"schedule_file={path!r}",
                        self.plan.placement)
        return period

    def build(self, minibatches: int) -> Schedule:
        """The plan's schedule of ``minibatches`` updates (its own minibatches in flight), or
        ``schedule_file``'s repeated (:attr:`schedule` keeps the last few built)."""
        if self.period is not None:
            return repeat_schedule(self.period, minibatches)
        return self.layout.build(self.replicas, minibatches, self.plan.in_flight,
                                 self.plan.virtual_stages, self.zero, self.steps_agree)

    def horizon_from(self, start: int) -> int:
        """The horizon of a segment from minibatch ``start``: what is reserved, within the cap."""
        return min(self.cap, max(HORIZON, 2 * (self.reserved_to - start)))

    def move_to(self, horizon: int) -> Schedule:
        """Run on the schedule of ``horizon`` minibatches from now: that schedule."""
        self.horizon = horizon
        return self.schedule(horizon)

    def grown(self, given: int) -> Schedule | None:
        """The longer schedule a segment of ``given`` minibatches moves to once they pass half
        its horizon (4 times as long, within the cap), or None: it runs on."""
        if 2 * given > self.horizon and self.horizon < self.cap:
            return self.move_to(min(4 * self.horizon, self.cap))
        return None

    def reserve(self, start: int, end: int) -> int:
        """Reserve the minibatches up to ``end`` (exclusive); the horizon of the segment that
        started at minibatch ``start``, longer where it reaches further now."""
        self.reserved_to = max(self.reserved_to, end)
        return self.horizon_from(start)

    def build_later(self, start: int) -> None:
        """Build the schedules of the segments after the one from minibatch ``start`` that
        begin within what is reserved, so that none of them pauses to build its own."""
        for later in range(start + self.cap, self.reserved_to, self.cap):
            self.schedule(self.horizon_from(later))

    def feed(self, runner: RankRunner) -> Feed:
        """A new segment's feed, given to ``runner``: it keeps a microbatch's inputs where the
        rank runs it on the first stage, its targets where it runs it on the last."""
        sched, rank = runner.schedule, runner.rank
        stage = sched.stage_of_rank(rank)
        mine = sched.replica_of_rank(rank)
        reps = self.replicas[stage]
        last = len(self.replicas) - 1 in sched.stages_of_rank(rank)
        feed = Feed(
            microbatches_per_update=self.layout.microbatches_per_update,
            device=runner.device, wants_inputs=lambda u: stage == 0 and u % reps == mine,
            wants_targets=lambda u: last and u % reps == mine, loss_weight=self.loss_weight,
        )
        runner.feed(feed)
        return feed

    def restart(self, runner: RankRunner, horizon: int) -> Feed:
        """A new segment on ``runner`` (after a drain), on a schedule of ``horizon``
        minibatches: its feed."""
        runner.restart(self.move_to(horizon))
        return self.feed(runner)

    def losses(self, runner: RankRunner, feed: Feed, given: int, *, reports: bool) -> list[float]:
        """The losses of a drained segment's ``given`` minibatches, on every rank (a
        collective); the rank counts its own where it ``reports``."""
        per = self.layout.microbatches_per_update
        microbatch_losses = torch.zeros(given * per, dtype=torch.float64)
        for u, loss in runner.losses.items():
            microbatch_losses[u] = float(loss) if reports else 0.0
        microbatch_losses = all_reduced(microbatch_losses, runner.device)
        values = [v * feed.share(u) for u, v in enumerate(microbatch_losses.tolist())]
        return [sum(values[k * per : (k + 1) * per]) / per for k in range(given)]
