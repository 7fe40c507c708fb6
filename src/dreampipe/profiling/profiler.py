"""Per-layer profiler: run a model once, then time every layer in training order.

A layer is a step of :mod:`dreampipe.profiling.model_steps` (a child of an
``nn.Sequential``, or a torch.fx node) whose output holds a tensor; edges come
from the steps' data flow (through glue), so a residual ``x + f(x)`` is a DAG.
One real pass records every layer's inputs, outputs and upstream gradient, and
whether it writes its input in place (:mod:`.record_pass`); then each timed pass
runs every layer's forward in model order and its backward in reverse, on fresh
leaf copies, with a second call for the weight gradient alone (``weight_grad_ms``).
Each figure is the median over the timed passes; ``meta["pass_ms"]`` keeps every
pass's total. The user's model, its buffers and the RNG are left as they were
(docs/design.md §2.2).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from dreampipe.errors import ProfileError
from dreampipe.models.spec import ModelSpec
from dreampipe.profiling.clock import Clock, CudaClock, Reading, clock_for
from dreampipe.profiling.graph import Layer, LayerGraph
from dreampipe.profiling.layer_memory import (
    backward_bytes,
    deferred_bytes,
    library_bytes,
    linear_operands,
    new_parameter_bytes,
    recorded_bytes,
    sent_bytes,
    with_library,
)
from dreampipe.profiling.model_steps import Env, Step, model_steps
from dreampipe.profiling.number_formats import in_formats, loss_in_fp32
from dreampipe.profiling.record_pass import LOSS, read_later, record, saved_bytes
from dreampipe.profiling.tensor_trees import fresh as _fresh
from dreampipe.profiling.tensor_trees import tensors as _tensors

__all__ = ["profile_model", "profile_spec"]

log = logging.getLogger(__name__)

Progress = Callable[[int, int], None]


def profile_model(
    model: nn.Module,
    sample_input: Tensor | dict[str, Tensor],
    loss_fn: Callable[..., Tensor],
    target: Tensor | None = None,
    *,
    warmup: int = 2,
    repeats: int = 5,
    min_time_s: float = 0.0,
    progress: Progress | None = None,
    name: str = "",
    autocast: torch.dtype | None = None,
    param_dtype: torch.dtype = torch.float32,
    sent: Callable[[Any], int] | None = None,
) -> LayerGraph:
    """Profile ``model`` on ``sample_input``; ``loss_fn(output, target)`` gives the loss.

    With ``target=None`` the loss is ``loss_fn(output)``. ``progress(done,
    total)`` is called after each pass. The graph's ``batch_size`` is the
    first dimension of ``sample_input`` (a tensor, or a dict of keyword arguments that
    the first layer takes as one argument). ``min_time_s``: time more passes
    than ``repeats`` until the timed ones took that long, so that the medians
    of a small model span seconds, not a moment of a host whose speed drifts.
    ``autocast`` and ``param_dtype``: the number formats the run trains in
    (:mod:`.number_formats`). ``sent(output)``: a layer's output in bytes as it crosses
    to the next stage, where the runtime sends it otherwise than as its tensors (a pack
    with a header); None: :func:`~.layer_memory.sent_bytes`.
    """
    if repeats < 1 or warmup < 0 or not min_time_s >= 0:
        raise ProfileError(
            f"repeats={repeats}, warmup={warmup}, min_time_s={min_time_s}: need repeats >= 1, "
            "warmup >= 0 and min_time_s >= 0"
        )
    steps, output_key = model_steps(model)
    first = next(_tensors(sample_input), None)
    if first is None:
        raise ProfileError("the sample input holds no tensor; give the model's input tensors")
    clock = clock_for(first.device)
    devices = [clock.device.index] if isinstance(clock, CudaClock) else []
    modes = {m: m.training for m in model.modules()}
    saved_buffers = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        with torch.random.fork_rng(devices=devices), torch.enable_grad(), in_formats(
                model, sample_input, first.device.type, autocast=autocast,
                param_dtype=param_dtype) as sample:
            model.train()
            loss = loss_in_fp32(loss_fn, param_dtype)
            bound = partial(_loss_of, loss, target)
            first_use = library_bytes(model, steps, output_key, sample, bound)  # cold: first of all
            running = [""]
            with linear_operands(model, steps, lambda: running[0]) as operands:
                env, grads, saved, written = record(steps, output_key, sample, loss, target,
                                                    running, [*model.parameters(),
                                                              *model.buffers()])
            layers, edges, pass_ms = _time_layers(steps, env, grads,
                                                  _Passes(warmup, repeats, min_time_s), clock,
                                                  progress)
            kept = _layer_steps(steps, env)
            working = backward_bytes(kept, env, grads, bound)
            deferred = deferred_bytes(operands, kept, env)
            recorded = recorded_bytes(operands, kept)
            held = [b for b, _ in saved_buffers]
            reads = [read_later(s, steps, env, output_key) for s in kept]
            layers = [replace(x, saved_bytes=saved_bytes(
                saved[s.key], s, env, held, saved[LOSS] if s is kept[-1] else None, read),
                loss_bytes=saved_bytes({}, s, env, held, {
                    ptr: n for ptr, n in saved[LOSS].items() if ptr not in saved[s.key]
                }) if s is kept[-1] else None, writes_input=s.key in written,
                backward_bytes=w, deferred_bytes=d, recorded_bytes=r,
                activation_bytes=(sent_bytes(read, autocast)
                                  if sent is None or s.key == output_key else sent(env[s.key])))
                for x, s, w, d, r, read in zip(layers, kept, working, deferred, recorded,
                                               reads, strict=True)]
            layers = with_library(layers, [first_use.get(s.key) for s in kept])
    finally:
        with torch.no_grad():
            for buffer, value in saved_buffers:
                buffer.copy_(value)
        for module, training in modes.items():
            module.training = training
    batch = int(first.shape[0]) if first.dim() > 0 else 1
    meta = {
        "device": str(first.device),
        "threads": torch.get_num_threads(),
        "warmup": warmup,
        "repeats": len(pass_ms) or repeats,
        "pass_ms": [round(t, 4) for t in pass_ms],
        "torch": torch.__version__,
        **({} if autocast is None else {"autocast": str(autocast).removeprefix("torch.")}),
        **({} if param_dtype == torch.float32
           else {"param_dtype": str(param_dtype).removeprefix("torch.")}),
    }
    log.info("profiled %d layers of %s at batch %d", len(layers), name or "model", batch)
    return LayerGraph(tuple(layers), tuple(edges), batch, name, meta)


def profile_spec(
    spec: ModelSpec,
    batch_size: int | None = None,
    *,
    warmup: int = 2,
    repeats: int = 5,
    min_time_s: float = 0.0,
    progress: Progress | None = None,
    seed: int = 0,
    autocast: torch.dtype | None = None,
    param_dtype: torch.dtype = torch.float32,
) -> LayerGraph:
    """Profile a zoo model built with ``seed`` at ``batch_size`` (default: the spec's), in
    the number formats ``autocast`` and ``param_dtype`` (:func:`profile_model`)."""
    batch = spec.default_batch_size if batch_size is None else batch_size
    if batch < 1:
        raise ProfileError(f"batch size {batch} must be at least 1")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        sample, target = spec.sample_input(batch), spec.sample_target(batch)
    model = spec.build(seed=seed)
    return profile_model(
        model, sample, spec.loss_fn, target,
        warmup=warmup, repeats=repeats, min_time_s=min_time_s, progress=progress,
        name=spec.name, autocast=autocast, param_dtype=param_dtype,
    )


def _loss_of(loss_fn: Callable[..., Tensor], target: Tensor | None, output: Any) -> Tensor:
    return loss_fn(output) if target is None else loss_fn(output, target)


def _layer_steps(steps: list[Step], env: Env) -> list[Step]:
    """The steps that are layers: may be one, and output a tensor."""
    return [s for s in steps if s.may_be_layer and any(True for _ in _tensors(env[s.key]))]


def _time_layers(
    steps: list[Step],
    env: Env,
    grads: dict[str, list[Tensor | None]],
    passes: _Passes,
    clock: Clock,
    progress: Progress | None,
) -> tuple[list[Layer], list[tuple[int, int]], list[float]]:
    """The layers with their median times, the edges, and each timed pass's milliseconds
    (all layers' forward and backward: how a whole pass varies, which medians leave out)."""
    layer_steps = _layer_steps(steps, env)
    is_layer = {s.key: i for i, s in enumerate(layer_steps)}
    sources: dict[str, set[int]] = {}
    edges: set[tuple[int, int]] = set()
    step_params: list[list[nn.Parameter]] = []
    for step in steps:
        feeding = set().union(*(sources.get(d, set()) for d in step.deps))
        if step.key not in is_layer:
            sources[step.key] = feeding
            continue
        sources[step.key] = {is_layer[step.key]}
        edges.update((src, is_layer[step.key]) for src in feeding)
        step_params.append(
            list(step.params) + [v for d in step.deps if isinstance(v := env[d], nn.Parameter)]
        )
    times = _time_passes(layer_steps, step_params, env, grads, passes, clock, progress)
    layers: list[Layer] = []
    counted: dict[int, tuple[int, int]] = {}
    for step, params, (forward, backward, weight) in zip(
            layer_steps, step_params, times, strict=True):
        backward_ms = statistics.median(backward)
        largest = max((p.numel() * p.element_size() for p in params if id(p) not in counted),
                      default=0)
        own, reused = new_parameter_bytes(params, counted, len(layers))
        layers.append(Layer(
            name=step.name,
            forward_ms=statistics.median(forward),
            backward_ms=backward_ms,
            weight_grad_ms=min(backward_ms, statistics.median(weight)),
            activation_bytes=sum(t.numel() * t.element_size() for t in _tensors(env[step.key])),
            largest_parameter_bytes=largest, parameter_bytes=own, reused=reused,
            description=step.description,
        ))
    columns = [t for forward, backward, _ in times for t in (forward, backward)]
    return layers, sorted(edges), [sum(one) for one in zip(*columns, strict=True)]


@dataclass(frozen=True)
class _Passes:
    """Untimed warm-up passes, then at least ``repeats`` timed ones lasting ``min_time_s``."""

    warmup: int
    repeats: int
    min_time_s: float

    def more(self, timed: int, timed_s: float) -> bool:
        return timed < self.repeats or timed_s < self.min_time_s


def _time_passes(
    layer_steps: list[Step],
    step_params: list[list[nn.Parameter]],
    env: Env,
    grads: dict[str, list[Tensor | None]],
    passes: _Passes,
    clock: Clock,
    progress: Progress | None,
) -> list[tuple[list[float], list[float], list[float]]]:
    """Every layer's forward, backward and weight-gradient milliseconds of each timed
    pass, in training order.

    Each pass runs every layer's forward in model order, then every layer's
    backward in reverse, as a training step does, so a layer's weights are
    as cold or warm in the cache as they are in training (timing one layer
    over and over would keep them hot and under-state its time). The pass's
    readings are read once all of it is queued, so a GPU runs it unstalled.
    """
    forward: list[list[float]] = [[] for _ in layer_steps]
    backward: list[list[float]] = [[] for _ in layer_steps]
    weight: list[list[float]] = [[] for _ in layer_steps]
    r = 0
    timed_s = 0.0
    while r < passes.warmup or passes.more(r - passes.warmup, timed_s):
        start = time.perf_counter()
        runs: list[tuple[Any, list[Tensor]] | None] = []
        readings: list[tuple[Reading, Reading, Reading]] = []
        for step in layer_steps:
            leaves: list[Tensor] = []
            inputs = {d: _fresh(env[d], leaves) for d in step.deps}
            mark = clock.start()
            out = step.run(inputs)
            readings.append((clock.stop(mark), _ZERO, _ZERO))
            runs.append((out, leaves))
        for i in reversed(range(len(layer_steps))):
            run, runs[i] = runs[i], None
            assert run is not None
            readings[i] = (readings[i][0], *_time_backward(
                run[0], grads[layer_steps[i].key], run[1],
                [p for p in step_params[i] if p.requires_grad], clock))
        values = [(fwd(), b(), w()) for fwd, b, w in readings]  # warm-up too: the GPU drains
        if r >= passes.warmup:
            for i, (fwd_ms, backward_ms, weight_ms) in enumerate(values):
                forward[i].append(fwd_ms)
                backward[i].append(backward_ms)
                weight[i].append(min(weight_ms, backward_ms))
            timed_s += time.perf_counter() - start
        r += 1
        if progress is not None:
            progress(r, max(r, passes.warmup + passes.repeats))
    return list(zip(forward, backward, weight, strict=True))


def _time_backward(
    out: Any, out_grads: list[Tensor | None], inputs: list[Tensor], params: list[Tensor],
    clock: Clock,
) -> tuple[Reading, Reading]:
    """Milliseconds of one layer's own backward with the real upstream gradient, whole (one
    call for inputs and weights, as training runs it), and of its weight gradient alone.

    A layer of several ops reaches its weights through its inner ops, so a call for the
    weights alone runs part of the backward again: timing the input and weight gradients
    as two calls and adding them would over-state the backward. So the whole backward is
    one call; the weight gradient is timed by a second call, for the layers that have
    both (a layer with weights only: the whole backward is its weight gradient).
    """
    pairs = [(o, g) for o, g in zip(_tensors(out), out_grads, strict=False)
             if g is not None and o.requires_grad]
    if not (pairs and (inputs or params)):
        return _ZERO, _ZERO
    outs, grads = [o for o, _ in pairs], [g for _, g in pairs]
    mark = clock.start()
    torch.autograd.grad(outs, inputs + params, grads, retain_graph=bool(inputs and params),
                        allow_unused=True)
    whole = clock.stop(mark)
    if not params:
        return whole, _ZERO
    if not inputs:
        return whole, whole
    mark = clock.start()
    torch.autograd.grad(outs, params, grads, allow_unused=True)
    return whole, clock.stop(mark)


def _zero() -> float:
    return 0.0


_ZERO: Reading = _zero
