"""The plan a Pipeline runs: given, read from a file, or profiled and planned on rank 0.

``plan="auto"`` profiles the model on rank 0 (one thread, as a worker runs,
on a microbatch of the example) and plans it for the world it runs in with the
runs' one plan choice (:func:`dreampipe.runplan.plan_choice.choose_plan`), priced with the
machine file (or, without one, the machine measured by every rank now:
:func:`dreampipe.machine.measure.machine_in_group`); rank 0 then
broadcasts the plan over the process group, so every rank runs the same
one whatever launched them. The ``dp`` schedule always runs one stage on
every worker.

A given plan runs its own ``virtual_stages`` to a rank
(:func:`~dreampipe.planning.placement.virtual_stages_of`): an argument asking for
another count is an error, and so is ``schedule="auto"`` for a plan of several.

``schedule="auto"`` (``semantics`` given) also profiles, for a given plan
too, and simulates that semantics' schedules on the plan (the same
function); rank 0 logs why each was kept or dropped and broadcasts the
fastest with the plan.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dreampipe.api.checks import Batch, map_inputs
from dreampipe.api.config import TrainConfig
from dreampipe.errors import DreampipeError, PlanError
from dreampipe.machine.calibration import measured_topology
from dreampipe.machine.measure import machine_in_group
from dreampipe.machine.torchrun import in_torchrun, torchrun_nodes
from dreampipe.planning.placement import check_schedule, virtual_stages_of
from dreampipe.planning.plan import Plan
from dreampipe.profiling.fixed_costs import with_small_batch
from dreampipe.profiling.graph import LayerGraph
from dreampipe.runplan.plan_choice import PlanAsk, choose_plan
from dreampipe.runplan.schedule_choice import small_profile_batch
from dreampipe.runtime.processes import pinned_threads
from dreampipe.scheduling.actions import ScheduleKind
from dreampipe.splitter.chain import Layers, build_stage
from dreampipe.splitter.pack import pack
from dreampipe.splitter.segments import Segment
from dreampipe.splitter.shape_graphs import Signature

__all__ = ["PlanArg", "Resolved", "profile_layers", "resolve_plan"]

_log = logging.getLogger(__name__)

#: What ``Pipeline(plan=...)`` takes: "auto", a Plan, a plan file, or a list of split points.
PlanArg = Plan | str | Path | list[str] | tuple[str, ...]


@dataclass(frozen=True)
class Resolved:
    """The plan every rank runs and, under ``schedule="auto"``, the schedule chosen for it
    with its microbatches per minibatch (else None, 0)."""

    plan: Plan
    kind: ScheduleKind | None = None
    microbatches: int = 0


def resolve_plan(
    plan: Plan | str | Path, *, layers: Layers, example: Batch, loss_fn: Callable[..., Any],
    microbatch_size: int, config: TrainConfig,
) -> Resolved:
    """The plan every rank runs, and the schedule ``config``'s ``schedule="auto"`` picks
    for it (a collective when rank 0 has to plan or choose); ``config.virtual_stages``
    (None: the plan's) must agree with a given plan's."""
    n, world = len(layers), dist.get_world_size()
    kind, semantics = config.kind, config.chooses
    given: Plan | None = None
    if isinstance(plan, Plan):
        given = plan
    elif str(plan) != "auto":
        if not Path(plan).is_file():
            raise PlanError(f"plan={str(plan)!r} is neither 'auto', a Plan, a plan file nor a "
                            f"list of split points; to cut before module {str(plan)!r}, give "
                            f"plan=[{str(plan)!r}]")
        given = Plan.load(plan)
    elif kind is ScheduleKind.DP or world == 1:
        given = Plan.from_config(n, [0], [world], layer_names=tuple(name for name, _ in layers))
    if given is not None:
        source = "the plan" if isinstance(plan, Plan) or str(plan) == "auto" else \
            f"plan {str(plan)!r}"
        virtual_stages_of(given, config.virtual_stages, source,
                          "Plan.from_config(..., virtual_stages={v}), or dreampipe plan "
                          "--virtual-stages {v}")
        check_schedule(given, "auto" if semantics is not None else kind.value, source)
    if given is not None and semantics is None:
        return Resolved(given)
    nodes = torchrun_nodes(world) if in_torchrun() else 1
    machine = machine_in_group(nodes=nodes)  # every rank: without a machine file all measure
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            graph = profile_layers(layers, example, loss_fn, microbatch_size, config)
            minibatch = int(example[1].shape[0])
            small = small_profile_batch(world, minibatch, graph.batch_size)
            if semantics is not None and small:  # microbatches of other sizes are priced
                graph = with_small_batch(graph, profile_layers(layers, example, loss_fn, small,
                                                               config))
            chosen = choose_plan(graph, measured_topology(graph, world, machine, nodes=nodes),
                                 PlanAsk(workers=world, given=given, semantics=semantics,
                                         microbatches=config.microbatches,
                                         minibatch_size=minibatch,
                                         allow_fewer_workers=False, zero=config.zero,
                                         steps_agree=config.runner_options().steps_agree,
                                         machine=machine, nodes=nodes))
            for line in chosen.lines:
                _log.info("%s", line)
            planned = given or dataclasses.replace(
                chosen.plan, layer_names=tuple(name for name, _ in layers))
            _log.info("planned %s", planned.config)
            pick = chosen.chosen
            box[0] = (planned.to_json(), None if pick is None else pick[0].value,
                      0 if pick is None else pick[1])
        except DreampipeError as exc:  # every rank fails alike, none waits for a plan
            box[0] = exc
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], DreampipeError):
        raise box[0]
    text, chosen_kind, per = box[0]
    return Resolved(Plan.from_dict(json.loads(text)),
                    None if chosen_kind is None else ScheduleKind(chosen_kind), per)


def profile_layers(
    layers: Layers, example: Batch, loss_fn: Callable[..., Any], microbatch_size: int,
    config: TrainConfig, *, timed: bool = True,
) -> LayerGraph:
    """The whole model profiled as one worker runs, on a microbatch of ``example`` (the
    Pipeline's, or the largest minibatch it met), in the config's number formats; not
    ``timed``: one pass, no warm-up, for the sizes alone (a memory prediction)."""
    from dreampipe.profiling.profiler import profile_model

    # copies, as the feed cuts microbatches: a view would count its whole base's storage
    x = map_inputs(example[0], lambda t: t[:microbatch_size].clone())
    target = example[1][:microbatch_size].clone()
    first = layers[0][1]
    formats = config.number_formats
    sent = None
    if isinstance(first, Segment):  # segments send their values packed (:mod:`.pack`)
        sig = first.signature(first.bind(x if isinstance(x, tuple) else (x,)))
        sent = _packed_bytes(sig, formats.compute_dtype)
        if sig is not None:  # the graph of these shapes
            layers = [(name, m.at(sig) if isinstance(m, Segment) else m) for name, m in layers]
    chain = build_stage(copy.deepcopy(layers), 0, len(layers) - 1, torch.device("cpu"),
                        config.seed)
    model = nn.Sequential(*chain.stage_layers)
    if isinstance(x, tuple):  # the first layer is a segment (a tuple input makes one)
        assert isinstance(first, Segment)
        x = dict(zip((str(n.target) for n in first.inputs), x, strict=False))
    with pinned_threads(1):
        run = profile_model if timed else partial(profile_model, warmup=0, repeats=1)
        graph = run(model, x, loss_fn, target, autocast=formats.autocast,
                    param_dtype=formats.param_dtype, sent=sent)
    if len(graph.layers) != len(layers):
        raise PlanError(
            f"the profiler found {len(graph.layers)} layers where the model has {len(layers)}; "
            "give plan= a Plan or a plan file for this model"
        )
    return graph


def _packed_bytes(sig: Signature | None, half: torch.dtype | None) -> Callable[[Any], int]:
    """A segment's values in bytes as a stage sends them: one pack, its header (a byte
    an element, which on a tiny model outweighs the data) and the data in the pack's
    dtype (``half`` where exact, as the stage's ``message_dtype``)."""
    def size(values: Any) -> int:
        packed = pack(values, "the profiled cut", sig, half)
        return packed.numel() * packed.element_size()
    return size
