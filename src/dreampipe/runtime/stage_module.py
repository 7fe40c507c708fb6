"""One rank's share of the model: its layers, live weights and stashed versions.

Each forward runs on a *version* of the weights and its backward on the same
one (weight stashing, copy-on-write, vertical sync: :mod:`.versions`);
buffers are not versioned. ``stash=False`` is PipeDream's naive pipelining.
Weight gradients of an update add up in one buffer per parameter
(:class:`~dreampipe.runtime.fused.LinearGradients`), and the backward that
completes a round reports each gradient as it becomes final, so its
all-reduce bucket starts during the backward (:mod:`.gradient_harvest`,
:mod:`.buckets`). The rules: docs/design.md §5.1 and §5.3.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import nullcontext

import torch
from torch import Tensor, nn

from dreampipe.errors import PlanError
from dreampipe.runtime.block_recompute import BlockRecompute, checkpoint_blocks
from dreampipe.runtime.fused import (
    DeferredGradients,
    GradientSum,
    LinearGradients,
    fuse_linear_gradients,
    fused_indices,
)
from dreampipe.runtime.gradient_harvest import GradientHarvest
from dreampipe.runtime.input_writes import InputWrites
from dreampipe.runtime.precision import Precision
from dreampipe.runtime.recompute import Replay, check_inputs_kept, record, replay
from dreampipe.runtime.slots import ParameterSlots
from dreampipe.runtime.split_backward import WeightWork, input_gradient, weight_gradients
from dreampipe.runtime.stage_records import InFlight, StageInput, scalar_loss, tensor_output
from dreampipe.runtime.versions import WeightVersions
from dreampipe.runtime.zero import ZeroPlace, ZeroShards
from dreampipe.runtime.zero_params import ZeroParams, stage_optimizer, writable

__all__ = ["StageModule"]

_log = logging.getLogger(__name__)

LossFn = Callable[[Tensor, Tensor], Tensor]


class StageModule:
    """Layers ``module`` of pipeline stage ``stage`` with its optimizer and versions.

    ``input_grad``: whether the stage sends a gradient back (stages after the
    first). The last stage's ``forward`` gets the target and returns the loss.
    ``linear`` says how ``nn.Linear`` layers make their weight gradients
    (:class:`~dreampipe.runtime.fused.LinearGradients`; PLAIN compares kernels alike).
    ``recompute``: keep only each microbatch's input and run the forward again, on the
    same version, in its backward (:mod:`.recompute`). ``blocks``: recompute some blocks
    or their attention instead (:mod:`.block_recompute`). ``precision``: 16-bit weights
    step 32-bit master copies; sends cross in the compute dtype (:mod:`.precision`).
    ``zero``: the stage's ZeRO level and this rank's replica (:mod:`.zero`).
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
        *,
        stage: int,
        input_grad: bool,
        stash: bool = True,
        vertical_sync: bool = False,
        loss_fn: LossFn | None = None,
        linear: LinearGradients = LinearGradients.FUSED,
        recompute: bool = False,
        blocks: BlockRecompute | None = None,
        precision: Precision = Precision.FP32,
        zero: ZeroPlace | None = None,
    ) -> None:
        self.module = module
        self.recompute = recompute
        self.stage = stage
        self.input_grad = input_grad
        self.stash = stash
        self.vertical_sync = vertical_sync
        self.loss_fn = loss_fn
        #: The blocks (or attention modules) that recompute in the backward.
        self.recomputed = checkpoint_blocks(module, blocks, index=stage, whole_stage=recompute)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self.precision = precision
        precision.adopt(module)
        self._master = stage_optimizer(module, self._params, optimizer, precision, zero, stage)
        self.optimizer = self._master.optimizer
        self._slots = ParameterSlots(module, self._params)
        self._grads = GradientSum(self._params, fused=linear is LinearGradients.FUSED)
        self._held = DeferredGradients(self._grads)
        #: Whether each microbatch's gradient is reduce-scattered as it ends (ZeRO-2).
        self._sharded = self.zero is not None and self.zero.shards_gradients
        self._harvest = GradientHarvest(self._grads, self._held, sharded=self._sharded)
        self._fused: frozenset[int] = frozenset()
        self._writes = InputWrites(module, stage, applies=input_grad)
        if linear is not LinearGradients.AUTOGRAD:
            fuse_linear_gradients(module, self._names, self._held)
            self._fused = fused_indices(module, self._names)
        self._weight_work: dict[int, tuple[InFlight, Tensor | None, WeightWork | None]] = {}
        self._versions = WeightVersions(self._params, stage=stage,
                                        on_leaf=self._harvest.leaf_done,
                                        on_drop=self._harvest.harvest)
        self._inflight: dict[int, InFlight] = {}
        uses = self._master if isinstance(self._master, ZeroParams) else None
        #: ZeRO-3: a forward saves its weights as references; a backward frees what it
        #: gathered when it ends (:mod:`.zero_params`).
        self._saving = uses.saving if uses else nullcontext
        self.backward_scope = uses.backward if uses else nullcontext

    # ---- versions --------------------------------------------------------
    @property
    def params(self) -> list[nn.Parameter]:
        """The trained parameters, in gradient index order (registration order)."""
        return self._params

    @property
    def module_param_names(self) -> list[str]:
        """The trained parameters' names in the module, in :attr:`params` order."""
        return self._names

    @property
    def version(self) -> int:
        """The live weights' version number, one more per update."""
        return self._versions.version

    @property
    def peak_versions(self) -> int:
        """The most weight versions stored at once."""
        return self._versions.peak

    @property
    def versions_held(self) -> int:
        """Stored weight versions, the live one included when a microbatch uses it."""
        return len(self._versions)

    def resume_at(self, version: int) -> None:
        """Count weight versions on from ``version``, a resumed checkpoint's."""
        self._versions.resume_at(version)

    @property
    def versions(self) -> WeightVersions:
        """The stashed weight versions (staleness compensation turns their prediction on)."""
        return self._versions

    def note_version(self, number: int) -> None:
        """Vertical sync: the newest received microbatch runs on ``number``; older ones may go."""
        self._versions.note(number)

    # ---- compute ---------------------------------------------------------
    def forward(
        self,
        microbatch: int,
        x: StageInput,
        *,
        version: int | None = None,
        target: Tensor | None = None,
        scale: float = 1.0,
        update: int | None = None,
    ) -> Tensor:
        """Run ``microbatch``; returns the output (or, with ``target``, the unscaled loss).

        ``version`` (vertical sync) picks a stored version; None uses the newest.
        ``scale`` multiplies the loss before the backward (microbatch share).
        ``update``: the segment's update the microbatch's gradient goes into (weight
        prediction, :class:`~.versions.WeightVersions`).
        """
        if self.input_grad and isinstance(x, Tensor) and x.is_floating_point():
            x.requires_grad_(True)
        if self.stash and self.recompute:
            v = self._versions.acquire(version, update)
            again = self._record(x)
            with torch.no_grad():
                _, report = self._writes.run_without_grad(
                    lambda y: self._compute(v.tensors, y, target, scale), x)
            check_inputs_kept(again, self.stage)
            self._inflight[microbatch] = InFlight(x, None, v, target, scale, again)
            return report
        if self.stash:
            v = self._versions.acquire(version, update)
            out, report = self._writes.run(lambda: self._compute(v.tensors, x, target, scale),
                                           x)
            self._inflight[microbatch] = InFlight(x, out, v, target, scale)
            return report
        # no stashing: the backward runs the forward again on the live weights, with the
        # random draws and buffers this one saw (dropout's masks, BatchNorm's running
        # statistics moved once), as a recomputing stage does
        again = self._record(x)
        with torch.no_grad():
            _, report = self._writes.run_without_grad(
                lambda y: self._compute(None, y, target, scale), x)
        check_inputs_kept(again, self.stage)
        self._inflight[microbatch] = InFlight(x, None, None, target, scale, again)
        return report

    def _record(self, x: StageInput) -> Replay:
        """What a forward about to run on ``x`` reads besides it, to run it again."""
        device = x.device if isinstance(x, Tensor) else next(
            (p.device for p in self._params), torch.device("cpu"))
        return record(device, self.module, x)

    def _compute(
        self, tensors: list[Tensor] | None, x: StageInput, target: Tensor | None,
        scale: float,
    ) -> tuple[Tensor, Tensor]:
        """(tensor to differentiate, what forward reports: output or unscaled loss)."""
        if self.stage == 0:
            x = self.precision.model_inputs(x)
        x = self._writes.input(x)  # type: ignore[assignment]
        args = x if isinstance(x, tuple) else (x,)
        with self._saving():
            out = self.module(*args) if tensors is None else self._slots.call(tensors, args)
        if target is None:
            out = self.precision.sent(tensor_output(out, f"stage {self.stage} returned"))
            return out, out
        if self.loss_fn is None:
            raise PlanError(f"stage {self.stage} got a target but has no loss function")
        loss = scalar_loss(self.loss_fn(self.precision.loss_input(out), target))
        return (loss * scale if scale != 1.0 else loss), loss.detach()

    def backward(
        self,
        microbatch: int,
        grad: Tensor | None = None,
        *,
        on_ready: Callable[[int, Tensor], None] | None = None,
        hold: bool = False,
    ) -> Tensor | None:
        """Backward of ``microbatch``: accumulate weight gradients, return the input's gradient.

        ``grad`` is the gradient of the stage output (None on the last stage,
        whose output is the loss). Autograd accumulates the weight gradients on
        the version's tensors (microbatches sharing a version, like the microbatches
        of one update, add up there without extra copies); they move to the
        update at the next all-reduce or step, or when the version is freed.

        ``on_ready`` marks the backward that completes a round: it is called
        once per parameter, ``on_ready(index, gradient)``, as soon as that
        parameter's gradient summed over the whole round is final (mostly
        during the backward, the rest before this returns). The gradient
        tensor is the one :meth:`gradients` returns until the next step.
        ``hold`` (not with ``on_ready``) keeps Linear weight GEMMs for :meth:`run_held`.
        """
        self._held.run()
        st = self._inflight.pop(microbatch)
        if st.version is None:  # no stashing: again, on the live weights
            v = self._versions.acquire(None)
            out = self._again(st, v.tensors)
        elif st.replay is not None:
            v, out = st.version, self._again(st, st.version.tensors)
        else:
            assert st.output is not None
            v, out = st.version, st.output
        x = st.input if isinstance(st.input, Tensor) else None
        want_input = self.input_grad and x is not None and x.requires_grad
        inputs = [x, *v.tensors] if want_input and x is not None else v.tensors
        self._held.holding = hold and on_ready is None
        try:
            with self._harvest.round(on_ready, v):
                if inputs:  # a frozen stage of the input's has nothing to differentiate
                    torch.autograd.backward(out, grad, inputs=inputs)
        finally:
            self._held.holding = False
        self._harvest.touch(v)
        self._versions.release(v)
        return x.grad if want_input and x is not None else None

    def backward_input(self, microbatch: int, grad: Tensor | None = None) -> Tensor | None:
        """Zero Bubble's ``B`` of ``microbatch``: its input's gradient (:mod:`.split_backward`);
        the weight gradients wait for :meth:`backward_weight`. A stage with no input
        gradient to send (the first) leaves the whole backward to ``W``."""
        st = self._inflight.pop(microbatch)
        assert st.version is not None, "B/W split needs stashing"
        if st.replay is not None:
            st.output, st.replay = self._again(st, st.version.tensors), None
        assert st.output is not None
        x = st.input if isinstance(st.input, Tensor) else None
        if not (self.input_grad and x is not None and x.requires_grad):
            self._weight_work[microbatch] = (st, grad, None)
            return None
        gx, work = input_gradient(st.output, grad, x, st.version.tensors, self._held,
                                  self._fused)
        st.output = None
        self._weight_work[microbatch] = (st, None, work)
        return gx

    def backward_weight(self, microbatch: int) -> None:
        """Zero Bubble's ``W`` of ``microbatch``: its weight gradients, added to the update's as
        :meth:`backward` adds them."""
        st, grad, work = self._weight_work.pop(microbatch)
        if work is None:
            self._inflight[microbatch] = st
            self.backward(microbatch, grad)
            return
        assert st.version is not None
        weight_gradients(work, self._held, self._grads.add_grad)
        self._versions.release(st.version)

    def _again(self, st: InFlight, tensors: list[Tensor]) -> Tensor:
        """The forward of ``st`` run again on ``tensors`` for its backward (a recomputing
        stage's, on its version; without stashing, on the live weights)."""
        assert st.replay is not None
        out: Tensor = replay(st.replay, self.module,
                             lambda: self._compute(tensors, st.input, st.target, st.scale)[0])
        return out

    def run_held(self) -> None:
        """The weight GEMMs a ``hold`` backward kept (its input gradient is on its way)."""
        self._held.run()

    # ---- update ----------------------------------------------------------
    @property
    def zero(self) -> ZeroShards | None:
        """The stage's ZeRO shards (:mod:`.zero`), None without."""
        return self._master if isinstance(self._master, ZeroShards) else None

    @property
    def optimized(self) -> list[nn.Parameter]:
        """What the optimizer steps, in :attr:`params` order: the parameters, or their
        32-bit master copies (:mod:`.precision`)."""
        return self._master.masters

    def state_dict(self) -> dict[str, Tensor]:
        """The stage's state, its weights at the optimizer's precision (the masters')."""
        return self._master.state(self.module)

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Load :meth:`state_dict`'s entries (the master weights from their values)."""
        with writable(self._master):  # ZeRO-3: into the chunks, the full weights freed again
            self.module.load_state_dict(state)
        self._master.load(state, self._names)

    def gradients(self) -> list[Tensor]:
        """The accumulated weight gradients (zeros where none arrived), for all-reduce."""
        self._harvest.harvest_all()
        return [self._grads.filled(i) for i in range(len(self._params))]

    def pop_gradients(self) -> list[Tensor]:
        """The microbatch's whole weight gradient (zeros where none arrived), which starts
        again: what ZeRO-2 reduce-scatters after a ``W`` (:mod:`.zero_buckets`)."""
        self._harvest.harvest_all()
        return [self._grads.pop(i) for i in range(len(self._params))]

    def used_mask(self) -> Tensor:
        """1 where this replica's microbatches gave parameter ``i`` a gradient this update,
        else 0: what the replicas sum to agree on which parameters get one."""
        self._harvest.harvest_all()
        used = self._grads.used()
        device = self._params[0].device if self._params else None
        return torch.tensor([float(i in used) for i in range(len(self._params))],
                            dtype=torch.float32, device=device)

    def close_update(self) -> None:
        """The update's gradients are whole: later backwards add to the next update's
        (a deferred ``STEP``'s all-reduce in flight, :mod:`dreampipe.scheduling.updates`)."""
        self._harvest.harvest_all()
        self._grads.close()

    def reduced(self, used: Sequence[bool]) -> None:
        """The update's gradients were all-reduced over the replicas: each counts where
        some replica's microbatches used the parameter (``used``, the replicas'
        :meth:`used_mask` summed), zeros included; the others get no gradient, as in
        one process, so that weight decay and momentum leave them be."""
        if self.zero is not None and self.zero.shards_gradients:
            self._grads.take()  # ZeRO-2: the full sums go, the replica keeps its shard
            self.zero.no_gradient(i for i, u in enumerate(used) if not u)
        else:
            self._grads.arrive(i for i, u in enumerate(used) if u)

    def step(self, *, apply: bool = True) -> None:
        """Apply the accumulated gradient to the live weights (copy-on-write, :mod:`.versions`).

        ``apply=False`` drops the gradient instead (a skipped update): the
        weights and the optimizer's state stay as they were.
        """
        self._harvest.harvest_all()
        self._versions.retire()
        sums = self._grads.take()
        if apply:
            self._master.step(sums)
        self._versions.advance()
        _log.debug("stage %d at version %d holds %s", self.stage, self.version,
                   sorted(self._versions))

    # ---- weights tied across stages (:mod:`.stage_ties`) -----------------
    def tied_gradient(self, index: int) -> Tensor:
        """Parameter ``index``'s gradient of the update so far, zeros where none came;
        whole, where the replicas shard it (a collective over them, :mod:`.zero`)."""
        self._harvest.harvest_all()
        if self._sharded:
            assert self.zero is not None
            return self.zero.whole_gradient(index)
        return self._grads.filled(index)

    def tied_used(self, index: int) -> bool:
        """Whether some replica's microbatches gave parameter ``index`` a gradient this
        update (asked after the replicas' ``ALLREDUCE``)."""
        self._harvest.harvest_all()
        if self._sharded:
            assert self.zero is not None
            return self.zero.has_gradient(index)
        return self._grads.has(index)

    def keep_tied(self, index: int, total: Tensor | None) -> None:
        """Parameter ``index``'s gradient of the update is ``total`` (its tie's sum; None:
        no copy used it, so none); a replica that shards its gradients keeps its chunk."""
        if self._sharded:
            assert self.zero is not None
            self.zero.keep_gradient(index, total)
        else:
            self._grads.keep(index, total)
