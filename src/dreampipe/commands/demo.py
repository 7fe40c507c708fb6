"""``dreampipe demo``: the whole flow on a real data set, in a few minutes on a CPU.

It profiles the zoo ``cnn`` on scikit-learn's handwritten digits (resized by
:mod:`dreampipe.models.datasets`), plans it for 2 local workers, trains it
with PipeDream's asynchronous 1F1B, then with data parallelism for as many
epochs, and reports both runs' test accuracy and throughput beside the
planner's prediction, with the PipeDream timeline as a PNG. Both runs are
``dreampipe train``'s (:func:`~dreampipe.commands.train_run.train_local`).
If the best plan is plain data parallelism, the demo says so and runs the
best straight pipeline instead. Data parallelism's pairing and learning
rate: docs/design.md §7.4.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from dreampipe.errors import ConfigError
from dreampipe.machine.calibration import LocalCalibration, local_topology
from dreampipe.machine.measure import local_machine
from dreampipe.machine.step_time import step_factor
from dreampipe.models.resolve import resolve_spec
from dreampipe.planning.plan import Plan
from dreampipe.profiling.graph import LayerGraph
from dreampipe.runplan.plan_choice import PlanAsk, choose_plan
from dreampipe.runplan.prediction import predict_samples_per_s
from dreampipe.runtime.processes import pinned_threads
from dreampipe.scheduling.actions import ScheduleKind
from dreampipe.scheduling.microbatch_layout import MicrobatchLayout

if TYPE_CHECKING:
    from dreampipe.commands.train_config import TrainResult
    from dreampipe.scheduling.events import Event

__all__ = ["DemoOptions", "DemoResult", "run_demo", "timeline_window"]

log = logging.getLogger(__name__)

_MODEL = "cnn"
_MODEL_KWARGS = (("image_size", 28),)


@dataclass(frozen=True)
class DemoOptions:
    """The demo's knobs; the defaults reach > 90 % test accuracy on the digits."""

    epochs: float = 8.0
    minibatch_size: int = 32
    lr: float = 0.1
    momentum: float = 0.0
    workers: int = 2
    seed: int = 0
    out_dir: Path = Path("out/demo")
    progress: bool = True
    timeline_microbatches: int = 12

    def with_epochs(self, epochs: float) -> DemoOptions:
        """These options with ``epochs`` passes over the digits (checked positive)."""
        if not (math.isfinite(epochs) and epochs > 0):  # NaN fails every comparison
            raise ConfigError(f"epochs={epochs}: use a positive number of epochs", "epochs")
        return replace(self, epochs=epochs)


@dataclass(frozen=True)
class DemoResult:
    """Both runs, the plan PipeDream ran, its prediction, and the files written."""

    plan: Plan
    predicted_samples_per_s: float
    pipedream: TrainResult
    dp: TrainResult
    timeline: Path
    trace: Path


def _profile(opts: DemoOptions) -> LayerGraph:
    """Per-layer times of the cnn on a real minibatch of digits, with one thread."""
    from dreampipe.models.datasets import load_dataset
    from dreampipe.profiling.profiler import profile_model

    spec = resolve_spec(_MODEL, _MODEL_KWARGS)
    data = load_dataset("digits", spec, seed=opts.seed)
    x, y = data.batch(0, opts.minibatch_size)
    with pinned_threads(1):
        return profile_model(spec.build(seed=opts.seed), x, spec.loss_fn, y, name=_MODEL)


def _pipeline_plan(graph: LayerGraph, workers: int, machine: LocalCalibration,
                   say: Callable[[str], None]) -> Plan:
    topology = local_topology(workers, machine)
    best = choose_plan(graph, topology, PlanAsk(workers=workers, allow_fewer_workers=False)).plan
    if best.num_stages > 1:
        return best
    straight = choose_plan(graph, topology, PlanAsk(workers=workers, config="straight")).plan
    say(f"the planner's best plan is data parallel ({best.time_per_minibatch_s * 1e3:.2f} "
        f"ms/minibatch); to show pipelining the demo runs its best straight pipeline "
        f"({straight.time_per_minibatch_s * 1e3:.2f} ms/minibatch)")
    return straight


def _step_factor(lr: float, momentum: float) -> float:
    """The demo's SGD step in plain SGD steps: more than one with momentum."""
    if not momentum:
        return 1.0
    import torch  # with the training, not at import

    return step_factor(lambda params: torch.optim.SGD(params, lr=lr, momentum=momentum))


def timeline_window(events: tuple[Event, ...], first: int, microbatches: int) -> list[Event]:
    """The events of microbatches ``first .. first+microbatches-1``: a readable slice of a
    long run."""
    return [e for e in events if first <= e.microbatch < first + microbatches]


def run_demo(opts: DemoOptions, say: Callable[[str], None]) -> DemoResult:
    """Profile, plan, train with PipeDream and with DP, draw; lines go to ``say``."""
    from dreampipe.api.config import TrainConfig
    from dreampipe.commands.train_config import TrainRun
    from dreampipe.commands.train_run import TrainJob, train_local
    from dreampipe.models.datasets import load_dataset, steps_for_epochs
    from dreampipe.simulation.chrome_trace import write_chrome_trace
    from dreampipe.simulation.timeline import draw_timeline

    spec = resolve_spec(_MODEL, _MODEL_KWARGS)
    data = load_dataset("digits", spec, seed=opts.seed)
    train_n = int(data.train_x.shape[0])
    test_n = int(data.test_x.shape[0]) if data.test_x is not None else 0
    say(f"digits: {train_n} training and {test_n} test images; model cnn "
        f"(conv1, conv2, fc1, fc2, out) at {dict(_MODEL_KWARGS)['image_size']} pixels")
    graph = _profile(opts)
    machine = local_machine(opts.workers, say=say)
    plan = _pipeline_plan(graph, opts.workers, machine, say)
    say(str(plan))
    steps = steps_for_epochs(opts.epochs, train_n, opts.minibatch_size)
    predicted = predict_samples_per_s(graph, plan, MicrobatchLayout(
        kind=ScheduleKind.PIPEDREAM, minibatch_size=opts.minibatch_size, microbatches=1),
        steps, machine, step_factor=_step_factor(opts.lr, opts.momentum))
    base = TrainRun(
        model=_MODEL, plan=plan, config=TrainConfig(schedule="pipedream", seed=opts.seed),
        minibatch_size=opts.minibatch_size, steps=steps, lr=opts.lr, momentum=opts.momentum,
        dataset="digits", model_kwargs=_MODEL_KWARGS, progress=opts.progress,
    )
    say(f"training with PipeDream (1F1B, weight stashing): {opts.epochs:g} epochs, "
        f"{steps} minibatches of {opts.minibatch_size}")
    pipedream = train_local(TrainJob(replace(base, config=replace(base.config,
                                                                  record_events=True))))
    dp_batch = opts.minibatch_size * opts.workers
    dp_steps = steps_for_epochs(opts.epochs, train_n, dp_batch)
    dp_plan = Plan.from_config(spec.num_layers, [0], [opts.workers], model=_MODEL)
    say(f"training with data parallelism on {opts.workers} workers: {opts.epochs:g} epochs, "
        f"{dp_steps} updates of {dp_batch}, learning rate x{opts.workers}")
    dp = train_local(TrainJob(replace(base, plan=dp_plan,
                                      config=replace(base.config, schedule="dp"),
                                      minibatch_size=dp_batch, steps=dp_steps,
                                      lr=opts.lr * opts.workers)))
    opts.out_dir.mkdir(parents=True, exist_ok=True)
    timeline, trace = opts.out_dir / "pipedream-timeline.png", opts.out_dir / "pipedream-trace.json"
    first = max(0, steps // 2 - opts.timeline_microbatches // 2)
    draw_timeline(timeline_window(pipedream.events, first, opts.timeline_microbatches), timeline,
                  title=f"cnn on digits, PipeDream {plan.config}, minibatches {first}.."
                        f"{first + opts.timeline_microbatches - 1} of {steps} (measured)")
    write_chrome_trace(list(pipedream.events), trace)
    plan.save(opts.out_dir / "plan.json")
    for name, res in (("PipeDream", pipedream), ("data parallel", dp)):
        acc = f"{res.accuracy:.1%}" if res.accuracy is not None else "n/a"
        say(f"{name:<14} test accuracy {acc}, {res.samples_per_s:7.1f} samples/s, "
            f"final loss {res.final_loss:.3f}")
    say(f"PipeDream predicted {predicted:.1f} samples/s, measured {pipedream.samples_per_s:.1f}")
    say(f"timeline: {timeline}")
    say(f"trace (chrome://tracing): {trace}")
    return DemoResult(plan, predicted, pipedream, dp, timeline, trace)
