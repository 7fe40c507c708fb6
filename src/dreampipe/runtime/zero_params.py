"""ZeRO level 3: a replicated stage's weights sharded over its replicas between uses.

The rule (Rajbhandari et al. 2020, §5.3; torch's pipelining ``UNSHARD``/``RESHARD``): on
top of level 2 (:mod:`.zero`), each replica keeps only its chunks of the weights between
uses, as tensors of their own (the optimizer's chunk parameters, or under ``bf16`` their
32-bit masters), and the full weights' storage is freed (``untyped_storage().resize_(0)``,
as FSDP does: every view of it, a weight version's tensors included, is freed with it).
Per use (FSDP's rule, where the replicas run as many microbatches in each update, so that
their gathers pair up): a module's forward gathers the weights it holds itself and frees
them after; a weight the backward needs is saved as a reference and gathered again into a
tensor of its own when unpacked. Per update otherwise: ``UNSHARD<k>`` gathers all of them
and ``RESHARD<k>`` frees them (:mod:`dreampipe.scheduling.unshard`). The update steps the
chunks alone (a bf16 stage gathers its masters' rounding). Only synchronous schedules: an
asynchronous one keeps a weight version per minibatch in flight. Evaluation and a
checkpoint's weights gather them for the while
(:func:`gathered`). docs/design.md §5.6.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor, nn

from dreampipe.errors import ConfigError, ScheduleError
from dreampipe.profiling.heap import glibc
from dreampipe.runtime.precision import MasterWeights, Precision
from dreampipe.runtime.zero import ZeroPlace, ZeroShards
from dreampipe.scheduling.actions import Action, ActionKind
from dreampipe.scheduling.unshard import SHARDED_LEVEL

__all__ = ["ZeroParams", "check_gathers", "gathered", "sharded_weights", "stage_optimizer",
           "writable"]


@dataclass(frozen=True)
class _Saved:
    """A weight autograd saved, kept as which parameter and which view of it."""

    index: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


class ZeroParams(ZeroShards):
    """:class:`~.zero.ZeroShards` at level 3 (module docstring): the full weights exist only
    in use; ``whole`` says whether all of them do now."""

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
        self._whole = [True] * len(self._params)
        self._at: dict[int, int] = {}  # a whole weight's storage address: its index
        self._pinned = self._in_backward = False
        self._differ: Tensor | None = None  # some gather per use paired other weights
        #: Whether the weights are gathered per use (else per update, at ``UNSHARD``):
        #: where the replicas run as many microbatches in every update, so that their
        #: per-use gathers pair up (:func:`~dreampipe.scheduling.unshard.pairs_per_use`).
        self.per_use = False
        index = {id(p): i for i, p in enumerate(self._params)}
        for sub in module.modules():  # a unit: the weights a module holds itself
            mine = [index[id(p)] for p in sub._parameters.values()
                    if p is not None and id(p) in index]
            if mine:
                sub.register_forward_pre_hook(lambda _m, _a, ix=mine: self._use(ix))
                sub.register_forward_hook(lambda _m, _a, _o, ix=mine: self._used(ix))
        self.reshard()
        libc = glibc()
        if libc is not None:  # weights made before the run lie inside the heap: give their
            libc.malloc_trim(0)  # pages back, as a resident size that is what lives shows

    @property
    def whole(self) -> bool:
        """Whether every weight is whole now."""
        return all(self._whole)

    def unshard(self, action: Action) -> None:
        """``UNSHARD``: per update, every weight gathered; per use, nothing yet (each
        module's forward and each saved weight's backward gathers what it needs)."""
        if self.whole and self._params:
            raise ScheduleError(f"stage {self._stage} runs {action} with its weights whole "
                                "already; each UNSHARD follows the last one's RESHARD")
        if not self.per_use:
            self.gather_all(action)

    def gather_all(self, action: Action) -> None:
        """Every weight whole, gathered from every replica's chunks (a collective over the
        replicas; ``action`` names it in a timeout's message)."""
        self.allocate(whole=True)
        self._all_gather(action)

    def reshard(self) -> None:
        """``RESHARD``: the full weights' storage freed; the chunks stay. Before the update,
        the gathers per use are checked: replicas that gathered different weights for one
        use (a forward that takes another path on other data) stop it here."""
        self.allocate(whole=False)
        differ, self._differ = self._differ, None
        if differ is not None and bool(differ):
            raise ScheduleError(
                f"stage {self._stage}'s replicas gathered different weights for one use: its "
                "forward takes another path on other data (routing, a branch, layer drop), "
                "which ZeRO level 3's gathers per use cannot follow; shard this stage at "
                "zero=2 or below")

    def allocate(self, *, whole: bool, only: Sequence[int] | None = None) -> None:
        """Give the weights (``only`` those) their storage (values undefined) or free it."""
        for i in range(len(self._params)) if only is None else only:
            storage = self._params[i].untyped_storage()
            self._at.pop(storage.data_ptr(), None)
            storage.resize_(self._nbytes[i] if whole else 0)
            if whole:
                self._at[storage.data_ptr()] = i
            self._whole[i] = whole

    # ---- per use: module hooks and saved tensors ----------------------------
    def _use(self, ix: Sequence[int]) -> None:
        """Before a module's forward: its weights whole (one all-gather)."""
        missing = [i for i in ix if not self._whole[i]]
        if self._pinned or not missing or not self.per_use:
            return
        for same in self._by_dtype(missing):
            out, b = self._gather_out(same)  # before the weights' storage: no copy beside both
            self.allocate(whole=True, only=same)
            for k, i in enumerate(same):
                self.layout.copy_whole(i, out, b, k, self._params[i].detach().view(-1))

    def _by_dtype(self, ix: Sequence[int]) -> list[list[int]]:
        """Weights ``ix`` in groups of one dtype, in order of first appearance: one
        gather each, so that no weight is cast to another's dtype on the way."""
        groups: dict[torch.dtype, list[int]] = {}
        for i in ix:
            groups.setdefault(self._params[i].dtype, []).append(i)
        return list(groups.values())

    def _used(self, ix: Sequence[int]) -> None:
        """After a module's forward: its weights freed (not while pinned whole, nor in a
        backward, whose recomputed forwards keep them for the backward that follows)."""
        if self.per_use and not (self._pinned or self._in_backward):
            self.allocate(whole=False, only=[i for i in ix if self._whole[i]])

    def _gather_out(self, ix: Sequence[int]) -> tuple[Tensor, Any]:
        """Every replica's chunks of weights ``ix`` (of one dtype, :meth:`_by_dtype`) and
        their bucket: one all-gather (a collective over the replicas, which all make the
        same ones), its send buffer freed once done."""
        b = self.layout.unit(ix, self._params[ix[0]].dtype)
        out, work = self.layout.gather(b, [self.masters[i].detach() for i in ix], self.group)
        self._waited(work, Action(ActionKind.UNSHARD, self._stage, 0))
        del work
        differ = self.layout.tags_differ(out, b)
        self._differ = differ if self._differ is None else self._differ | differ
        return out, b

    def _gather(self, ix: Sequence[int]) -> list[Tensor]:
        """Weights ``ix`` whole (1-D, fresh tensors) from every replica's chunks."""
        whole: dict[int, Tensor] = {}
        for same in self._by_dtype(ix):
            out, b = self._gather_out(same)
            whole.update((i, self.layout.whole(i, out, b, k)) for k, i in enumerate(same))
        return [whole[i] for i in ix]

    def _pack(self, t: Tensor) -> Any:
        """A tensor autograd saves: a view of a weight is kept as which one (gathered
        again when the backward unpacks it), anything else as it is."""
        if not (self._at and self.per_use):
            return t
        try:
            i = self._at.get(t.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):  # a tensor without storage of its own
            return t
        if i is None or t.dtype != self._params[i].dtype:
            return t
        return _Saved(i, tuple(t.size()), tuple(t.stride()), int(t.storage_offset()))

    def _unpack(self, saved: Any) -> Tensor:
        if not isinstance(saved, _Saved):
            return cast(Tensor, saved)
        i = saved.index
        full = (self._params[i].detach().view(-1) if self._whole[i]
                else self._gather([i])[0])
        return full.as_strided(saved.size, saved.stride, saved.offset)

    @contextmanager
    def saving(self) -> Iterator[None]:
        """Around a forward: the weights it saves for its backward kept as references. A
        weight read while sharded, whose module the forward did not call
        (``F.linear(x, self.fc.weight)`` in its parent's forward), stops it with the fix."""
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        except RuntimeError as exc:
            if not self.per_use or "storage of size 0" not in str(exc):
                raise
            raise ConfigError(
                f"zero=3 on stage {self._stage}: its forward read a weight whose module it "
                "did not call (such as F.linear(x, self.fc.weight) in the parent's "
                "forward), which ZeRO level 3 had not gathered: it gathers a module's "
                "weights as that module runs; call the module (self.fc(x)), or shard this "
                "stage at zero=2 or below", "zero") from exc

    @contextmanager
    def backward(self) -> Iterator[None]:
        """Around a backward (or ``W``): what its recomputed forwards gather stays whole
        until it ends, then goes."""
        outer, self._in_backward = self._in_backward, True
        try:
            yield
        finally:
            self._in_backward = outer
            if self.per_use and not (self._pinned or outer):
                self.allocate(whole=False, only=[i for i, w in enumerate(self._whole) if w])

    @contextmanager
    def pinned(self, action: Action) -> Iterator[None]:
        """Every weight whole for the while (evaluation), then freed."""
        self.gather_all(action)
        self._pinned = True
        try:
            yield
        finally:
            self._pinned = False
            self.reshard()


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
    held = [z for z in shards if isinstance(z, ZeroParams)]
    with ExitStack() as stack:
        for z in held:
            stack.enter_context(z.pinned(Action(ActionKind.UNSHARD, z.stage, 0)))
        yield


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
