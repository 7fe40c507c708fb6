"""Checks of a Pipeline's inputs that every rank runs before anything is sent.

Each rank sees the same model, example, loss, optimizer factory and batch
stream, so each raises the same error at the same point and no peer is
left waiting. The model check runs the whole model on the ``meta`` device
(shapes only, no memory, no compute), stage by stage.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import logging
from collections.abc import Callable, Mapping, Sequence
from enum import Enum
from typing import Any

import torch
from torch import Tensor, nn

from dreampipe.api.config import TrainConfig
from dreampipe.errors import ConfigError, PlanError, ScheduleError
from dreampipe.planning.plan import Plan
from dreampipe.runtime.precision import check_made
from dreampipe.runtime.stage_records import scalar_loss, tensor_output
from dreampipe.scheduling.actions import ScheduleKind
from dreampipe.scheduling.agreement import check_agreement
from dreampipe.scheduling.unshard import ASYNC_REASON, SHARDED_LEVEL
from dreampipe.splitter.chain import Chain, Layers
from dreampipe.splitter.fx_tracer import call_on_meta, on_meta

__all__ = [
    "Batch", "Inputs", "check_arguments", "check_counted_targets", "check_example",
    "check_loss_signature", "check_optimizer",
    "check_plan", "check_schedule", "check_schedulers", "check_split", "check_stages_on_meta",
    "check_stages_per_rank", "check_virtual", "map_inputs", "mode_warning", "packing_warning",
    "refuse_legacy",
]

_log = logging.getLogger(__name__)

#: A model's input: a tensor, a tuple of tensors, or a dict of keyword arguments.
Inputs = Tensor | tuple[Tensor, ...] | dict[str, Tensor]
#: A minibatch: the input and the target.
Batch = tuple[Inputs, Tensor]


def map_inputs(x: Inputs, fn: Callable[[Tensor], Tensor]) -> Inputs:
    """``fn`` applied to each tensor of the input, keeping its tuple or dict."""
    if isinstance(x, dict):
        return {k: fn(t) for k, t in x.items()}
    return tuple(fn(t) for t in x) if isinstance(x, tuple) else fn(x)


def check_arguments(config: TrainConfig, plan: object, example: object,
                    optimizer: Callable[[list[nn.Parameter]], Any]) -> None:
    """A Pipeline's arguments, before anything runs: :func:`check_virtual`,
    :func:`check_example` and :func:`check_optimizer`."""
    check_virtual(config, plan)
    check_example(example, config.variable_dims)
    check_optimizer(optimizer)


def check_example(example: object, variable_dims: Sequence[int]) -> None:
    """``example`` must be one minibatch, ``(inputs, target)``: the inputs a tensor, or a
    tuple or dict of them, and the target a tensor with a batch dimension; each of
    ``variable_dims`` a dimension one of them has (a typo would declare nothing)."""
    pair = example if isinstance(example, tuple | list) and len(example) == 2 else (None, None)
    inputs, target = pair
    parts = (list(inputs.values()) if isinstance(inputs, dict) else list(inputs)
             if isinstance(inputs, tuple) else [inputs])
    tensors = [t for t in (*parts, target) if isinstance(t, Tensor)]
    if not (isinstance(target, Tensor) and target.dim() >= 1 and parts
            and len(tensors) == len(parts) + 1):
        raise ConfigError(f"example={type(example).__name__}: give one minibatch as "
                          "(inputs, target), tensors with the batch first, e.g. "
                          "example=next(iter(loader))", "example")
    most = max(t.dim() for t in tensors)
    beyond = [d for d in variable_dims if d >= most]
    if beyond:
        raise ConfigError(f"variable_dims={tuple(variable_dims)}: the example's tensors have "
                          f"dimensions 0..{most - 1}, none {beyond[0]}; give dimensions they "
                          "have, e.g. (1,) for the sequence of [batch, sequence] tokens",
                          "variable_dims")


def mode_warning(model: nn.Module) -> str | None:
    """What to say where no module of ``model`` is in training mode: it trains in the
    modes the user left, as one process would (a BatchNorm put in eval mode on purpose
    stays frozen), and a whole model in eval mode is more likely an oversight."""
    if any(m.training for m in model.modules()):
        return None
    return (f"{type(model).__name__} is in eval mode (Hugging Face's from_pretrained "
            "returns models so), and trains in it, as one process would: dropout off, "
            "BatchNorm's running statistics frozen; call model.train() before "
            "Pipeline(...) to train in training mode")


def check_optimizer(factory: Callable[[list[nn.Parameter]], Any]) -> None:
    """The factory must return a ``torch.optim.Optimizer``, tried early on a one-element
    stand-in parameter; a factory that cannot take one (it looks its parameters up by
    identity) is checked on each stage's own parameters instead."""
    if not callable(factory):
        raise ConfigError(f"optimizer={factory!r}: give a function of a stage's parameters "
                          "that returns its optimizer, e.g. optimizer=lambda params: "
                          "torch.optim.AdamW(params, lr=3e-4)", "optimizer")
    try:
        got = factory([nn.Parameter(torch.zeros(1))])
    except Exception as exc:  # the user's code, on a tensor it never saw: not its fault
        _log.debug("the optimizer factory refused a stand-in parameter (%r); it is checked "
                   "on each stage's parameters", exc)
        return
    check_made(got)


def check_schedulers(schedulers: Mapping[int, Any]) -> None:
    """A scheduler the Pipeline steps after every update must step without a metric."""
    for scheduler in schedulers.values():
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise ConfigError(
                "lr_scheduler made a ReduceLROnPlateau, whose step() needs a metric the "
                "Pipeline, stepping it after every update, does not have; give no "
                "lr_scheduler and step your own on the rank's optimizer: plateau = "
                "ReduceLROnPlateau(pipe.module.optimizer), then plateau.step(pipe.evaluate("
                "held_out).loss)", "lr_scheduler")


def check_plan(plan: Plan, names: Sequence[str], world: int) -> None:
    """The plan must cover exactly the model's layers and use every rank."""
    if plan.num_layers != len(names):
        raise PlanError(
            f"the plan covers {plan.num_layers} layers but the model has {len(names)}; plan "
            "this model (plan='auto')"
        )
    if plan.layer_names and tuple(plan.layer_names) != tuple(names):
        i = next(i for i, (a, b) in enumerate(zip(plan.layer_names, names, strict=True)) if a != b)
        raise PlanError(
            f"the plan is for another model: its layer {i} is {plan.layer_names[i]!r}, the "
            f"model's is {names[i]!r}; plan this model (plan='auto')"
        )
    if plan.workers_used != world:
        raise PlanError(
            f"the plan {plan.config} uses {plan.workers_used} workers but {world} were started; "
            f"start {plan.workers_used} or plan for {world} (plan='auto')"
        )


def check_stages_on_meta(
    layers: Layers, plan: Plan, example: Batch, loss_fn: Callable[..., Any], microbatch_size: int
) -> None:
    """Every stage but the last returns one tensor, and the loss of the last one's
    output (whatever the model returns) is a scalar.

    Runs on the meta device with the example's first ``microbatch_size`` samples. A
    model or loss that cannot run on meta (an op without a meta kernel, a
    data-dependent shape) skips the check with a debug log line; the runtime
    then raises the same errors at the first forward.
    """
    check_loss_signature(loss_fn)
    first = map_inputs(example[0], lambda t: on_meta(t[:microbatch_size]))
    x: Any = first if isinstance(first, tuple) else (first,)
    shared = _shared_buffers(layers, plan)
    written: set[int] = set()
    try:
        for s, st in enumerate(plan.stages):
            stage = Chain(layers[st.first : st.last + 1])
            where = f"stage {s} (layers {st.first}..{st.last}, {layers[st.last][0]!r} last) returns"
            names: set[str] = set()
            out = call_on_meta(stage, x, written=names)
            written.update(id(b) for n, b in stage.named_buffers() if n in names)
            x = (tensor_output(out, where) if s < len(plan.stages) - 1 else out,)
        loss = loss_fn(x[0], on_meta(example[1][:microbatch_size]))
    except PlanError:
        raise
    except (RuntimeError, NotImplementedError, TypeError, ValueError) as exc:
        _log.debug("meta-device dry run not possible: %s", exc)
        _refuse_written(shared, written | _running_stats(layers))
        return
    _refuse_written(shared, written)
    scalar_loss(loss)


def _shared_buffers(layers: Layers, plan: Plan) -> dict[int, list[tuple[int, str]]]:
    """The buffers layers of more than one stage hold (a module called on several): by
    buffer, each stage's name of it."""
    held: dict[int, list[tuple[int, str]]] = {}
    for s, st in enumerate(plan.stages):
        for name, b in Chain(layers[st.first : st.last + 1]).named_buffers():
            held.setdefault(id(b), []).append((s, name))
    return {k: v for k, v in held.items() if len(v) > 1}


def _running_stats(layers: Layers) -> set[int]:
    """The buffers of the normalisations that track running statistics: written by every
    forward in training, where the dry run could not show it."""
    norms = (m for _, layer in layers for m in layer.modules()
             if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats)
    return {id(b) for m in norms for b in m.buffers()}


def _refuse_written(shared: dict[int, list[tuple[int, str]]], written: set[int]) -> None:
    """A buffer written in training and held by several stages would drift apart (each
    stage its own copy): a ConfigError naming it and the fix."""
    for key, uses in shared.items():
        if key in written:
            where = ", ".join(f"{name!r} on stage {s}" for s, name in uses)
            raise ConfigError(
                f"buffer {where} is written by its module's forward in training (running "
                "statistics, a counter) and held by several stages, each of which would "
                "keep its own copy: choose split points that keep the module's calls on one "
                "stage", "plan")


#: The ends of the class names of causal language models, whose loss shifts the labels
#: by one inside the model (Hugging Face's ``GPT2LMHeadModel``, ``LlamaForCausalLM``).
_SHIFTING = ("ForCausalLM", "LMHeadModel")


#: The target ``F.cross_entropy`` and ``F.nll_loss`` ignore unless told otherwise.
_TORCH_IGNORED = -100


def _rank_zero() -> bool:
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def _same(a: Tensor, b: Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a, b)


def _the_labels(labels: Tensor, target: Tensor) -> bool:
    """Whether ``target`` is ``labels``, or ``labels[:, 1:]`` (a causal model's shift)."""
    return _same(labels, target) or (labels.dim() > 1 and _same(labels[:, 1:], target))


def packing_warning(model: nn.Module, inputs: object) -> str | None:
    """What to say where ``inputs`` pack documents by their ``position_ids`` without an
    ``attention_mask`` into a Hugging Face model whose config keeps ``use_cache``: in
    training one process then makes a cache, beside which Hugging Face's masks do not
    see the packing and attend across documents, where the Pipeline, which runs the
    model with ``use_cache=False``, keeps each document to itself."""
    config = getattr(model, "config", None)
    if (not isinstance(inputs, Mapping) or "position_ids" not in inputs
            or "attention_mask" in inputs or not getattr(config, "use_cache", False)):
        return None
    return (f"{type(model).__name__} is given position_ids without an attention_mask and "
            "its config has use_cache=True: the Pipeline runs it with use_cache=False, "
            "where Hugging Face's masks keep packed documents apart, while one process "
            "with the cache attends across them; set model.config.use_cache = False so "
            "that both keep them apart")


def check_counted_targets(model: nn.Module, example: Batch, config: TrainConfig) -> None:
    """``ignore_index`` counts the targets given: where they are a causal language model's
    own ``labels``, which its loss shifts by one and so averages one token fewer a
    sequence over, the count would be wrong; a ConfigError naming the fix. Targets, or a
    model's own labels, that hold PyTorch's ignored -100 where the count does not read
    them draw a warning."""
    inputs, target = example
    if (config.ignore_index is None and not target.is_floating_point()
            and bool((target == _TORCH_IGNORED).any()) and _rank_zero()):
        _log.warning(
            "the example's target holds %d, the index F.cross_entropy ignores by default: "
            "each microbatch's mean then counts its own labelled targets, and the "
            "microbatches are averaged per sample, not one process's mean over the "
            "minibatch; give TrainConfig(ignore_index=%d) to count them as one process",
            _TORCH_IGNORED, _TORCH_IGNORED)
    labels = inputs.get("labels") if isinstance(inputs, Mapping) else None
    if (isinstance(labels, Tensor) and not labels.is_floating_point()
            and bool((labels == _TORCH_IGNORED).any()) and _rank_zero()
            and not (config.ignore_index is not None and _the_labels(labels, target))):
        _log.warning(
            "the inputs' labels hold %d, which the model's own loss ignores: each "
            "microbatch's loss is then a mean over its own labelled tokens, and the "
            "microbatches are weighed by what the target given counts, not as one process "
            "weighs them; give the labels the loss averages over as the target "
            "(labels[:, 1:] for a causal language model, which shifts them) with "
            "TrainConfig(ignore_index=%d)", _TORCH_IGNORED, _TORCH_IGNORED)
    if (config.ignore_index is None or not isinstance(labels, Tensor)
            or not type(model).__name__.endswith(_SHIFTING) or not _same(labels, target)):
        return
    raise ConfigError(
        f"ignore_index={config.ignore_index} counts the targets given, here the labels "
        f"{type(model).__name__} shifts by one inside its loss, which so averages over "
        "labels[:, 1:]: give target=labels[:, 1:] (keep the whole labels in the inputs)",
        "ignore_index")


def check_loss_signature(loss_fn: Callable[..., Any]) -> None:
    """``loss_fn`` must take ``(output, target)``: a mistake is found on every rank before
    anything runs, not as a TypeError on the last stage's rank alone."""
    try:
        signature = inspect.signature(loss_fn)
    except (TypeError, ValueError):  # a builtin without one: the run will tell
        return
    try:
        signature.bind(object(), object())
    except TypeError:
        raise ConfigError(
            f"loss_fn{signature} cannot be called as loss_fn(output, target), which is how "
            "the last stage calls it; give a function of the model's output and the target",
            "loss_fn") from None


def check_split(plan: Plan, config: TrainConfig) -> None:
    """What a plan of tensor-split stages cannot run with yet, each a ConfigError (a plan
    may mix split and unsplit stages, replicate the unsplit ones, recompute any)."""
    t = max(st.tensor_parallel for st in plan.stages)
    kind, max_grad_norm = config.kind, config.max_grad_norm
    if any(st.replicas > 1 and st.tensor_parallel > 1 for st in plan.stages):
        raise ConfigError(
            f"plan {plan.config} replicates stages split over {t} workers; a split stage runs "
            "one replica for now: use one replica per split stage, or no split", "plan")
    if kind is ScheduleKind.DP:
        raise ConfigError(
            f"schedule dp with plan {plan.config}: data parallelism over split groups is not "
            "supported yet; use pipedream, 1f1b-flush or gpipe", "schedule")
    if kind is ScheduleKind.TWO_BW:
        raise ConfigError(
            f"schedule 2bw with plan {plan.config}: the two weight versions of stages split "
            "over workers are not supported yet; use pipedream or 1f1b-flush", "schedule")
    if kind.splits_backward:
        raise ConfigError(
            f"schedule {kind.value} with plan {plan.config}: the zero-bubble split backward of "
            "stages split over workers is not supported yet; use 1f1b-flush", "schedule")
    if max_grad_norm is not None:
        raise ConfigError(
            f"max_grad_norm={max_grad_norm} with stages split over {t} workers: clipping by the "
            "norm of split gradients is not supported yet; drop max_grad_norm", "max_grad_norm")
    if config.number_formats.master_weights:
        raise ConfigError(
            f"precision={config.precision} with stages split over {t} workers: master weights "
            "of split weights are not supported yet; use precision='bf16-mixed'", "precision")


def check_virtual(config: TrainConfig, plan: object) -> None:
    """Several stages per rank need stages cut for them: split points or a plan, as the
    planner of ``plan="auto"`` cuts one stage per rank (a ConfigError)."""
    v = config.stages_per_rank
    if v > 1 and isinstance(plan, str) and plan == "auto":
        raise ConfigError(f"virtual_stages={v} with plan='auto'"
                          f"{'' if config.virtual_stages else f' (schedule={config.schedule})'}"
                          "; give split points "
                          f"(plan=[...]) or a plan of world x {v} stages", "virtual_stages", "plan")


def check_stages_per_rank(stages: int, virtual_stages: int, world: int,
                          replicas: int | Sequence[int] = 1) -> None:
    """``virtual_stages`` to a rank on ``world`` ranks needs ``world * v`` stages, or
    ``world * v / r`` stages each on ``r`` replicas (``r`` copies of the pipeline); given
    each stage's ``replicas``, stages whose replicas add up to ``world * v``."""
    v = virtual_stages
    if isinstance(replicas, int):
        total, want = stages * replicas, f"{world * v / replicas:g} stages" + (
            f" each on {replicas} replicas" if replicas > 1 else "")
    else:
        total, want = sum(replicas), f"stages whose replicas add up to {world * v}"
    if v > 1 and total != world * v:
        raise ConfigError(f"virtual_stages={v} on {world} workers needs {want}, not the "
                          f"plan's {stages} (of {total} replicas); give a plan of world x "
                          "virtual_stages / replicas stages", "virtual_stages", "plan")


def check_schedule(config: TrainConfig, plan: Plan) -> None:
    """The schedule's options must fit the plan's stages and replicas (the options alone
    are :class:`~dreampipe.api.config.TrainConfig`'s to check)."""
    kind, replicas = config.kind, [st.replicas for st in plan.stages]
    if kind is ScheduleKind.DP and len(replicas) != 1:
        raise ScheduleError(f"the dp schedule runs one stage on every worker, not plan "
                            f"{plan.config} of {len(replicas)} stages; use a one-stage plan "
                            f"(config like '{plan.workers_used}'), or plan='auto'")
    sharded = [s for s, (st, level) in enumerate(zip(plan.stages, plan.zero_levels(config.zero),
                                                     strict=True))
               if st.replicas > 1 and level >= SHARDED_LEVEL]
    if sharded and not kind.synchronous:
        raise ConfigError(
            f"zero=3 on stage {sharded[0]} with schedule={kind.value}: {ASYNC_REASON}; give the "
            "stage zero=2, or use a synchronous schedule", "zero", "schedule")
    vsync, max_grad_norm = config.vertical_sync, config.max_grad_norm
    if vsync or max_grad_norm is not None:
        check_agreement(kind, replicas, "vertical_sync=True" if vsync
                        else f"max_grad_norm={max_grad_norm}", "plan")


def refuse_legacy(legacy: Mapping[str, object]) -> None:
    """Keywords a Pipeline does not take: a ConfigError saying where each knob goes (a
    TrainConfig field, or the plan's split points), a TypeError for any other."""
    fields = [f.name for f in dataclasses.fields(TrainConfig)]
    moved = {k: v.value if isinstance(v, Enum) else v for k, v in legacy.items() if k in fields}
    if moved:
        keys = ", ".join(f"{k}=" for k in moved)
        args = ", ".join(f"{k}={v!r}" for k, v in moved.items())
        verb = "is a TrainConfig field" if len(moved) == 1 else "are TrainConfig fields"
        raise ConfigError(f"{keys} {verb} now: Pipeline(..., config=TrainConfig({args}))",
                          *moved)
    if "split_points" in legacy:
        points = legacy["split_points"]
        shown = list(points) if isinstance(points, list | tuple) else [points]
        raise ConfigError(f"split_points= is plan= now: Pipeline(..., plan={shown!r})", "plan")
    for key in legacy:
        near = difflib.get_close_matches(key, [*_PIPELINE_ARGS, *fields], n=1)
        hint = f"; did you mean {near[0]}=?" if near else ""
        raise TypeError(f"Pipeline() got an unexpected keyword argument {key!r}{hint}")


#: What a Pipeline takes besides the model and its config's fields.
_PIPELINE_ARGS = ("example", "loss_fn", "optimizer", "plan", "config", "lr_scheduler")
