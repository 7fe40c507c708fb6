"""A stage's weight gradients, moved off its weight versions into the update's sums.

Autograd accumulates a backward's weight gradients on the leaf tensors of the
version it ran on (:mod:`.versions`); microbatches sharing a version add up
there without extra copies. :class:`GradientHarvest` moves them to the
update's :class:`~dreampipe.runtime.fused.GradientSum` when the version is
freed, or before an all-reduce or a step. In the backward that completes a
round it reports each parameter's gradient as soon as it is final (the
post-accumulate hook of the version's leaf, which autograd runs after every
node feeding it, fused GEMMs included), so its all-reduce bucket starts
during the backward (:mod:`.buckets`); under ZeRO-2 the reported gradient is
the microbatch's own, popped for its reduce-scatter. docs/design.md §5.3.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from torch import Tensor

from dreampipe.runtime.fused import DeferredGradients, GradientSum
from dreampipe.runtime.stage_records import Round
from dreampipe.runtime.versions import Version

__all__ = ["GradientHarvest"]


class GradientHarvest:
    """Moves the gradients on versions' leaves into ``grads`` (see the module docstring).

    ``held``: the stage's held weight GEMMs, run before a harvest of every
    version. ``sharded``: ZeRO-2, each round reports the gradient popped."""

    def __init__(self, grads: GradientSum, held: DeferredGradients, *, sharded: bool) -> None:
        self._grads = grads
        self._held = held
        self._sharded = sharded
        self._round: Round | None = None
        self._touched: dict[tuple[int, int], Version] = {}

    def harvest(self, v: Version) -> None:
        """Move the weight gradients autograd accumulated on ``v``'s tensors to the update."""
        if self._touched.pop(v.key, None) is None:
            return
        for i, leaf in enumerate(v.tensors):
            if leaf.grad is not None:
                g, leaf.grad = leaf.grad, None
                self._grads.add_grad(i, g)

    def harvest_all(self) -> None:
        """Run the held GEMMs and harvest every version a backward touched."""
        self._held.run()
        for v in list(self._touched.values()):
            self.harvest(v)

    def touch(self, v: Version) -> None:
        """A backward accumulated gradients on ``v``'s tensors."""
        self._touched[v.key] = v

    @contextmanager
    def round(self, on_ready: Callable[[int, Tensor], None] | None, v: Version
              ) -> Iterator[None]:
        """A backward on ``v``; with ``on_ready``, the one completing a round: every
        parameter is reported to it once, as it becomes final, the rest at the end."""
        if on_ready is not None:
            held = [*self._touched.values()]
            held += [v] if v.key not in self._touched else []
            self._round = Round(on_ready, [h.tensors for h in held], [False] * len(v.tensors))
        try:
            yield
            if self._round is not None:
                for i, done in enumerate(self._round.reported):
                    if not done:
                        self._report(self._round, i)
        finally:
            self._round = None

    def leaf_done(self, index: int, _leaf: Tensor) -> None:
        """Post-accumulate hook of a version's leaf: in a round's last backward, report it."""
        if self._round is not None and not self._round.reported[index]:
            self._report(self._round, index)

    def _report(self, rnd: Round, index: int) -> None:
        """Harvest parameter ``index`` off every version the round touched, then report it.

        The sum is the one :meth:`~dreampipe.runtime.stage_module.StageModule.gradients`
        takes after the backward, bit for bit: the same terms in the same order
        (every schedule touches one version per round, since each step harvests
        them all).
        """
        for leaves in rnd.leaves:
            leaf = leaves[index]
            g = leaf.grad
            if g is not None:
                leaf.grad = None
                self._grads.add_grad(index, g)
        rnd.reported[index] = True
        if self._sharded:  # ZeRO-2: the microbatch's gradient goes to its reduce-scatter
            rnd.on_ready(index, self._grads.pop(index))
        else:
            rnd.on_ready(index, self._grads.filled(index))
