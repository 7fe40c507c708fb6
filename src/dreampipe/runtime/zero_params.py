"""ZeRO level 3: a replicated stage's weights sharded over its replicas between uses.

The rule (Rajbhandari et al. 2020, §5.3; torch's pipelining ``UNSHARD``/``RESHARD``): on
top of level 2 (:mod:`.zero`), each replica keeps only its chunks of the weights between
uses, as tensors of their own (the optimizer's chunk parameters, or under ``bf16`` their
32-bit masters), and the full weights' storage is freed (``untyped_storage().resize_(0)``,
as FSDP does: every view of it, a weight version's tensors included, is freed with it).
The schedule says when they are whole (:mod:`dreampipe.scheduling.unshard`): ``UNSHARD<k>``
all-gathers them before update ``k``'s first computation and ``RESHARD<k>`` frees them
after its last, so a 1F1B backward finds the weights its forward ran on. The update steps
the chunks alone; the next ``UNSHARD`` gathers the new values (a bf16 stage's rounding of
its masters). Only synchronous schedules: an asynchronous one keeps a weight version per
minibatch in flight. Evaluation and a checkpoint's weights gather them for the while
(:func:`gathered`). docs/design.md §5.6.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from dreampipe.errors import ScheduleError
from dreampipe.runtime.precision import MasterWeights, Precision
from dreampipe.runtime.zero import ZeroPlace, ZeroShards
from dreampipe.scheduling.actions import Action, ActionKind
from dreampipe.scheduling.unshard import SHARDED_LEVEL

__all__ = ["ZeroParams", "check_gathers", "gathered", "sharded_weights", "stage_optimizer",
           "writable"]


class ZeroParams(ZeroShards):
    """:class:`~.zero.ZeroShards` at level 3 (module docstring): the full weights exist only
    between :meth:`unshard` and :meth:`reshard`; ``whole`` says whether they do now."""

    frees_weights = True

    def __init__(self, module: nn.Module, params: Sequence[nn.Parameter],
                 optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
                 precision: Precision, place: ZeroPlace, stage: int) -> None:
        for p in params:  # each weight alone in its storage, which can then be freed
            if (p.storage_offset() or not p.is_contiguous()
                    or p.untyped_storage().nbytes() != p.numel() * p.element_size()):
                p.data = p.data.clone(memory_format=torch.contiguous_format)
        super().__init__(module, params, optimizer, precision, place, stage)
        self._nbytes = [p.untyped_storage().nbytes() for p in self._params]
        self.whole = True
        self.reshard()

    def unshard(self, action: Action) -> None:
        """``UNSHARD``: the full weights, gathered from every replica's chunks (a collective
        over the replicas; ``action`` names it in a timeout's message)."""
        if self.whole:
            raise ScheduleError(f"stage {self._stage} runs {action} with its weights whole "
                                "already; each UNSHARD follows the last one's RESHARD")
        self.allocate(whole=True)
        self._all_gather(action)

    def reshard(self) -> None:
        """``RESHARD``: the full weights' storage freed; the chunks stay."""
        self.allocate(whole=False)

    def allocate(self, *, whole: bool) -> None:
        """Give the full weights their storage (values undefined) or free it."""
        for p, n in zip(self._params, self._nbytes, strict=True):
            p.untyped_storage().resize_(n if whole else 0)
        self.whole = whole


def stage_optimizer(module: nn.Module, params: Sequence[nn.Parameter],
                    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
                    precision: Precision, place: ZeroPlace | None, stage: int
                    ) -> MasterWeights | ZeroShards:
    """The optimizer of stage ``stage``'s ``params``: sharded where ``place`` is active (its
    weights too at level 3), otherwise whole (with master weights under a 16-bit
    ``precision``)."""
    if place is None or not place.active:
        return MasterWeights(module, params, optimizer, precision)
    if place.level >= SHARDED_LEVEL:
        return ZeroParams(module, params, optimizer, precision, place, stage)
    return ZeroShards(module, params, optimizer, precision, place, stage)


def sharded_weights(zero: ZeroShards | None, action: Action) -> ZeroParams:
    """The level-3 shards a schedule's ``UNSHARD``/``RESHARD`` ``action`` works on."""
    if not isinstance(zero, ZeroParams):
        raise ScheduleError(
            f"the schedule runs {action} on stage {action.stage}, which does not shard its "
            "weights (ZeRO level 3 on a replicated stage); build the schedule with the "
            "stages' ZeRO levels")
    return zero


def check_gathers(zero: ZeroShards | None, actions: Iterable[Action], stage: int) -> None:
    """A level-3 stage's action list must gather its weights before using them."""
    if isinstance(zero, ZeroParams) and not any(a.kind is ActionKind.UNSHARD
                                                for a in actions):
        raise ScheduleError(
            f"stage {stage} shards its weights between uses (ZeRO level 3) but its schedule "
            "never gathers them (no UNSHARD); build the schedule with the stages' ZeRO levels")


@contextmanager
def gathered(shards: Iterable[ZeroShards | None]) -> Iterator[None]:
    """The level-3 weights among ``shards`` whole for the while (evaluation); a collective
    over each stage's replicas, which all enter it."""
    held = [z for z in shards if isinstance(z, ZeroParams) and not z.whole]
    for z in held:
        z.unshard(Action(ActionKind.UNSHARD, z.stage, 0))
    try:
        yield
    finally:
        for z in held:
            z.reshard()


@contextmanager
def writable(master: MasterWeights | ZeroShards) -> Iterator[None]:
    """Level-3 weights with their storage for the while (values undefined), so that a
    ``load_state_dict`` can write them; nothing for any other stage."""
    if not isinstance(master, ZeroParams) or master.whole:
        yield
        return
    master.allocate(whole=True)
    try:
        yield
    finally:
        master.reshard()
