"""A stage's weight versions: copy-on-write stashes of its live weights, by number.

**Weight stashing.** The forward of microbatch ``u`` runs functionally on a
*version* of the weights (:mod:`.slots`), so the autograd graph holds that
version; ``u``'s backward differentiates the same graph, and the gradient goes
to the live parameters. A version shares the live weights' storage until a
``STEP`` changes them while a backward still needs it: the live parameters
then move to a fresh copy. **Vertical sync**: microbatch ``u`` runs on the version
number the input stage used. **Weight prediction** (:mod:`.staleness`): a microbatch
whose gradient will update version ``v + k`` runs on ``w_v + k (w_v - w_{v-1})``,
a version of its own keyed ``(v, k)``. The rules: docs/design.md §5.1, §12.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor, nn

from dreampipe.errors import ScheduleError

__all__ = ["Version", "WeightVersions"]


@dataclass
class Version:
    """Version ``number`` of a stage's weights; ``live`` while it shares the live storage."""

    number: int
    tensors: list[Tensor]  # in parameter index order
    live: bool
    refs: int = 0
    ahead: int = 0  # a prediction ``ahead`` updates on (module doc)

    @property
    def key(self) -> tuple[int, int]:
        """What names this version among those held: ``(number, ahead)``."""
        return self.number, self.ahead


class WeightVersions(Mapping[int, Version]):
    """The versions of stage ``stage``'s parameters ``params`` that are held, by number.

    ``version`` is the live weights' number, one more per update. A version made
    from the live weights, or predicted from one, registers ``on_leaf(index, leaf)``
    as the post-accumulate gradient hook of each of its leaves; ``on_drop(version)``
    takes the gradients off a version before it is freed. ``predict``: run a microbatch
    on its weights extrapolated to the update its gradient goes into (module doc).
    """

    def __init__(
        self,
        params: list[nn.Parameter],
        *,
        stage: int,
        on_leaf: Callable[[int, Tensor], None],
        on_drop: Callable[[Version], None],
        predict: bool = False,
    ) -> None:
        self._params = params
        self._stage = stage
        self._on_leaf = on_leaf
        self._on_drop = on_drop
        self._held: dict[int, Version] = {}
        self._floor: int | None = None
        self.version = 0
        self.peak = 0
        self.predict = predict
        self._predicted: dict[tuple[int, int], Version] = {}
        self._deltas: dict[int, list[Tensor]] = {}  # version -> w_v - w_{v-1}
        self._before: tuple[list[Tensor], bool] | None = None  # (values, a copy of our own)
        self._base: int | None = None

    def __getitem__(self, number: int) -> Version:
        return self._held[number]

    def __iter__(self) -> Iterator[int]:
        return iter(self._held)

    def __len__(self) -> int:
        return len(self._held)

    def resume_at(self, version: int) -> None:
        """Count versions on from ``version``, a resumed checkpoint's."""
        self.version = version

    def restart(self) -> None:
        """A new segment (the pipeline filled again): predictions start afresh, and the
        versions vertical sync kept for microbatches to come go, as no microbatch of the
        drained segment is left to run on them."""
        self._base = None
        self._deltas.clear()
        self._floor = None
        for v in [v for v in self._held.values() if v.refs == 0]:
            self._drop(v)

    def note(self, number: int) -> None:
        """Vertical sync: the newest received microbatch runs on ``number``; older ones may go."""
        self._floor = number
        for v in [v for v in self._held.values() if v.number < number and v.refs == 0]:
            self._drop(v)

    def _needed_later(self, number: int) -> bool:
        return self._floor is not None and number >= self._floor

    def _leaves(self, tensors: list[Tensor]) -> list[Tensor]:
        for i, leaf in enumerate(tensors):
            leaf.requires_grad_(True)
            leaf.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                partial(self._on_leaf, i)
            )
        return tensors

    def _live_version(self) -> Version:
        v = Version(self.version, self._leaves([p.data for p in self._params]), live=True)
        self._held[self.version] = v
        self._count()
        return v

    def _count(self) -> None:
        self.peak = max(self.peak, len(self._held) + len(self._predicted))

    def acquire(self, number: int | None, update: int | None = None) -> Version:
        """Version ``number`` (None: the live weights'), held until :meth:`release`.

        ``update``: the segment's update that the microbatch's gradient goes into; with
        :attr:`predict`, the microbatch runs on the version extrapolated to it.
        """
        number = self.version if number is None else number
        if self.predict and update is not None:
            if self._base is None:
                self._base = self.version
            ahead = self._base + update - number
            delta = self._deltas.get(number)
            if ahead > 0 and delta is not None:
                return self._prediction(number, ahead, delta)
        v = self._held.get(number)
        if v is None:
            self._check_held(number)
            v = self._live_version()
        v.refs += 1
        return v

    def _check_held(self, number: int) -> None:
        if number not in self._held and number != self.version:
            raise ScheduleError(
                f"stage {self._stage} has no weight version {number} (it is at version "
                f"{self.version}, holds {sorted(self._held)}); vertical sync needs a "
                "schedule in which later stages are never behind the input stage"
            )

    def _prediction(self, number: int, ahead: int, delta: list[Tensor]) -> Version:
        v = self._predicted.get((number, ahead))
        if v is None:
            self._check_held(number)
            base = self._held[number].tensors if number in self._held else [
                p.data for p in self._params]
            tensors = [torch.add(w.detach(), d, alpha=ahead)
                       for w, d in zip(base, delta, strict=True)]
            v = Version(number, self._leaves(tensors), live=False, ahead=ahead)
            self._predicted[v.key] = v
            self._count()
        v.refs += 1
        return v

    def release(self, v: Version) -> None:
        """A microbatch is done with ``v``: free it if nothing needs it any more."""
        v.refs -= 1
        if v.refs == 0 and not v.live and (v.ahead or not self._needed_later(v.number)):
            self._drop(v)

    def _drop(self, v: Version) -> None:
        if v.live:
            return
        self._on_drop(v)
        if v.ahead:
            del self._predicted[v.key]
        else:
            del self._held[v.number]

    def retire(self) -> None:
        """Before an update: the live version keeps the current values if a microbatch (or,
        under vertical sync, a later one) still needs them, the live parameters moving
        to a fresh copy; otherwise it goes. With :attr:`predict`, the values are also
        kept to take the update's change."""
        cur = self._held.get(self.version)
        if cur is None and self._needed_later(self.version):
            cur = self._live_version()
        if cur is not None and cur.live:
            if cur.refs > 0 or self._needed_later(cur.number):
                for p in self._params:
                    _to_fresh_copy(p)
                cur.live = False
            else:
                del self._held[cur.number]
        if self.predict:  # the change of a version no microbatch can name again is not needed
            for old in [n for n in self._deltas if n not in self._held]:
                del self._deltas[old]
            if cur is not None and not cur.live:  # the version kept the values: no copy
                self._before = ([t.detach() for t in cur.tensors], False)
            else:
                self._before = ([p.detach().clone() for p in self._params], True)

    def advance(self) -> None:
        """After an update: the live weights are the next version (with :attr:`predict`,
        the update's change kept while that version may still be run on)."""
        self.version += 1
        if self._before is not None:
            before, own = self._before
            self._deltas[self.version] = [
                b.neg_().add_(p.detach()) if own else p.detach() - b
                for b, p in zip(before, self._params, strict=True)]
            self._before = None


def _to_fresh_copy(p: nn.Parameter) -> None:
    """Move the live ``p`` to a copy of its values, leaving its old storage to the version.
    A DTensor's shard is a tensor of its own: assigning the DTensor's ``.data`` would
    leave the shard, and the version's view of it, to the update."""
    local = getattr(p, "_local_tensor", None)
    if isinstance(local, Tensor):
        local.data = local.data.clone()
    else:
        p.data = p.data.clone()
